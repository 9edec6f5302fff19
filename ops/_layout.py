"""Transposed copies on the CPU, tiled.

The model keeps activations as (B, L, D) rows while the CEMA ops work on (B, D, L), so CEMA's
input and its gradients arrive as transposed views. ``t.contiguous()`` of such a view walks one
side with a stride of D (or L) elements, and torch's CPU copy does not tile it: every element
lands on another cache line, and a (2, 256, 4096) fp32 copy takes ~15 ms where a plain copy of
the same 8 MB takes under 1 ms. Copying slabs of ``SLAB`` positions of the destination's last
dimension at a time keeps the lines of both sides in cache (~1.5 ms for the same copy).
"""
from __future__ import annotations

import torch

#: Positions of the destination's last dimension per slab: 64 fp32 rows of a few hundred
#: features stay in L1/L2 while they are written out.
SLAB = 64
#: Below this many elements the copy is cheap whatever its order.
MIN_ELEMS = 1 << 16


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, copied slab by slab on the CPU when ``t``'s last dimension is not its
    fastest-moving one (a transposed view). Not differentiable: for backend code."""
    if (t.is_contiguous() or t.device.type != "cpu" or t.dim() < 2 or t.stride(-1) == 1
            or t.numel() < MIN_ELEMS or torch.compiler.is_compiling()):
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype)
    for i in range(0, t.shape[-1], SLAB):
        out[..., i:i + SLAB] = t[..., i:i + SLAB]
    return out


class _Transposed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim0, dim1):
        ctx.dims = (dim0, dim1)
        return contiguous(x.transpose(dim0, dim1))

    @staticmethod
    def backward(ctx, grad):
        return contiguous(grad.transpose(*ctx.dims)), None, None


def transpose_contiguous(x: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    """``x.transpose(dim0, dim1).contiguous()``, differentiable, with the tiled copy both ways
    (forward and gradient)."""
    if torch.compiler.is_compiling():  # the compiler plans its own copy
        return x.transpose(dim0, dim1).contiguous()
    return _Transposed.apply(x, dim0, dim1)
