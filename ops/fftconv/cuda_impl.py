"""CUDA backend of fftconv: the kernels are cuda/fftconv.cuh (one block per row: L <= 16384, or
8192 in float64) and cuda/fftconv_long.cuh (the multi-pass four-step FFT through a global workspace,
up to L = 2^27, or 2^25 in float64); this file is their whole launch path, run by the GPU runtime
(NVRTC) or the CPU emulator from the same records.

x float32 / bfloat16 computes in float32 (complex64 spectra), float64 in double (complex128); k is
converted to that arithmetic type. Above the one-block limit the spectra's bins are in the
multi-pass layout, which only these kernels read.
"""
from __future__ import annotations

import ctypes

import torch

from ...cuda import launch as L
from ...cuda import runtime
from ...cuda.backend import _Backend

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


def _k(header: str, name: str) -> L.Kernel:
    return L.Kernel(header, f"mk::{name}")


_ONE, _LONG = "fftconv.cuh", "fftconv_long.cuh"
_R = {torch.float32: "float", torch.float64: "double"}
KERNELS = ([_k(_ONE, f"fftconv_spectrum_kernel<{r}>") for r in _R.values()]
           + [_k(_ONE, f"fftconv_{n}_kernel<{t}>") for n in ("fwd", "bwd_dx") for t in L.CPP_TYPES.values()]
           + [_k(_ONE, f"fftconv_bwd_dk_kernel<{r}>") for r in _R.values()]
           + [_k(_LONG, f"fft4_col_{p}_kernel<{t}, {f}>") for p in ("fwd", "inv") for t in L.CPP_TYPES.values()
              for f in ("false", "true")]
           + [_k(_LONG, f"fft4_row_{p}_kernel<{r}>") for p in ("spectrum", "conv", "dk") for r in _R.values()]
           + [_k(_LONG, f"fft4_twiddle_probe_kernel<{r}>") for r in _R.values()])


# --- sizes (fftconv.cuh, fftconv_long.cuh) ----------------------------------------------------------

def real_of(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic type: float64 for float64 x, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def max_len(dtype: torch.dtype) -> int:
    """Longest L the CUDA fftconv takes for x of this dtype (2^27; 2^25 in float64)."""
    return 1 << CFG[real_of(dtype)].multi_max_log2


def fft_size(L_: int) -> int:
    """Complex points N (real FFT length 2N): max(32, nextpow2(L))."""
    return max(1 << MIN_LOG2, 1 << max(0, (int(L_) - 1).bit_length()))


def fft_threads(log2n: int) -> int:
    return max(32, min(1 << (log2n - 1), MAX_THREADS))


def fft_smem_bytes(real: torch.dtype, log2n: int) -> int:
    return CFG[real].complex_bytes << log2n


def log2n_of(L_: int, real: torch.dtype) -> int:
    if L_ < 1:
        raise ValueError(f"fftconv: L must be >= 1, got {L_}")
    limit = max_len(real)
    if L_ > limit:
        where = " in float64" if real == torch.float64 else ""
        raise ValueError(f"fftconv: the CUDA kernels handle L <= {limit}{where} (got L = {L_}); use backend='torch'")
    return fft_size(L_).bit_length() - 1


def multi_pass(log2n: int, real: torch.dtype) -> bool:
    return log2n > CFG[real].max_log2


def workspace_row_floats(L_: int, real: torch.dtype) -> int:
    """One multi-pass workspace row (N complex values of the arithmetic type) in 4-byte floats;
    0 up to the one-block limit (no workspace)."""
    return (4 if real == torch.float64 else 2) * fft_size(L_) if L_ > (1 << CFG[real].max_log2) else 0


def plan(log2n: int, real: torch.dtype) -> Fft4Plan:
    cfg = CFG[real]
    n2 = min(cfg.row_max_log2, (log2n + 1) // 2)
    n1 = log2n - n2
    return Fft4Plan(log2n, n1, n2, max(0, min(4, cfg.col_elems.bit_length() - 1 - n1)))


def one_block_max_smem_bytes() -> int:
    return max(fft_smem_bytes(r, CFG[r].max_log2) for r in CFG)


def multi_pass_max_smem_bytes(rows: bool) -> int:
    """Worst case over every multi-pass length of the row (or column) passes' dynamic smem."""
    worst = 0
    for r, cfg in CFG.items():
        for log2n in range(cfg.max_log2 + 1, cfg.multi_max_log2 + 1):
            p = plan(log2n, r)
            worst = max(worst, fft_smem_bytes(r, p.log2n2 + 1 if rows else p.log2n1 + p.log2c))
    return worst


def _workspace(L_: int, rows: int, max_workspace_bytes: int, real: torch.dtype, device):
    """(ws, ws_rows): at most max_workspace_bytes of rows (at least one); (None, 0) without multi-pass."""
    row_floats = workspace_row_floats(L_, real)
    if row_floats == 0 or rows == 0:
        return None, 0
    ws_rows = max(1, min(rows, max_workspace_bytes // (4 * row_floats)))
    return torch.empty(ws_rows, row_floats, dtype=torch.float32, device=device), ws_rows


# --- the multi-pass passes ---------------------------------------------------------------------------

class _Passes:
    """Launches of the four-step passes for one length and arithmetic type."""

    def __init__(self, launcher, log2n: int, real: torch.dtype, device):
        self.launcher, self.real, self.device = launcher, real, device
        self.p = plan(log2n, real)
        self.col_groups = 1 << (self.p.log2n2 - self.p.log2c)
        self.row_blocks = (1 << (self.p.log2n1 - 1)) + 1
        self.col_threads = fft_threads(self.p.log2n1 + self.p.log2c)
        self.row_threads = fft_threads(self.p.log2n2 + 1)
        self.col_smem = fft_smem_bytes(real, self.p.log2n1 + self.p.log2c)
        self.row_smem = fft_smem_bytes(real, self.p.log2n2 + 1)
        self.bins = (1 << log2n) + 1
        self.cbytes = CFG[real].complex_bytes

    def _go(self, kernel, grid, threads, smem, args):
        L.launch(self.launcher, _k(_LONG, kernel), grid, threads, smem, [*args, L.struct_arg(self.p)], self.device)

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

def spectrum(launcher, k, max_workspace_bytes: int = 256 << 20, like: torch.Tensor | None = None):
    """rfft of each kernel row, zero-padded to 2N: (D, N + 1) complex64, or complex128 when ``like``
    (x) is float64 (multi-pass layout of the bins above the one-block limit)."""
    D, L_ = k.shape
    real = real_of((k if like is None else like).dtype)
    log2n = log2n_of(L_, real)
    N = 1 << log2n
    kc = k.to(real).contiguous()
    kf = torch.empty(D, N + 1, dtype=torch.complex128 if real == torch.float64 else torch.complex64, device=k.device)
    if D == 0:
        return kf
    if D >= 2**31:
        raise ValueError("fftconv: D must be < 2^31")
    if not multi_pass(log2n, real):
        L.launch(launcher, _k(_ONE, f"fftconv_spectrum_kernel<{_R[real]}>"), D, fft_threads(log2n),
                 fft_smem_bytes(real, log2n), [("ptr", L.ptr(kc)), ("ptr", L.ptr(kf)), ("i32", L_), ("i32", log2n)],
                 k.device)
        return kf
    ws, ws_rows = _workspace(L_, D, max_workspace_bytes, real, k.device)
    _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, k.device)
    for d0 in range(0, D, ws_rows):
        rows = min(ws_rows, D - d0)
        passes.col_fwd(_R[real], False, L.ptr(kc) + d0 * L_ * kc.element_size(), L.ptr(ws), rows, L_)
        passes.row_spectrum(L.ptr(ws), L.ptr(kf) + d0 * passes.bins * passes.cbytes, rows)
    return kf


def _x_checks(x, name="x"):
    if x.dtype not in L.CPP_TYPES:
        raise TypeError(f"the CUDA kernels take float32, bfloat16 or float64 {name}, got {x.dtype}")
    B, D, _ = x.shape
    if B * D >= 2**31:
        raise ValueError("fftconv: need B * D < 2^31")


def launch_fwd(launcher, x, k, max_workspace_bytes: int = 256 << 20):
    """y (x's dtype), computed in float32 (float64 for float64 x). Above the one-block limit a
    workspace of at most ``max_workspace_bytes`` (at least one row) is walked in row chunks."""
    _x_checks(x)
    B, D, L_ = x.shape
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    real = real_of(x.dtype)
    log2n = log2n_of(L_, real)
    xc = x.contiguous()
    kf = spectrum(launcher, k, max_workspace_bytes, like=x)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    cpp = L.CPP_TYPES[x.dtype]
    if not multi_pass(log2n, real):
        L.launch(launcher, _k(_ONE, f"fftconv_fwd_kernel<{cpp}>"), B * D, fft_threads(log2n),
                 fft_smem_bytes(real, log2n), [("ptr", L.ptr(xc)), ("ptr", L.ptr(kf)), ("ptr", L.ptr(y)), ("i32", D),
                                               ("i32", L_), ("i32", log2n)], x.device)
        return y
    ws, ws_rows = _workspace(L_, B * D, max_workspace_bytes, real, x.device)
    _check_ws(ws, ws_rows)
    passes, es = _Passes(launcher, log2n, real, x.device), xc.element_size()
    for r0 in range(0, B * D, ws_rows):
        rows = min(ws_rows, B * D - r0)
        passes.col_fwd(cpp, False, L.ptr(xc) + r0 * L_ * es, L.ptr(ws), rows, L_)
        passes.row_conv(L.ptr(ws), L.ptr(kf), 0, D, r0, rows, True)
        passes.col_inv(cpp, False, L.ptr(ws), L.ptr(y) + r0 * L_ * es, rows, L_)
    return y


def _bwd_dx(launcher, dyc, xc, kf, dx, prod, D, L_, log2n, real, ws, ws_rows):
    """dx (or nothing) and the product spectra prod (or nothing) of the rows of dyc / xc."""
    B = xc.shape[0]
    if B == 0 or D == 0 or (dx is None and prod is None):
        return
    cpp, dev, es = L.CPP_TYPES[xc.dtype], xc.device, xc.element_size()
    if not multi_pass(log2n, real):
        L.launch(launcher, _k(_ONE, f"fftconv_bwd_dx_kernel<{cpp}>"), B * D, fft_threads(log2n),
                 fft_smem_bytes(real, log2n), [("ptr", L.ptr(dyc)), ("ptr", L.ptr(xc)), ("ptr", L.ptr(kf)),
                                               ("ptr", L.ptr(dx)), ("ptr", L.ptr(prod)), ("i32", D), ("i32", L_),
                                               ("i32", log2n)], dev)
        return
    _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, dev)
    for r0 in range(0, B * D, ws_rows):
        rows = min(ws_rows, B * D - r0)
        at = r0 * passes.bins * passes.cbytes
        if prod is not None:  # prod = rfft(x), multiplied by G = rfft(flip dy) below
            passes.col_fwd(cpp, False, L.ptr(xc) + r0 * L_ * es, L.ptr(ws), rows, L_)
            passes.row_spectrum(L.ptr(ws), L.ptr(prod) + at, rows)
        passes.col_fwd(cpp, True, L.ptr(dyc) + r0 * L_ * es, L.ptr(ws), rows, L_)
        passes.row_conv(L.ptr(ws), L.ptr(kf), L.ptr(prod) + at if prod is not None else 0, D, r0, rows,
                        dx is not None)
        if dx is not None:
            passes.col_inv(cpp, True, L.ptr(ws), L.ptr(dx) + r0 * L_ * es, rows, L_)


def _bwd_dk(launcher, prod, acc, dk, nb, D, L_, log2n, real, accumulate, finalize, ws, ws_rows):
    """Sums the nb product spectra into acc and, when finalize, writes dk (D, L) in the arithmetic type."""
    if D == 0:
        return
    dev = prod.device
    if not multi_pass(log2n, real):
        L.launch(launcher, _k(_ONE, f"fftconv_bwd_dk_kernel<{_R[real]}>"), D, fft_threads(log2n),
                 fft_smem_bytes(real, log2n) if finalize else 0,
                 [("ptr", L.ptr(prod)), ("ptr", L.ptr(acc)), ("ptr", L.ptr(dk)), ("i32", nb), ("i32", D),
                  ("i32", L_), ("i32", log2n), ("bool", accumulate), ("bool", finalize)], dev)
        return
    if finalize:
        _check_ws(ws, ws_rows)
    passes = _Passes(launcher, log2n, real, dev)
    chunk = ws_rows if finalize else D
    for d0 in range(0, D, chunk):
        rows = min(chunk, D - d0)
        passes.row_dk(L.ptr(prod), L.ptr(acc), L.ptr(ws), nb, D, d0, rows, accumulate, finalize)
        if finalize:
            passes.col_inv(_R[real], True, L.ptr(ws), L.ptr(dk) + d0 * L_ * dk.element_size(), rows, L_)


def launch_bwd(launcher, dy, x, k, need_x: bool = True, need_k: bool = True, max_workspace_bytes: int = 256 << 20):
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
    log2n = log2n_of(L_, real)
    N = 1 << log2n
    cplx = torch.complex128 if real == torch.float64 else torch.complex64
    xc, dyc = x.contiguous(), dy.to(x.dtype).contiguous()
    kf = spectrum(launcher, k, max_workspace_bytes, like=x)
    dx = torch.empty(xc.shape, dtype=x.dtype, device=dev) if need_x else None
    dk = torch.empty(D, L_, dtype=real, device=dev) if need_k else None
    if not need_k:
        ws, ws_rows = _workspace(L_, B * D, max_workspace_bytes, real, dev)
        _bwd_dx(launcher, dyc, xc, kf, dx, None, D, L_, log2n, real, ws, ws_rows)
        return dx, None
    row_bytes = D * (N + 1) * kf.element_size()
    nb = max(1, min(B, max_workspace_bytes // max(1, row_bytes)))
    prod = torch.empty(nb, D, N + 1, dtype=cplx, device=dev)
    acc = torch.empty(D, N + 1, dtype=cplx, device=dev) if nb < B else None
    ws, ws_rows = _workspace(L_, max(nb * D, D), max_workspace_bytes, real, dev)
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        _bwd_dx(launcher, dyc[b0:b1], xc[b0:b1], kf, dx[b0:b1] if dx is not None else None, prod, D, L_, log2n, real,
                ws, ws_rows)
        _bwd_dk(launcher, prod[: b1 - b0], acc, dk, b1 - b0, D, L_, log2n, real, b0 > 0, b1 == B, ws, ws_rows)
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
        L.launch(launcher, _k(_LONG, f"fft4_twiddle_probe_kernel<{_R[real]}>"), -(-n // 256), 256, 0,
                 [("ptr", L.ptr(a32)), ("ptr", L.ptr(out)), ("i32", n), ("i32", s), (L.acc_tag(out.real), sign)],
                 a.device)
    return out


class FftconvBackend(_Backend):
    #: max_workspace_bytes: cap of the (batch slice, D, N + 1) complex product spectra of dk,
    #: and of the multi-pass FFT's row workspace above the one-block limit (at least one row either way).
    DEFAULT_CONFIG: dict = {"max_workspace_bytes": 256 << 20}
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
        if x.shape[-1] > max_len(x.dtype):
            # one block per row up to 16384 (8192 in float64), the multi-pass four-step FFT above,
            # up to 2^27 (2^25 in float64: 16-byte complex values, every pass within 128 KiB of smem)
            reasons.append(f"the CUDA fftconv handles L <= {MAX_LEN} (2^27; L <= {FP64_MAX_LEN} = 2^25 in float64), "
                           f"got L = {x.shape[-1]} with x {x.dtype} (use backend='torch')")
        return reasons

    def fftconv_fwd(self, x, k, max_workspace_bytes=DEFAULT_CONFIG["max_workspace_bytes"]):
        return launch_fwd(self.ext, x, k, max_workspace_bytes)

    def fftconv_bwd(self, dy, x, k, need_x, need_k, max_workspace_bytes=DEFAULT_CONFIG["max_workspace_bytes"]):
        return launch_bwd(self.ext, dy, x, k, need_x, need_k, max_workspace_bytes)


_backend = FftconvBackend(runtime.gpu_launcher)
DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
fftconv_fwd = _backend.fftconv_fwd
fftconv_bwd = _backend.fftconv_bwd
