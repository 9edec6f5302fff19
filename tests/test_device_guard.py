"""Every op's forward and backward run with the tensors' CUDA device current (issue 27, item 2).

Triton launches on the current device, not the tensors' (and the CUDA backends allocate there), so
ops/_library.py makes the device of an op's first tensor argument current around the whole
implementation, once for every backend. No second GPU is needed to check it: the tensors' device is
faked at ``_library.cuda_device`` (every tensor of the test "is on cuda:1"), ``torch.cuda.device`` and
``torch.cuda.current_device`` by a recording stand-in, and each op's torch backend by a proxy that
records the current device whenever one of its functions runs. Plain eager calls and calls under
a no-op TorchFunctionMode (where the ops' own eager-only shortcuts, such as attention's kept
tiles, stay off) are both covered.
"""
import contextlib
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megalodon_kernels import ops
from megalodon_kernels.ops import _library

F32 = torch.float32
OPS = ("attention", "cema", "cema_kernel", "dropkey_softmax", "ema_hidden", "fftconv", "rotary", "timestep_norm")


def _gen():
    return torch.Generator().manual_seed(0)


def _coefficients(D=3, N=2):
    g = _gen()
    p = torch.rand(D, N, generator=g, dtype=F32).requires_grad_()
    log_q = torch.complex(-torch.rand(D, N, generator=g) - 0.1, torch.rand(D, N, generator=g)).requires_grad_()
    gamma = torch.randn(D, N, generator=g, dtype=torch.complex64).requires_grad_()
    return p, log_q, gamma


def _x(*shape):
    return torch.randn(*shape, generator=_gen(), dtype=F32).requires_grad_()


def _call(op: str):
    """One small forward of ``op`` on the torch backend; returns the outputs to differentiate."""
    kw = dict(backend="torch")
    if op == "attention":
        q, k, v = _x(1, 5, 2, 4), _x(1, 5, 2, 4), _x(1, 5, 2, 4)
        return ops.attention(q, k, v, scale=0.5, **kw)
    if op == "cema":
        p, log_q, gamma = _coefficients()
        return ops.cema(_x(2, 3, 6), p, log_q, gamma, _x(3), return_state=True, **kw)
    if op == "cema_kernel":
        return ops.cema_kernel(*_coefficients(), 6, **kw)
    if op == "dropkey_softmax":
        return ops.dropkey_softmax(_x(1, 2, 4, 5), True, 0.2, 3, **kw)
    if op == "ema_hidden":
        p, log_q, _ = _coefficients()
        return ops.ema_hidden(_x(2, 3, 6), p, log_q, **kw)
    if op == "fftconv":
        return ops.fftconv(_x(2, 3, 8), _x(3, 8), **kw)
    if op == "rotary":
        return ops.rotary(_x(1, 5, 2, 4), torch.arange(5), **kw)
    if op == "timestep_norm":
        return ops.timestep_norm(_x(2, 5, 4), _x(4), _x(4), 2, **kw)
    raise AssertionError(op)


def _loss(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = 0
    for t in outs:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            total = total + (t.abs() if t.is_complex() else t).sum()
    return total


class _FakeCudaDevice:
    """Stand-in for ``torch.cuda.device``: makes its device current while entered, and records it."""

    current: list = []
    entered: list = []

    def __init__(self, device):
        self.index = torch.device(device).index

    def __enter__(self):
        _FakeCudaDevice.entered.append(self.index)
        _FakeCudaDevice.current.append(self.index)

    def __exit__(self, *exc):
        _FakeCudaDevice.current.pop()
        return False


def _current_device() -> int:
    return _FakeCudaDevice.current[-1] if _FakeCudaDevice.current else 0


class _Recording(types.ModuleType):
    """A backend module that records (function name, current device) for every function it runs."""

    def __init__(self, module, calls):
        super().__init__(module.__name__)
        self._module, self._calls = module, calls

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if not callable(value) or name == "not_supported_reasons" or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            self._calls.append((name, torch.cuda.current_device()))
            return value(*args, **kwargs)
        return call


@pytest.fixture
def fake_devices(monkeypatch):
    """torch.cuda.device / current_device faked; every op's torch backend recording -> {op: calls}."""
    monkeypatch.setattr(_FakeCudaDevice, "current", [])
    monkeypatch.setattr(_FakeCudaDevice, "entered", [])
    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    monkeypatch.setattr(torch.cuda, "current_device", _current_device)
    monkeypatch.setattr(_library, "CUDA_BUILD", True)  # as on a CUDA build of torch, whatever this one is
    calls = {}
    for op in OPS:
        backends = getattr(ops, op).__globals__["BACKENDS"]
        real = backends._load("torch")
        calls[op] = []
        monkeypatch.setitem(backends._loaded, "torch", _Recording(real, calls[op]))
    return calls


class _PassThrough(TorchFunctionMode):
    """A mode that changes nothing, but makes a call not plain eager (_library.plain_eager)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _run(op, dispatcher):
    with _PassThrough() if dispatcher else contextlib.nullcontext():
        out = _call(op)
        _loss(out).backward()


@pytest.mark.parametrize("dispatcher", [False, True], ids=["eager", "dispatcher"])
@pytest.mark.parametrize("op", OPS)
def test_forward_and_backward_run_on_the_tensors_device(fake_devices, monkeypatch, op, dispatcher):
    monkeypatch.setattr(_library, "cuda_device", lambda t: torch.device("cuda", 1))
    _run(op, dispatcher)
    calls = fake_devices[op]
    names = [name for name, _ in calls]
    # a backend's forward is <op>_fwd or forward* (attention's forward_keeping_tiles), likewise backward
    assert any(n.endswith("_fwd") or n.startswith("forward") for n in names), names
    assert any(n.endswith("_bwd") or n.startswith("backward") for n in names), names
    assert calls and all(device == 1 for _, device in calls), calls
    assert _FakeCudaDevice.current == [], "a guard was left entered"


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_enter_no_device_guard(fake_devices, op):
    _run(op, dispatcher=False)
    assert fake_devices[op], "the recording backend did not run"
    assert _FakeCudaDevice.entered == [], "a device guard was entered for CPU tensors"
    assert all(device == 0 for _, device in fake_devices[op])


def test_the_guard_follows_the_lead_tensor(fake_devices, monkeypatch):
    """The device entered is the tensor's own (cuda:3 here), not a fixed or current one."""
    monkeypatch.setattr(_library, "cuda_device", lambda t: torch.device("cuda", 3))
    _run("rotary", dispatcher=False)
    assert {d for _, d in fake_devices["rotary"]} == {3}
    assert set(_FakeCudaDevice.entered) == {3}
