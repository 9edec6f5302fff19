"""CUDA backend of cema: the CUDA stage kernels composed (cuda/cema.cuh's synthesis and analysis,
cuda/fftconv.cuh's convolution), the bias and skip terms summed before the single rounding.

Forward: (k, b) = cema_kernel (CUDA) in p's precision; y = fftconv(x, k) (CUDA) in the compute
precision (float32, float64 for float64 inputs), plus omega x and b, then rounded once to x's dtype;
h, V, W from the CUDA ema_hidden when the state is returned. Backward (dy the gradient of y, dh that
of h):

    dx = fftconv_x(dy) + omega dy (+ ema_hidden_x(dh)),  domega = sum_{b,t} dy x
    (dp, dlog_q, dgamma, dhx) = cema_kernel's backward(dk = fftconv_k(dy), db = dy) (+ ema_hidden's terms)

The epilogue (omega x + b, the single rounding) runs as torch elementwise passes after the
convolution kernel: the CUDA fftconv writes y in its input's dtype, so a bfloat16 x is widened to
float32 for the convolution (one extra B D L pass each way) to keep one rounding, as the torch and
Triton backends do. Saved for the backward: the inputs, k r(D L) and ema_hidden's sums V, W.

``CemaBackend`` holds the three stage backends over one launcher getter: the module's functions run
it over the GPU runtime (NVRTC); tests build it over the CPU emulator (tests/conftest.py).
"""
from __future__ import annotations

from ...cuda import runtime
from ...cuda.backend import Backend
from ..cema_kernel.cuda_impl import CemaKernelBackend
from ..ema_hidden.cuda_impl import EmaHiddenBackend
from ..fftconv.cuda_impl import FftconvBackend
from ..fftconv.torch_impl import compute_dtype
from .compose import Needs, Saved, add_optional


class CemaBackend(Backend):
    """cema as the CUDA stage kernels of cema_kernel, fftconv and ema_hidden."""

    #: fftconv's knobs (its workspace cap and FFT block size) are the stages' only ones
    CONFIG_SPACE: dict = dict(FftconvBackend.CONFIG_SPACE)
    DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}
    FP64 = True

    def __init__(self, get_ext, device_type: str = "cuda"):
        super().__init__(get_ext, device_type)
        self.kernel = CemaKernelBackend(get_ext, device_type)
        self.conv = FftconvBackend(get_ext, device_type)
        self.hidden = EmaHiddenBackend(get_ext, device_type)

    def not_supported_reasons(self, x, p, log_q=None, gamma=None, omega=None, hx=None, **_other_inputs) -> list[str]:
        unavailable = self._available()
        if unavailable:  # no GPU runtime here: that one reason, as the stage backends give it
            return unavailable
        why = self.kernel.not_supported_reasons(p, log_q=log_q, gamma=gamma, length=x.shape[-1], hx=hx)
        # the convolution runs on x widened to the compute dtype, with k in p's dtype: its reasons
        # for that pair (a zero-size stand-in of x: only its dtype, length and device are read)
        cd = compute_dtype(x.dtype, p.dtype)
        x_cd = x.new_empty((0, x.shape[1], x.shape[-1]), dtype=cd)
        why += [r for r in self.conv.not_supported_reasons(x=x_cd, k=p) if r not in why]
        why += [r for r in self.hidden.not_supported_reasons(x=x, p=p, log_q=log_q, hx=hx) if r not in why]
        if omega is not None:
            why += [r for r in self._device_reasons({"omega": omega}) if r not in why]
        return why

    def forward(self, x, p, log_q, gamma, omega, hx, return_state, weighted=False, **conv_config):
        """-> (y r(B D L) in x's dtype, h c(B D N) or None, Saved)."""
        L = x.shape[-1]
        cd = compute_dtype(x.dtype, p.dtype)
        k, b = self.kernel.forward(p, log_q, gamma, L, hx)
        xc = x.to(cd).contiguous()                       # a copy only for bfloat16 x (or a strided view)
        y = self.conv.forward(xc, k, **conv_config)   # new, in cd
        y = y.addcmul_(omega.to(cd)[:, None], xc)
        if b is not None:
            y = y.add_(b)
        h = V = W = None
        if return_state:
            h, V, W = self.hidden.forward(x.contiguous(), p, log_q, hx, weighted)
        return y.to(x.dtype), h, Saved(k, V, W)

    def backward(self, dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, **conv_config):
        """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
        need_x, need_p, need_lq, need_gamma, need_omega, need_hx = Needs(*needs)
        k, V, W = saved
        L = x.shape[-1]
        cd = compute_dtype(x.dtype, k.dtype)
        dx = dp = dlq = dgamma = domega = dhx = None
        if dy is not None:
            dyc = dy.to(cd).contiguous()
            xc = x.to(cd).contiguous()
            need_k = need_p or need_lq or need_gamma
            if need_x or need_k:
                dx, dk = self.conv.backward(dyc, xc, k, need_x, need_k, **conv_config)
            else:
                dk = None
            if need_x:
                dx = dx.addcmul_(omega.to(cd)[:, None], dyc)
            if need_omega:
                domega = (dyc * xc).sum((0, 2))
            if need_k or (need_hx and hx is not None):
                dp, dlq, dgamma, dhx = self.kernel.backward(
                    dk, None if hx is None else dyc, p, log_q, gamma, L, hx, (need_p, need_lq, need_gamma, need_hx))
                dp, dlq, dgamma = (g if need else None for g, need in ((dp, need_p), (dlq, need_lq),
                                                                         (dgamma, need_gamma)))
                dhx = dhx if need_hx else None
        if dh is not None:
            dxh, dph, dlqh, dhxh = self.hidden.backward(dh.contiguous(), p, log_q, hx, V, W, L,
                                                        (need_x, need_p, need_lq, need_hx))
            dx, dp, dlq, dhx = (add_optional(a, b) if need else a
                                for a, b, need in ((dx, dxh, need_x), (dp, dph, need_p), (dlq, dlqh, need_lq),
                                                   (dhx, dhxh, need_hx)))
        return dx, dp, dlq, dgamma, domega, dhx


# The backend module's names over the GPU launcher (tests build CemaBackend over the emulator).
_GPU = CemaBackend(runtime.gpu_launcher)
CONFIG_SPACE: dict = CemaBackend.CONFIG_SPACE
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(*args, **inputs) -> list[str]:
    return _GPU.not_supported_reasons(*args, **inputs)


def forward(x, p, log_q, gamma, omega, hx, return_state, weighted=False, **conv_config):
    return _GPU.forward(x, p, log_q, gamma, omega, hx, return_state, weighted, **conv_config)


def backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, **conv_config):
    return _GPU.backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, **conv_config)
