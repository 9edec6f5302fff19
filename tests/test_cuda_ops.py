"""The ops' autograd Functions end to end on the CUDA backend classes, executed by the emulator.

cuda/backend.py holds what each ``ops/<op>/cuda_impl.py`` re-exports. Here the same classes are
built over the CPU emulator extension and plugged into the op's dispatcher as backend "cuda",
so the public op (argument handling, autograd Function, saved tensors, dtype casts) runs the
CUDA kernels and must agree with backend="torch", forward and backward.
"""
import importlib
import os
import shutil

import pytest
import torch

from megalodon_kernels import ops
from support import assert_close, to_np

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")

TOL = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (2e-2, 4e-2)}


@pytest.fixture(scope="module")
def emulated():
    from megalodon_kernels.cuda import backend, build

    ext = build.load_emulator()
    get = lambda: ext  # noqa: E731
    return {
        "rotary": backend.RotaryBackend(get, "cpu"),
        "dropkey_softmax": backend.DropKeySoftmaxBackend(get, "cpu"),
        "timestep_norm": backend.TimestepNormBackend(get, "cpu"),
        "fftconv": backend.FftconvBackend(get, "cpu"),
    }


@pytest.fixture
def use_emulated_cuda(emulated, monkeypatch):
    for op, impl in emulated.items():
        backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
        monkeypatch.setitem(backends._modules, "cuda", f"(emulated) megalodon_kernels.cuda.backend.{op}")
        monkeypatch.setitem(backends._loaded, "cuda", impl)


def _grads(out, inputs, seed):
    outs = out if isinstance(out, tuple) else (out,)
    outs = [o for o in outs if o.is_floating_point() and o.requires_grad]
    g = torch.Generator().manual_seed(seed)
    gs = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, inputs, gs)


def _compare(run, inputs, dtype):
    fwd_tol, bwd_tol = TOL[dtype]
    outs_c, grads_c = _grads(run("cuda"), inputs, 1)
    outs_t, grads_t = _grads(run("torch"), inputs, 1)
    for i, (a, b) in enumerate(zip(outs_c, outs_t)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(f"out{i}", a, to_np(b), fwd_tol)
    for i, (a, b) in enumerate(zip(grads_c, grads_t)):
        assert a.dtype == b.dtype
        assert_close(f"grad{i}", a, to_np(b), bwd_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_op(use_emulated_cuda, dtype):
    x = torch.randn(2, 17, 2, 8).to(dtype).requires_grad_()
    _compare(lambda b: ops.rotary(x, torch.arange(3, 20), xpos_scale_base=512.0, backend=b), [x], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropkey_softmax_op(use_emulated_cuda, dtype):
    s = (torch.randn(2, 3, 9, 12) * 2).to(dtype).requires_grad_()
    _compare(lambda b: ops.dropkey_softmax(s, True, 0.2, 77, backend=b), [s], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_timestep_norm_op(use_emulated_cuda, dtype):
    B, L, D, G = 2, 45, 8, 2
    x = (torch.randn(B, L, D) + 1).to(dtype).requires_grad_()
    scale = torch.randn(D).requires_grad_()
    bias = torch.randn(D).requires_grad_()
    pm = torch.randn(B, G).requires_grad_()
    pv = (torch.rand(B, G) + 0.5).requires_grad_()
    pc = torch.tensor([0, 4])
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :7] = True
    mask[1, 30:33] = True
    _compare(lambda b: ops.timestep_norm(x, scale, bias, G, pc, pm, pv, mask, backend=b),
             [x, scale, bias, pm, pv], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fftconv_op(use_emulated_cuda, dtype):
    x = torch.randn(2, 3, 70).to(dtype).requires_grad_()
    k = (torch.randn(3, 70) * torch.exp(-torch.arange(70) / 10.0)).requires_grad_()
    _compare(lambda b: ops.fftconv(x, k, backend=b), [x, k], dtype)


def test_reasons_name_the_fix(emulated):
    from megalodon_kernels.cuda import backend

    L = 2**27 + 1  # beyond the multi-pass FFT (expanded views: no memory)
    why = backend.fftconv.not_supported_reasons(torch.zeros(1, dtype=torch.float64).expand(1, 1, L),
                                                torch.zeros(1).expand(1, L))
    text = " ".join(why)
    assert "pip install" in text or "_C" in text  # the product extension is not built here
    assert "cuda tensors" in text and "float64" in text and "L <= 134217728" in text
