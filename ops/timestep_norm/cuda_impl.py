"""CUDA backend of timestep_norm: the kernels are cuda/timestep_norm.cuh; this file is their whole
launch path (a GPU through the NVRTC runtime, or the CPU emulator: the same Launch records).

mean/var, the saved statistics, scale/bias/prior and the workspace are in the accumulation type:
float32, or float64 for float64 x.

Packed rows (``cu_seqlens``, int64 (n + 1,) document bounds the op has validated; x is one batch
element): the kernels read the bounds themselves, one scan block per (document, group), so a
packed call is the same launches as an unpacked one; the state in and out (prev_count, prev_mean,
prev_var, count, mean, var and their gradients) is per document.

Shift: the kernels take every statistic relative to a per-(row, group) shift K (as the torch and
Triton backends do; the header says how it is chosen): tsn_shift_kernel writes K per state row
and per step, the saved cummean is relative to it, and both are saved for the backward (they are
the op's gmu and K residuals, which the op's schema has whatever the backend: before, the forward
zero-filled those and the backward launched the shift kernel again).
"""
from __future__ import annotations

import torch

from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ...cuda.backend import Backend
from . import CudaSaved

MAX_CHUNKS = 128   # kTsnMaxChunks: threads (time chunks) of the scan kernels
ROW_THREADS = 256  # kTsnRowThreads: 8 warps = 8 rows per block in the row kernels
SLOTS = 64         # kTsnSlots: row slices of the dscale/dbias partial sums (8 x 8)
HEADER = "timestep_norm.cuh"


def _k(name: str, cpp: str) -> cuda_launch.Kernel:
    return cuda_launch.Kernel(HEADER, f"mk::{name}<{cpp}>")


#: element-typed kernels take x's type T, the scans and the reduction its accumulation type A
_ELEMENT = ("tsn_shift_kernel", "tsn_moments_kernel", "tsn_normalize_kernel", "tsn_row_grads_kernel", "tsn_dx_kernel",
            "tsn_param_partial_kernel")
_ACC = ("tsn_scan_fwd_kernel", "tsn_scan_bwd_kernel", "tsn_param_reduce_kernel")
_ACC_CPP = {torch.float32: "float", torch.float64: "double"}
KERNELS = ([_k(n, cpp) for n in _ELEMENT for cpp in cuda_launch.CPP_TYPES.values()]
           + [_k(n, cpp) for n in _ACC for cpp in _ACC_CPP.values()])


def _kernel(name: str, x: torch.Tensor) -> cuda_launch.Kernel:
    cpp = cuda_launch.CPP_TYPES[x.dtype] if name in _ELEMENT else _ACC_CPP[cuda_launch.acc_dtype(x)]
    return _k(name, cpp)


def _shape(x: torch.Tensor, G: int, cu_seqlens: torch.Tensor | None):
    """(B, L, D, n, threads): n state rows (batch elements, or documents), threads of the scan
    blocks (the chunk count of the longest row there can be; each block takes its row's own,
    tsn_chunks in the header)."""
    if x.dtype not in cuda_launch.CPP_TYPES:
        raise TypeError(f"the CUDA timestep_norm takes float32, bfloat16 or float64 x, got {x.dtype}")
    B, Lq, D = x.shape
    n = B if cu_seqlens is None else _documents(cu_seqlens, x)
    if D < 1 or G < 1 or D % G:
        raise ValueError(f"timestep_norm: num_groups must divide D >= 1, got D = {D}, num_groups = {G}")
    if Lq >= 2**31 or D >= 2**31 or n * G >= 2**31:
        raise ValueError("timestep_norm: L, D and (batch or documents) * num_groups must be < 2^31")
    chunks = 32  # a power of two in [32, 128], about 16 steps each for short sequences
    while chunks < MAX_CHUNKS and chunks * 16 < Lq:
        chunks *= 2
    return B, Lq, D, n, chunks


def _documents(cu_seqlens: torch.Tensor, x: torch.Tensor) -> int:
    """The number of documents; their bounds stay on the device (the op validated the values)."""
    if cu_seqlens.dtype != torch.int64:
        raise TypeError(f"timestep_norm: the CUDA kernels take int64 cu_seqlens, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"timestep_norm: cu_seqlens must be (n + 1,), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"timestep_norm: cu_seqlens must be on x's device {x.device}, got {cu_seqlens.device}")
    if not cu_seqlens.is_contiguous():
        raise ValueError("timestep_norm: the CUDA kernels take a contiguous cu_seqlens")
    if x.shape[0] != 1:
        raise ValueError(f"timestep_norm: packed rows (cu_seqlens) take x of batch size 1, got {x.shape[0]}")
    return cu_seqlens.shape[0] - 1


def workspace_elems(B: int, Lq: int, D: int, G: int) -> int:
    """Accumulation-type elements: 3 per row (fwd: the (mean, var) pairs, bwd: (gmu, ds, db)) plus
    the dscale/dbias partial sums."""
    return 3 * B * Lq * G + 2 * SLOTS * D


def _shift(launcher, x, mask, cu_seqlens, n, Lq, G):
    """(kshift (n, G), kstep (B, L, G)): the shift K of every state row and group, and K at every
    step (tsn_shift_kernel), in the accumulation type."""
    B, _, D = x.shape
    acc = cuda_launch.acc_dtype(x)
    kshift = torch.empty(n, G, dtype=acc, device=x.device)
    kstep = torch.empty(B, Lq, G, dtype=acc, device=x.device)
    if n * G > 0:
        p = cuda_launch.ptr
        cuda_launch.launch(launcher, _kernel("tsn_shift_kernel", x), _row_grid(n * G), ROW_THREADS, 0,
                 [("ptr", p(x)), ("ptr", p(mask)), ("ptr", p(cu_seqlens)), ("ptr", p(kshift)), ("ptr", p(kstep)),
                  ("i32", n * G), ("i32", Lq), ("i32", G), ("i32", D // G)], x.device)
    return kshift, kstep


def _row_grid(rows: int) -> int:
    return cuda_launch.grid_1d(-(-rows // 8))


def _elem_grid(n: int) -> int:
    return cuda_launch.grid_1d(-(-n // 256), 1 << 16)


def launch_fwd(launcher, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
               cu_seqlens=None):
    """(y, count, mean, var, saved) like the torch backend; count, mean and var per document with
    ``cu_seqlens``."""
    G = int(num_groups)
    B, Lq, D, n, chunks = _shape(x, G, cu_seqlens)
    if not eps > 0:
        raise ValueError(f"timestep_norm: eps must be > 0, got {eps}")
    dev, acc, A = x.device, cuda_launch.acc_dtype(x), cuda_launch.acc_tag(x)
    xc = x.contiguous()
    scale_f, bias_f = scale.to(acc).contiguous(), bias.to(acc).contiguous()
    pc = prev_count.to(torch.int64).contiguous()
    pm, pv = prev_mean.to(acc).contiguous(), prev_var.to(acc).contiguous()
    mask = padding_mask.to(torch.bool).contiguous()
    y = torch.empty(xc.shape, dtype=x.dtype, device=dev)
    count = torch.empty(n, dtype=torch.int64, device=dev)
    mean = torch.empty(n, G, dtype=acc, device=dev)
    var = torch.empty(n, G, dtype=acc, device=dev)
    cummean = torch.empty(B, Lq, G, dtype=acc, device=dev)
    cumrstd = torch.empty(B, Lq, G, dtype=acc, device=dev)
    ws = torch.empty(max(1, workspace_elems(B, Lq, D, G)), dtype=acc, device=dev)
    if n == 0:  # nothing to shift (no state row, so no step either)
        empty = torch.empty(0, G, dtype=acc, device=dev)
        return y, count, mean, var, CudaSaved(xc, scale_f, pc, pm, mask, cummean, cumrstd,
                                              torch.empty(B, Lq, G, dtype=acc, device=dev), empty)
    rows, total, Dg = B * Lq * G, B * Lq * D, D // G
    p = cuda_launch.ptr
    kshift, kstep = _shift(launcher, xc, mask, cu_seqlens, n, Lq, G)
    saved = CudaSaved(xc, scale_f, pc, pm, mask, cummean, cumrstd, kstep, kshift)
    if rows > 0:
        cuda_launch.launch(launcher, _kernel("tsn_moments_kernel", x), _row_grid(rows), ROW_THREADS, 0,
                 [("ptr", p(xc)), ("ptr", p(mask)), ("ptr", p(kstep)), ("ptr", p(ws)), ("i64", rows), ("i32", G),
                  ("i32", Dg)], dev)
    cuda_launch.launch(launcher, _kernel("tsn_scan_fwd_kernel", x), n * G, chunks, 0,
             [("ptr", p(ws)), ("ptr", p(mask)), ("ptr", p(cu_seqlens)), ("ptr", p(kshift)), ("ptr", p(pc)),
              ("ptr", p(pm)), ("ptr", p(pv)),
              ("ptr", p(cummean)), ("ptr", p(cumrstd)), ("ptr", p(count)), ("ptr", p(mean)), ("ptr", p(var)),
              ("i32", Lq), ("i32", G), (A, float(eps))], dev)
    if total > 0:
        cuda_launch.launch(launcher, _kernel("tsn_normalize_kernel", x), _elem_grid(total), 256, 0,
                 [("ptr", p(xc)), ("ptr", p(mask)), ("ptr", p(kstep)), ("ptr", p(cummean)), ("ptr", p(cumrstd)),
                  ("ptr", p(scale_f)), ("ptr", p(bias_f)), ("ptr", p(y)), ("i64", total), ("i32", D), ("i32", Dg)], dev)
    return y, count, mean, var, saved


def launch_bwd(launcher, dy, dmean, dvar, saved, num_groups, cu_seqlens=None):
    """(dx (x's dtype), dscale, dbias, dprev_mean, dprev_var) (accumulation type); dprev_* per
    document with ``cu_seqlens`` (the forward's)."""
    xc, scale_f, pc, pm, mask, cummean, cumrstd, kstep, kshift = saved
    G = int(num_groups)
    B, Lq, D, n, chunks = _shape(xc, G, cu_seqlens)
    dev, acc = xc.device, cummean.dtype
    dyc = (torch.zeros_like(xc) if dy is None else dy.to(xc.dtype)).contiguous()
    dm = torch.zeros(n, G, dtype=acc, device=dev) if dmean is None else dmean.to(acc).contiguous()
    dv = torch.zeros(n, G, dtype=acc, device=dev) if dvar is None else dvar.to(acc).contiguous()
    dx = torch.empty(xc.shape, dtype=xc.dtype, device=dev)
    dscale = torch.empty(D, dtype=acc, device=dev)
    dbias = torch.empty(D, dtype=acc, device=dev)
    dpm = torch.empty(n, G, dtype=acc, device=dev)
    dpv = torch.empty(n, G, dtype=acc, device=dev)
    ws = torch.empty(max(1, workspace_elems(B, Lq, D, G)), dtype=acc, device=dev)
    rows, total, Dg = B * Lq * G, B * Lq * D, D // G
    part = ws[3 * rows:]  # the dscale/dbias partial sums follow the per-row gradients
    p = cuda_launch.ptr
    if n > 0:
        if rows > 0:
            cuda_launch.launch(launcher, _kernel("tsn_row_grads_kernel", xc), _row_grid(rows), ROW_THREADS, 0,
                     [("ptr", p(xc)), ("ptr", p(dyc)), ("ptr", p(mask)), ("ptr", p(kstep)), ("ptr", p(scale_f)),
                      ("ptr", p(cummean)), ("ptr", p(ws)), ("i64", rows), ("i32", G), ("i32", Dg)], dev)
        cuda_launch.launch(launcher, _kernel("tsn_scan_bwd_kernel", xc), n * G, chunks, 0,
                 [("ptr", p(ws)), ("ptr", p(mask)), ("ptr", p(cu_seqlens)), ("ptr", p(kshift)), ("ptr", p(pc)),
                  ("ptr", p(pm)),
                  ("ptr", p(cummean)), ("ptr", p(cumrstd)), ("ptr", p(dm)), ("ptr", p(dv)), ("ptr", p(dpm)),
                  ("ptr", p(dpv)), ("i32", Lq), ("i32", G)], dev)
        if total > 0:
            cuda_launch.launch(launcher, _kernel("tsn_dx_kernel", xc), _elem_grid(total), 256, 0,
                     [("ptr", p(xc)), ("ptr", p(dyc)), ("ptr", p(mask)), ("ptr", p(kstep)), ("ptr", p(cumrstd)),
                      ("ptr", p(ws)), ("ptr", p(scale_f)), ("ptr", p(dx)), ("i64", total), ("i32", D), ("i32", Dg)],
                     dev)
    cuda_launch.launch(launcher, _kernel("tsn_param_partial_kernel", xc), (-(-D // 32), SLOTS // 8), (32, 8), 0,
             [("ptr", p(xc)), ("ptr", p(dyc)), ("ptr", p(mask)), ("ptr", p(kstep)), ("ptr", p(cummean)),
              ("ptr", p(cumrstd)), ("ptr", p(part)), ("i64", B * Lq), ("i32", D), ("i32", Dg)], dev)
    cuda_launch.launch(launcher, _kernel("tsn_param_reduce_kernel", xc), _elem_grid(D), 256, 0,
             [("ptr", p(part)), ("ptr", p(dscale)), ("ptr", p(dbias)), ("i32", D), ("i32", SLOTS)], dev)
    return dx, dscale, dbias, dpm, dpv


class TimestepNormBackend(Backend):
    FP64 = True  # double x: Welford/Kahan state, statistics and side inputs in double

    def not_supported_reasons(self, x, num_groups=None, **_other_inputs) -> list[str]:
        reasons = self._reasons({"x": x}, "x")
        if x.dim() == 3 and x.shape[1] >= 2**31:
            reasons.append("L must be < 2^31")
        return reasons

    def forward(self, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
                cu_seqlens=None):
        return launch_fwd(self.ext, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask,
                          num_groups, eps, cu_seqlens)

    def backward(self, dy, dmean, dvar, saved, num_groups, cu_seqlens=None):
        return launch_bwd(self.ext, dy, dmean, dvar, saved, num_groups, cu_seqlens)


# The backend module's names over the GPU launcher (tests build TimestepNormBackend over the emulator).
_GPU = TimestepNormBackend(runtime.gpu_launcher)
CONFIG_SPACE: dict = TimestepNormBackend.CONFIG_SPACE
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(*args, **inputs) -> list[str]:
    return _GPU.not_supported_reasons(*args, **inputs)


def forward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, cu_seqlens=None):
    return _GPU.forward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, cu_seqlens)


def backward(dy, dmean, dvar, saved, num_groups, cu_seqlens=None):
    return _GPU.backward(dy, dmean, dvar, saved, num_groups, cu_seqlens)
