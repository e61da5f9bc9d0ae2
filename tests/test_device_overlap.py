"""Lazy mode with ``overlap=True`` (kiln.device.inflight): a step's compiled program runs in
the background while the next step is recorded. It must train exactly as the steps run in
turn do (the same programs, bit for bit), record the next step without waiting for the
program, wait wherever a value is read, keep eager's order for a host write to data the
recorded step reads, and report a failed program where the program's values are asked for."""
import copy

import pytest
import torch
import torch.nn.functional as F

from kiln.device import inflight, metrics, modes, programs
from tests import test_device
from tests.test_device_compile import MODELS, _data

DEV = modes.device()
_fresh = test_device._fresh     # the device tests' autouse fixture: fresh metrics and programs, defaults after


def _train(kind, overlap, steps=4):
    """Lazy-mode AdamW steps of a test model (programs compiled in line, so both runs use
    the same ones from the first step); the losses (read at the end) and parameters."""
    modes.set_mode("lazy", overlap=overlap, background=False, optlevel=1)
    torch.manual_seed(0)
    model = copy.deepcopy(MODELS[kind]()).to(DEV)
    x, y = _data(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(7)
    losses, in_flight = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(DEV)), y.to(DEV))
        loss.backward()
        opt.step()
        # recorded while the last step's program ran: nothing waited for it
        flight = inflight._STATE["flight"]
        in_flight.append(flight is not None and flight.promises is not None)
        modes.mark_step()
        losses.append(loss.detach())
    return [float(v) for v in losses], [p.detach().cpu() for p in model.parameters()], in_flight


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_steps_overlapped_train_exactly_as_steps_run_in_turn(kind):
    expected, params, _ = _train(kind, overlap=False)
    metrics.clear()
    got, got_params, in_flight = _train(kind, overlap=True)
    assert got == expected                       # the same programs on the same inputs: bit for bit
    for p, q in zip(params, got_params):
        assert torch.equal(p, q)
    assert metrics.counter_value("OverlappedRuns") == 4, metrics.report()
    # the programs recorded with promised inputs are the ones recorded after steps in turn
    assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") == 0, \
        metrics.report()
    # every step after the first was recorded with the one before still in flight
    assert in_flight == [False, True, True, True], in_flight


def test_values_read_while_a_program_runs_wait_for_it():
    torch.manual_seed(0)
    w_host = torch.randn(8, 8)
    w = w_host.clone().to(DEV).requires_grad_()
    modes.set_mode("lazy", overlap=True, background=False, optlevel=1)
    opt = torch.optim.SGD([w], lr=0.5)
    x = torch.randn(4, 8)
    for _ in range(2):
        opt.zero_grad()
        loss = (x.to(DEV) @ w).tanh().sum()
        loss.backward()
        opt.step()
        modes.mark_step()
    # eager's two steps
    we = w_host.clone().requires_grad_()
    opte = torch.optim.SGD([we], lr=0.5)
    for _ in range(2):
        opte.zero_grad()
        le = (x @ we).tanh().sum()
        le.backward()
        opte.step()
    assert inflight._STATE["flight"] is not None                     # the last step is in flight
    wt = w.detach().t()
    assert type(wt._kc.data) is inflight.Promise                     # a view of promised data: promised
    torch.testing.assert_close(float(loss), float(le), rtol=1e-6, atol=1e-6)   # item() waits
    torch.testing.assert_close(w.detach().cpu(), we.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(wt.cpu(), we.detach().t(), rtol=1e-6, atol=1e-6)
    assert "tensor(" in repr(wt)


def test_a_host_write_after_a_recorded_read_of_promised_data_keeps_eager_order():
    """``z = w * 2`` is recorded while the program computing ``w`` runs; then ``w`` is
    written on the host in place (an operation run now). ``z`` must be twice the ``w``
    before the write, as in eager."""
    modes.set_mode("lazy", overlap=True, background=False, optlevel=1)
    w = torch.ones(4, 4).to(DEV)
    w.add_(1.0)                      # recorded: w becomes a program's output
    modes.mark_step()                # ... which runs in the background
    z = w * 2                        # recorded: reads w's promised value
    torch.manual_seed(3)
    w.uniform_()                     # run now on w's memory
    torch.manual_seed(3)
    expected = torch.empty(4, 4).uniform_()
    assert torch.equal(z.cpu(), torch.full((4, 4), 4.0))
    assert torch.equal(w.cpu(), expected)


def test_a_program_that_fails_in_the_background_says_so_where_its_values_are_read(monkeypatch):
    modes.set_mode("lazy", overlap=True, background=False, optlevel=1)
    w = torch.ones(3).to(DEV)
    w.add_(1.0)
    modes.mark_step()                # compiles the program (and runs it)
    flush = programs.flush

    def failing(*args, **kwargs):
        out = flush(*args, **kwargs)
        if isinstance(out, programs.Overlapped):
            def broken(*inputs):
                raise ValueError("engine gave up")
            out.run = broken
        return out
    monkeypatch.setattr(programs, "flush", failing)
    w.add_(1.0)
    modes.mark_step()
    with pytest.raises(RuntimeError, match=r"failed while the next step was recorded: ValueError: engine gave up"):
        w.cpu()
    monkeypatch.setattr(programs, "flush", flush)
    with pytest.raises(RuntimeError, match="engine gave up"):   # and stays failed, not stale
        w.cpu()


def test_a_promised_view_is_one_input_before_and_after_its_program_lands():
    """A view of promised data (``w.t()``) read by the trace, then printed (its value at
    hand once the program has landed), then read again: one input of the trace, not two
    (two would be another program, compiled again, at every such step)."""
    from kiln.device import dispatch
    modes.set_mode("lazy", overlap=True, background=False, optlevel=1)
    w = torch.randn(4, 4).to(DEV)
    x = torch.randn(2, 4).to(DEV)
    w.mul_(2.0)
    modes.mark_step()                              # w's new value: promised
    wt, wv = w.t(), w.view(16)
    assert type(wt._kc.data) is inflight.Promise
    modes.synchronize()                            # the program lands; the views hold their promises
    a = wv * 1                                     # a promised input ...
    b = x * 1                                      # ... asked for its value by the next new input
    z1 = x @ wt                                    # another, after that
    assert "tensor(" in repr(wt)                   # wt's value taken in place of the promise
    assert type(wt._kc.data) is torch.Tensor
    z2 = x @ wt
    trace = dispatch.current()
    reads_wt = [k for k, d in trace.inputs if d is wt._kc.data or (type(d) is inflight.Promise and d.value is wt._kc.data)]
    assert len(reads_wt) == 1, trace.inputs
    torch.testing.assert_close(z1.cpu(), z2.cpu())
    torch.testing.assert_close(z1.cpu(), x.cpu() @ w.cpu().t())
    torch.testing.assert_close(a.cpu() + b.cpu().sum(), w.cpu().view(16) + x.cpu().sum())
