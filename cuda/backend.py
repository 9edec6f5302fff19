"""The backend-object base shared by every op's CUDA backend (``Backend``: availability, device
and dtype reasons over a getter of the launcher).

Each op's ``<Op>Backend`` (in its ``ops/<op>/cuda_impl.py``) has the backend-module interface of
ops/_dispatch.py (``CONFIG_SPACE``, ``DEFAULT_CONFIG``, ``not_supported_reasons(**inputs)``
(inputs it does not use are ignored, so an op may pass more), ``forward``/``backward``) over a
launcher getter and a device type. The module's own functions of those names run it over the GPU
launcher; tests build the same class over the CPU emulator (``device_type="cpu"``) and swap it in
as the op's "cuda" backend (``OpBackends.use``) to run the ops end to end.

Device limits: a backend plans its launches for :meth:`Backend.caps` of the inputs' device (the
GPU's compute capability, opt-in shared memory per block and grid limits from cuda/device.py; the
emulator's profile, an A100 unless faked, for CPU tensors) and says in ``not_supported_reasons``
what does not fit, so ``auto`` falls back (the per-op plans: fftconv's ``config``, attention's
``flash_device_reasons``; a GPU NVRTC cannot target: :meth:`Backend._arch_reasons`). The
launchers check every launch against the same limits again (cuda/launch.py ``check_fits``), so a
plan that missed one fails with its reason instead of trapping on the GPU.

Imports only cuda/device.py (and, for CUDA tensors, cuda/runtime.py) from the rest of the package.
"""
from __future__ import annotations

import torch

from . import device as _device

#: element types of the kernels (fp32 accumulation) ...
DTYPES = (torch.float32, torch.bfloat16)
#: ... and of the ops whose kernels also run in double (double accumulation)
FP64_DTYPES = (*DTYPES, torch.float64)


class Backend:
    #: the knobs (none by default) and their first values, as in a backend module
    CONFIG_SPACE: dict = {}
    DEFAULT_CONFIG: dict = {}
    #: the op's kernels also run in float64 (FP64_DTYPES)
    FP64 = False

    def _dtype_reason(self, name: str, t: torch.Tensor, what: str = "the CUDA kernels take") -> list[str]:
        """Why the kernels cannot take ``t``'s dtype (empty when they can)."""
        if t.dtype in (FP64_DTYPES if self.FP64 else DTYPES):
            return []
        names = "float32, bfloat16 or float64" if self.FP64 else "float32 or bfloat16"
        return [f"{what} {names} {name}, got {t.dtype} (use backend='torch')"]

    def __init__(self, get_ext, device_type: str = "cuda"):
        """``get_ext``: returns the launcher (cuda/launch.py, cuda/runtime.py) or raises why there is none."""
        self._get_ext = get_ext
        self.device_type = device_type

    @property
    def ext(self):
        return self._get_ext()

    def _available(self) -> list[str]:
        try:
            self._get_ext()
        except Exception as exc:  # no GPU runtime here / no compiler (emulator)
            return [str(exc)]
        return []

    @staticmethod
    def caps(t) -> "_device.DeviceCaps":
        """The capabilities of the device of ``t`` (a tensor or device) the launches plan for."""
        return _device.launch_caps(t.device if isinstance(t, torch.Tensor) else t)

    @staticmethod
    def _arch_reasons(tensors) -> list[str]:
        """Why NVRTC cannot compile for the GPU of the first CUDA tensor (an sm_70 of a mixed
        machine, say), as a list; nothing for CPU (emulator) tensors."""
        t = next((t for t in tensors if t is not None and t.device.type == "cuda"), None)
        if t is None:
            return []
        from . import runtime  # (imports NVRTC's module only when there is a CUDA tensor)

        reason = runtime.arch_reason(t.device)
        return [] if reason is None else [reason]

    def _device_reasons(self, named: dict) -> list[str]:
        """Why the kernels cannot take these tensors (name -> tensor or None) for their device:
        the first one not on this backend's device type (empty when all are)."""
        for name, t in named.items():
            if t is not None and t.device.type != self.device_type:
                return [f"needs {self.device_type} tensors, got {name} on {t.device} (use backend='torch')"]
        return []

    def _reasons(self, named: dict, dtype_of: str) -> list[str]:
        # an unavailable backend (no GPU, no CuPy) gives that one reason, not also "needs cuda tensors"
        reasons = self._available() or self._arch_reasons(named.values()) + self._device_reasons(named)
        reasons += self._dtype_reason(dtype_of, named[dtype_of])
        return reasons
