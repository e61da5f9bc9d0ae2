"""Fuzzing a compiled model's inputs (issue 14).

Compiled models (an MLP on ONNX Runtime and on OpenVINO, one with a host
fallback op, a model with nested tuple/dict inputs, a bucketed one, a
dynamic-batch one and a keyword-input Hugging Face BERT) are called with what
callers really pass: wrong ranks, shapes and dtypes, NaN and inf, strided and
expanded views, zero-size batches, tensors that require grad or live on
another device, missing and extra inputs, NumPy arrays, lists, scalars, None.

The oracle: each call either gives eager PyTorch's answer (at the tolerance
named per model; NaN where eager has NaN) or raises an ``InputError`` whose
message names the input and what was expected. Nothing else: no other
exception, no silently different answer. Hypothesis draws the cases (and
shrinks a failure to a small one); a sweep also runs every kind of case on
every input of every model once.
"""
from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
import torch

import kiln
from tests import models
from tests.reliability import count, long_run, record

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900 if long_run() else 400)]

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

FIGURES = {"cases": 0, "correct": 0, "input_errors": 0, "other": 0, "seconds": 0.0}


class SeqModel(torch.nn.Module):
    """Per-token linear map of a (batch, seq, 8) input: bucketed on seq."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


@dataclasses.dataclass
class Leaf:
    path: tuple          # where it sits in the call's keyword inputs
    name: str            # the name kiln's messages use ("pair[0]", "extras.w")
    shape: tuple         # a valid shape (the compiled one)
    dtype: torch.dtype
    flexible: dict = dataclasses.field(default_factory=dict)   # dim -> (lo, hi) also valid
    values: tuple = None  # (lo, hi) for integer inputs (token ids, masks)


@dataclasses.dataclass
class Subject:
    name: str
    eager: torch.nn.Module
    compiled: kiln.Model
    leaves: list
    args: list           # top-level argument names, in call order
    tol: float
    shape_hint: str      # what a message about a wrong shape must contain (regex; {shape}: the compiled)


def _subjects():
    torch.manual_seed(0)
    out = {}
    mlp, x = models.mlp()
    compiled = kiln.trace(mlp, x)
    xleaf = Leaf(("x",), "x", (2, 16), torch.float32)
    out["mlp"] = Subject("mlp", mlp, compiled, [xleaf], ["x"], 1e-4, r"\(2, 16\)")
    try:
        ov = kiln.trace(mlp, x, engine="openvino")
        out["openvino"] = Subject("openvino", mlp, ov, [xleaf], ["x"], 1e-4, r"\(2, 16\)")
    except kiln.KilnError:
        pass
    dyn = kiln.dynamic_batch(compiled)
    out["dynamic_batch"] = Subject("dynamic_batch", mlp, dyn,
                                   [Leaf(("x",), "x", (2, 16), torch.float32, {0: (0, 7)})], ["x"],
                                   1e-4, r"\(N, 16\)")
    custom, xc = models.custom_op()
    out["fallback"] = Subject("fallback", custom, kiln.trace(custom, xc),
                              [Leaf(("x",), "x", (2, 8), torch.float32)], ["x"], 1e-4, r"\(2, 8\)")
    tree = models.Pytree().eval()
    pair, extras = (torch.randn(2, 4), torch.randn(2, 4)), {"w": torch.randn(4)}
    out["pytree"] = Subject("pytree", tree, kiln.trace(tree, (pair, extras)),
                            [Leaf(("pair", 0), "pair[0]", (2, 4), torch.float32),
                             Leaf(("pair", 1), "pair[1]", (2, 4), torch.float32),
                             Leaf(("extras", "w"), "extras.w", (4,), torch.float32)],
                            ["pair", "extras"], 1e-4, r"\(2, 4\)|\(4,\)")
    seq = SeqModel().eval()
    bucketed = kiln.trace(seq, torch.randn(2, 8, 8), buckets={"x": {1: [4, 8]}})
    out["bucketed"] = Subject("bucketed", seq, bucketed,
                              [Leaf(("x",), "x", (2, 8, 8), torch.float32, {1: (0, 8)})], ["x"],
                              1e-4, r"3-d|must be \d+|largest bucket")
    bert = models.tiny_bert()
    inputs = models.bert_inputs()
    out["bert"] = Subject("bert", bert, kiln.trace(bert, inputs),
                          [Leaf(("input_ids",), "input_ids", (2, 16), torch.int64, values=(0, 120)),
                           Leaf(("attention_mask",), "attention_mask", (2, 16), torch.int64,
                                values=(0, 2))],
                          ["input_ids", "attention_mask"], 1e-3, r"\(2, 16\)")
    return out


@pytest.fixture(scope="module")
def subjects():
    return _subjects()


# -- building a call ------------------------------------------------------------------------------

def fresh(leaf: Leaf, gen: torch.Generator, shape=None):
    shape = leaf.shape if shape is None else shape
    if leaf.values is not None:
        return torch.randint(*leaf.values, shape, generator=gen, dtype=leaf.dtype)
    return torch.randn(shape, generator=gen, dtype=leaf.dtype)


def valid_inputs(subject: Subject, gen, sizes=None) -> dict:
    """Keyword inputs of valid shapes; flexible dims shared by all leaves take ``sizes``."""
    kwargs: dict = {}
    for leaf in subject.leaves:
        shape = list(leaf.shape)
        for d, size in (sizes or {}).items():
            if d in leaf.flexible:
                shape[d] = size
        put(kwargs, leaf.path, fresh(leaf, gen, tuple(shape)))
    # tuples are built as lists above: the traced structure says tuple
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def put(kwargs, path, value):
    if len(path) == 1:
        kwargs[path[0]] = value
        return
    head, key = path
    if isinstance(key, int):
        seq = list(kwargs.get(head, []))
        seq += [None] * (key + 1 - len(seq))
        seq[key] = value
        kwargs[head] = seq
    else:
        kwargs.setdefault(head, {})[key] = value


def get(kwargs, path):
    value = kwargs[path[0]]
    return value if len(path) == 1 else value[path[1]]


def replace(kwargs, path, value) -> dict:
    """A copy of ``kwargs`` with the leaf at ``path`` replaced."""
    out = {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v)
           for k, v in kwargs.items()}
    put(out, path, value)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def as_torch(value):
    """What eager PyTorch is given: NumPy arrays as tensors, containers through."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))
    if isinstance(value, (tuple, list)):
        return type(value)(as_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: as_torch(v) for k, v in value.items()}
    return value


def out_leaves(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in out_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in out_leaves(v)]
    return []


# -- the cases ------------------------------------------------------------------------------------

VALID = ["plain", "special", "transposed", "stepped", "expanded", "offset", "grad", "numpy",
         "positional", "resized"]
INVALID = ["rank", "shape", "dtype", "meta", "list", "scalar", "none", "numpy_dtype", "missing",
           "extra", "too_many"]
KINDS = VALID + INVALID


def build(subject: Subject, kind: str, leaf_index: int, seed: int, special=(), size=0):
    """(args, kwargs, expect) for one case; ``expect`` is "answer" or a list of regexes the
    InputError's message must match."""
    gen = torch.Generator().manual_seed(seed)
    leaf = subject.leaves[leaf_index % len(subject.leaves)]
    kwargs = valid_inputs(subject, gen)
    t = get(kwargs, leaf.path)
    name = re.escape(leaf.name)
    floating = leaf.dtype.is_floating_point
    if kind == "plain" or (kind in ("special", "grad") and not floating):
        return (), kwargs, "answer"
    if kind == "special":
        t = t.clone()
        flat = t.view(-1)
        found = set()
        for pos, value in special:
            flat[pos % flat.numel()] = value
        for k, test in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
            if bool(test(t).any()):
                found.add(k)
        kwargs = replace(kwargs, leaf.path, t)
        refused = found & subject.compiled.nonfinite
        if refused:
            return (), kwargs, [f"'{name}'", "|".join(re.escape(k) for k in refused)]
        return (), kwargs, "answer"
    if kind == "transposed":
        v = t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1 else t.flip(0).flip(0)
        return (), replace(kwargs, leaf.path, v), "answer"
    if kind == "stepped":
        big = fresh(leaf, gen, tuple(2 * s + 1 for s in t.shape))
        v = big[tuple(slice(1, None, 2) for _ in t.shape)]
        assert v.shape == t.shape
        return (), replace(kwargs, leaf.path, v), "answer"
    if kind == "expanded":
        v = t[:1].expand(t.shape) if t.dim() else t
        return (), replace(kwargs, leaf.path, v), "answer"
    if kind == "offset":
        v = fresh(leaf, gen, (t.numel() + 7,))[7:].view(t.shape)
        return (), replace(kwargs, leaf.path, v), "answer"
    if kind == "grad":
        return (), replace(kwargs, leaf.path, t.clone().requires_grad_(True)), "answer"
    if kind == "numpy":
        return (), replace(kwargs, leaf.path, t.numpy()), "answer"
    if kind == "positional":
        return tuple(kwargs[a] for a in subject.args), {}, "answer"
    if kind == "resized":
        flexible = next((lf for lf in subject.leaves if lf.flexible), None)
        if flexible is None:
            return (), kwargs, "answer"
        (d, (lo, hi)), = flexible.flexible.items()
        return (), valid_inputs(subject, gen, {d: lo + size % (hi - lo + 1)}), "answer"
    # -- invalid --
    if kind == "rank":
        v = t.unsqueeze(0) if t.dim() < 2 or size % 2 else t.reshape(-1)
        return (), replace(kwargs, leaf.path, v), [f"'{name}'", subject.shape_hint]
    if kind == "shape":
        dims = [d for d in range(t.dim()) if d not in leaf.flexible] or list(range(t.dim()))
        d = dims[size % len(dims)]
        shape = list(t.shape)
        shape[d] += 1
        return (), replace(kwargs, leaf.path, fresh(leaf, gen, tuple(shape))), [f"'{name}'", subject.shape_hint]
    if kind == "dtype":
        other = [torch.float64, torch.int32, torch.float16, torch.bool, torch.int64]
        dtype = [o for o in other if o != leaf.dtype][size % 4]
        return (), replace(kwargs, leaf.path, t.to(dtype)), [f"'{name}'", re.escape(str(leaf.dtype)[6:])]
    if kind == "meta":
        return (), replace(kwargs, leaf.path, t.to("meta")), [f"'{name}'", "CPU"]
    if kind in ("list", "scalar", "none", "numpy_dtype"):
        v = {"list": t.tolist(), "scalar": 1.5, "none": None,
             "numpy_dtype": t.numpy().astype(np.float64 if leaf.dtype != torch.float64 else np.float32)}[kind]
        return (), replace(kwargs, leaf.path, v), [f"'{name}'", re.escape(str(leaf.dtype)[6:])]
    if kind == "missing":
        arg = subject.args[size % len(subject.args)]
        del kwargs[arg]
        return (), kwargs, [f"missing input '{re.escape(arg)}'", "float32|int64"]
    if kind == "extra":
        return (), dict(kwargs, bogus=t), ["'bogus'"]
    if kind == "too_many":
        return tuple(kwargs[a] for a in subject.args) + (t,), {}, ["positional"]
    raise AssertionError(kind)


def run_case(subject: Subject, kind, leaf_index, seed, special=(), size=0):
    args, kwargs, expect = build(subject, kind, leaf_index, seed, special, size)
    desc = f"{subject.name} {kind} leaf {leaf_index} seed {seed} special {special} size {size}"
    started = time.perf_counter()
    FIGURES["cases"] += 1
    try:
        try:
            got = subject.compiled(*args, **kwargs)
        except kiln.InputError as e:
            if expect == "answer":
                raise AssertionError(f"{desc}: InputError for a valid call: {e}") from None
            for pattern in expect:
                assert re.search(pattern, str(e)), f"{desc}: message {str(e)!r} lacks {pattern!r}"
            FIGURES["input_errors"] += 1
            return "input_error"
        except Exception as e:
            raise AssertionError(f"{desc}: {type(e).__name__} (not an InputError): {e}") from e
        assert expect == "answer", f"{desc}: accepted, but expected an InputError matching {expect}"
        with torch.no_grad():
            want = subject.eager(*as_torch(args), **as_torch(kwargs))
        got_leaves, want_leaves = out_leaves(got), out_leaves(want)
        assert len(got_leaves) == len(want_leaves), f"{desc}: {len(got_leaves)} outputs, eager {len(want_leaves)}"
        for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
            try:
                torch.testing.assert_close(g, w.detach(), atol=subject.tol, rtol=subject.tol,
                                           equal_nan=True)
            except AssertionError as e:
                raise AssertionError(f"{desc}: output {i} differs from eager: {e}") from None
        FIGURES["correct"] += 1
        return "correct"
    except AssertionError:
        FIGURES["other"] += 1
        raise
    finally:
        FIGURES["seconds"] += time.perf_counter() - started


def save_figures():
    record("input_fuzz", **{k: round(v, 2) if isinstance(v, float) else v for k, v in FIGURES.items()})


# -- tests ----------------------------------------------------------------------------------------

def test_every_kind_on_every_input(subjects):
    """The sweep: each kind of case once on each input of each model."""
    outcomes = {}
    try:
        for subject in subjects.values():
            for kind in KINDS:
                for i in range(len(subject.leaves)):
                    special = ((3, float("nan")),) if kind == "special" else ()
                    outcomes[(subject.name, kind, i)] = run_case(subject, kind, i, seed=i, special=special,
                                                                 size=i)
                    if kind == "special":
                        run_case(subject, kind, i, seed=i, special=((1, float("inf")), (5, -float("inf"))))
    finally:
        save_figures()
    assert outcomes[("dynamic_batch", "resized", 0)] == "correct"
    assert outcomes[("mlp", "numpy", 0)] == "correct"


def test_empty_batches_answer_like_eager(subjects):
    for name, dim in (("dynamic_batch", 0), ("bucketed", 1)):
        subject = subjects[name]
        shape = list(subject.leaves[0].shape)
        shape[dim] = 0
        x = torch.randn(shape)
        got, want = subject.compiled(x), subject.eager(x).detach()
        assert got.shape == want.shape and got.dtype == want.dtype


SPECIALS = st.lists(st.tuples(st.integers(0, 10_000),
                              st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                                               1e6, -1e6, 1e-30])),
                    min_size=1, max_size=4)


def test_random_calls_answer_or_raise_input_errors(subjects):
    names = sorted(subjects)

    @settings(max_examples=count(ci=400, long=20000), deadline=None, database=None,
              derandomize=not long_run(), suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(names), kind=st.sampled_from(KINDS), leaf=st.integers(0, 2),
           seed=st.integers(0, 2 ** 31), special=SPECIALS, size=st.integers(0, 20))
    def case(name, kind, leaf, seed, special, size):
        run_case(subjects[name], kind, leaf, seed, tuple(special), size)

    try:
        case()
    finally:
        save_figures()


def test_a_constant_input_given_an_array_is_an_input_error():
    """``array != 3`` has no single truth value: comparing a tensor or array given where the
    model was compiled with a constant raised RuntimeError or ValueError."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, n: int = 3):
            return self.lin(x) * n

    model, x = Scaled().eval(), torch.randn(2, 4)
    compiled = kiln.trace(model, (x, 3))
    torch.testing.assert_close(compiled(x, 3), model(x, 3).detach(), atol=1e-5, rtol=1e-5)
    for bad in (4, torch.tensor([3, 3]), np.array([3, 3]), None, "3"):
        with pytest.raises(kiln.InputError, match=r"input 'n': the model was compiled with the constant 3"):
            compiled(x, bad)
