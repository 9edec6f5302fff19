"""Causal Toeplitz matrices of a kernel and the diagonal sums that are their adjoint.

A causal convolution y[t] = sum_{s<=t} k[t-s] x[s] over a block of L steps is a matmul with the
lower-triangular Toeplitz matrix Kt[d, t, s] = k[d, t-s]; the kernel's gradient is the sum of each
diagonal of the [L, L] gradient of that matrix. Used by fftconv's direct path (short sequences)
and cema's chunked form (within chunks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["toeplitz", "toeplitz_t", "diagonal_sums"]


def toeplitz(k: torch.Tensor) -> torch.Tensor:
    """r(D L) -> [D, L, L] with Kt[d, t, s] = k[d, t-s] for t >= s, else 0: window t of the
    left-padded k, reversed."""
    L = k.shape[-1]
    return F.pad(k, (L - 1, 0)).unfold(-1, L, 1).flip(-1)


def toeplitz_t(k: torch.Tensor) -> torch.Tensor:
    """:func:`toeplitz` transposed, contiguous (Tt[d, s, t] = k[d, t-s], t >= s): row s is the window
    L-1-s of the left-padded k. bmm takes a contiguous right operand ~2x faster than the view."""
    L = k.shape[-1]
    return F.pad(k, (L - 1, 0)).unfold(-1, L, 1).flip(-2)


def diagonal_sums(G: torch.Tensor) -> torch.Tensor:
    """[D, L, L] -> r(D L), out[d, j] = sum_t G[d, t, t-j] (j < L).

    With the columns reversed, entry (t, t-j) sits at column L-1-t+j; padding rows to width 2L and
    re-reading them with width 2L-1 shifts row t right by t, so every entry of diagonal j lands in
    column L-1+j and a column sum finishes it."""
    D, L, _ = G.shape
    skew = F.pad(G.flip(-1), (0, L)).flatten(1)[:, : L * (2 * L - 1)].view(D, L, 2 * L - 1)
    return skew.sum(1)[:, L - 1:]
