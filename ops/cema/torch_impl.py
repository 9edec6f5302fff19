"""PyTorch backend of cema: the three stage backends composed, with one rounding of y.

Forward: (k, b) = cema_kernel(p, log_q, gamma, L, hx); y = fftconv(x, k) kept in the compute dtype,
plus b and omega x, then rounded once to x's dtype; h = ema_hidden(x, p, log_q, hx) if asked.
Backward, with dy the gradient of y and dh that of h:

    dx = fftconv_x(dy) + omega dy (+ ema_hidden_x(dh)),  domega = sum_{b,t} dy x
    (dp, dlog_q, dgamma, dhx) = cema_kernel_bwd(dk = fftconv_k(dy), db = dy) (+ ema_hidden's terms)

One power table (ops/_vandermonde.py) serves every stage of a pass: the kernel, the bias (shifted
view) and the state (flipped). Saved for the backward: the inputs, k r(D L) (cheaper than
recomputing it), and ema_hidden's c(B D N) sums V, W.

With ``chunk`` = C > 0 and L >= ``chunk_min_len`` the convolution and the bias run in chunked
form instead (ops/cema/chunked.py: C x C Toeplitz matmuls within chunks plus a scan over the
chunk states; no FFT); k is still synthesised and saved, so the packed path and the FFT form can
read it. ``chunk`` = 0 selects the FFT form at every length. Up to ``RECURRENCE_MAX_LEN`` steps
(and chunk > 0) the forward is the recurrence itself (decoding), with the same saved tensors.
"""
from __future__ import annotations

import functools

import torch

from .._layout import contiguous
from .._vandermonde import power_table
from ..cema_kernel.torch_impl import cema_kernel_bwd, cema_kernel_fwd
from ..ema_hidden.torch_impl import ema_hidden_bwd, ema_hidden_fwd
from ..fftconv.torch_impl import compute_dtype, fftconv_bwd, fftconv_fwd
from .chunked import RECURRENCE_MAX_LEN, chunked_conv_bwd, chunked_conv_fwd, recurrence_fwd

#: The knobs of the stages it composes (see cema_kernel and fftconv), ``chunk``: the chunk length
#: of the chunked form (0: never chunked), and ``chunk_min_len``: the lengths from which the
#: chunked form runs (below: the FFT form). On a 1-thread x86 CPU (`python bench/cema_forms.py
#: time`) the chunked form (C 64) is on par with the FFT form or slower up to L 2048, and faster
#: from L 4096 on, where the FFT's spectra (B D (L+1) complex values) leave the cache.
DEFAULT_CONFIG: dict = {"chunk": 64, "chunk_min_len": 4096, "power_block": 64, "direct_max_len": 16}


def _chunked(L, chunk, chunk_min_len) -> bool:
    """Whether a length-L call runs the chunked form (its recurrence for the shortest calls)."""
    return chunk > 0 and (L >= chunk_min_len or L <= RECURRENCE_MAX_LEN)


def not_supported_reasons(**inputs) -> list[str]:
    return []  # every device and dtype torch supports


def _conv(conv, direct_max_len):
    """The FFT form's convolution stage: fftconv's torch backend with its ``direct_max_len`` knob,
    or ``conv``, another fftconv backend module without knobs (the cpu backend passes its kernel)."""
    if conv is None:
        return (functools.partial(fftconv_fwd, direct_max_len=direct_max_len),
                functools.partial(fftconv_bwd, direct_max_len=direct_max_len))
    return conv.fftconv_fwd, conv.fftconv_bwd


def cema_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted=False, *, chunk, chunk_min_len, power_block,
             direct_max_len, conv=None):
    """-> (y r(B D L) in x's dtype, h c(B D N) or None, saved = (k, V, W)). ``conv``: see _conv."""
    L = x.shape[-1]
    cd = compute_dtype(x.dtype, p.dtype)
    chunked = _chunked(L, chunk, chunk_min_len)
    if chunked and L <= RECURRENCE_MAX_LEN:                               # e.g. decoding, one step per call
        y, h, saved = recurrence_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted, cd)
        return y.to(x.dtype), h, saved
    x = contiguous(x)  # once for every stage below (the model passes a transposed (B, L, D) view)
    table = power_table(log_q, L, power_block)                            # shared by every stage
    if chunked:
        k, _ = cema_kernel_fwd(p, log_q, gamma, L, None, power_block=power_block, table=table)
        y = chunked_conv_fwd(x, p, log_q, gamma, hx, chunk, cd)          # [B, D, L], bias included
        y = y.addcmul_(omega.to(cd)[:, None], x.to(cd))
    else:
        k, b = cema_kernel_fwd(p, log_q, gamma, L, hx, power_block=power_block, table=table)
        y = _conv(conv, direct_max_len)[0](x, k, cd)                       # [B, D, L]
        # torch's y is a strided view (the first halves of the FFT rows, or a transposed matmul):
        # the out-of-place sum is also the contiguous copy the op returns (one pass, not two); a
        # compiled kernel's y is a fresh contiguous tensor, summed into in place
        add = torch.Tensor.addcmul_ if conv is not None else torch.addcmul
        y = add(y, omega.to(cd)[:, None], x.to(cd))
        if b is not None:
            y = y.add_(b)
    h = V = W = None
    if return_state:
        h, V, W = ema_hidden_fwd(x, p, log_q, hx, weighted, power_block=power_block, table=table)
    return y.to(x.dtype), h, (k, V, W)


def cema_bwd(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, *, chunk, chunk_min_len, power_block,
             direct_max_len, conv=None):
    """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
    need_x, need_p, need_lq, need_gamma, need_omega, need_hx = needs
    k, V, W = saved
    L = x.shape[-1]
    x = contiguous(x)
    dy = None if dy is None else contiguous(dy)
    cd = compute_dtype(x.dtype, k.dtype)
    dx = dp = dlq = dgamma = domega = dhx = None
    chunked = _chunked(L, chunk, chunk_min_len)
    # the chunked form evaluates its own few powers; the table serves the FFT form and the state
    table = power_table(log_q, L, power_block) if (dy is not None and not chunked) or dh is not None else None
    if dy is not None:
        dyc = dy.to(cd)
        if chunked:
            dx, dp, dlq, dgamma, dhx = chunked_conv_bwd(dyc, x, p, log_q, gamma, hx,
                                                        (need_x, need_p, need_lq, need_gamma, need_hx), chunk, cd)
        else:
            need_k = need_p or need_lq or need_gamma
            dx, dk = _conv(conv, direct_max_len)[1](dyc, x, k, need_x, need_k)
            if need_k or (need_hx and hx is not None):
                dp, dlq, dgamma, dhx = cema_kernel_bwd(
                    dk, None if hx is None else dyc, p, log_q, gamma, L, hx,
                    (need_p, need_lq, need_gamma, need_hx), power_block=power_block, table=table)
        if need_x:
            dx = dx.addcmul_(omega.to(cd)[:, None], dyc)
        if need_omega:
            domega = (dyc * x.to(cd)).sum((0, 2))
    if dh is not None:
        dxh, dph, dlqh, dhxh = ema_hidden_bwd(dh, p, log_q, hx, V, W, L, (need_x, need_p, need_lq, need_hx),
                                              power_block=power_block, table=table)
        dx = _add(dx, dxh)
        dp = _add(dp, dph)
        dlq = _add(dlq, dlqh)
        dhx = _add(dhx, dhxh)
    return dx, dp, dlq, dgamma, domega, dhx


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b
