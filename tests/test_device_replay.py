"""The device replays a step whose operations match the last one's, and never replays a
stale one: a step that takes another branch, another shape, another Python scalar
(``2`` for ``2.0``, ``-0.0`` for ``0.0``) or another wiring part way through is recorded
afresh from there on, and its values equal CPU eager's. Programs are interpreted here
(nothing compiles), so a replayed program that is not the step's own shows up as wrong
values, a wrong dtype or a shape error."""
import pytest
import torch
import torch.nn.functional as F

from kiln.device import metrics, modes

DEV = modes.device()


@pytest.fixture(autouse=True)
def _interpreted():
    modes.forget_compiled()
    yield
    modes.set_mode("eager")


def _step(x, w, counts, *, branch="a", power=3, slope=0.1, shift=0.0, scale=2):
    """A forward with dropout, a backward and a few results; every keyword changes the
    program part way through, after operations a replay takes from the template."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.manual_seed(7)                        # dropout's mask: the CPU generator, in order
    h = F.dropout(x, 0.25) @ w                  # the shared prefix: replayed each time
    t = torch.tanh(h)
    if branch == "a":
        z = t - h                               # the same operations both ways, wired the other way
    elif branch == "b":
        z = h - t
    else:
        z = torch.sigmoid(h) - h
    z = F.leaky_relu(z, slope).pow(power)
    off = torch.zeros_like(h).fill_(shift)      # -0.0: the sign is the answer (a fill's argument)
    loss = (z + off).sum()
    loss.backward()
    ints = counts.pow(scale).sum(0)             # int64 ** 2 stays int64; ** 2.0 is float32
    return loss.detach(), w.grad, z.t().contiguous(), off, ints, x.grad


def _cpu(out):
    return [t.cpu() for t in out]


CHANGES = [{"branch": "b"}, {"branch": "c"}, {"power": 2}, {"slope": 0.2}, {"shift": -0.0}, {"scale": 2.0},
           {"rows": 6}]


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_changed_step_is_recorded_afresh_never_replayed_stale(mode):
    modes.set_mode(mode, compile_after=10 ** 9)                 # interpret: no compiles
    metrics.clear()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g)
    counts = torch.randint(0, 5, (4, 3), generator=g)
    xs = {rows: torch.randn(rows, 8, generator=g) for rows in (4, 6)}
    plan = [{}, {}] + [step for change in CHANGES for step in (change, {})]
    counted = []
    for change in plan:
        kw = dict(change)
        x = xs[kw.pop("rows", 4)]
        expected = _step(x, w, counts, **kw)
        before = metrics.counter_value("ReplayedOps"), metrics.counter_value("RecordedOps")
        got = _step(x.to(DEV), w.to(DEV), counts.to(DEV), **kw)
        if mode == "lazy":
            modes.mark_step()
        got = _cpu(got)
        for e, o in zip(expected, got):
            assert o.dtype == e.dtype and o.shape == e.shape, (change, o.dtype, e.dtype, o.shape, e.shape)
            torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-6, msg=lambda m: f"{change}: {m}")
            assert torch.equal(torch.signbit(o), torch.signbit(e)), change           # -0.0 stays -0.0
        counted.append((change, metrics.counter_value("ReplayedOps") - before[0],
                        metrics.counter_value("RecordedOps") - before[1]))
    # every repeat of the first step replays whole, the one right after a change too
    # (from the template it shares a prefix with); every change replays the operations
    # before it (none for a new input shape) and records the rest
    for change, replayed, recorded in counted[1:]:
        if change:
            assert recorded > 0 and (replayed > 0 or "rows" in change), str(counted)
        else:
            assert replayed > 0 and recorded == 0, str(counted)


def test_a_guard_compared_as_it_is_walked_agrees_with_the_guard_built_whole():
    """``replay.matches`` (the replay's comparison, stopping at the first difference) must
    accept exactly the calls whose built guard (``replay.guard``) equals the template's:
    across argument kinds that only the guard tells apart (``2`` / ``2.0``, ``1`` / ``True``,
    ``0.0`` / ``-0.0``, a list's length, keyword names, a tensor's wiring and layout)."""
    from kiln.device import dispatch, replay
    from kiln.device import tensor as dt
    modes.set_mode("lazy", compile_after=10 ** 9)
    trace = dispatch.current()
    a = dt.wrap(torch.randn(4, 3))
    b = dt.wrap(torch.randn(4, 3))
    at = dt.wrap(a._kc.data.t())                    # other strides, same storage
    host = torch.tensor(2.0)                         # a 0-dim host tensor: copied in as an input
    calls = [((a, b), {}), ((b, a), {}), ((a, a), {}), ((at, b), {}), ((a, 2), {}), ((a, 2.0), {}),
             ((a, True), {}), ((a, 1), {}), ((a, [True, 2]), {}), ((a, 0.0), {}), ((a, -0.0), {}), ((a, [1, 2]), {}), ((a, [1, 2, 3]), {}),
             ((a, (1, 2)), {}), ((a, [a, b]), {}), ((a, [b, a]), {}), ((a, None), {}),
             ((a, b), {"alpha": 2}), ((a, b), {"beta": 2}), ((a, b), {"alpha": 2.0}), ((a, host), {}),
             ((a, torch.float16), {}), ((a, torch.float32), {}), ((a, [[1], [2, 3]]), {})]
    checked = 0
    for t_args, t_kwargs in calls:
        template, _ = replay.guard(trace, t_args, t_kwargs)
        for args, kwargs in calls:
            built, _ = replay.guard(trace, args, kwargs)
            walked = replay.matches(trace, template, args, kwargs)
            assert (walked is not None) == (built == template), (t_args, t_kwargs, args, kwargs)
            checked += 1
    assert checked == len(calls) ** 2
    # a host tensor with dimensions: the call runs now, never replays
    assert replay.matches(trace, replay.guard(trace, (a, b), {})[0], (a, torch.randn(4, 3)), {}) is None


# A Python float in arithmetic is lifted to a 0-dim tensor input (rewrites.lift_scalars):
# the lifted form must give CPU eager's dtype and values, bit for bit.
SCALAR_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32]
SCALAR_OPS = [lambda t, s: t + s, lambda t, s: t - s, lambda t, s: t * s, lambda t, s: t / s,
              lambda t, s: s / t, lambda t, s: t.clone().add_(s), lambda t, s: t.clone().mul_(s)]


def _same(got, want):
    got = got.cpu()
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    if want.is_floating_point():
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_python_float_in_arithmetic_gives_cpu_dtypes_and_values(mode):
    modes.set_mode(mode)
    for dtype in SCALAR_DTYPES:
        for shape in [(), (2,)]:
            x = torch.tensor([3.0, -2.0][:max(1, len(shape) * 2)], dtype=torch.float64).reshape(shape or ()).to(dtype)
            for op in SCALAR_OPS:
                for s in [2.5, 0.1, 65519.0, -0.0, 0.0]:
                    if dtype in (torch.int64, torch.int32) and op is SCALAR_OPS[-2]:
                        continue                 # int add_ of a float: an error both ways
                    if dtype in (torch.int64, torch.int32) and op is SCALAR_OPS[-1]:
                        continue
                    got = op(x.to(DEV), s)
                    modes.mark_step()
                    _same(got, op(x, s))


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_times_minus_zero_is_not_times_zero(mode):
    modes.set_mode(mode)
    x = torch.tensor([1.0, -2.0])
    a, b = x.to(DEV) * 0.0, x.to(DEV) * -0.0
    modes.mark_step()
    _same(a, x * 0.0)
    _same(b, x * -0.0)
    from kiln.device import rewrites
    before = len(rewrites._SCALARS)
    for _ in range(5):
        x.to(DEV) * float("nan")
    modes.mark_step()
    assert len(rewrites._SCALARS) <= before + 1


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_out_with_two_outputs_writes_and_returns_both(mode):
    modes.set_mode(mode)
    a = torch.tensor([[3.0, 1.0, 2.0], [0.5, -1.0, 4.0]])
    for call in [lambda x, o: torch.sort(x, 1, out=o), lambda x, o: torch.max(x, 1, out=o),
                 lambda x, o: torch.min(x, 0, out=o)]:
        want_o = (torch.empty(0), torch.empty(0, dtype=torch.long))
        want = call(a, want_o)
        got_o = (torch.empty(0, device=DEV), torch.empty(0, dtype=torch.long, device=DEV))
        got = call(a.to(DEV), got_o)
        modes.mark_step()
        assert got[0] is got_o[0] and got[1] is got_o[1]
        for g, w in zip(list(got) + list(got_o), list(want) + list(want_o)):
            _same(g, w)


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_pow_and_ldexp_give_the_cpus_dtype_where_meta_does_not(mode):
    modes.set_mode(mode)
    b = torch.tensor([[True, False], [False, True]])
    i = torch.tensor([1, 2, 3])
    calls = [(lambda x: torch.pow(x, True), b), (lambda x: torch.pow(x, 2), b), (lambda x: torch.pow(x, 2.5), i),
             (lambda x: torch.ldexp(x, torch.tensor(2.0, dtype=torch.float16).to(x.device)), i),
             (lambda x: torch.ldexp(x, torch.tensor(1.0, dtype=torch.bfloat16).to(x.device)), i),
             (lambda x: torch.ldexp(x, torch.tensor([1, 2, 0]).to(x.device)), i)]
    for call, x in calls:
        got = call(x.to(DEV))
        modes.mark_step()
        _same(got, call(x))


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_parameters_class_called_on_data_makes_a_parameter_as_on_the_cpu(mode):
    modes.set_mode(mode)
    for requires_grad in [True, False, None]:
        kw = {} if requires_grad is None else {"requires_grad": requires_grad}
        want = type(torch.nn.Parameter(torch.ones(2)))(torch.zeros(2), **kw)
        p = torch.nn.Parameter(torch.ones(2, device=DEV))
        got = type(p)(torch.zeros(2, device=DEV), **kw)
        assert isinstance(got, torch.nn.Parameter) and got.device == p.device
        assert got.requires_grad == want.requires_grad
        _same(got.detach(), want.detach())
    assert type(p)(torch.zeros(2, device=DEV), False).requires_grad is False


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_add_with_a_float_alpha_rounds_once_as_on_the_cpu(mode):
    modes.set_mode(mode)
    g = torch.Generator().manual_seed(0)
    for dtype, other_dtype in [(torch.float32, torch.float32), (torch.float64, torch.float64),
                               (torch.float32, torch.float64), (torch.float16, torch.float32)]:
        for n in [(), (1,), (37,), (300,)]:
            a = torch.randn(n, generator=g).to(dtype)
            b = (torch.randn(n, generator=g) * 30).to(other_dtype)
            for op in [lambda x, y: torch.add(x, y, alpha=-0.1), lambda x, y: torch.sub(x, y, alpha=0.37),
                       lambda x, y: x.clone().add_(y, alpha=-0.1), lambda x, y: x.clone().sub_(y, alpha=1e-3)]:
                got = op(a.to(DEV), b.to(DEV))
                modes.mark_step()
                _same(got, op(a, b))
    p, grad = torch.tensor([1.3]), torch.tensor([22.638708114624023])
    got = p.to(DEV).add_(grad.to(DEV), alpha=-0.1)
    modes.mark_step()
    _same(got, p.clone().add_(grad, alpha=-0.1))
