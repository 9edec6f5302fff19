"""CUDA backend of dropkey_softmax: the kernels are cuda/dropkey_softmax.cuh (fused bottom-right
causal mask + the package's DropKey rule + softmax over score rows, and its backward); this file
is their whole launch path. The attention op's matmul path launches them through the same
functions (ops/attention/cuda_impl.py).

The launch description below runs on a GPU through the NVRTC runtime (cuda/runtime.py) and in
the CPU emulator (tests), both from the same :class:`~megalodon_kernels.cuda.launch.Launch` records.
"""
from __future__ import annotations

import math

import torch

from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ...cuda.backend import Backend
from ..dropkey_rule import seed_key, threshold

ITEMS = 8          # kSoftmaxItems: scores per thread held in registers (tests/test_attention_layouts.py)
MAX_THREADS = 512  # kSoftmaxMaxThreads: the kernels' __launch_bounds__
#: (scores dtype, "fwd" | "bwd") -> instantiation
KERNELS_BY_KEY = {(dtype, d): cuda_launch.Kernel("dropkey_softmax.cuh", f"mk::dropkey_softmax_{d}_kernel<{cpp}, {ITEMS}>")
                  for d in ("fwd", "bwd") for dtype, cpp in cuda_launch.CPP_TYPES.items()}
KERNELS = list(KERNELS_BY_KEY.values())


def threads(S: int) -> int:
    """Threads per row: a power of two >= 32 giving each thread at most ITEMS scores, up to MAX_THREADS."""
    per, nt = -(-S // ITEMS), 32
    while nt < per and nt < MAX_THREADS:
        nt *= 2
    return nt


def _rows(shape) -> tuple[int, int, int, int]:
    """(flat batch, heads, L, S) of scores (..., [H,] L, S); the kernels see (Bf, Hf, L, S)."""
    Lq, S = shape[-2:]
    H = shape[-3] if len(shape) >= 3 else 1
    Bf = math.prod(shape[:-3])
    if Lq >= 2**31 or S >= 2**31 or H >= 2**31:
        raise ValueError(f"dropkey_softmax: L, S and H must be < 2**31, got shape {tuple(shape)}")
    if Bf > 0xFFFFFFFF:
        raise ValueError(f"dropkey_softmax: the flat batch size must fit 32 bits (DropKey rule), got {Bf}")
    return Bf, H, Lq, S


def _check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in cuda_launch.CPP_TYPES:
        raise TypeError(f"the CUDA dropkey_softmax kernels take float32, bfloat16 or float64 {name}, got {t.dtype}")


def _per_flat_batch(t: torch.Tensor | None, name: str, Bf: int, device) -> torch.Tensor | None:
    """``t`` (Bf,) as the int64 array the kernel reads (None stays None: the kernel's default)."""
    if t is None:
        return None
    if tuple(t.shape) != (Bf,):
        raise ValueError(f"{name} must have shape ({Bf},), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()


def softmax_fwd(launcher, scores: torch.Tensor, *, causal: bool, dropkey_p: float, seed: int,
                        batch_index: torch.Tensor | None = None,
                        index_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities in scores' dtype (float64 scores: exp and sums in double).

    ``batch_index`` (Bf,) integer or None: the batch index the DropKey rule hashes for each flat
    batch (None: the flat batch index itself; packed attention passes each row's document).
    ``index_offset`` (Bf,) integer or None: added to the row and column indices the rule hashes
    for each flat batch (None: 0; chunks of an attention run as batch rows pass their start)."""
    _check_dtype(scores, "scores")
    if not 0.0 <= dropkey_p < 1.0:
        raise ValueError(f"dropkey_softmax: dropkey_p must be in [0, 1), got {dropkey_p}")
    x = scores.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    Bf, H, Lq, S = _rows(x.shape)
    bidx = _per_flat_batch(batch_index, "batch_index", Bf, x.device)
    offs = _per_flat_batch(index_offset, "index_offset", Bf, x.device)
    rows = Bf * H * Lq
    if rows == 0 or S == 0:
        return y
    cuda_launch.launch(launcher, KERNELS_BY_KEY[(x.dtype, "fwd")], cuda_launch.grid_1d(rows), threads(S), 0,
             [("ptr", cuda_launch.ptr(x)), ("ptr", cuda_launch.ptr(y)), ("i64", rows), ("i32", H), ("i32", Lq), ("i32", S),
              ("bool", bool(causal)), ("u32", seed_key(int(seed))), ("u32", threshold(float(dropkey_p))),
              ("ptr", cuda_launch.ptr(bidx)), ("ptr", cuda_launch.ptr(offs))], x.device)
    return y


def softmax_bwd(launcher, dy: torch.Tensor, y: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """dscores = y (dy - rowsum(y dy)) from the saved output alone (dropped and masked entries have y = 0)."""
    _check_dtype(y, "y")
    yc, dyc = y.contiguous(), dy.to(y.dtype).contiguous()
    dx = torch.empty(yc.shape, dtype=y.dtype, device=y.device)
    Bf, H, Lq, S = _rows(yc.shape)
    rows = Bf * H * Lq
    if rows == 0 or S == 0:
        return dx
    cuda_launch.launch(launcher, KERNELS_BY_KEY[(y.dtype, "bwd")], cuda_launch.grid_1d(rows), threads(S), 0,
             [("ptr", cuda_launch.ptr(yc)), ("ptr", cuda_launch.ptr(dyc)), ("ptr", cuda_launch.ptr(dx)), ("i64", rows), ("i32", Lq), ("i32", S),
              ("bool", bool(causal))], y.device)
    return dx


CONFIG_SPACE: dict = {}  # no knob: the launch is planned from the row length
DEFAULT_CONFIG: dict = {}


class DropKeySoftmaxBackend(Backend):
    FP64 = True  # double scores: exp and sums in double, the same DropKey decisions

    def not_supported_reasons(self, scores, **_other_inputs) -> list[str]:
        return self._reasons({"scores": scores}, "scores")

    def forward(self, scores, *, causal, dropkey_p, seed):
        return softmax_fwd(self.ext, scores, causal=causal, dropkey_p=dropkey_p, seed=seed)

    def backward(self, dy, y, *, causal, dropkey_p=0.0, seed=0):
        # the saved output alone: dropped and masked entries have y = 0 (no mask replay)
        return softmax_bwd(self.ext, dy, y, causal=causal)


# The backend module's names over the GPU launcher (tests build DropKeySoftmaxBackend over the emulator).
_GPU = DropKeySoftmaxBackend(runtime.gpu_launcher)


def not_supported_reasons(scores, **other_inputs) -> list[str]:
    return _GPU.not_supported_reasons(scores, **other_inputs)


def forward(scores, *, causal, dropkey_p, seed):
    return _GPU.forward(scores, causal=causal, dropkey_p=dropkey_p, seed=seed)


def backward(dy, y, *, causal, dropkey_p=0.0, seed=0):
    return _GPU.backward(dy, y, causal=causal, dropkey_p=dropkey_p, seed=seed)
