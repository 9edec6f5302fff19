"""CUDA backend of rotary: the kernel is cuda/rotary.cuh; this file is its whole launch path.

The launch description below runs on a GPU through the NVRTC runtime (cuda/runtime.py: compiled
on first use, launched on torch's current stream) and in the CPU emulator (tests), both from the
same :class:`~megalodon_kernels.cuda.launch.Launch` records.
"""
from __future__ import annotations

from ...cuda import launch as L
from ...cuda import runtime
from ...cuda.backend import _Backend

THREADS = 256  # rotary_kernel's __launch_bounds__
#: (x dtype, conjugate) -> instantiation; conjugate = True is the backward (transposed rotation)
KERNELS_BY_KEY = {(dtype, conj): L.Kernel("rotary.cuh", f"mk::rotary_kernel<{cpp}, {'true' if conj else 'false'}>")
                  for dtype, cpp in L.CPP_TYPES.items() for conj in (False, True)}
KERNELS = list(KERNELS_BY_KEY.values())


def rotary(launcher, x, cos, sin, conjugate: bool):
    """y = x rotated by the (P, L, 1, d/2) tables (P = 1 or B); conjugate: the transpose."""
    if x.dtype not in L.CPP_TYPES:
        raise TypeError(f"the CUDA rotary kernel takes float32, bfloat16 or float64 x, got {x.dtype}")
    B, Lq, H, d = x.shape
    half = d // 2
    P = cos.shape[0]
    if P not in (1, B):
        raise ValueError(f"rotary: the tables must have 1 or B = {B} rows, got {P}")
    acc = L.acc_dtype(x)  # the tables in the kernel's arithmetic type
    c = cos.to(acc).contiguous()
    s = sin.to(acc).contiguous()
    xc = x.contiguous()
    y = xc.new_empty(xc.shape)
    pairs = B * Lq * H * half
    if pairs == 0:
        return y
    L.launch(launcher, KERNELS_BY_KEY[(x.dtype, conjugate)], L.grid_1d(-(-pairs // THREADS), 65535), THREADS, 0,
             [("ptr", L.ptr(xc)), ("ptr", L.ptr(c)), ("ptr", L.ptr(s)), ("ptr", L.ptr(y)), ("i64", pairs),
              ("i64", Lq), ("i64", H), ("i64", half), ("bool", P == B and B > 1)], x.device)
    return y


class RotaryBackend(_Backend):
    FP64 = True  # double x with double tables

    def not_supported_reasons(self, x, **_other_inputs) -> list[str]:
        return self._reasons({"x": x}, "x")

    def rotary_fwd(self, x, cos, sin):
        return rotary(self.ext, x, cos, sin, False)

    def rotary_bwd(self, dy, cos, sin):
        return rotary(self.ext, dy, cos, sin, True)


_backend = RotaryBackend(runtime.gpu_launcher)
DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
rotary_fwd = _backend.rotary_fwd
rotary_bwd = _backend.rotary_bwd
