"""Triton backend of cema: the Triton stage kernels composed, bias and skip fused into the convolution.

Forward: (k, b) = cema_kernel (Triton, fp32), then ONE fftconv launch whose epilogue adds the bias
rows b[b, d] and omega[d] x[b, d] (x re-read from L1/L2 by the program that just transformed it: the
FFT tile paths do not hold it across the transforms, to stay within the register file) to the fp32
convolution before the single rounding of y to x's dtype; h, V, W from
the Triton ema_hidden when the state is returned. Nothing of size B D L is written besides y (and b,
which cema_kernel produces).

Backward (dy the gradient of y, dh that of h): ONE fftconv backward launch computes
dx = corr(dy, k) + omega dy (dy re-read by the same program), dk = sum_b corr(dy_b, x_b) and
domega[d] = sum_{b,t} dy x (both tiles are loaded for dk anyway) per feature program, deterministic;
then cema_kernel's backward takes (dk, db = dy) and ema_hidden's backward adds the dh terms:

    dx = fftconv_x(dy) + omega dy (+ ema_hidden_x(dh)),  domega = sum_{b,t} dy x
    (dp, dlog_q, dgamma, dhx) = cema_kernel's backward(dk, db = dy) (+ ema_hidden's terms)

Saved for the backward: the inputs, k r(D L) and ema_hidden's sums V, W (as the torch backend).
"""
from __future__ import annotations

import torch

from .._triton_common import HAVE_TRITON, arch_reasons, dtype_reasons, release_reasons
from ..cema_kernel import triton_impl as kernel_impl
from ..ema_hidden import triton_impl as hidden_impl
from ..fftconv import triton_impl as conv_impl
from .compose import Needs, Saved, add_optional

#: the stage kernels' knobs: cema_kernel's (ema_hidden's kernels share them) and fftconv's, its
#: num_warps as conv_warps
CONFIG_SPACE: dict = {**kernel_impl.CONFIG_SPACE,
                      **{("conv_warps" if k == "num_warps" else k): v for k, v in conv_impl.CONFIG_SPACE.items()}}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

_STAGE = ("block_m", "block_r", "num_warps", "analysis_warps")
_CONV = ("direct_max_len", "work_warps", "work_bc", "direct_warps")


def _split(config):
    stage = {k: config[k] for k in _STAGE}
    conv = {k: config[k] for k in _CONV}
    conv["num_warps"] = config["conv_warps"]
    return stage, conv


def not_supported_reasons(x=None, p=None, log_q=None, gamma=None, omega=None, hx=None, **_) -> list[str]:
    why = conv_impl.not_supported_reasons(x=x)
    if x.shape[-1] <= conv_impl.MAX_LENGTH:  # its fused convolution kernels (fftconv's tiles with the skip term)
        why += release_reasons("cema", x.device, **conv_impl.launch_path(x.shape[-1]))
    if x.is_cuda and HAVE_TRITON:  # its own FFT tile kernels (TF32 dots), beside fftconv's and the CEMA kernels'
        why += arch_reasons("cema", x.device)
    why += [r for r in kernel_impl.not_supported_reasons(p=p, log_q=log_q, gamma=gamma, length=x.shape[-1], hx=hx)
            if r not in why]
    why += [r for r in hidden_impl.not_supported_reasons(x=x, p=p, log_q=log_q, hx=hx) if r not in why]
    if omega is not None:
        why += dtype_reasons("omega", omega, (torch.float16, torch.bfloat16, torch.float32))
    return why


def forward(x, p, log_q, gamma, omega, hx, return_state, weighted=False, **config):
    """-> (y r(B D L) in x's dtype, h c(B D N) or None, Saved)."""
    stage, conv = _split(config)
    L = x.shape[-1]
    k, b = kernel_impl.forward(p, log_q, gamma, L, hx, **stage)
    y = conv_impl.conv_fwd(x, k, bias=b, omega=omega.to(torch.float32), **conv)
    h = V = W = None
    if return_state:
        h, V, W = hidden_impl.forward(x, p, log_q, hx, weighted, **stage)
    return y, h, Saved(k, V, W)


def backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, **config):
    """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
    stage, conv = _split(config)
    need_x, need_p, need_lq, need_gamma, need_omega, need_hx = Needs(*needs)
    k, V, W = saved
    L = x.shape[-1]
    dx = dp = dlq = dgamma = domega = dhx = None
    if dy is not None:
        need_k = need_p or need_lq or need_gamma
        with_omega = need_x or need_omega
        dx, dk, domega = conv_impl.conv_bwd(dy, x, k, need_x, need_k,
                                            omega.to(torch.float32) if with_omega else None, **conv)
        if not need_x:
            dx = None
        if not need_omega:
            domega = None
        if need_k or (need_hx and hx is not None):
            dp, dlq, dgamma, dhx = kernel_impl.backward(
                dk, None if hx is None else dy, p, log_q, gamma, L, hx, (need_p, need_lq, need_gamma, need_hx),
                **stage)
    if dh is not None:
        dxh, dph, dlqh, dhxh = hidden_impl.backward(dh, p, log_q, hx, V, W, L,
                                                          (need_x, need_p, need_lq, need_hx), **stage)
        dx, dp, dlq, dhx = (add_optional(a, b) for a, b in ((dx, dxh), (dp, dph), (dlq, dlqh), (dhx, dhxh)))
    return dx, dp, dlq, dgamma, domega, dhx
