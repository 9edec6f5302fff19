"""CUDA backend of rotary: the kernel is cuda/rotary.cuh; this file is its whole launch path.

The launch description below runs on a GPU through the NVRTC runtime (cuda/runtime.py: compiled
on first use, launched on torch's current stream) and in the CPU emulator (tests), both from the
same :class:`~megalodon_kernels.cuda.launch.Launch` records.
"""
from __future__ import annotations

from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ...cuda.backend import Backend

THREADS = 256  # rotary_kernel's __launch_bounds__
#: (x dtype, conjugate) -> instantiation; conjugate = True is the backward (transposed rotation)
KERNELS_BY_KEY = {(dtype, conj): cuda_launch.Kernel("rotary.cuh", f"mk::rotary_kernel<{cpp}, {'true' if conj else 'false'}>")
                  for dtype, cpp in cuda_launch.CPP_TYPES.items() for conj in (False, True)}
KERNELS = list(KERNELS_BY_KEY.values())


def rotary(launcher, x, cos, sin, conjugate: bool):
    """y = x rotated by the (P, L, 1, d/2) tables (P = 1 or B); conjugate: the transpose."""
    if x.dtype not in cuda_launch.CPP_TYPES:
        raise TypeError(f"the CUDA rotary kernel takes float32, bfloat16 or float64 x, got {x.dtype}")
    B, Lq, H, d = x.shape
    half = d // 2
    P = cos.shape[0]
    if P not in (1, B):
        raise ValueError(f"rotary: the tables must have 1 or B = {B} rows, got {P}")
    acc = cuda_launch.acc_dtype(x)  # the tables in the kernel's arithmetic type
    c = cos.to(acc).contiguous()
    s = sin.to(acc).contiguous()
    xc = x.contiguous()
    y = xc.new_empty(xc.shape)
    pairs = B * Lq * H * half
    if pairs == 0:
        return y
    cuda_launch.launch(launcher, KERNELS_BY_KEY[(x.dtype, conjugate)], cuda_launch.grid_1d(-(-pairs // THREADS), 65535), THREADS, 0,
             [("ptr", cuda_launch.ptr(xc)), ("ptr", cuda_launch.ptr(c)), ("ptr", cuda_launch.ptr(s)), ("ptr", cuda_launch.ptr(y)), ("i64", pairs),
              ("i64", Lq), ("i64", H), ("i64", half), ("bool", P == B and B > 1)], x.device)
    return y


CONFIG_SPACE: dict = {}  # no knob: one thread per pair
DEFAULT_CONFIG: dict = {}


class RotaryBackend(Backend):
    FP64 = True  # double x with double tables

    def not_supported_reasons(self, x, **_other_inputs) -> list[str]:
        return self._reasons({"x": x}, "x")

    def forward(self, x, cos, sin):
        return rotary(self.ext, x, cos, sin, False)

    def backward(self, dy, cos, sin):
        return rotary(self.ext, dy, cos, sin, True)


# The backend module's names over the GPU launcher (tests build RotaryBackend over the emulator).
_GPU = RotaryBackend(runtime.gpu_launcher)


def not_supported_reasons(x, **other_inputs) -> list[str]:
    return _GPU.not_supported_reasons(x, **other_inputs)


def forward(x, cos, sin):
    return _GPU.forward(x, cos, sin)


def backward(dy, cos, sin):
    return _GPU.backward(dy, cos, sin)
