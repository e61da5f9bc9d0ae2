"""The compiler's phases as a caller sees them: typed hand-offs, entry from an FX graph,
options parsed once and frozen, hooks instead of imports (docs/architecture.md)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kiln
from kiln.compiler import driver, options as options_mod, phases
from kiln.graph.capture import capture
from kiln.progress import Progress
from kiln.runtime.options import RuntimeOptions
from tests import models
from tests.conftest import assert_close


def test_an_fx_graph_enters_at_the_plan_phase_and_matches_eager():
    model, x = models.mlp()
    gm = torch.fx.symbolic_trace(model)
    compiled = driver.compile_fx(gm, [x], name="from-fx")
    assert compiled.manifest["model_name"] == "from-fx"
    assert compiled.manifest["validation"]["passed"]
    assert_close(compiled(x), model(x))


def test_phases_hand_typed_frozen_objects_to_each_other():
    model, x = models.mlp()
    opts = driver.make_options(engine="onnxruntime")
    progress = Progress(quiet=True)
    captured = capture(model, (x,))
    plan = phases.plan(captured, opts, progress)
    assert isinstance(plan, phases.Plan) and plan.engine.name == "onnxruntime"
    built = phases.build(plan, RuntimeOptions(), progress)
    assert isinstance(built, phases.Build) and built.partitions
    art = phases.package(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.options = opts
    loaded = kiln.load(art.to_bytes())          # the artifact is complete without the driver
    assert_close(loaded(x), model(x))


def test_options_are_frozen_and_parsed_once_per_trace(monkeypatch):
    calls = []
    real = options_mod.parse_compiler_args
    monkeypatch.setattr(driver, "parse_compiler_args", lambda a: calls.append(a) or real(a))
    model, x = models.mlp()
    compiled = kiln.trace(model, x, compiler_args="--optlevel 1", buckets=[x, torch.cat([x, x])],
                          cache=False)
    assert calls == ["--optlevel 1"]                    # once, for the two buckets too
    assert compiled.manifest["buckets"]["variants"]
    opts = driver.make_options("--optlevel 1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.engine = "openvino"
    assert opts.device in ("cpu", "cuda")               # settled, by a new object


def test_a_hook_wraps_the_compile_without_the_driver_knowing_it():
    model, x = models.mlp()
    seen = []

    def hook(job, compile_):
        seen.append((job.label, job.options.engine))
        return compile_()                               # a cache would look up first

    job = driver.GraphJob(model, (x,), None, driver.make_options(engine="onnxruntime"), label="one")
    compiled = driver.run_job(job, hook, Progress(quiet=True))
    assert seen == [("one", "onnxruntime")]
    assert_close(compiled(x), model(x))
    stand_in = driver.run_job(job, lambda job, compile_: "stand-in")
    assert stand_in == "stand-in"                       # a hook may answer without compiling


def test_remembered_failures_keep_their_class():
    from kiln.errors import CachedFailure, UnsupportedOpError, cached_failure
    e = cached_failure("UnsupportedOpError", "remembered")
    assert isinstance(e, CachedFailure) and isinstance(e, UnsupportedOpError)
    plain = cached_failure("os.system", "not a kiln error")
    assert type(plain) is CachedFailure
