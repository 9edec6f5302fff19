"""What of tests/test_gpu.py can break on the CPU: its subprocess script and its fixtures.

The GPU tests run only on a lent GPU; a mistake in their plumbing (a script that does not parse, a
CPU-side fixture swapping the real CUDA backend for the emulator) would otherwise surface only
there, costing rare device minutes (both did in the H200 run of bench/results/gpu/h200_run1).
"""
from __future__ import annotations

import ast
import importlib

import pytest

fftconv = importlib.import_module("megalodon_kernels.ops.fftconv")


def test_the_fresh_process_script_parses():
    from tests import test_gpu

    tree = ast.parse(test_gpu.FRESH_PROCESS_SCRIPT)
    assert any(isinstance(node, ast.Assert) for node in ast.walk(tree))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda"])
def test_gpu_marked_cuda_tests_keep_the_real_backend(backend):
    """tests/conftest.py swaps the emulator in for ``backend="cuda"`` tests, but not for ``gpu`` ones."""
    assert not fftconv.BACKENDS._modules["cuda"].startswith("(emulated)")


@pytest.mark.parametrize("backend", ["cuda"])
def test_unmarked_cuda_tests_get_the_emulator(backend, request):
    from tests.conftest import NO_EMULATOR

    if NO_EMULATOR:
        pytest.skip(NO_EMULATOR)
    assert fftconv.BACKENDS._modules["cuda"].startswith("(emulated)")


def test_device_assertion_messages_fit_torch_limit(monkeypatch):
    """On CUDA, torch._assert_async refuses messages of 255 characters or more; xPos rotary's range
    check had a longer one and failed every call on an H200. A meta tensor takes the device path."""
    import torch

    from megalodon_kernels.ops import _host_sync
    from megalodon_kernels.ops.rotary import rotation_tables

    seen = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, message: seen.append(message))
    rotation_tables(torch.arange(64, device="meta"), 16, 10000.0, 512.0, False, torch.float32)
    assert seen and all(len(m) < 255 for m in seen)
    assert seen[0].startswith("rotary: with xPos every position must lie within")
    long = "x: " + "y" * 400
    _host_sync.check_on_device(torch.ones(3, dtype=torch.bool, device="meta"), long)
    assert len(seen[-1]) < 255 and seen[-1].startswith("x: yyy") and seen[-1].endswith("...")


def test_cached_rotary_frequencies_are_normal_tensors():
    """The per-device cache of the rotary frequencies (built once, outside CUDA-graph capture) holds
    ordinary tensors even when its first call ran under inference_mode, and answers with the same
    objects the second time."""
    import torch

    from megalodon_kernels.ops.rotary import _theta_split_cached, _theta_split_tensors

    _theta_split_cached.cache_clear()
    with torch.inference_mode():
        hi, lo = _theta_split_cached(16, 10000.0, torch.device("cpu"))
    assert not hi.is_inference() and not lo.is_inference()
    again = _theta_split_cached(16, 10000.0, torch.device("cpu"))
    assert again[0] is hi and again[1] is lo
    fresh = _theta_split_tensors(16, 10000.0, torch.device("cpu"))
    assert torch.equal(hi, fresh[0]) and torch.equal(lo, fresh[1])
    _theta_split_cached.cache_clear()


def test_bf16_valued_gradients_keep_complex_outputs_complex():
    """tests/test_gpu.py's paper-shape test seeds the backward with bf16-valued gradients; ema_hidden's
    state is complex, and a real gradient for it was refused on the H200."""
    import torch

    from megalodon_kernels import ops
    from tests.test_gpu import _bf16_valued

    x = torch.randn(1, 4, 16, requires_grad=True)
    p = torch.rand(4, 2)
    log_q = torch.complex(-0.1 * torch.rand(4, 2), torch.rand(4, 2)).requires_grad_()
    h = ops.ema_hidden(x, p, log_q, backend="torch")
    outs = [o for o in (h if isinstance(h, tuple) else (h,)) if o.requires_grad]
    ups = [_bf16_valued(torch.randn_like(o)) for o in outs]
    assert any(u.is_complex() for u in ups)
    assert all(u.dtype == o.dtype for u, o in zip(ups, outs))
    grads = torch.autograd.grad(outs, [x, log_q], ups)
    assert all(torch.isfinite(torch.view_as_real(g) if g.is_complex() else g).all() for g in grads)
