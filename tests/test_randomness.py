"""Graphs that draw random numbers (dropout, ``rand_like``) compile to eager's numbers for
the same seed, and compiling does not use up the caller's random numbers
(``kiln.graph.randomness``). The training paths are in ``test_device_compile.py``
(dropout in ONNX Runtime partitions and whole on Inductor)."""
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import randomness


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
    assert "random" in host["aten::rand_like"] and "random" in host["aten::native_dropout"]
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


# -- the device's dropout masks (kiln.device.draws) --------------------------------------------

def _masks_both_ways(like, p, seed=3):
    from kiln.device import draws
    torch.manual_seed(seed)
    expected = torch.empty_like(like).bernoulli_(p).to(torch.bool)
    after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    got = draws.keep_mask(like.to("meta"), p)
    return expected, got, after_eager, torch.get_rng_state()


def test_device_masks_are_cpu_eagers_bits_and_leave_the_generator_where_eager_does():
    """Contiguous and transposed (CPU draws in memory order), float32 and bf16, odd sizes,
    p near the ends: the same kept elements, the same generator state afterwards."""
    from kiln.device import draws
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
    from kiln.device import draws
    monkeypatch.setattr(draws, "_exact", {})
    monkeypatch.setattr(draws, "_from_bits", lambda bits, p: bits.bitwise_and(1).bool())   # a wrong rule
    assert draws._probe(torch.float32) is False
    expected, got, s1, s2 = _masks_both_ways(torch.empty(8, 100), 0.9)
    assert draws._exact[torch.float32] is False
    assert torch.equal(got, expected) and torch.equal(s1, s2)
