"""The CUDA backend of each op, as ``ops/<op>/cuda_impl.py`` exposes it.

Each ``<Op>Backend`` has the backend-module interface of ops/_dispatch.py (``DEFAULT_CONFIG``,
``not_supported_reasons(**inputs)`` (inputs it does not use are ignored, so an op may pass more),
the op's ``*_fwd``/``*_bwd``) over an extension getter and
a device type. The module-level instances use the product extension on CUDA tensors, so an
``ops/<op>/cuda_impl.py`` only re-exports them; tests build the same classes over the CPU
emulator (``device_type="cpu"``) to run the ops' autograd Functions end to end.

Imports nothing from the rest of the package.
"""
from __future__ import annotations

import torch

from . import extension, extension_error
from . import kernels as K

_KERNEL_DTYPES = tuple(K.DTYPE_CODES)  # float32, bfloat16


def _product_ext():
    mod = extension()
    if mod is None:
        raise RuntimeError(extension_error())
    return mod


class _Backend:
    DEFAULT_CONFIG: dict = {}

    def __init__(self, get_ext=_product_ext, device_type: str = "cuda"):
        self._get_ext = get_ext
        self.device_type = device_type

    @property
    def ext(self):
        return self._get_ext()

    def _available(self) -> list[str]:
        try:
            self._get_ext()
        except Exception as exc:  # not built (product) / no compiler (emulator)
            return [str(exc)]
        return []

    def _reasons(self, named: dict, dtype_of: str) -> list[str]:
        reasons = self._available()
        for name, t in named.items():
            if t.device.type != self.device_type:
                reasons.append(f"needs {self.device_type} tensors, got {name} on {t.device} "
                               f"(use backend='torch')")
                break
        t = named[dtype_of]
        if t.dtype not in _KERNEL_DTYPES:
            reasons.append(f"the CUDA kernels take float32 or bfloat16 {dtype_of}, got {t.dtype} (use backend='torch')")
        return reasons


class RotaryBackend(_Backend):
    def not_supported_reasons(self, x, **_other_inputs) -> list[str]:
        return self._reasons({"x": x}, "x")

    def rotary_fwd(self, x, cos, sin):
        return K.rotary_fwd(self.ext, x, cos, sin)

    def rotary_bwd(self, dy, cos, sin):
        return K.rotary_bwd(self.ext, dy, cos, sin)


class DropKeySoftmaxBackend(_Backend):
    def not_supported_reasons(self, scores, **_other_inputs) -> list[str]:
        return self._reasons({"scores": scores}, "scores")

    def dropkey_softmax_fwd(self, scores, *, causal, dropkey_p, seed):
        return K.dropkey_softmax_fwd(self.ext, scores, causal=causal, dropkey_p=dropkey_p, seed=seed)

    def dropkey_softmax_bwd(self, dy, y, *, causal, dropkey_p=0.0, seed=0):
        return K.dropkey_softmax_bwd(self.ext, dy, y, causal=causal)


class TimestepNormBackend(_Backend):
    def not_supported_reasons(self, x, num_groups=None, **_other_inputs) -> list[str]:
        reasons = self._reasons({"x": x}, "x")
        if x.dim() == 3 and x.shape[1] >= 2**31:
            reasons.append("L must be < 2^31")
        return reasons

    def timestep_norm_fwd(self, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps):
        return K.timestep_norm_fwd(self.ext, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask,
                                   num_groups, eps)

    def timestep_norm_bwd(self, dy, dmean, dvar, saved, num_groups):
        return K.timestep_norm_bwd(self.ext, dy, dmean, dvar, saved, num_groups)


class FftconvBackend(_Backend):
    #: max_workspace_bytes: cap of the (batch slice, D, N + 1) complex64 product spectra of dk.
    DEFAULT_CONFIG: dict = {"max_workspace_bytes": 256 << 20}

    def not_supported_reasons(self, x, k, **_other_inputs) -> list[str]:
        reasons = self._reasons({"x": x, "k": k}, "x")
        if k.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"k must be float32, bfloat16 or float16 for the CUDA kernels, got {k.dtype}")
        L = x.shape[-1]
        if L > K.FFTCONV_MAX_LEN:
            reasons.append(f"the CUDA fftconv handles L <= {K.FFTCONV_MAX_LEN} in one block per row, got L = {L} "
                           f"(use backend='torch'; the multi-pass FFT is not implemented)")
        return reasons

    def fftconv_fwd(self, x, k, max_workspace_bytes=None):
        return K.fftconv_fwd(self.ext, x, k)

    def fftconv_bwd(self, dy, x, k, need_x, need_k, max_workspace_bytes=DEFAULT_CONFIG["max_workspace_bytes"]):
        return K.fftconv_bwd(self.ext, dy, x, k, need_x, need_k, max_workspace_bytes=max_workspace_bytes)


# The product backends (CUDA tensors, megalodon_kernels.cuda._C): ops/<op>/cuda_impl.py re-exports these.
rotary = RotaryBackend()
dropkey_softmax = DropKeySoftmaxBackend()
timestep_norm = TimestepNormBackend()
fftconv = FftconvBackend()
