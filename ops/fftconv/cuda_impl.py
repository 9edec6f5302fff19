"""CUDA backend of fftconv: the kernels are cuda/fftconv.cuh (one block per row: L <= 16384, or
8192 in float64) and cuda/fftconv_long.cuh (the multi-pass four-step FFT through a global workspace,
up to L = 2^27, or 2^25 in float64); this file is their whole launch path, run by the GPU runtime
(NVRTC) or the CPU emulator from the same records.

Those limits are for a device with at least 128 KiB of shared memory per block (sm_80, 90, 100).
With less (sm_75: 64 KiB, sm_86/89/120: 99 KiB) one block per row takes half the length (one
block holds N complex values), the multi-pass plan splits N with a smaller row factor and ends at
2^25 (2^23 in float64): :func:`config` of the device's capabilities (cuda/device.py) decides, the
launches and ``not_supported_reasons`` follow it.

x float32 / bfloat16 computes in float32 (complex64 spectra), float64 in double (complex128); k is
converted to that arithmetic type. Above the one-block limit the spectra's bins are in the
multi-pass layout, which only these kernels read.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch

from ...cuda import device as _device
from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ...cuda.backend import Backend
from .._library import plain_eager

MIN_LOG2 = 5  # kFftMinLog2: the warp stages need N >= 32
MAX_THREADS = 1024


class FftCfg:
    """cuda/fftconv.cuh FftCfg<R> for the arithmetic type R (float or double)."""

    def __init__(self, cpp, complex_bytes, max_log2, multi_max_log2, row_max_log2, col_elems):
        self.cpp, self.complex_bytes = cpp, complex_bytes
        self.max_log2, self.multi_max_log2 = max_log2, multi_max_log2  # one block / multi-pass limits
        self.row_max_log2, self.col_elems = row_max_log2, col_elems


CFG = {torch.float32: FftCfg("float", 8, 14, 27, 13, 8192), torch.float64: FftCfg("double", 16, 13, 25, 12, 4096)}
ONE_BLOCK_MAX_LEN = 1 << CFG[torch.float32].max_log2
MAX_LEN = 1 << CFG[torch.float32].multi_max_log2
FP64_ONE_BLOCK_MAX_LEN = 1 << CFG[torch.float64].max_log2
FP64_MAX_LEN = 1 << CFG[torch.float64].multi_max_log2


class Fft4Plan(ctypes.Structure):
    """cuda/fftconv_long.cuh Fft4Plan (passed by value): N = 2^log2n = N1 N2, C columns per block."""

    _fields_ = [("log2n", ctypes.c_int), ("log2n1", ctypes.c_int), ("log2n2", ctypes.c_int), ("log2c", ctypes.c_int)]


def _k(header: str, name: str) -> cuda_launch.Kernel:
    return cuda_launch.Kernel(header, f"mk::{name}")


_ONE, _LONG = "fftconv.cuh", "fftconv_long.cuh"
_R = {torch.float32: "float", torch.float64: "double"}
KERNELS = ([_k(_ONE, f"fftconv_spectrum_kernel<{r}>") for r in _R.values()]
           + [_k(_ONE, f"fftconv_{n}_kernel<{t}>") for n in ("fwd", "bwd_dx") for t in cuda_launch.CPP_TYPES.values()]
           + [_k(_ONE, f"fftconv_bwd_dk_kernel<{r}>") for r in _R.values()]
           + [_k(_LONG, f"fft4_col_{p}_kernel<{t}, {f}>") for p in ("fwd", "inv") for t in cuda_launch.CPP_TYPES.values()
              for f in ("false", "true")]
           + [_k(_LONG, f"fft4_row_{p}_kernel<{r}>") for p in ("spectrum", "conv", "dk") for r in _R.values()]
           + [_k(_LONG, f"fft4_twiddle_probe_kernel<{r}>") for r in _R.values()])


# --- the twiddle table of the one-block kernels (fftconv.cuh, tw_at) ----------------------------------

def _twiddle_values(max_log2: int) -> torch.Tensor:
    """complex64 e^{-i pi r / m} for m = 2^5 .. 2^max_log2, r < m, span after span: computed in float64
    on the host (r / m exact, one multiply by pi) and rounded once."""
    parts = []
    for s in range(MIN_LOG2, max_log2 + 1):
        m = 1 << s
        angle = torch.arange(m, dtype=torch.float64) * (-math.pi / m)
        parts.append(torch.polar(torch.ones_like(angle), angle))
    return torch.cat(parts).to(torch.complex64)


@functools.lru_cache(maxsize=16)
def _twiddles_cached(device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even when first made under inference_mode
        return _twiddle_values(CFG[torch.float32].max_log2).to(device)


def twiddles(real: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The table for float arithmetic on ``device`` (None for double: its kernels keep sincospi,
    whose ~1 ulp a float64 table built through pi's rounding would not improve).

    Built on the host and copied over once: in plain eager mode it is kept per device, so a call
    inside CUDA-graph capture (which refuses the copy) finds it made by its eager warm-up call;
    traced or faked calls build it anew (a cached tensor must never be a fake or traced one)."""
    if real != torch.float32:
        return None
    if plain_eager(profiler_ok=True):
        return _twiddles_cached(torch.device(device))
    return _twiddle_values(CFG[torch.float32].max_log2).to(device)


# --- sizes (fftconv.cuh, fftconv_long.cuh) ----------------------------------------------------------

def real_of(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic type: float64 for float64 x, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Shared memory the kernels' sizes were chosen for (FftCfg<R>: 128 KiB per block at most); the
#: functions below plan for this when they are given no device (caps=None).
DESIGN_SMEM = 128 * 1024


def _fit_log2(caps, real: torch.dtype) -> int:
    """Largest k with a 2^k-point complex buffer of the arithmetic type within the device's
    opt-in shared memory per block (the kernels have no static shared memory)."""
    smem = DESIGN_SMEM if caps is None else caps.smem_per_block_optin
    return (smem // CFG[real].complex_bytes).bit_length() - 1


def limits(caps, real: torch.dtype) -> tuple[int, int, int]:
    """(one-block max log2 N, multi-pass row-pass max log2 N2, column-pass max log2 (N1 C)) on a
    device with ``caps`` (cuda/device.py DeviceCaps; None: the 128 KiB the kernels were sized for).
    One block holds N complex values, a row pass 2 N2, a column pass N1 C."""
    cfg, fit = CFG[real], _fit_log2(caps, real)
    return min(cfg.max_log2, fit), min(cfg.row_max_log2, fit - 1), fit


def max_log2(real: torch.dtype, caps=None) -> int:
    """Largest log2 N the kernels run on this device: the multi-pass limit, lowered where the row and
    column passes of the largest N would not fit its shared memory (N1 above the column limit)."""
    one, row, col = limits(caps, real)
    return max(one, min(CFG[real].multi_max_log2, row + col))


def max_len(dtype: torch.dtype, caps=None) -> int:
    """Longest L the CUDA fftconv takes for x of this dtype: 2^27 (2^25 in float64) on a device with
    128 KiB of shared memory per block or more, 2^25 (2^23) on one with 64-127 KiB (sm_75/86/89/120)."""
    return 1 << max_log2(real_of(dtype), caps)


def one_block_max_len(dtype: torch.dtype, caps=None) -> int:
    """Longest L one block per row takes on this device (16384 / 8192 in float64 with 128 KiB of
    shared memory, half that with 64-127 KiB); longer rows run the multi-pass FFT."""
    return 1 << limits(caps, real_of(dtype))[0]


def fft_size(L_: int) -> int:
    """Complex points N (real FFT length 2N): max(32, nextpow2(L))."""
    return max(1 << MIN_LOG2, 1 << max(0, (int(L_) - 1).bit_length()))


#: Butterflies each thread owns per FFT stage: the block of an N-point transform has N / (2 x this)
#: threads (at least a warp, at most 1024). With one butterfly per thread (N / 2 threads) every
#: transform of N >= 2048 points filled an SM with one 1024-thread block (42 registers per thread),
#: so each of its ~20 barriers idled the whole SM; with 8, an SM holds several rows' blocks
#: (N = 4096: 256 threads, 32 KiB; five blocks by registers) and one block's barrier leaves the others
#: issuing. A tuning knob (1 reproduces the former launch): the GPU run times both.
BUTTERFLIES_PER_THREAD = (8, 1)


#: Small transforms keep blocks of at least this many threads (up to N / 2): an SM holds at most
#: 32 blocks, so smaller ones would leave it below its 2048 resident threads.
MIN_BLOCK_THREADS = 128


def fft_threads(log2n: int, butterflies: int = 1) -> int:
    """Threads of the block of a 2^log2n-point transform with ``butterflies`` butterflies per thread
    and stage (the kernels stride over any multiple of 32 threads)."""
    half = 1 << (log2n - 1)
    return max(32, min(max(half // butterflies, min(half, MIN_BLOCK_THREADS)), MAX_THREADS))


def fft_smem_bytes(real: torch.dtype, log2n: int) -> int:
    return CFG[real].complex_bytes << log2n


def _where(real: torch.dtype, caps) -> str:
    dev = "" if caps is None else f" on {caps.name} ({caps.sm}, {caps.smem_per_block_optin} B of shared memory per block)"
    return (" in float64" if real == torch.float64 else "") + dev


def log2n_of(L_: int, real: torch.dtype, caps=None) -> int:
    if L_ < 1:
        raise ValueError(f"fftconv: L must be >= 1, got {L_}")
    limit = max_len(real, caps)
    if L_ > limit:
        raise ValueError(f"fftconv: the CUDA kernels handle L <= {limit}{_where(real, caps)} (got L = {L_}); "
                         f"use backend='torch'")
    return fft_size(L_).bit_length() - 1


def multi_pass(log2n: int, real: torch.dtype, caps=None) -> bool:
    """Whether N = 2^log2n runs the multi-pass FFT (above the device's one-block limit)."""
    return log2n > limits(caps, real)[0]


def workspace_row_floats(L_: int, real: torch.dtype, caps=None) -> int:
    """One multi-pass workspace row (N complex values of the arithmetic type) in 4-byte floats;
    0 up to the one-block limit (no workspace)."""
    N = fft_size(L_)
    return (4 if real == torch.float64 else 2) * N if multi_pass(N.bit_length() - 1, real, caps) else 0


def plan(log2n: int, real: torch.dtype, caps=None) -> Fft4Plan:
    """The four-step split N = N1 N2 and columns per block C on this device: N2 as large as the
    row pass allows (at most half of log2 N, rounded up), C columns while N1 C stays within the
    column pass's budget (k4ColElems) and the device's shared memory."""
    cfg = CFG[real]
    _, row, col = limits(caps, real)
    n2 = min(row, (log2n + 1) // 2)
    n1 = log2n - n2
    return Fft4Plan(log2n, n1, n2, max(0, min(4, cfg.col_elems.bit_length() - 1 - n1, col - n1)))


def one_block_max_smem_bytes() -> int:
    return max(fft_smem_bytes(r, CFG[r].max_log2) for r in CFG)


def multi_pass_max_smem_bytes(rows: bool, caps=None) -> int:
    """Worst case over every multi-pass length of the row (or column) passes' dynamic smem."""
    worst = 0
    for r in CFG:
        for log2n in range(limits(caps, r)[0] + 1, max_log2(r, caps) + 1):
            p = plan(log2n, r, caps)
            worst = max(worst, fft_smem_bytes(r, p.log2n2 + 1 if rows else p.log2n1 + p.log2c))
    return worst


class FftConfig:
    """What the CUDA fftconv launches for one (device, L, dtype): the path, N, the four-step plan
    (multi-pass only), threads and dynamic shared memory of each kernel kind. A pure function of
    its inputs (:func:`config`), which the launch path and the device-profile tests both call."""

    def __init__(self, caps, L_: int, dtype: torch.dtype, butterflies: int = BUTTERFLIES_PER_THREAD[0]):
        self.real = real_of(dtype)
        self.log2n = log2n_of(L_, self.real, caps)
        self.path = "multi_pass" if multi_pass(self.log2n, self.real, caps) else "one_block"
        if self.path == "one_block":
            self.plan = None
            self.launches = {"one_block": (fft_threads(self.log2n, butterflies), fft_smem_bytes(self.real, self.log2n))}
        else:
            p = self.plan = plan(self.log2n, self.real, caps)
            if min(p.log2n1, p.log2n2) < MIN_LOG2:
                raise ValueError(f"fftconv: L = {L_} needs a multi-pass FFT with both factors >= 32 points, which "
                                 f"does not fit{_where(self.real, caps)}; use backend='torch'")
            self.launches = {"col": (fft_threads(p.log2n1 + p.log2c, butterflies),
                                     fft_smem_bytes(self.real, p.log2n1 + p.log2c)),
                             "row": (fft_threads(p.log2n2 + 1, butterflies), fft_smem_bytes(self.real, p.log2n2 + 1))}

    @property
    def smem(self) -> int:
        """The largest dynamic shared memory of its launches."""
        return max(s for _, s in self.launches.values())

    def summary(self) -> tuple:
        p = self.plan
        split = () if p is None else (p.log2n1, p.log2n2, p.log2c)
        return (self.path, self.log2n, split, self.smem)


def config(caps, L_: int, dtype: torch.dtype) -> FftConfig:
    """The configuration for x of length L and this dtype on a device with ``caps``; ValueError
    (the reason) when no configuration fits."""
    return FftConfig(caps, L_, dtype)


def config_reason(caps, L_: int, dtype: torch.dtype) -> str | None:
    try:
        config(caps, L_, dtype)
    except ValueError as exc:
        return str(exc)
    return None


def _caps(device):
    """The capabilities the launches plan for: the tensors' GPU, or the emulator's profile."""
    return _device.launch_caps(device)


def _workspace(L_: int, rows: int, max_workspace_bytes: int, real: torch.dtype, device):
    """(ws, ws_rows): at most max_workspace_bytes of rows (at least one); (None, 0) without multi-pass."""
    row_floats = workspace_row_floats(L_, real, _caps(device))
    if row_floats == 0 or rows == 0:
        return None, 0
    ws_rows = max(1, min(rows, max_workspace_bytes // (4 * row_floats)))
    return torch.empty(ws_rows, row_floats, dtype=torch.float32, device=device), ws_rows


# --- the multi-pass passes ---------------------------------------------------------------------------

class _Passes:
    """Launches of the four-step passes for one length and arithmetic type."""

    def __init__(self, launcher, log2n: int, real: torch.dtype, device, butterflies: int):
        self.launcher, self.real, self.device = launcher, real, device
        self.p = plan(log2n, real, _caps(device))
        self.col_groups = 1 << (self.p.log2n2 - self.p.log2c)
        self.row_blocks = (1 << (self.p.log2n1 - 1)) + 1
        self.col_threads = fft_threads(self.p.log2n1 + self.p.log2c, butterflies)
        self.row_threads = fft_threads(self.p.log2n2 + 1, butterflies)
        self.col_smem = fft_smem_bytes(real, self.p.log2n1 + self.p.log2c)
        self.row_smem = fft_smem_bytes(real, self.p.log2n2 + 1)
        self.bins = (1 << log2n) + 1
        self.cbytes = CFG[real].complex_bytes

    def _go(self, kernel, grid, threads, smem, args):
        cuda_launch.launch(self.launcher, _k(_LONG, kernel), grid, threads, smem, [*args, cuda_launch.struct_arg(self.p)], self.device)

    def col_fwd(self, cpp, flip, src, ws, rows, L_):
        self._go(f"fft4_col_fwd_kernel<{cpp}, {'true' if flip else 'false'}>", (rows, self.col_groups),
                 self.col_threads, self.col_smem, [("ptr", src), ("ptr", ws), ("i32", L_)])

    def col_inv(self, cpp, flip, ws, dst, rows, L_):
        self._go(f"fft4_col_inv_kernel<{cpp}, {'true' if flip else 'false'}>", (rows, self.col_groups),
                 self.col_threads, self.col_smem, [("ptr", ws), ("ptr", dst), ("i32", L_)])

    def row_spectrum(self, ws, spec, rows):
        self._go(f"fft4_row_spectrum_kernel<{_R[self.real]}>", (rows, self.row_blocks), self.row_threads,
                 self.row_smem, [("ptr", ws), ("ptr", spec)])

    def row_conv(self, ws, kf, prod, D, row0, rows, out):
        self._go(f"fft4_row_conv_kernel<{_R[self.real]}>", (rows, self.row_blocks), self.row_threads, self.row_smem,
                 [("ptr", ws), ("ptr", kf), ("ptr", prod), ("i32", D), ("i64", row0), ("bool", out)])

    def row_dk(self, prod, acc, ws, nb, D, d0, rows, accumulate, finalize):
        self._go(f"fft4_row_dk_kernel<{_R[self.real]}>", (rows, self.row_blocks), self.row_threads,
                 self.row_smem if finalize else 0,
                 [("ptr", prod), ("ptr", acc), ("ptr", ws), ("i32", nb), ("i32", D), ("i64", d0),
                  ("bool", accumulate), ("bool", finalize)])


def _check_ws(ws, ws_rows):
    if ws is None or ws_rows < 1:
        raise ValueError("fftconv: L above the one-block limit needs a workspace of at least one row "
                         "(N complex values)")


# --- launch descriptions ------------------------------------------------------------------------------

def spectrum(launcher, k, max_workspace_bytes: int = 256 << 20, like: torch.Tensor | None = None,
             butterflies: int = BUTTERFLIES_PER_THREAD[0]):
    """rfft of each kernel row, zero-padded to 2N: (D, N + 1) complex64, or complex128 when ``like``
    (x) is float64 (multi-pass layout of the bins above the one-block limit)."""
    D, L_ = k.shape
    real = real_of((k if like is None else like).dtype)
    caps = _caps(k.device)
    log2n = log2n_of(L_, real, caps)
    N = 1 << log2n
    kc = k.to(real).contiguous()
    kf = torch.empty(D, N + 1, dtype=torch.complex128 if real == torch.float64 else torch.complex64, device=k.device)
    if D == 0:
        return kf
    if D >= 2**31:
        raise ValueError("fftconv: D must be < 2^31")
    if not multi_pass(log2n, real, caps):
        cuda_launch.launch(launcher, _k(_ONE, f"fftconv_spectrum_kernel<{_R[real]}>"), D, fft_threads(log2n, butterflies),
                 fft_smem_bytes(real, log2n), [("ptr", cuda_launch.ptr(kc)), ("ptr", cuda_launch.ptr(kf)), ("i32", L_), ("i32", log2n),
                                               ("ptr", cuda_launch.ptr(twiddles(real, k.device)))], k.device)
        return kf
    ws, ws_rows = _workspace(L_, D, max_workspace_bytes, real, k.device)
    _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, k.device, butterflies)
    for d0 in range(0, D, ws_rows):
        rows = min(ws_rows, D - d0)
        passes.col_fwd(_R[real], False, cuda_launch.ptr(kc) + d0 * L_ * kc.element_size(), cuda_launch.ptr(ws), rows, L_)
        passes.row_spectrum(cuda_launch.ptr(ws), cuda_launch.ptr(kf) + d0 * passes.bins * passes.cbytes, rows)
    return kf


def _x_checks(x, name="x"):
    if x.dtype not in cuda_launch.CPP_TYPES:
        raise TypeError(f"the CUDA kernels take float32, bfloat16 or float64 {name}, got {x.dtype}")
    B, D, _ = x.shape
    if B * D >= 2**31:
        raise ValueError("fftconv: need B * D < 2^31")


def launch_fwd(launcher, x, k, max_workspace_bytes: int = 256 << 20, butterflies: int = BUTTERFLIES_PER_THREAD[0]):
    """y (x's dtype), computed in float32 (float64 for float64 x). Above the one-block limit a
    workspace of at most ``max_workspace_bytes`` (at least one row) is walked in row chunks."""
    _x_checks(x)
    B, D, L_ = x.shape
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    real = real_of(x.dtype)
    caps = _caps(x.device)
    log2n = log2n_of(L_, real, caps)
    xc = x.contiguous()
    kf = spectrum(launcher, k, max_workspace_bytes, like=x, butterflies=butterflies)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    cpp = cuda_launch.CPP_TYPES[x.dtype]
    if not multi_pass(log2n, real, caps):
        cuda_launch.launch(launcher, _k(_ONE, f"fftconv_fwd_kernel<{cpp}>"), B * D, fft_threads(log2n, butterflies),
                 fft_smem_bytes(real, log2n), [("ptr", cuda_launch.ptr(xc)), ("ptr", cuda_launch.ptr(kf)), ("ptr", cuda_launch.ptr(y)), ("i32", D),
                                               ("i32", L_), ("i32", log2n), ("ptr", cuda_launch.ptr(twiddles(real, x.device)))],
                 x.device)
        return y
    ws, ws_rows = _workspace(L_, B * D, max_workspace_bytes, real, x.device)
    _check_ws(ws, ws_rows)
    passes, es = _Passes(launcher, log2n, real, x.device, butterflies), xc.element_size()
    for r0 in range(0, B * D, ws_rows):
        rows = min(ws_rows, B * D - r0)
        passes.col_fwd(cpp, False, cuda_launch.ptr(xc) + r0 * L_ * es, cuda_launch.ptr(ws), rows, L_)
        passes.row_conv(cuda_launch.ptr(ws), cuda_launch.ptr(kf), 0, D, r0, rows, True)
        passes.col_inv(cpp, False, cuda_launch.ptr(ws), cuda_launch.ptr(y) + r0 * L_ * es, rows, L_)
    return y


def _bwd_dx(launcher, dyc, xc, kf, dx, prod, D, L_, log2n, real, ws, ws_rows,
            butterflies=BUTTERFLIES_PER_THREAD[0]):
    """dx (or nothing) and the product spectra prod (or nothing) of the rows of dyc / xc."""
    B = xc.shape[0]
    if B == 0 or D == 0 or (dx is None and prod is None):
        return
    cpp, dev, es = cuda_launch.CPP_TYPES[xc.dtype], xc.device, xc.element_size()
    if not multi_pass(log2n, real, _caps(dev)):
        cuda_launch.launch(launcher, _k(_ONE, f"fftconv_bwd_dx_kernel<{cpp}>"), B * D, fft_threads(log2n, butterflies),
                 fft_smem_bytes(real, log2n), [("ptr", cuda_launch.ptr(dyc)), ("ptr", cuda_launch.ptr(xc)), ("ptr", cuda_launch.ptr(kf)),
                                               ("ptr", cuda_launch.ptr(dx)), ("ptr", cuda_launch.ptr(prod)), ("i32", D), ("i32", L_),
                                               ("i32", log2n), ("ptr", cuda_launch.ptr(twiddles(real, dev)))], dev)
        return
    _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, dev, butterflies)
    for r0 in range(0, B * D, ws_rows):
        rows = min(ws_rows, B * D - r0)
        at = r0 * passes.bins * passes.cbytes
        if prod is not None:  # prod = rfft(x), multiplied by G = rfft(flip dy) below
            passes.col_fwd(cpp, False, cuda_launch.ptr(xc) + r0 * L_ * es, cuda_launch.ptr(ws), rows, L_)
            passes.row_spectrum(cuda_launch.ptr(ws), cuda_launch.ptr(prod) + at, rows)
        passes.col_fwd(cpp, True, cuda_launch.ptr(dyc) + r0 * L_ * es, cuda_launch.ptr(ws), rows, L_)
        passes.row_conv(cuda_launch.ptr(ws), cuda_launch.ptr(kf), cuda_launch.ptr(prod) + at if prod is not None else 0, D, r0, rows,
                        dx is not None)
        if dx is not None:
            passes.col_inv(cpp, True, cuda_launch.ptr(ws), cuda_launch.ptr(dx) + r0 * L_ * es, rows, L_)


def _bwd_dk(launcher, prod, acc, dk, nb, D, L_, log2n, real, accumulate, finalize, ws, ws_rows,
            butterflies=BUTTERFLIES_PER_THREAD[0]):
    """Sums the nb product spectra into acc and, when finalize, writes dk (D, L) in the arithmetic type."""
    if D == 0:
        return
    dev = prod.device
    if not multi_pass(log2n, real, _caps(dev)):
        cuda_launch.launch(launcher, _k(_ONE, f"fftconv_bwd_dk_kernel<{_R[real]}>"), D, fft_threads(log2n, butterflies),
                 fft_smem_bytes(real, log2n) if finalize else 0,
                 [("ptr", cuda_launch.ptr(prod)), ("ptr", cuda_launch.ptr(acc)), ("ptr", cuda_launch.ptr(dk)), ("i32", nb), ("i32", D),
                  ("i32", L_), ("i32", log2n), ("bool", accumulate), ("bool", finalize),
                  ("ptr", cuda_launch.ptr(twiddles(real, dev)))], dev)
        return
    if finalize:
        _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, dev, butterflies)
    chunk = ws_rows if finalize else D
    for d0 in range(0, D, chunk):
        rows = min(chunk, D - d0)
        passes.row_dk(cuda_launch.ptr(prod), cuda_launch.ptr(acc), cuda_launch.ptr(ws), nb, D, d0, rows, accumulate, finalize)
        if finalize:
            passes.col_inv(_R[real], True, cuda_launch.ptr(ws), cuda_launch.ptr(dk) + d0 * L_ * dk.element_size(), rows, L_)


def launch_bwd(launcher, dy, x, k, need_x: bool = True, need_k: bool = True, max_workspace_bytes: int = 256 << 20,
               butterflies: int = BUTTERFLIES_PER_THREAD[0]):
    """(dx in x's dtype or None, dk or None): dk float32, or float64 for float64 x. The dk product
    spectra are summed over batch slices so the workspace stays under ``max_workspace_bytes`` (at
    least one slice; above the one-block limit the multi-pass row workspace is capped by the same)."""
    _x_checks(x)
    real = real_of(x.dtype)
    B, D, L_ = x.shape
    dev = x.device
    if x.numel() == 0:  # nothing to convolve: dk is an empty sum
        return (torch.empty(x.shape, dtype=x.dtype, device=dev) if need_x else None,
                torch.zeros(D, L_, dtype=real, device=dev) if need_k else None)
    log2n = log2n_of(L_, real, _caps(dev))
    N = 1 << log2n
    cplx = torch.complex128 if real == torch.float64 else torch.complex64
    xc, dyc = x.contiguous(), dy.to(x.dtype).contiguous()
    kf = spectrum(launcher, k, max_workspace_bytes, like=x, butterflies=butterflies)
    dx = torch.empty(xc.shape, dtype=x.dtype, device=dev) if need_x else None
    dk = torch.empty(D, L_, dtype=real, device=dev) if need_k else None
    if not need_k:
        ws, ws_rows = _workspace(L_, B * D, max_workspace_bytes, real, dev)
        _bwd_dx(launcher, dyc, xc, kf, dx, None, D, L_, log2n, real, ws, ws_rows, butterflies)
        return dx, None
    row_bytes = D * (N + 1) * kf.element_size()
    nb = max(1, min(B, max_workspace_bytes // max(1, row_bytes)))
    prod = torch.empty(nb, D, N + 1, dtype=cplx, device=dev)
    acc = torch.empty(D, N + 1, dtype=cplx, device=dev) if nb < B else None
    ws, ws_rows = _workspace(L_, max(nb * D, D), max_workspace_bytes, real, dev)
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        _bwd_dx(launcher, dyc[b0:b1], xc[b0:b1], kf, dx[b0:b1] if dx is not None else None, prod, D, L_, log2n, real,
                ws, ws_rows, butterflies)
        _bwd_dk(launcher, prod[: b1 - b0], acc, dk, b1 - b0, D, L_, log2n, real, b0 > 0, b1 == B, ws, ws_rows,
                butterflies)
    return dx, dk


def twiddle_probe(launcher, a: torch.Tensor, s: int, sign: float, real: torch.dtype) -> torch.Tensor:
    """e^{sign i pi a / 2^s} (complex of the arithmetic type) as the multi-pass twiddles compute it
    (a test hook of fftconv_long.cuh); a holds 32-bit unsigned values (a uint32 or int32 tensor)."""
    n = a.numel()
    if a.element_size() != 4 or a.is_floating_point():
        raise TypeError(f"twiddle_probe: a must hold 32-bit integers, got {a.dtype}")
    if not 0 <= s < 127 or n >= 2**31:
        raise ValueError("twiddle_probe: need 0 <= s < 127 and fewer than 2^31 values")
    a32 = a.contiguous()
    out = torch.empty(n, dtype=torch.complex128 if real == torch.float64 else torch.complex64, device=a.device)
    if n:
        cuda_launch.launch(launcher, _k(_LONG, f"fft4_twiddle_probe_kernel<{_R[real]}>"), -(-n // 256), 256, 0,
                 [("ptr", cuda_launch.ptr(a32)), ("ptr", cuda_launch.ptr(out)), ("i32", n), ("i32", s), (cuda_launch.acc_tag(out.real), sign)],
                 a.device)
    return out


class FftconvBackend(Backend):
    #: max_workspace_bytes: cap of the (batch slice, D, N + 1) complex product spectra of dk,
    #: and of the multi-pass FFT's row workspace above the one-block limit (at least one row either way).
    #: butterflies_per_thread: the FFT blocks' size (BUTTERFLIES_PER_THREAD above).
    CONFIG_SPACE: dict = {"max_workspace_bytes": (256 << 20,), "butterflies_per_thread": BUTTERFLIES_PER_THREAD}
    DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}
    #: float64 x runs the kernels in double (complex128 spectra, double twiddles)
    FP64 = True

    def not_supported_reasons(self, x, k, **_other_inputs) -> list[str]:
        reasons = self._reasons({"x": x, "k": k}, "x")
        # k is converted to x's arithmetic type (float32, or float64 for float64 x): a float64 k
        # with a narrower x would silently lose its precision, so it goes to backend='torch'
        if k.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            reasons.append(f"k must be float32, bfloat16, float16 or float64 for the CUDA kernels, got {k.dtype}")
        elif k.dtype == torch.float64 and x.dtype != torch.float64:
            reasons.append(f"a float64 k needs float64 x for the CUDA kernels (they compute in x's precision), "
                           f"got x {x.dtype} (use backend='torch')")
        if x.dim() != 3:
            return reasons
        # one block per row up to the length whose N complex values fit the device's shared memory
        # (16384 / 8192 in float64 with 128 KiB or more, half that below), the multi-pass four-step
        # FFT above, up to 2^27 (2^25 in float64; 2^25 / 2^23 with less than 128 KiB per block).
        # Reported beside the other reasons, so one error names every fix.
        try:
            caps = self.caps(x)
        except Exception:  # a CUDA tensor without a usable device: the reasons above say why
            return reasons
        why = config_reason(caps, x.shape[-1], x.dtype)
        if why is not None:
            log2 = max_log2(real_of(x.dtype), caps)
            reasons.append(f"the CUDA fftconv handles L <= {1 << log2} = 2^{log2}{_where(real_of(x.dtype), caps)}, "
                           f"got L = {x.shape[-1]} with x {x.dtype} (use backend='torch')")
        return reasons

    def forward(self, x, k, out_dtype=None, *, max_workspace_bytes=DEFAULT_CONFIG["max_workspace_bytes"],
                butterflies_per_thread=DEFAULT_CONFIG["butterflies_per_thread"]):
        """y in x's dtype, or ``out_dtype`` (as the other backends)."""
        y = launch_fwd(self.ext, x, k, max_workspace_bytes, butterflies_per_thread)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def backward(self, dy, x, k, need_x=True, need_k=True, *,
                 max_workspace_bytes=DEFAULT_CONFIG["max_workspace_bytes"],
                 butterflies_per_thread=DEFAULT_CONFIG["butterflies_per_thread"]):
        return launch_bwd(self.ext, dy, x, k, need_x, need_k, max_workspace_bytes, butterflies_per_thread)


# The backend module's names over the GPU launcher (tests build FftconvBackend over the emulator).
_GPU = FftconvBackend(runtime.gpu_launcher)
CONFIG_SPACE: dict = FftconvBackend.CONFIG_SPACE
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(*args, **inputs) -> list[str]:
    return _GPU.not_supported_reasons(*args, **inputs)


def forward(x, k, out_dtype=None, **config):
    return _GPU.forward(x, k, out_dtype, **config)


def backward(dy, x, k, need_x=True, need_k=True, **config):
    return _GPU.backward(dy, x, k, need_x, need_k, **config)
