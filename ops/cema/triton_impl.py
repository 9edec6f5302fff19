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

The chunked form (``chunk`` = C > 0, the default; ops/cema/triton_chunked.py) replaces the
convolution, the bias and the skip term by tensor-core dots over chunks of C steps and a scan over
the chunk states, forward and backward, no FFT; it serves every call with N <= 16 (the other calls
run the FFT form above, as does ``chunk`` = 0). Its backward reads no kernel, so its forward
synthesises none: the Saved/packed contract's k r(D L) is a NaN placeholder (the backward runs the
same form, chosen by the same rule from the same inputs and config). The state h, V, W and its
gradients come from ema_hidden in both forms.
"""
from __future__ import annotations

import torch

from .._triton_common import HAVE_TRITON, arch_reasons, device_reasons, dtype_reasons, release_reasons
from ..cema_kernel import triton_impl as kernel_impl
from ..ema_hidden import triton_impl as hidden_impl
from ..fftconv import triton_impl as conv_impl
from . import triton_chunked as chunked
from .compose import Needs, Saved, add_optional

#: the chunked form's knobs: ``chunk`` (C; 0: the FFT form always), ``chunk_block`` (BM chunks per
#: block of dots) and its kernels' ``chunk_warps``. C = 64 is not offered: the backward's scan kernel
#: needs 255 registers there and spills (bench/results/aot_sm*.json lists what is offered).
CHUNK_SPACE: dict = {"chunk": (32, 0), "chunk_block": (16,), "chunk_warps": (4,)}
#: the stage kernels' knobs: cema_kernel's (ema_hidden's kernels share them) and fftconv's, its
#: num_warps as conv_warps; then the chunked form's
CONFIG_SPACE: dict = {**kernel_impl.CONFIG_SPACE,
                      **{("conv_warps" if k == "num_warps" else k): v for k, v in conv_impl.CONFIG_SPACE.items()},
                      **CHUNK_SPACE}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

_STAGE = ("block_m", "block_r", "num_warps", "analysis_warps")
_CONV = ("direct_max_len", "work_warps", "work_bc", "direct_warps")


def _split(config):
    stage = {k: config[k] for k in _STAGE}
    conv = {k: config[k] for k in _CONV}
    conv["num_warps"] = config["conv_warps"]
    return stage, conv


def _fft_form_reasons(x) -> list[str]:
    """Why the FFT form cannot run x (fftconv's dtype and length limits, and its launches that the
    running Triton release compiles to spilling code); the chunked form has none of these."""
    why = conv_impl.not_supported_reasons(x=x)
    if x.shape[-1] <= conv_impl.MAX_LENGTH:  # its fused convolution kernels (fftconv's tiles with the skip term)
        why += release_reasons("cema", x.device, **conv_impl.launch_path(x.shape[-1], x.dtype))
    return why


def form_chunk(x, p, config) -> int:
    """The chunk length C this call runs the chunked form with, 0 for the FFT form: ``chunk`` when
    the chunked kernels serve the call; also with ``chunk`` = 0 (e.g. a tuned entry) when the FFT
    form cannot run this launch and the chunked kernels can (then at the space's first C)."""
    if chunked.unserved_reasons(x, p):
        return 0
    if config["chunk"] > 0:
        return config["chunk"]
    return CHUNK_SPACE["chunk"][0] if _fft_form_reasons(x) else 0


def chunked_form(x, p, config) -> bool:
    """Whether this call runs the chunked form (:func:`form_chunk`)."""
    return form_chunk(x, p, config) > 0


def _chunk_config(x, p, config):
    return {**{k: config[k] for k in CHUNK_SPACE}, "chunk": form_chunk(x, p, config)}


def not_supported_reasons(x=None, p=None, log_q=None, gamma=None, omega=None, hx=None, **_) -> list[str]:
    # a call the chunked kernels serve runs them (form_chunk): the FFT form's limits do not apply
    why = _fft_form_reasons(x) if chunked.unserved_reasons(x, p) else device_reasons(x, op="cema")
    if x.is_cuda and HAVE_TRITON:  # its tile kernels (TF32 dots), beside fftconv's and the CEMA kernels'
        why += [r for r in arch_reasons("cema", x.device) if r not in why]
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
    if chunked_form(x, p, config):
        # The chunked backward reads no kernel, so none is synthesised (that costs more than the
        # chunked forward itself at long L: cema_kernel's Triton forward took 0.34 ms at D 4096,
        # L 4096 on the H200, bench/results/gpu/h200_run3). The Saved/packed contract's k r(D L) is
        # a NaN placeholder: a backward that read it (the FFT form) would give NaN, not wrong numbers.
        k = torch.full((p.shape[0], L), float("nan"), dtype=torch.float32, device=x.device)
        y = chunked.conv_fwd(x, p, log_q, gamma, omega, hx, **_chunk_config(x, p, config))
    else:
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
    if dy is not None and chunked_form(x, p, config):
        # dx in x's dtype, or fp32 when the state's gradient is added to it below (one rounding)
        dx, dp, dlq, dgamma, domega, dhx = chunked.conv_bwd(
            dy.to(x.dtype), x, p, log_q, gamma, omega, hx, needs, x.dtype if dh is None else torch.float32,
            **_chunk_config(x, p, config))
    elif dy is not None:
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
