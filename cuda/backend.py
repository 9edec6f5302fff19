"""The backend-object base shared by every op's CUDA backend (``_Backend``: availability, device
and dtype reasons over a getter of the launcher or extension).

Each op's ``<Op>Backend`` (in its ``ops/<op>/cuda_impl.py``) has the backend-module interface of
ops/_dispatch.py (``DEFAULT_CONFIG``, ``not_supported_reasons(**inputs)`` (inputs it does not use
are ignored, so an op may pass more), the op's ``*_fwd``/``*_bwd``) over a launcher (or extension)
getter and a device type; tests build the same classes over the CPU emulator
(``device_type="cpu"``) to run the ops' autograd Functions end to end.

Imports nothing from the rest of the package.
"""
from __future__ import annotations

import torch

from . import extension, extension_error
from . import kernels as K


def _product_ext():
    mod = extension()
    if mod is None:
        raise RuntimeError(extension_error())
    return mod


class _Backend:
    DEFAULT_CONFIG: dict = {}
    #: the op's kernels also run in float64 (double accumulation; kernels.FP64_DTYPE_CODES)
    FP64 = False

    def _dtype_reason(self, name: str, t: torch.Tensor, what: str = "the CUDA kernels take") -> list[str]:
        """Why the kernels cannot take ``t``'s dtype (empty when they can)."""
        if t.dtype in (K.FP64_DTYPE_CODES if self.FP64 else K.DTYPE_CODES):
            return []
        return [f"{what} {K._dtype_names(self.FP64)} {name}, got {t.dtype} (use backend='torch')"]

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
        reasons += self._dtype_reason(dtype_of, named[dtype_of])
        return reasons
