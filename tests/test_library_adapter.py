"""ops/_library.py (issue 28 item 2, issue 41): every op is a plain torch.library custom op, plus one
adapter, ``Op``: a plain eager call that autograd will not record runs the implementation
directly, and one it records runs the same implementation inside the op's own autograd.Function
(the op's registered setup_context and backward), where the adapter's self-check passes on the
running torch. Forced off (as on a torch where the self-check fails) every call goes through the
dispatcher with the same results and gradients.
Where a torch release drops one of the private names the module reads, the fallback keeps results
right (checked here by removing them)."""
import importlib

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.ops import _library

rotary_module = importlib.import_module("megalodon_kernels.ops.rotary")
norm_module = importlib.import_module("megalodon_kernels.ops.timestep_norm")


class _Counting:
    """Stands in for an Op's torch.library op and counts the calls that reach the dispatcher."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.op(*args, **kwargs)


@pytest.fixture
def dispatched(monkeypatch):
    """{op name: counter of the calls that went through the dispatcher} for rotary and timestep_norm."""
    counters = {}
    for name, op in (("rotary", rotary_module.rotary_op), ("timestep_norm", norm_module.timestep_norm_op)):
        counters[name] = _Counting(op._op)
        monkeypatch.setattr(op, "_op", counters[name])
    return counters


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 2, 8, generator=g).requires_grad_()
    xn = torch.randn(2, 5, 8, generator=g).requires_grad_()
    w, b = torch.randn(8, generator=g).requires_grad_(), torch.randn(8, generator=g).requires_grad_()
    return x, xn, w, b


def _outputs(no_grad: bool):
    """(rotary y, timestep_norm y) and, with autograd, every input's gradient of a weighted sum."""
    x, xn, w, b = _inputs()
    with torch.no_grad() if no_grad else torch.enable_grad():
        y = ops.rotary(x, torch.arange(6), backend="torch")
        yn = ops.timestep_norm(xn, w, b, 2, backend="torch")[0]
    if no_grad:
        return y, yn
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + (yn * yn.detach()).sum()
    return (y.detach(), yn.detach(), *torch.autograd.grad(loss, (x, xn, w, b)))


def test_the_self_check_passes_here_and_eager_calls_skip_the_dispatcher(dispatched):
    assert _library._self_check()
    _outputs(no_grad=True)
    _outputs(no_grad=False)  # recorded calls: the op's own autograd.Function
    assert dispatched["rotary"].calls == 0 and dispatched["timestep_norm"].calls == 0


def test_an_eager_call_autograd_records_gets_the_ops_own_node(monkeypatch):
    x = _inputs()[0]
    y = ops.rotary(x, torch.arange(6), backend="torch")
    assert type(y.grad_fn).__name__ == "EagerAutogradFor_megalodon_kernels_rotaryBackward", type(y.grad_fn).__name__
    monkeypatch.setattr(_library, "_SELF_CHECK", [False])  # the dispatcher: torch.library's generated node
    y = ops.rotary(x, torch.arange(6), backend="torch")
    assert "GeneratedBackwardFor_megalodon_kernels_rotary" in type(y.grad_fn).__name__, type(y.grad_fn).__name__


def test_recorded_calls_with_defaults_left_out_or_keywords_match_the_dispatcher():
    """A recorded eager call that leaves a schema default out gets it filled in (setup_context
    sees every input, as torch.library's kernel gives it); one with keyword arguments takes the
    dispatcher. Both give the dispatcher's results and gradients, bit for bit."""
    fftconv = importlib.import_module("megalodon_kernels.ops.fftconv")
    g = torch.Generator().manual_seed(1)
    x, k = torch.randn(2, 3, 9, generator=g).requires_grad_(), torch.randn(3, 9, generator=g).requires_grad_()
    w = torch.randn(2, 3, 9, generator=g)
    results = []
    for call in (lambda: fftconv.fftconv_op(x, k, "torch"), lambda: fftconv.fftconv_op(x, k, backend="torch"),
                 lambda: fftconv.fftconv_op._op(x, k, "torch", None)):
        y = call()
        results.append((y.detach(), *torch.autograd.grad((y * w).sum(), (x, k))))
    assert "EagerAutogradFor" in type(fftconv.fftconv_op(x, k, "torch").grad_fn).__name__
    assert "GeneratedBackwardFor" in type(fftconv.fftconv_op(x, k, backend="torch").grad_fn).__name__
    for got in results[:2]:
        for g_, e in zip(got, results[2]):
            torch.testing.assert_close(g_, e, rtol=0, atol=0)


@pytest.mark.parametrize("no_grad", [True, False], ids=["no_grad", "autograd"])
def test_forced_fallback_gives_the_same_results_and_gradients(dispatched, monkeypatch, no_grad):
    direct = _outputs(no_grad)
    monkeypatch.setattr(_library, "_SELF_CHECK", [False])  # as where the self-check failed
    fallback = _outputs(no_grad)
    assert dispatched["rotary"].calls == 1 and dispatched["timestep_norm"].calls == 1
    assert len(direct) == len(fallback) == (2 if no_grad else 6)
    for d, f in zip(direct, fallback):  # the same implementation either way: bit for bit
        torch.testing.assert_close(f, d, rtol=0, atol=0)


def test_the_self_check_fails_without_the_eager_probes(monkeypatch):
    monkeypatch.setattr(_library, "_PROBES_OK", False)  # a torch that lacks one of the probed names
    assert not _library._self_check()
    assert not _library.plain_eager()


def test_the_self_check_fails_where_a_mode_goes_unseen(monkeypatch):
    """A torch whose function-mode stack the probe no longer sees: plain_eager says True under a
    mode, so the self-check must turn the direct calls off."""
    probes = list(_library._EAGER_PROBES)
    probes[2] = lambda: 0
    monkeypatch.setattr(_library, "_EAGER_PROBES", tuple(probes))
    assert not _library._self_check()


def _rotary_result():
    x = _inputs()[0]
    y = ops.rotary(x, torch.arange(6), backend="torch")
    (gx,) = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), x)
    return y.detach(), gx


def test_without_the_eager_probes_results_and_gradients_are_unchanged(monkeypatch):
    expected = _rotary_result()
    monkeypatch.setattr(_library, "_PROBES_OK", False)
    monkeypatch.setattr(rotary_module, "_TABLES", {})
    got = _rotary_result()
    assert rotary_module._TABLES == {}, "the eager-only table cache ran without its probes"
    for e, g in zip(expected, got):  # cached tables multiply as complex numbers: within 1 ulp of the real form
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_without_the_alias_check_outputs_are_still_fresh(monkeypatch):
    monkeypatch.setattr(_library, "_ALIAS_CHECK", None)
    x = torch.randn(4)
    same, view, _ = _library._fresh((x, x[:2], torch.ones(3)), [x])
    for out in (same, view):
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(same, x, rtol=0, atol=0)
    torch.testing.assert_close(view, x[:2], rtol=0, atol=0)
    expected = _rotary_result()
    monkeypatch.undo()
    for e, g in zip(expected, _rotary_result()):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("road", ["eager", "dispatcher"])
def test_a_recorded_gradient_goes_through_the_backward_ops_dispatcher_on_both_roads(monkeypatch, road):
    """create_graph: the backward op is called with grad mode on and inputs that require grad,
    which no eager shortcut takes (it has no autograd formula): on both roads the gradient is
    recorded by torch.library's node of the backward op, whose own backward raises the same error."""
    if road == "dispatcher":
        monkeypatch.setattr(_library, "_SELF_CHECK", [False])
    g = torch.Generator().manual_seed(2)
    x, k = torch.randn(2, 3, 8, generator=g).requires_grad_(), torch.randn(3, 8, generator=g).requires_grad_()
    (gx,) = torch.autograd.grad(ops.fftconv(x, k, backend="torch").sum(), x, create_graph=True)
    assert "GeneratedBackwardFor_megalodon_kernels_fftconv_bwd" in type(gx.grad_fn).__name__
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        gx.sum().backward()


def test_filled_defaults_are_kept_on_the_cpu_and_rebuilt_after_a_write():
    """timestep_norm's default state (issue 41): one kept CPU tensor per key in plain eager mode,
    never the caller's (outputs are fresh), rebuilt when something wrote to it; is_filled knows it
    only while it is unchanged, and a tensor of the same values the caller made is not known."""
    a = _library.filled((3,), 0, torch.int64, torch.device("cpu"))
    assert _library.filled((3,), 0, torch.int64, torch.device("cpu")) is a and _library.is_filled(a)
    assert not _library.is_filled(torch.zeros(3, dtype=torch.int64))
    a.add_(1)  # a write bumps the version: no longer known, and the next call builds a new one
    assert not _library.is_filled(a)
    b = _library.filled((3,), 0, torch.int64, torch.device("cpu"))
    assert b is not a and _library.is_filled(b) and torch.equal(b, torch.zeros(3, dtype=torch.int64))
    with torch.inference_mode():  # the kept tensor is a normal one (it has a version counter) also here
        c = _library.filled((4,), 0, torch.int64, torch.device("cpu"))
        assert not c.is_inference() and _library.filled((4,), 0, torch.int64, torch.device("cpu")) is c
        assert _library.is_filled(c) and not _library.is_filled(torch.zeros(4, dtype=torch.int64))
        x = torch.randn(2, 5, 4)
        counts = [ops.timestep_norm(x, x[0, 0], x[0, 1], 2, backend="torch")[1] for _ in range(2)]
        assert counts[0].tolist() == counts[1].tolist() == [5, 5]


def test_filled_defaults_are_kept_per_stream_and_not_while_capturing(monkeypatch):
    """On a GPU (faked: kept_place answers a (device, stream) place for CPU tensors) one kept tensor
    per stream; no kept tensor at all while a CUDA graph is captured (kept_place None)."""
    real_place = _library.kept_place
    place = [("faked-gpu", 1)]
    monkeypatch.setattr(_library, "kept_place", lambda device: place[0])
    monkeypatch.setattr(_library, "_KEPT", {})
    cpu = torch.device("cpu")
    a = _library.filled((3,), 1.0, torch.float32, cpu)
    assert _library.filled((3,), 1.0, torch.float32, cpu) is a
    place[0] = ("faked-gpu", 2)
    b = _library.filled((3,), 1.0, torch.float32, cpu)
    assert b is not a and _library.filled((3,), 1.0, torch.float32, cpu) is b and _library.is_filled(b)
    place[0] = None  # capturing
    c, d = (_library.filled((3,), 1.0, torch.float32, cpu) for _ in range(2))
    assert len({id(a), id(b), id(c), id(d)}) == 4 and _library.is_filled(c) and len(_library._KEPT) == 2
    assert all(torch.equal(t, torch.ones(3)) for t in (a, b, c, d))
    assert real_place(cpu) == "cpu" and real_place(torch.device("meta")) is None


def test_timestep_norm_defaults_skip_only_their_own_check():
    x, w, b = torch.randn(2, 5, 4), torch.randn(4), torch.randn(4)
    y, count, mean, var = ops.timestep_norm(x, w, b, 2, backend="torch")
    explicit = ops.timestep_norm(x, w, b, 2, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2), torch.ones(2, 2),
                                 torch.zeros(2, 5, dtype=torch.bool), backend="torch")
    for got, want in zip((y, count, mean, var), explicit):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept = [t for t in _library._KEPT.values() if t.shape == (2,) and t.dtype == torch.int64]
    assert kept and all(count.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in kept)
    with pytest.raises(ValueError, match="prev_count must be >= 0"):
        ops.timestep_norm(x, w, b, 2, torch.tensor([1, -1]), backend="torch")


def test_as_dtype_and_residual_outputs():
    t = torch.randn(3)
    assert _library.as_dtype(t, torch.float32) is t and _library.as_dtype(t, torch.float64).dtype == torch.float64
    # residual outputs are non-differentiable on both roads (fewer outputs for autograd to track)
    x, xn, w, b = _inputs()
    args = (xn, w, b, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2), torch.ones(2, 2),
            torch.zeros(2, 5, dtype=torch.bool), 2, 1e-5, "torch", None)
    for op in (norm_module.timestep_norm_op, norm_module.timestep_norm_op._op):
        out = op(*args)
        assert [t.requires_grad for t in out] == [True, False, True, True, False, False, False, False]


@pytest.mark.parametrize("road", ["eager", "dispatcher"])
def test_timestep_norm_gradients_from_some_outputs_only(monkeypatch, road):
    """timestep_norm's backward gets None for the outputs nobody differentiated (it turned autograd's
    zero-filling off) and makes those zeros itself: the same gradients as zero gradients given."""
    if road == "dispatcher":
        monkeypatch.setattr(_library, "_SELF_CHECK", [False])
    x, xn, w, b = _inputs()
    for used in ((0,), (2,), (3,), (2, 3)):
        out = ops.timestep_norm(xn, w, b, 2, backend="torch")
        got = torch.autograd.grad(sum((out[i] * (i + 1)).sum() for i in used), (xn, w, b))
        out = ops.timestep_norm(xn, w, b, 2, backend="torch")
        want = torch.autograd.grad(sum((out[i] * (i + 1 if i in used else 0)).sum() for i in (0, 2, 3)), (xn, w, b))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
