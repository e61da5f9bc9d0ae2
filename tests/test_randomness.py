"""Graphs that draw random numbers (dropout, ``rand_like``) compile to eager's numbers for
the same seed, and compiling does not use up the caller's random numbers
(``kiln.graph.randomness``), and dropout's masks drawn apart from the graph keep it whole
(``kiln.graph.dropout``). The training paths are in ``test_device_compile.py``."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import randomness
from tests import forkserver


class _Noisy(torch.nn.Module):
    """Noise added to a transposed product: ``rand_like`` draws into its input's layout, a
    transpose eager leaves as a view and ONNX Runtime hands back contiguous."""

    def forward(self, x):
        y = (x * 2).t()
        return y + torch.rand_like(y), F.dropout(x, 0.5, training=True)


def test_a_graph_that_draws_compiles_to_eagers_numbers_and_leaves_the_seed_alone():
    model, x = _Noisy(), torch.randn(6, 10)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    compiled = kiln.trace(model, x, engine="onnxruntime", optlevel=1, cache=False, quiet=True)
    # the check drew eager's numbers twice and passed; the caller's generator is untouched
    assert torch.equal(torch.get_rng_state(), before)
    kiln.analyze(model, x, engine="onnxruntime", quiet=True)      # its capture runs the model too
    assert torch.equal(torch.get_rng_state(), before)
    assert compiled.manifest["validation"]["passed"]
    host = {u["op"]: u["reason"] for u in compiled.manifest["report"]["unsupported_ops"]}
    # dropout's mask drawn apart from its product (kiln.graph.dropout), on the host
    assert "random" in host["aten::rand_like"] and "random" in host["kiln::dropout_keep_mask"]
    assert "aten::native_dropout" not in host
    assert "lays out" in host["aten::copy"]        # the transposed input, laid out as eager's
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = compiled(x)
        torch.manual_seed(seed)
        expected = model(x)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


class _Attend(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=self.p)


def test_attention_without_dropout_draws_nothing():
    """PyTorch tags attention as random for its dropout_p: at 0 it must stay on the engine
    (every inference attention graph would otherwise move to the host)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    q = torch.randn(1, 2, 4, 8)
    drawn = {}
    for p in (0.0, 0.1):
        graph = make_fx(_Attend(p), pre_dispatch=True)(q)
        drawn[p] = [randomness.draws(n) for n in graph.graph.nodes if "attention" in str(n.target)]
    assert drawn[0.0] and not any(drawn[0.0])
    assert drawn[0.1] and all(drawn[0.1])
    report = kiln.analyze(_Attend(0.0), q, engine="onnxruntime", quiet=True)
    assert report.host_ops == 0 and report.support_percentage == 100.0, str(report)


def test_draws_restore_sets_the_generator_back():
    torch.manual_seed(3)
    with randomness.unchanged():
        snapshot = randomness.Draws()
        a = torch.rand(5)
        snapshot.restore()
        assert torch.equal(torch.rand(5), a)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(5), a)       # the block's draws did not count


# -- the device's dropout masks (kiln.graph.draws) --------------------------------------------

def _masks_both_ways(like, p, seed=3):
    from kiln.graph import draws
    torch.manual_seed(seed)
    expected = torch.empty_like(like).bernoulli_(p).to(torch.bool)
    after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    got = draws.keep_mask(like.to("meta"), p)
    return expected, got, after_eager, torch.get_rng_state()


def test_device_masks_are_cpu_eagers_bits_and_leave_the_generator_where_eager_does():
    """Contiguous and transposed (CPU draws in memory order), float32 and bf16, odd sizes,
    p near the ends: the same kept elements, the same generator state afterwards."""
    from kiln.graph import draws
    for dtype in (torch.float32, torch.bfloat16):
        for shape, transpose in (((4, 33, 65), False), ((2, 3, 40, 24), True), ((1000,), False)):
            like = torch.empty(shape, dtype=dtype)
            like = like.transpose(-1, -2) if transpose else like
            for p in (0.9, 0.5, 1e-6, 1 - 1e-9, 0.0):
                expected, got, s1, s2 = _masks_both_ways(like, p)
                assert got.dtype == torch.bool and got.stride() == expected.stride()
                assert torch.equal(got, expected), (dtype, shape, transpose, p)
                assert torch.equal(s1, s2), (dtype, shape, transpose, p)
    # which way it drew: the integer draw where the probe found it exact (every CPU but Intel's,
    # where PyTorch draws through MKL)
    assert draws._exact[torch.float32] == draws._probe(torch.float32)


def test_device_masks_fall_back_to_bernoulli_where_the_integer_draw_is_not_exact(monkeypatch):
    from kiln.graph import draws
    monkeypatch.setattr(draws, "_exact", {})
    monkeypatch.setattr(draws, "_from_bits", lambda bits, p: bits.bitwise_and(1).bool())   # a wrong rule
    assert draws._probe(torch.float32) is False
    expected, got, s1, s2 = _masks_both_ways(torch.empty(8, 100), 0.9)
    assert draws._exact[torch.float32] is False
    assert torch.equal(got, expected) and torch.equal(s1, s2)


@pytest.mark.parametrize("held", [None, 1], ids=["a-period-ahead", "one-mask-ahead"])
def test_masks_drawn_ahead_are_the_masks_drawn_here_whatever_the_caller_does_between_them(held, monkeypatch):
    """kiln.graph.draw_ahead: steps of masks that repeat are drawn on a worker thread from a
    copy of the generator's state. Every mask and every generator state after it equals
    ``bernoulli_``'s on the default generator, through a steady run, random data drawn between
    masks, a seed set mid-step, a new shape and a new probability; and most steady masks
    were in fact drawn ahead (else this test would test nothing)."""
    from kiln.graph import draw_ahead, draws
    monkeypatch.setattr(draw_ahead, "_cpus", [2])          # whatever this machine has
    if held is not None:            # the bytes held ahead capped: one mask at a time
        monkeypatch.setattr(draw_ahead, "_MAX_HELD_BYTES", held)
    draw_ahead.reset()
    step = [torch.empty(4, 33, 65), torch.empty(2, 3, 40, 24).transpose(-1, -2), torch.empty(4, 33, 65),
            torch.empty(1000)]
    events = {(3, 1): lambda: torch.rand(5), (5, 0): lambda: torch.manual_seed(7),
              (6, 2): lambda: torch.randn(3)}

    def run(draw):
        torch.manual_seed(2026)
        out = []
        for s in range(12):
            for i, like in enumerate(step if s != 8 else step[:2] + [torch.empty(5, 7)]):
                p = 0.5 if (s, i) == (9, 3) else 0.9
                out.append((draw(like, p), torch.get_rng_state()))
                if (s, i) in events:
                    events[(s, i)]()
        return out

    expected = run(lambda like, p: torch.empty_like(like).bernoulli_(p).to(torch.bool))
    before = draw_ahead.stats()
    got = run(lambda like, p: draws.keep_mask(like.to("meta"), p))
    after = draw_ahead.stats()
    assert len(got) == len(expected)
    for n, ((m1, s1), (m2, s2)) in enumerate(zip(expected, got)):
        assert m2.dtype == torch.bool and m2.stride() == m1.stride(), n
        assert torch.equal(m1, m2) and torch.equal(s1, s2), n
    ahead = after["ahead"] - before["ahead"]
    assert ahead >= len(got) // 2, after
    # the device's form: the mask and its values in the input's dtype, both drawn ahead
    torch.manual_seed(3)
    for _ in range(4):
        mask, values = draws.keep_mask(step[1].to("meta"), 0.9, also_as_values=True)
        assert values.dtype == torch.float32 and torch.equal(values, mask.float())
    draw_ahead.reset()


def test_a_draw_that_fails_on_the_worker_is_drawn_again_where_it_is_asked_for(monkeypatch):
    """The worker's prediction ends; the caller draws the mask itself (no hang, the same mask)."""
    import threading
    from kiln.graph import draw_ahead
    monkeypatch.setattr(draw_ahead, "_cpus", [2])
    tried = []

    def draw(layout, generator):
        if threading.current_thread().name == "kiln-draw-ahead":
            tried.append(layout)
            raise MemoryError("no room on the worker")
        return torch.empty(layout[0]).bernoulli_(0.5, generator=generator).bool()
    draw_ahead.reset()
    torch.manual_seed(5)
    got = [draw_ahead.mask(((16,), "test"), draw) for _ in range(12)]
    torch.manual_seed(5)
    want = [torch.empty(16).bernoulli_(0.5).bool() for _ in range(12)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert tried                     # the worker did try
    draw_ahead.reset()


@pytest.mark.parametrize("why", ["switched off", "one CPU"])
def test_masks_are_drawn_here_when_draw_ahead_is_off_or_has_no_core_to_use(why, monkeypatch):
    from kiln.graph import draw_ahead, draws
    if why == "one CPU":
        monkeypatch.setattr(draw_ahead, "_cpus", [1])
    else:
        monkeypatch.setattr(draw_ahead, "_cpus", [2])
        monkeypatch.setenv("KILN_DRAW_AHEAD", "off")
    draw_ahead.reset()
    before = draw_ahead.stats()
    torch.manual_seed(1)
    got = [draws.keep_mask(torch.empty(64, device="meta"), 0.9) for _ in range(8)]
    torch.manual_seed(1)
    want = [torch.empty(64).bernoulli_(0.9).bool() for _ in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert draw_ahead.stats()["ahead"] == before["ahead"]


def _dropout_graph(transposed):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        y = (x * 2).transpose(0, 1) if transposed else x * 2
        out, mask = torch.ops.aten.native_dropout.default(y, 0.3, True)
        return out + 1, mask
    x = torch.randn(6, 10)
    return make_fx(f)(x), f, x


def test_a_mask_drawn_apart_is_native_dropouts_to_the_bit():
    """``draw_masks_apart``: the mask from x's shape, strides and dtype alone (no input from
    the graph), then the products; for a seed, the same output and mask, bit for bit, as
    ``native_dropout`` on a contiguous and a transposed input; a bf16 one is left as it is."""
    from kiln.graph import dropout
    for transposed in (False, True):
        gm, f, x = _dropout_graph(transposed)
        randomness.lay_out_as_eager(gm)
        assert dropout.draw_masks_apart(gm) == 1
        draws = [n for n in gm.graph.nodes if dropout.is_mask_draw(n)]
        assert len(draws) == 1 and not draws[0].all_input_nodes
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
        for seed in (3, 4):
            torch.manual_seed(seed)
            got = gm(x)
            torch.manual_seed(seed)
            expected = f(x)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            assert got[1].dtype == torch.bool
    gm, _, _ = _dropout_graph(False)
    from torch.fx.experimental.proxy_tensor import make_fx
    half = make_fx(lambda t: torch.ops.aten.native_dropout.default(t, 0.3, True))(torch.randn(4, 4, dtype=torch.bfloat16))
    assert dropout.draw_masks_apart(half) == 0


def test_a_program_with_a_drawn_mask_loads_in_a_fresh_process(tmp_path):
    """The host program names ``kiln::dropout_keep_mask``: a process that loads the artifact
    resolves it without importing anything itself, and draws eager's mask for the seed."""
    import sys

    class Drop(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(F.dropout(x * 3, 0.4, training=True))
    x = torch.randn(5, 7)
    compiled = kiln.trace(Drop(), x, engine="onnxruntime", optlevel=1, whole_graph=True, cache=False, quiet=True)
    assert [p["engine"] for p in compiled.manifest["partitions"]] == ["onnxruntime"]
    path = tmp_path / "drop.kiln"
    compiled.save(path)
    torch.manual_seed(9)
    expected = Drop()(x)
    torch.save(x, tmp_path / "x.pt")
    code = (f"import torch, kiln; m = kiln.load({str(path)!r}); x = torch.load({str(tmp_path / 'x.pt')!r}); "
            f"torch.manual_seed(9); torch.save(m(x), {str(tmp_path / 'y.pt')!r})")
    r = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(tmp_path / "y.pt")
    assert torch.equal(got == 0, expected == 0)                      # the same elements dropped
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # ONNX Runtime's tanh
