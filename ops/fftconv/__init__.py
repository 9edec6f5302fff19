"""Causal long convolution:  y[b, d, t] = sum_{s <= t} k[d, t-s] x[b, d, s]  (docs/math.md, fftconv;
the FFT algorithms of every backend: docs/fft.md).

A linear convolution truncated to L (no wrap-around). CEMA calls it with k in float32 and x in
bf16/fp16: arithmetic runs in float32 (float64 if x or k is float64) whatever the input dtypes,
y is rounded once to x's dtype, and the gradients come back in x's and k's dtypes.

The torch backend uses zero-padded FFTs of size 2*nextpow2(L) and, for L up to the
``direct_max_len`` knob, a direct Toeplitz matmul (FFT overheads dominate there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, check_sequence, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, custom_op, empty_like, grad_or_none

__all__ = ["fftconv"]

BACKENDS = OpBackends("fftconv", {
    "cuda": "megalodon_kernels.ops.fftconv.cuda_impl",
    "torch": "megalodon_kernels.ops.fftconv.torch_impl",
    "triton": "megalodon_kernels.ops.fftconv.triton_impl",
})

#: the Triton backend's knobs (the first values are the default): direct path up to direct_max_len;
#: warps of the tile, workspace and direct kernels; work_bc columns per workspace-pass program.
#: cema's space extends it.
TRITON_SPACE = {"direct_max_len": [64, 32, 0], "num_warps": [8], "work_warps": [8], "work_bc": [16],
                "direct_warps": [4]}

autotune.register(
    "fftconv",
    key=lambda x, k: {"D": x.shape[1], "L": autotune.pow2_bucket(x.shape[2]), "k": str(k.dtype).replace("torch.", "")},
    # direct (Toeplitz) path for L <= direct_max_len, FFT above; 0 = always FFT.
    space={"cuda": {"max_workspace_bytes": [256 << 20]},  # the multi-pass FFT's workspace cap (L > 16384)
           "torch": {"direct_max_len": [16, 0, 64, 256, 1024]},
           "triton": TRITON_SPACE},
)


@custom_op("fftconv", lambda x, k, backend: empty_like(x))
def fftconv_op(x: Tensor, k: Tensor, backend: str) -> Tensor:
    impl = BACKENDS.select(backend, {"x": x, "k": k}, device=x.device, dtype=x.dtype)
    return impl.module.fftconv_fwd(x, k, **impl.config)


def _bwd_fake(dy, x, k, need_x, need_k, backend):
    return (empty_like(x) if need_x else absent(x),
            empty_like(k) if need_k else absent(k))


@custom_op("fftconv_bwd", _bwd_fake)
def fftconv_bwd_op(dy: Tensor, x: Tensor, k: Tensor, need_x: bool, need_k: bool,
                   backend: str) -> tuple[Tensor, Tensor]:
    impl = BACKENDS.select(backend, {"x": x, "k": k}, device=x.device, dtype=x.dtype)
    dx, dk = impl.module.fftconv_bwd(dy, x, k, need_x, need_k, **impl.config)
    return (dx.to(x.dtype) if need_x else absent(x), dk.to(k.dtype) if need_k else absent(k))


def _setup(ctx, inputs, output):
    x, k, backend = inputs
    ctx.save_for_backward(x, k)
    ctx.backend = backend


def _backward(ctx, dy):
    x, k = ctx.saved_tensors
    need_x, need_k = ctx.needs_input_grad[:2]
    dx, dk = fftconv_bwd_op(dy, x, k, need_x, need_k, ctx.backend)
    return grad_or_none(dx, need_x), grad_or_none(dk, need_k), None


fftconv_op.register_autograd(_backward, setup_context=_setup)


def fftconv(x: torch.Tensor, k: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Causal convolution of every (b, d) row of x with the kernel row k[d].

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        k: r(D L), any of the same dtypes (CEMA passes float32).
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        y r(B D L) in x's dtype. Gradients flow to x (x's dtype) and k (k's dtype).

    Example::

        y = fftconv(x.bfloat16(), k)        # k r(D L) float32 from cema_kernel
    """
    B, D, L = check_sequence(x)
    check_tensor("k", k, (D, L), REAL_DTYPES, device=x.device, dims="(D, L)")
    check_backend(backend)
    return fftconv_op(x, k, backend)
