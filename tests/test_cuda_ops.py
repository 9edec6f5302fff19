"""The ops' autograd Functions end to end on the CUDA backend classes, executed by the emulator.

cuda/backend.py holds what each ``ops/<op>/cuda_impl.py`` re-exports. Here the same classes are
built over the CPU emulator extension and plugged into the op's dispatcher as backend "cuda",
so the public op (argument handling, autograd Function, saved tensors, dtype casts) runs the
CUDA kernels and must agree with backend="torch", forward and backward.
"""
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
        "attention": backend.AttentionBackend(get, "cpu"),
        "cema_kernel": backend.CemaKernelBackend(get, "cpu"),
        "ema_hidden": backend.EmaHiddenBackend(get, "cpu"),
    }


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
    why = backend.fftconv.not_supported_reasons(torch.zeros(1, dtype=torch.float16).expand(1, 1, L),
                                                torch.zeros(1).expand(1, L))
    text = " ".join(why)
    assert "pip install" in text or "_C" in text  # the product extension is not built here
    assert "cuda tensors" in text and "L <= 134217728" in text
    assert "float16" in text and "backend='torch'" in text  # a refused dtype, and where to go instead


# --- fp64: rotary / dropkey_softmax / timestep_norm / attention ---
# float64 inputs run the double instantiations of the kernels (acc_t<double>) and must agree with
# backend="torch" (float64 too) at the ("cuda", float64) budget of support.TOLERANCES.
from support import tol as _tol  # noqa: E402

FP64_TOL = (_tol("cuda", torch.float64, "fwd"), _tol("cuda", torch.float64, "bwd"))


def _compare_fp64(run, inputs):
    outs_c, grads_c = _grads(run("cuda"), inputs, 1)
    outs_t, grads_t = _grads(run("torch"), inputs, 1)
    assert outs_c and grads_c
    for i, (a, b) in enumerate(zip(outs_c, outs_t)):
        assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape
        assert_close(f"out{i}", a, to_np(b), FP64_TOL[0])
    for i, (a, b) in enumerate(zip(grads_c, grads_t)):
        assert a.dtype == b.dtype
        assert_close(f"grad{i}", a, to_np(b), FP64_TOL[1])


@pytest.mark.parametrize("per_batch", [False, True], ids=["P1", "PB"])
def test_rotary_op_fp64(use_emulated_cuda, per_batch):
    x = torch.randn(2, 17, 2, 8, dtype=torch.float64).requires_grad_()
    pos = torch.randint(0, 500, (2, 17)) if per_batch else torch.arange(3, 20)
    _compare_fp64(lambda b: ops.rotary(x, pos, xpos_scale_base=512.0, backend=b), [x])


@pytest.mark.parametrize("causal,p", [(True, 0.2), (False, 0.0)], ids=["causal_dropkey", "full"])
def test_dropkey_softmax_op_fp64(use_emulated_cuda, causal, p):
    s = (torch.randn(2, 3, 9, 12, dtype=torch.float64) * 2).requires_grad_()
    _compare_fp64(lambda b: ops.dropkey_softmax(s, causal, p, 77, backend=b), [s])


def test_timestep_norm_op_fp64(use_emulated_cuda):
    B, L, D, G = 2, 45, 8, 2
    f64 = dict(dtype=torch.float64)
    x = (torch.randn(B, L, D, **f64) + 1).requires_grad_()
    scale = torch.randn(D, **f64).requires_grad_()
    bias = torch.randn(D, **f64).requires_grad_()
    pm = torch.randn(B, G, **f64).requires_grad_()
    pv = (torch.rand(B, G, **f64) + 0.5).requires_grad_()
    pc = torch.tensor([0, 4])
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :7] = True
    mask[1, 30:33] = True
    _compare_fp64(lambda b: ops.timestep_norm(x, scale, bias, G, pc, pm, pv, mask, backend=b),
                  [x, scale, bias, pm, pv])


def test_attention_op_fp64(use_emulated_cuda):
    q, k, v = (torch.randn(2, 11, 2, 8, dtype=torch.float64).requires_grad_() for _ in range(3))
    _compare_fp64(lambda b: ops.attention(q, k, v, scale=0.4, chunk_size=4, block_causal=True, dropkey_p=0.3,
                                          seed=5, backend=b), [q, k, v])


def test_fp64_backends_accept_float64_and_name_the_refused_dtype(emulated):
    from megalodon_kernels.cuda import kernels as K

    x64 = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    for op, arg in (("rotary", "x"), ("dropkey_softmax", "scores"), ("timestep_norm", "x")):
        impl = emulated[op]
        t = x64[0] if op == "timestep_norm" else x64
        assert impl.not_supported_reasons(**{arg: t}) == [], op
        why = impl.not_supported_reasons(**{arg: t.half()})
        assert any(f"float64 {arg}, got torch.float16" in r for r in why), (op, why)
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        K.rotary_fwd(emulated["rotary"].ext, x64.half(), torch.ones(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))
# --- end fp64 ---


# --- fp64: fftconv ---
# float64 x runs the double instantiations of the fftconv kernels (one block up to L = 8192, the
# multi-pass FFT above): the op agrees with backend="torch" at the ("cuda", float64) budget.
@pytest.mark.parametrize("L", [70, 8193], ids=lambda v: f"L{v}")
def test_fftconv_op_fp64(use_emulated_cuda, L):
    x = torch.randn(2, 3, L, dtype=torch.float64).requires_grad_()
    k = (torch.randn(3, L, dtype=torch.float64) * torch.exp(-torch.arange(L) / (L / 7.0))).requires_grad_()
    _compare_fp64(lambda b: ops.fftconv(x, k, backend=b), [x, k])
# --- end fp64: fftconv ---


# --- fp64: cema_kernel / ema_hidden ---
# float64 p with complex128 log_q/gamma/hx runs the double instantiations of cuda/cema.cuh (every
# power, sum and output in double): the public ops with backend="cuda" agree with backend="torch"
# (float64 too), outputs and every gradient, at the ("cuda", float64) budget.
def _cema_fp64_inputs(D, N, B, seed):
    g = torch.Generator().manual_seed(seed)
    kw = dict(generator=g, dtype=torch.float64)
    p = torch.rand(D, N, **kw) * 0.9 + 0.05
    log_q = torch.complex(-torch.rand(D, N, **kw) * 0.1, (2 * torch.rand(D, N, **kw) - 1) * torch.pi)
    gamma = torch.complex(torch.randn(D, N, **kw), torch.randn(D, N, **kw)) / (2 * N) ** 0.5
    hx = torch.complex(torch.randn(B, D, N, **kw), torch.randn(B, D, N, **kw))
    return [t.requires_grad_() for t in (p, log_q, gamma, hx)]


def _compare_cema_fp64(run, inputs, seed=1):
    """Outputs (real or complex) and the gradients of a random linear loss, cuda vs torch."""
    fwd, bwd = _tol("cuda", torch.float64, "fwd"), _tol("cuda", torch.float64, "bwd")
    results = []
    for b in ("cuda", "torch"):
        out = run(b)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        g = torch.Generator().manual_seed(seed)
        cots = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, [t for t in inputs if t.requires_grad], cots)
        results.append((outs, grads))
    (outs_c, grads_c), (outs_t, grads_t) = results
    assert outs_c and grads_c
    for i, (a, b) in enumerate(zip(outs_c, outs_t)):
        assert a.dtype == b.dtype and a.dtype in (torch.float64, torch.complex128) and a.shape == b.shape
        assert_close(f"out{i}", a, to_np(b), fwd)
    for i, (a, b) in enumerate(zip(grads_c, grads_t)):
        assert a.dtype == b.dtype
        # a float32 x's gradient is rounded to float32 by the op: one fp32 rounding apart at most
        assert_close(f"grad{i}", a, to_np(b), _tol("cuda", a.dtype, "bwd") if a.dtype == torch.float32 else bwd)


@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
def test_cema_kernel_op_fp64(use_emulated_cuda, with_hx):
    p, log_q, gamma, hx = _cema_fp64_inputs(5, 20, 2, seed=3)
    inputs = [p, log_q, gamma] + ([hx] if with_hx else [])
    _compare_cema_fp64(lambda b: ops.cema_kernel(p, log_q, gamma, 300, hx if with_hx else None, backend=b), inputs)


@pytest.mark.parametrize("x_dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
def test_ema_hidden_op_fp64(use_emulated_cuda, with_hx, x_dtype):
    """x float64 is summed in double; float32 x with float64 coefficients is widened on load (the
    torch backend casts it to float64 too), its gradient rounded to float32 by the op."""
    p, log_q, _, hx = _cema_fp64_inputs(4, 16, 2, seed=4)
    x = torch.randn(2, 4, 150, dtype=torch.float64).to(x_dtype).requires_grad_()
    inputs = [x, p, log_q] + ([hx] if with_hx else [])
    _compare_cema_fp64(lambda b: ops.ema_hidden(x, p, log_q, hx if with_hx else None, backend=b), inputs)


def test_ema_hidden_op_fp64_without_log_q_gradient(use_emulated_cuda):
    """log_q without requires_grad: the inference path (no weighted sums W) in double."""
    p, log_q, _, _ = _cema_fp64_inputs(3, 24, 2, seed=5)
    log_q = log_q.detach()
    x = torch.randn(2, 3, 90, dtype=torch.float64).requires_grad_()
    _compare_cema_fp64(lambda b: ops.ema_hidden(x, p, log_q, backend=b), [x, p])
# --- end fp64: cema_kernel / ema_hidden ---
