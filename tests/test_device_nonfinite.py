"""Values and layouts where a device program would part from eager PyTorch.

* NaN and infinities reaching a compiled program whose engine was found at compile time to
  answer them otherwise (a ReLU or max that turns NaN into a number, ``%`` by an infinity):
  that call runs op by op, so the answer is eager's. Until 12-03 the program ran it: CPU
  ``relu([nan, ...])`` is ``[nan, ...]``, the device's was ``[0.0, ...]``, and a NaN loss
  could come out a number.
* A batch norm's output laid out as the CPU's kernel lays it out (contiguous), not as its
  meta kernel does (the input's strides): until 12-03 ``transpose -> BatchNorm1d ->
  transpose -> Linear`` failed on the device with "view size is not compatible".
"""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

NAN, INF = float("nan"), float("inf")


@contextlib.contextmanager
def _compiling(mode, **options):
    """The device in ``mode``, compiling in line with ``options``, its metrics and programs
    fresh; any RuntimeWarning (a program running op by op) an error; back to the defaults after."""
    from kiln.device import metrics, modes
    metrics.clear()
    modes.forget_compiled()
    modes.set_mode(mode, background=False, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)          # the program compiles
            yield modes.device()
    finally:
        modes.wait_compiles()
        modes.set_mode("eager", background="auto", engine=None)


def _f(x, y):
    return torch.relu(x) * 2, x.amax(), torch.remainder(y, x.abs() + 1), F.gelu(x)


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_nan_and_infinities_into_a_compiled_program_give_eagers_answers(engine, mode):
    from kiln.device import metrics, modes

    good = ([1.0, -2.0, 3.0, 4.0], [3.0, 5.0, -7.0, 1.5])
    with _compiling(mode, engine=engine) as dev:
        def step(x, y):
            out = _f(torch.tensor(x).to(dev), torch.tensor(y).to(dev))
            if mode == "lazy":
                modes.mark_step()
            return [t.cpu() for t in out]

        for _ in range(3):                                          # seen, compiled, run
            for got, want in zip(step(*good), _f(*map(torch.tensor, good))):
                torch.testing.assert_close(got, want)
        assert metrics.counter_value("UncachedCompile") == 1
        assert metrics.counter_value("NonfiniteEagerCalls") == 0
        for x, y in (([NAN, -2.0, 3.0, 4.0], good[1]), (good[0], [3.0, INF, -INF, NAN]),
                     ([INF, -INF, 3.0, 4.0], [3.0, 5.0, -7.0, 1.5])):
            want = _f(torch.tensor(x), torch.tensor(y))
            for got, w in zip(step(x, y), want):
                torch.testing.assert_close(got, w, equal_nan=True)
        assert metrics.counter_value("NonfiniteEagerCalls") >= 2          # the two holding NaN ran op by op
        for got, want in zip(step(*good), _f(*map(torch.tensor, good))):          # finite: compiled again
            torch.testing.assert_close(got, want)
        assert metrics.counter_value("UncachedCompile") == 1


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_batch_norm_over_a_transposed_input_then_a_linear_trains_like_the_cpu(mode):
    from kiln.device import modes
    dev = modes.device()
    modes.set_mode(mode)

    def run(device):
        torch.manual_seed(0)
        bn, lin = torch.nn.BatchNorm1d(4).to(device), torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.SGD([*bn.parameters(), *lin.parameters()], lr=0.1)
        losses = []
        for i in range(3):
            h = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(i)).to(device)
            out = lin(bn(h.transpose(1, 2)).transpose(1, 2))       # (B, L, C) layers' usual pattern
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mode == "lazy":
                modes.mark_step()
            losses.append(float(loss))
        bn.eval()
        with torch.no_grad():
            h = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(9)).to(device)
            evaluated = lin(bn(h.transpose(1, 2)).transpose(1, 2)).cpu()
        return losses, evaluated, [p.detach().cpu() for p in (*bn.parameters(), *lin.parameters())]

    try:
        want, got = run("cpu"), run(dev)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    finally:
        modes.wait_compiles()
        modes.set_mode("eager")


def _scores(q, k):
    cache = torch.tensor([], device=q.device)      # a Hugging Face cache layer's first keys
    keys = torch.cat([cache, k.transpose(1, 2)], dim=-2)
    return keys, q @ (keys.transpose(-2, -1) * 0.25)


def test_a_key_cached_onto_an_empty_tensor_compiles_on_inductor_in_lazy_mode():
    """``cat([empty, k])`` is recorded as the contiguous copy ``cat`` returns: Inductor's
    decomposition of the ``cat`` kept the key's transposed layout, and the view of its
    scaled transpose for the batched matmul was refused ("Cannot view a tensor with shape
    [2, 4, 8, 16] and strides (512, 8, 1, 32)"), so until 12-03 every GPT-2 and T5 training
    step on the device ran op by op."""
    from kiln.device import metrics, modes
    q, k = torch.randn(2, 2, 7, 16), torch.randn(2, 7, 2, 16)
    with _compiling("lazy", engine="inductor", optlevel=1) as dev:
        for _ in range(2):
            got = _scores(q.to(dev), k.to(dev))
            modes.mark_step()
            for g, w in zip(got, _scores(q, k)):
                assert g.is_contiguous() == w.is_contiguous()
                torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
        assert metrics.counter_value("UncachedCompile") == 1
        assert metrics.counter_value("EagerGraphs") == 0


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_channels_last_cnn_trains_and_drops_out_like_the_cpu(mode):
    """A convolution's output is channels-last on the CPU where its input or weight is; the
    device's meta kernel said contiguous. Until 12-03 a channels-last CNN failed at its first
    ``flatten`` on the device ("view size is not compatible"), and dropout after such a
    convolution drew its mask in another order than the CPU's (found by probing)."""
    import torch.nn as nn
    from kiln.device import modes
    dev = modes.device()
    modes.set_mode(mode)
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 10))
    cpu = cpu.to(memory_format=torch.channels_last)
    on_dev = copy.deepcopy(cpu).to(dev)
    x = torch.randn(8, 3, 8, 8).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (8,))
    losses = {}
    for where, model in (("cpu", cpu), ("kiln", on_dev)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            torch.manual_seed(123)
            features = F.dropout(model[0](x.to(where)), 0.5)      # the mask drawn in memory order
            loss = F.cross_entropy(model[1:](features), y.to(where))
            loss.backward()
            opt.step()
            if where == "kiln":
                modes.mark_step()
            losses.setdefault(where, []).append(loss.item())
    torch.testing.assert_close(losses["kiln"], losses["cpu"], rtol=1e-5, atol=1e-6)
    for p, q in zip(on_dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
