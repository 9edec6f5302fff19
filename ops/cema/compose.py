"""CEMA as host-side composition of its stages: the torch and cpu backends' forward and backward.

Forward: (k, b) = cema_kernel(p, log_q, gamma, L, hx); y = fftconv(x, k) kept in the compute
dtype, plus b and omega x, then rounded once to x's dtype; h = ema_hidden(x, p, log_q, hx) if
asked. Backward, with dy the gradient of y and dh that of h:

    dx = fftconv_x(dy) + omega dy (+ ema_hidden_x(dh)),  domega = sum_{b,t} dy x
    (dp, dlog_q, dgamma, dhx) = cema_kernel_bwd(dk = fftconv_k(dy), db = dy) (+ ema_hidden's terms)

The kernel and state stages are the torch backends of cema_kernel and ema_hidden; the
convolution is the caller's :class:`Convolution` (fftconv's torch backend, or its compiled cpu
kernel). One power table (ops/_vandermonde.py) serves every stage of a pass: the kernel, the bias
(shifted view) and the state (flipped). Saved for the backward (:class:`Saved`): k r(D L)
(cheaper than recomputing it) and ema_hidden's c(B D N) sums V, W.

With ``chunk`` = C > 0 and L >= ``chunk_min_len`` the convolution and the bias run in chunked
form instead (ops/cema/chunked.py: C x C Toeplitz matmuls within chunks plus a scan over the
chunk states; no FFT); k is still synthesised and saved, so the packed path and the FFT form can
read it. ``chunk`` = 0 selects the FFT form at every length. Up to ``RECURRENCE_MAX_LEN`` steps
(and chunk > 0) the forward is the recurrence itself (decoding), with the same saved tensors.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .._layout import contiguous
from .._vandermonde import power_table
from ..cema_kernel import torch_impl as kernel_stage
from ..ema_hidden import torch_impl as state_stage
from ..fftconv.torch_impl import compute_dtype
from .chunked import RECURRENCE_MAX_LEN, chunked_conv_bwd, chunked_conv_fwd, recurrence_fwd


class Saved(NamedTuple):
    """What a cema forward hands its backward besides the inputs (every backend)."""

    k: Tensor                  # r(D L), the kernel
    V: Optional[Tensor]        # c(B D N), ema_hidden's sums (None without the state)
    W: Optional[Tensor]        # c(B D N), its weighted sums (None unless a log_q gradient needs them)


class Needs(NamedTuple):
    """Which gradients of (x, p, log_q, gamma, omega, hx) a backward computes."""

    x: bool
    p: bool
    log_q: bool
    gamma: bool
    omega: bool
    hx: bool


class Convolution(NamedTuple):
    """The convolution stage: fftconv's ``forward(x, k, out_dtype)`` and ``backward(dy, x, k,
    need_x, need_k)`` with their knobs bound; ``fresh``: its y is a new contiguous tensor that
    may be summed into in place (torch's FFT y is a strided view of the transform's buffer)."""

    forward: Callable
    backward: Callable
    fresh: bool


def add_optional(a, b):
    """a + b where either may be None (a gradient one stage did not produce)."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def chunked_form(L: int, chunk: int, chunk_min_len: int) -> bool:
    """Whether a length-L call runs the chunked form (its recurrence for the shortest calls)."""
    return chunk > 0 and (L >= chunk_min_len or L <= RECURRENCE_MAX_LEN)


def forward(x, p, log_q, gamma, omega, hx, return_state, weighted, conv: Convolution, *, chunk, chunk_min_len,
            power_block):
    """-> (y r(B D L) in x's dtype, h c(B D N) or None, Saved)."""
    L = x.shape[-1]
    cd = compute_dtype(x.dtype, p.dtype)
    chunked = chunked_form(L, chunk, chunk_min_len)
    if chunked and L <= RECURRENCE_MAX_LEN:                               # e.g. decoding, one step per call
        y, h, saved = recurrence_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted, cd)
        return y.to(x.dtype), h, Saved(*saved)
    x = contiguous(x)  # once for every stage below (the model passes a transposed (B, L, D) view)
    table = power_table(log_q, L, power_block)                            # shared by every stage
    if chunked:
        k, _ = kernel_stage.forward(p, log_q, gamma, L, None, power_block=power_block, table=table)
        y = chunked_conv_fwd(x, p, log_q, gamma, hx, chunk, cd)          # [B, D, L], bias included
        y = y.addcmul_(omega.to(cd)[:, None], x.to(cd))
    else:
        k, b = kernel_stage.forward(p, log_q, gamma, L, hx, power_block=power_block, table=table)
        y = conv.forward(x, k, cd)                                       # [B, D, L]
        # a strided y: the out-of-place sum is also the contiguous copy the op returns (one pass)
        y = (torch.Tensor.addcmul_ if conv.fresh else torch.addcmul)(y, omega.to(cd)[:, None], x.to(cd))
        if b is not None:
            y = y.add_(b)
    h = V = W = None
    if return_state:
        h, V, W = state_stage.forward(x, p, log_q, hx, weighted, power_block=power_block, table=table)
    return y.to(x.dtype), h, Saved(k, V, W)


def backward(dy, dh, x, p, log_q, gamma, omega, hx, saved: Saved, needs: Needs, conv: Convolution, *, chunk,
             chunk_min_len, power_block):
    """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
    L = x.shape[-1]
    x = contiguous(x)
    dy = None if dy is None else contiguous(dy)
    cd = compute_dtype(x.dtype, saved.k.dtype)
    dx = dp = dlq = dgamma = domega = dhx = None
    chunked = chunked_form(L, chunk, chunk_min_len)
    # the chunked form evaluates its own few powers; the table serves the FFT form and the state
    table = power_table(log_q, L, power_block) if (dy is not None and not chunked) or dh is not None else None
    if dy is not None:
        dyc = dy.to(cd)
        if chunked:
            dx, dp, dlq, dgamma, dhx = chunked_conv_bwd(dyc, x, p, log_q, gamma, hx,
                                                        (needs.x, needs.p, needs.log_q, needs.gamma, needs.hx),
                                                        chunk, cd)
        else:
            need_k = needs.p or needs.log_q or needs.gamma
            dx, dk = conv.backward(dyc, x, saved.k, needs.x, need_k)
            if need_k or (needs.hx and hx is not None):
                dp, dlq, dgamma, dhx = kernel_stage.backward(
                    dk, None if hx is None else dyc, p, log_q, gamma, L, hx,
                    (needs.p, needs.log_q, needs.gamma, needs.hx), power_block=power_block, table=table)
        if needs.x:
            dx = dx.addcmul_(omega.to(cd)[:, None], dyc)
        if needs.omega:
            domega = (dyc * x.to(cd)).sum((0, 2))
    if dh is not None:
        dxh, dph, dlqh, dhxh = state_stage.backward(dh, p, log_q, hx, saved.V, saved.W, L,
                                                    (needs.x, needs.p, needs.log_q, needs.hx),
                                                    power_block=power_block, table=table)
        dx, dp, dlq, dhx = (add_optional(a, b) for a, b in ((dx, dxh), (dp, dph), (dlq, dlqh), (dhx, dhxh)))
    return dx, dp, dlq, dgamma, domega, dhx
