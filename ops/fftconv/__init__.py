"""Causal long convolution:  y[b, d, t] = sum_{s <= t} k[d, t-s] x[b, d, s]  (docs/math.md, fftconv;
the FFT algorithms of every backend: docs/fft.md).

A linear convolution truncated to L (no wrap-around). CEMA calls it with k in float32 and x in
bf16/fp16: arithmetic runs in float32 (float64 if x or k is float64) whatever the input dtypes,
y is rounded once to x's dtype, and the gradients come back in x's and k's dtypes.

The torch backend uses zero-padded FFTs of size 2*nextpow2(L) and, for L up to the
``direct_max_len`` knob, a direct Toeplitz matmul (FFT overheads dominate there). The cpu backend
(compiled C++) runs the same transforms in cache, vectorised across channels.

Packed rows (``cu_seqlens``) run as document rows (``ops/_packing.py``): each bucket of documents
is gathered into a zero-padded batch with every document at the start of its row and convolved
with the first Lb entries of k (the row length; a document of length len reads k[:len] only),
one backend call per bucket. dk is each bucket's dk summed into (D, L): entries past a document's
length get nothing from it, as a separate call on that document would give.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, check_sequence, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, as_dtype, custom_op, empty_like, grad_or_none
from .._packing import check_cu_seqlens, plan

__all__ = ["fftconv"]

BACKENDS = OpBackends("fftconv", {
    "cpu": "megalodon_kernels.ops.fftconv.cpu_impl",
    "cuda": "megalodon_kernels.ops.fftconv.cuda_impl",
    "torch": "megalodon_kernels.ops.fftconv.torch_impl",
    "triton": "megalodon_kernels.ops.fftconv.triton_impl",
})

autotune.register(
    "fftconv",
    key=lambda x, k: {"D": x.shape[1], "L": autotune.pow2_bucket(x.shape[2]), "k": str(k.dtype).replace("torch.", "")},
    space=BACKENDS.config_spaces,
)


def _select(x, k, backend):
    return BACKENDS.select(backend, {"x": x, "k": k}, device=x.device, dtype=x.dtype)


def _kernel_rows(k, size):
    """The kernel of a bucket's rows: its first ``size`` entries (size <= L)."""
    return k[:, :size].contiguous()


def _packed_fwd(x, k, cu_seqlens, backend):
    """y r(1 D L) of a packed call: one backend call per bucket of left-aligned document rows (the
    backend chosen for the rows' shapes); every step belongs to one document, so y is filled."""
    y = x.new_empty(x.shape)
    for bucket in plan(cu_seqlens, x.shape[-1]).buckets:
        xr, kr = bucket.rows(x, 2), _kernel_rows(k, bucket.size)
        impl = _select(xr, kr, backend)
        bucket.put(impl.module.forward(xr, kr, **impl.config), y, 2)
    return y


def _packed_bwd(dy, x, k, cu_seqlens, need_x, need_k, backend):
    """(dx r(1 D L) or None, dk r(D L) in the compute dtype or None) of a packed call. A bucket's
    dk[:, j] sums dy[t] x[t - j] over its rows; the zero padding after each document adds
    nothing, so the sum over buckets is the sum of the documents' own dk."""
    dx = x.new_empty(x.shape) if need_x else None
    dk = None
    for bucket in plan(cu_seqlens, x.shape[-1]).buckets:
        dyr, xr, kr = bucket.rows(dy, 2), bucket.rows(x, 2), _kernel_rows(k, bucket.size)
        impl = _select(xr, kr, backend)
        dxr, dkr = impl.module.backward(dyr, xr, kr, need_x, need_k, **impl.config)
        if need_x:
            bucket.put(dxr, dx, 2)
        if need_k:
            dk = dkr.new_zeros(k.shape) if dk is None else dk
            dk[:, :bucket.size] += dkr
    return dx, dk


def _fwd_fake(x, k, backend, cu_seqlens=None):
    return empty_like(x)


@custom_op("fftconv", _fwd_fake)
def fftconv_op(x: Tensor, k: Tensor, backend: str, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """-> y; with ``cu_seqlens`` (B = 1) the convolution restarts at every document start."""
    if cu_seqlens is not None:
        return _packed_fwd(x, k, cu_seqlens, backend)
    impl = _select(x, k, backend)
    return impl.module.forward(x, k, **impl.config)


def _bwd_fake(dy, x, k, need_x, need_k, backend, cu_seqlens=None):
    return (empty_like(x) if need_x else absent(x),
            empty_like(k) if need_k else absent(k))


@custom_op("fftconv_bwd", _bwd_fake)
def fftconv_bwd_op(dy: Tensor, x: Tensor, k: Tensor, need_x: bool, need_k: bool,
                   backend: str, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    if cu_seqlens is not None:
        dx, dk = _packed_bwd(dy, x, k, cu_seqlens, need_x, need_k, backend)
    else:
        impl = _select(x, k, backend)
        dx, dk = impl.module.backward(dy, x, k, need_x, need_k, **impl.config)
    return (as_dtype(dx, x.dtype) if need_x else absent(x), as_dtype(dk, k.dtype) if need_k else absent(k))


def _setup(ctx, inputs, output):
    x, k, backend, cu_seqlens = inputs
    ctx.save_for_backward(x, k, cu_seqlens)
    ctx.backend = backend


def _backward(ctx, dy):
    x, k, cu_seqlens = ctx.saved_tensors
    need_x, need_k = ctx.needs_input_grad[:2]
    dx, dk = fftconv_bwd_op(dy, x, k, need_x, need_k, ctx.backend, cu_seqlens)
    return grad_or_none(dx, need_x), grad_or_none(dk, need_k), None, None


fftconv_op.register_autograd(_backward, setup_context=_setup)


def fftconv(x: torch.Tensor, k: torch.Tensor, *, backend: str = "auto",
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal convolution of every (b, d) row of x with the kernel row k[d].

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        k: r(D L), any of the same dtypes (CEMA passes float32).
        backend: "auto", "torch", "cpu", "triton" or "cuda".
        cu_seqlens: None, or an integer tensor (n + 1,) on x's device delimiting n documents
            packed in one row (0 first, non-decreasing, L last; empty documents allowed), with
            x of batch size 1: the convolution restarts at every document start, so document
            [s, e) gets y[..., s:e] = fftconv(x[..., s:e], k[:, :e - s]).

    Returns:
        y r(B D L) in x's dtype. Gradients flow to x (x's dtype) and k (k's dtype; packed: the
        sum of the documents' gradients, each zero past its document's length).

    Example::

        y = fftconv(x.bfloat16(), k)        # k r(D L) float32 from cema_kernel
        # documents of 100, 23 and 900 steps packed into one row x r(1 D 1023):
        cu = torch.tensor([0, 100, 123, 1023], device=x.device)
        y = fftconv(x, k, cu_seqlens=cu)
    """
    B, D, L = check_sequence(x)
    check_tensor("k", k, (D, L), REAL_DTYPES, device=x.device, dims="(D, L)")
    check_backend(backend)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch=B, length=L, device=x.device)
    return fftconv_op(x, k, backend, cu_seqlens)
