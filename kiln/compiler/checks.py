"""A build checked against eager on its partition's example inputs: the same answers
within tolerance (or, for lossy compiles, no invented NaN and a cosine similarity above
:data:`LOSSY_FLOOR`), and how it treats NaN and
infinities (:func:`nonfinite_probe`). Selection (:mod:`kiln.compiler.selection`) keeps
only builds that pass.
"""
from __future__ import annotations

import torch

from kiln.compiler.options import lossy, tf32_ops
from kiln.errors import KilnError
from kiln.graph import randomness, validation

_SATURATED = 1e30


class Reference:
    """The partition's eager outputs on its example inputs, computed once, when first needed."""

    def __init__(self, sub, inputs, opts):
        self.sub, self.inputs, self._outputs = sub, inputs, None
        # a partition that draws random numbers (dropout on Inductor): every run of it in a
        # check, eager's and the build's, starts from this one state of the generators
        self.draws = randomness.Draws() if randomness.draws_random(sub) else None
        # the precision the partition computes at: bf16/fp16 where some value of it has that
        # type (an autocast step's fp32 gradients carry bf16's roundings too), on a GPU TF32
        # where torch allows it; held to that precision's floor, as the model's validation
        # gate holds it. (Held to 1e-3 here, the whole of a bf16 MLP step on Inductor was
        # refused for a 1.2e-3 difference that the gate passes.)
        precision = validation.comparison_precision(sub, opts.device, tf32_ops(opts) if opts.device == "cuda"
                                                    else None)
        self.precision = None if precision == "fp32" else precision

    def same_draws(self):
        """Set the generators to the state every run of this partition's check starts from."""
        randomness.restore(self.draws)

    def outputs(self) -> list:
        if self._outputs is None:
            self.same_draws()
            with torch.no_grad():
                out = self.sub(*self.inputs)
            self._outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        return self._outputs


def try_run(engine, blob, runtime_opts, inputs, reference, opts):
    """(runner, None), or (runner or None, why) when the engine cannot run its own build or
    answers differently from eager on the partition's example inputs.

    Checked per partition so that the next engine gets a partition the first
    one gets wrong: OpenVINO 2026.4 answered 18 of the 144 two-stage cuts of a
    tiny BERT pipeline wrongly (errors up to 3.7, or NaN), where ONNX Runtime ran
    all of them right. Lossy compiles (int8, auto-cast) are held to the model's
    accuracy gate instead; here they must only not invent NaN nor fall below
    :data:`LOSSY_FLOOR`. When no engine
    agrees, the first that ran is kept and the model's validation reports it.
    """
    try:
        runner = engine.load(blob, runtime_opts)
        reference.same_draws()
        actual = runner(list(inputs))
    except KilnError:
        raise
    except Exception as e:
        return None, f"compiled, but could not run: {type(e).__name__}: {str(e).strip()[:300]}"
    expected = reference.outputs()
    problem = disagreement(expected, actual, opts, reference.precision)
    return runner, problem


# (values refused if the probe differs, what goes in the last two elements of an input)
_NONFINITE = ((("nan",), (float("nan"), float("nan"))),
              (("+inf",), (float("inf"), float("inf"))),
              (("-inf",), (float("-inf"), float("-inf"))),
              (("+inf", "-inf"), (float("inf"), float("-inf"))))


def nonfinite_probe(runner, reference, opts) -> list | None:
    """Which of NaN, +inf and -inf in a float input this build does not answer as eager does.

    Engines differ from PyTorch here and the example inputs never show it: OpenVINO's
    ReLU, clamp, max-pool and softmax turn NaN into numbers (so also the NaN that two
    infinities make in a matmul), ONNX Runtime's ReduceMax and ArgMax skip NaN unless it
    comes first. Each value goes in the last two elements of a float input (last: a max
    that starts from the first element skips it; two: inf - inf inside), one input at a
    time (NaN in every input at once can hide one that a max skips), and the NaN pattern
    and the rest are compared with eager. A build that mishandles NaN gets the infinities
    listed as well: inside the graph they become NaN (inf - inf, 0 * inf) in ways no probe
    covers. The runtime refuses inputs holding the values listed (``InputError``) rather
    than answer differently from PyTorch. None when there is nothing to probe (no float
    inputs, lossy compiles).
    """
    inputs = reference.inputs
    floats = [i for i, t in enumerate(inputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floats or lossy(opts):
        return None
    differs: list = []
    for labels, values in _NONFINITE:
        if all(label in differs for label in labels):
            continue
        for i in floats[:_PROBED_INPUTS]:
            probe, filled = list(inputs), inputs[i].detach().contiguous().clone()
            for k, value in enumerate(values[:filled.numel()]):
                filled.view(-1)[-1 - k] = value
            # the example's own strides: a stage may take a view that its graph permutes back;
            # unless its elements share memory (a broadcast input: a sum's gradient on the
            # device is ones expanded), where no layout like it holds one value apart
            probe[i] = filled if torch._debug_has_internal_overlap(inputs[i]) else torch.empty_strided(
                inputs[i].shape, inputs[i].stride(), dtype=inputs[i].dtype, device=inputs[i].device).copy_(filled)
            expected = _eager_on(reference, probe)
            try:
                reference.same_draws()
                actual = runner(probe)
            except Exception:  # noqa: BLE001 - an engine that cannot run such values differs
                actual = None
            if expected is None and actual is None:
                continue            # eager refuses these values too (eigh of a NaN matrix)
            if expected is None or actual is None or \
                    nonfinite_disagreement(expected, actual, opts, reference.precision):
                differs += [label for label in labels if label not in differs]
                break
        if "nan" in differs:
            # arithmetic makes NaN of infinities (inf - inf, 0 * inf) anywhere inside, and
            # this build mishandles NaN: no probe can show every such case, so refuse them
            return ["nan", "+inf", "-inf"]
    return differs


_PROBED_INPUTS = 4      # bounds the probe's runs: 3 values x this many float inputs


def _eager_on(reference, probe) -> list | None:
    """Eager's outputs on the probe's values, or None where eager raises on them (a
    decomposition that does not converge on NaN): a build must then not answer either. It
    ended the compile before: the device ran a graph holding ``linalg.eigh`` eagerly."""
    reference.same_draws()
    try:
        with torch.no_grad():
            out = reference.sub(*probe)
    except Exception:  # noqa: BLE001 - eager's refusal is the answer to match
        return None
    return list(out) if isinstance(out, (list, tuple)) else [out]


def nonfinite_disagreement(expected, actual, opts, precision=None) -> bool:
    """Whether a probe's outputs differ from eager's: in where they are NaN, or elsewhere by
    more than the tolerances. An output NaN everywhere in both has nothing else to compare:
    in a training step a NaN weight reaches the loss and every gradient."""
    rest = []
    for e, a in zip(expected, actual):
        if not isinstance(e, torch.Tensor) or _plainly_close(e, a, opts):
            continue
        if tuple(a.shape) != tuple(e.shape):
            return True
        if e.is_floating_point():
            nan = e.isnan()
            if not torch.equal(nan, a.to(e.dtype).isnan()):
                return True
            if nan.all() and a.dtype == e.dtype:
                continue
        rest.append((e, a))
    return disagreement([e for e, _ in rest], [a for _, a in rest], opts, precision) is not None


class Misfit(str):
    """A build's outputs that are not eager's shapes or dtypes: whatever reads them next (a
    partition built for eager's, a host op, the caller) reads garbage, so unlike a build
    that is only inaccurate (:mod:`kiln.compiler.selection` keeps the first of those for the
    validation gate to report), such a build is never kept."""


def _plainly_close(e, a, opts) -> bool:
    """Whether ``a`` is within ``atol`` of ``e`` everywhere, with no NaN in either: then every
    test of :func:`disagreement` passes (clamping moves two values no further apart), found
    in three passes over the data instead of a dozen. A training step's probes compared a
    hundred outputs (its weights, gradients, optimizer state) 32 times: 16.7 of a BERT-4L
    step's 76 s of compile went to these comparisons (2 cores, 11-28). Anything else (NaN,
    infinities, a larger difference, a lossy build) takes the full test.

    A precision floor (a bf16 graph's) only loosens both tolerances, so within ``atol``
    passes under one too; before that held, a bf16 BERT-4L step's probes spent about 3 of
    their 10 s in the full test of 260 outputs 16 times (11-29). Narrow outputs are
    subtracted in float32: a bf16 difference rounds, and could round down to ``atol``."""
    if lossy(opts) or not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype \
            or not e.is_floating_point() or not e.numel():
        return False
    diff = a.float() - e.float() if e.dtype in validation.NARROW else a - e
    return bool(diff.abs_().max() <= opts.atol)          # NaN anywhere: a NaN maximum, False


def disagreement(expected, actual, opts, precision=None) -> str | None:
    for i, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor) or _plainly_close(e, a, opts):
            continue
        if tuple(a.shape) != tuple(e.shape):
            return Misfit(f"output {i} has shape {tuple(a.shape)}, eager {tuple(e.shape)}")
        if a.dtype != e.dtype:
            # AOTInductor returned a bf16 MLP step's fp32 loss terms as bf16, and the
            # partition after them, built for fp32, computed garbage (cosine 0, NaN)
            return Misfit(f"output {i} has dtype {str(a.dtype).replace('torch.', '')}, "
                          f"eager {str(e.dtype).replace('torch.', '')}")
        if not e.is_floating_point():
            if not torch.equal(e, a):
                return f"integer output {i} differs from eager"
            continue
        if (a.isnan() & ~e.isnan()).any():
            return f"output {i} has NaN where eager has none"
        # Mask arithmetic saturates: -inf and float32's lowest both mean "masked out",
        # and engines legitimately disagree on which one a partition returns.
        # compared in float32 at least: 1e30 is no float16 (clamping a float16 output to it
        # raised "cannot be converted to type c10::Half", so every float16 model's compile crashed)
        e, a = ((t.float() if t.dtype in validation.NARROW else t).nan_to_num(nan=0.0).clamp(-_SATURATED, _SATURATED)
                for t in (e, a))
        rtol, atol = (validation.tolerances(e.masked_fill(e.abs() >= _SATURATED, 0).double(), opts.atol, opts.rtol,
                                            validation.rtol_floor(precision)) if precision else (opts.rtol, opts.atol))
        if lossy(opts):
            e64, a64 = e.double().flatten(), a.double().flatten()
            cos = torch.nn.functional.cosine_similarity(e64, a64, dim=0).item() if e64.norm() > 1e-12 else 1.0
            if cos < LOSSY_FLOOR:
                return f"output {i} is not eager's, even allowing for lossy compute: cosine similarity {cos:.3g}"
        elif not torch.allclose(a, e, atol=atol, rtol=rtol):
            err = (a.double() - e.double()).abs().max().item()
            return f"output {i} differs from eager: max abs error {err:.3g} (atol {atol:.3g}, rtol {rtol:g})"
    return None


# A lossy build (int8/int4 weights, auto-cast) is held to the model's accuracy gate, not to
# eager's tolerances, partition by partition. But an output this far from eager's is a broken
# build, not a lossy one: once in five suite runs an OpenVINO int4 prefill of a tiny Llama
# answered with cosine 0.045, was kept as the faster engine, and failed the whole compile at
# the gate, where ONNX Runtime's build of the same partition would have passed. Below this
# floor the build counts as disagreeing, so selection tries the next engine; the gate (0.99 by
# default, on the model's outputs) stays the accuracy check.
LOSSY_FLOOR = 0.5

