"""CUDA backend of cema_kernel: the kernels are cuda/cema.cuh (tiled synthesis of k and b, tiled
analysis of the gradients, the per-coefficient finishing kernel); this file is their whole launch
path, run by the GPU runtime (NVRTC, cuda/runtime.py) or the CPU emulator from the same records.
ops/ema_hidden/cuda_impl.py launches the same header and shares the sizing helpers below.

float32 p with complex64 log_q/gamma/hx (fp32 sums), or float64 p with complex128 (every power,
sum and output in double); N <= MAX_N (the n tile is padded to 16, 32 or 64), and L + 1 < 2^24 so
every exponent is exact in fp32.
"""
from __future__ import annotations

import torch

from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ...cuda.backend import Backend

HEADER = "cema.cuh"
MAX_N = 64
MAX_LENGTH = 1 << 24
THREADS = 256          # kThreads: synthesis and analysis blocks
FINISH_THREADS = 128   # kFinishThreads
TABLE_SIZE = 2048      # kTableSize = NP * T
SYN_ROWS_MAX = 4       # kSynRowsMax
TARGET_BLOCKS = 1024   # kTargetBlocks
#: p's dtype -> (C++ real type, kAnalysisRows, kSynQ2) of cema.cuh's Real<R>
REAL = {torch.float32: ("float", 32, MAX_N * MAX_N // 2), torch.float64: ("double", 16, 512)}
COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _k(name: str) -> cuda_launch.Kernel:
    return cuda_launch.Kernel(HEADER, f"mk::cema::{name}")


def synth_kernel(mode: str, real: torch.dtype) -> cuda_launch.Kernel:
    return _k(f"cema_synth_kernel<mk::cema::{mode}, {REAL[real][0]}>")


def analysis_kernel(mode: str, x_cpp: str, real: torch.dtype, weighted: bool) -> cuda_launch.Kernel:
    return _k(f"cema_analysis_kernel<mk::cema::{mode}, {x_cpp}, {REAL[real][0]}, {'true' if weighted else 'false'}>")


def finish_kernel(name: str, real: torch.dtype) -> cuda_launch.Kernel:
    return _k(f"{name}<{REAL[real][0]}>")


KERNELS = ([synth_kernel("kSynthCema", r) for r in REAL]
           + [analysis_kernel("kAnalysisCema", REAL[r][0], r, w) for r in REAL for w in (False, True)]
           + [finish_kernel("cema_bwd_finish_kernel", r) for r in REAL])


# --- sizing (cema.cuh: Layout, syn_rows, synth_tiles, analysis_tiles, blocks_along) ---------------

def layout(N: int, length: int) -> tuple[int, int, int]:
    """(NP, T, M): n tile, positions per table row, rows of T positions covering length."""
    NP = 16 if N <= 16 else (32 if N <= 32 else 64)
    T = TABLE_SIZE // NP
    return NP, T, -(-length // T)


def synth_tiles(real: torch.dtype, N: int, length: int) -> int:
    NP, T, M = layout(N, length)
    rows = SYN_ROWS_MAX if real == torch.float32 else min(SYN_ROWS_MAX, REAL[real][2] * TABLE_SIZE // (THREADS * NP * NP))
    RT = (THREADS // T) * rows
    return -(-M // RT)


def analysis_tiles(real: torch.dtype, N: int, length: int) -> int:
    return -(-layout(N, length)[2] // REAL[real][1])


def blocks_along(tiles: int, D: int) -> int:
    """Blocks along the sequence per feature: enough (d, y) blocks for several waves."""
    return max(1, min(-(-TARGET_BLOCKS // D), tiles, 65535))


def finish_grid(items: int) -> int:
    return cuda_launch.grid_1d(-(-items // FINISH_THREADS), 1 << 16)


def workspace(real: torch.dtype, rows: int, D: int, N: int, length: int, device) -> torch.Tensor:
    """The analysis partial sums (rows, D, Y, N) x 4 reals of p's dtype."""
    n = 4 * rows * D * blocks_along(analysis_tiles(real, N, length), D) * N
    return torch.empty(max(1, n), dtype=real, device=device)


# --- argument checks shared with ema_hidden ---------------------------------------------------------

def coef_p(p: torch.Tensor) -> torch.Tensor:
    if p.dtype not in REAL:
        raise TypeError(f"the CUDA CEMA kernels take float32 or float64 p, got {p.dtype}")
    return p.contiguous()


def cplx(t: torch.Tensor | None, name: str, real: torch.dtype) -> torch.Tensor | None:
    """complex of p's precision -> contiguous interleaved (re, im) real view (a conj view is resolved
    first). A mixed precision is refused, not cast: the op never produces one, and a silent cast
    would hide which precision the caller gets."""
    if t is None:
        return None
    want = COMPLEX[real]
    if t.dtype != want:
        raise TypeError(f"the CUDA CEMA kernels take {name} {want} with {real} p, got {t.dtype}")
    return torch.view_as_real(t.resolve_conj().contiguous())


def check_length(N: int, length: int) -> None:
    if N > MAX_N:
        raise ValueError(f"the CUDA CEMA kernels take N <= {MAX_N}, got N = {N}")
    if not 1 <= length < MAX_LENGTH - 1:
        raise ValueError(f"the CUDA CEMA kernels take 1 <= length < 2**24 - 1, got {length}")


# --- launch descriptions ------------------------------------------------------------------------------

def launch_fwd(launcher, p, log_q, gamma, length, hx):
    """(k r(D L), b r(B D L) or None) in p's dtype; same contract as ops/cema_kernel/torch_impl.py."""
    D, N = p.shape
    n = int(length)
    check_length(N, n)
    pc = coef_p(p)
    real = p.dtype
    lq, g, h = cplx(log_q, "log_q", real), cplx(gamma, "gamma", real), cplx(hx, "hx", real)
    B = 0 if hx is None else hx.shape[0]
    k = torch.empty(D, n, dtype=real, device=p.device)
    b = torch.empty(B, D, n, dtype=real, device=p.device) if hx is not None else None
    if D > 0:
        P = cuda_launch.ptr
        cuda_launch.launch(launcher, synth_kernel("kSynthCema", real), (D, blocks_along(synth_tiles(real, N, n), D)), THREADS, 0,
                 [("ptr", P(pc)), ("ptr", P(lq)), ("ptr", P(g)), ("ptr", P(h)), ("ptr", P(k)), ("ptr", P(b)),
                  ("i32", D), ("i32", N), ("i64", n), ("i32", 1 + B), ("bool", True)], p.device)
    return k, b


def launch_bwd(launcher, dk, db, p, log_q, gamma, length, hx, needs=(True, True, True, True)):
    """(dp r(D N), dlog_q c(D N), dgamma c(D N), dhx c(B D N) or None) in p's precision; dk/db may be
    None and are read in p's dtype (as the torch backend's dk.to(p.dtype))."""
    D, N = p.shape
    n = int(length)
    check_length(N, n)
    pc = coef_p(p)
    real, cdt = p.dtype, COMPLEX[p.dtype]
    lq, g, h = cplx(log_q, "log_q", real), cplx(gamma, "gamma", real), cplx(hx, "hx", real)
    B = 0 if hx is None else hx.shape[0]
    has_k, has_b = dk is not None, db is not None and hx is not None and B > 0
    weighted = bool(needs[1])
    dkc = dk.to(real).contiguous() if has_k else None  # an expanded (stride-0) gradient becomes contiguous
    dbc = db.to(real).contiguous() if has_b else None
    rows = int(has_k) + (B if has_b else 0)
    dev = p.device
    ws = workspace(real, rows, D, N, n, dev)
    dp = torch.empty(D, N, dtype=real, device=dev)
    dlq = torch.empty(D, N, dtype=cdt, device=dev)
    dgamma = torch.empty(D, N, dtype=cdt, device=dev)
    dhx = torch.empty(B, D, N, dtype=cdt, device=dev) if hx is not None else None
    if D == 0 or N == 0:
        return dp, dlq, dgamma, dhx
    P = cuda_launch.ptr
    Y = blocks_along(analysis_tiles(real, N, n), D)
    if rows > 0:
        cuda_launch.launch(launcher, analysis_kernel("kAnalysisCema", REAL[real][0], real, weighted), (D, Y), THREADS, 0,
                 [("ptr", P(dkc)), ("ptr", P(dbc)), ("ptr", P(lq)), ("ptr", P(ws)), ("i32", D), ("i32", N),
                  ("i64", n), ("i32", rows), ("bool", has_k)], dev)
    real_view = lambda t: P(torch.view_as_real(t)) if t is not None else 0  # noqa: E731
    cuda_launch.launch(launcher, finish_kernel("cema_bwd_finish_kernel", real), finish_grid(D * N), FINISH_THREADS, 0,
             [("ptr", P(ws)), ("ptr", P(pc)), ("ptr", P(g)), ("ptr", P(h)), ("ptr", P(dp)), ("ptr", real_view(dlq)),
              ("ptr", real_view(dgamma)), ("ptr", real_view(dhx)), ("i32", D), ("i32", N), ("i32", B), ("i32", Y),
              ("bool", has_k), ("bool", has_b), ("bool", weighted)], dev)
    return dp, dlq, dgamma, dhx


# --- backends -------------------------------------------------------------------------------------------

class CemaBackendBase(Backend):
    #: float64 p with complex128 parameters runs in double (cuda/cema.cuh's R = double)
    FP64 = True

    def _cema_reasons(self, named: dict, p, N: int, length: int | None) -> list[str]:
        reasons = self._available() or self._arch_reasons(named.values()) + self._device_reasons(named)
        if p.dtype not in REAL:
            reasons.append(f"the CUDA CEMA kernels take float32 or float64 p, got p {p.dtype} (use backend='torch')")
        else:
            # the parameters share p's precision (ops._checks.check_coefficients enforces it for
            # the public ops); a mix is refused rather than cast, as launch_fwd/launch_bwd do
            want = COMPLEX[p.dtype]
            for name in ("log_q", "gamma", "hx"):
                t = named.get(name)
                if t is not None and t.dtype != want:
                    reasons.append(f"the CUDA CEMA kernels take {name} {want} with {p.dtype} p, got {t.dtype} "
                                   f"(use backend='torch')")
        if N > MAX_N:
            reasons.append(f"N = {N} > {MAX_N} (the CUDA n tile is 16, 32 or 64; use backend='torch')")
        if length is not None and length + 1 >= MAX_LENGTH:
            reasons.append(f"L = {length}: L + 1 >= 2**24, exponents would not be exact in fp32 (use backend='torch')")
        return reasons


class CemaKernelBackend(CemaBackendBase):
    """cema_kernel on cuda/cema.cuh: k and b by tiled synthesis, the gradients by tiled analysis."""

    def not_supported_reasons(self, p, log_q=None, gamma=None, length=None, hx=None, **_other_inputs) -> list[str]:
        named = {"p": p, "log_q": log_q, "gamma": gamma, "hx": hx}
        return self._cema_reasons(named, p, p.shape[-1], length)

    def forward(self, p, log_q, gamma, length, hx):
        return launch_fwd(self.ext, p, log_q, gamma, length, hx)

    def backward(self, dk, db, p, log_q, gamma, length, hx, needs=(True, True, True, True)):
        return launch_bwd(self.ext, dk, db, p, log_q, gamma, length, hx, needs)


# The backend module's names over the GPU launcher (tests build CemaKernelBackend over the emulator).
_GPU = CemaKernelBackend(runtime.gpu_launcher)
CONFIG_SPACE: dict = CemaKernelBackend.CONFIG_SPACE
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(*args, **inputs) -> list[str]:
    return _GPU.not_supported_reasons(*args, **inputs)


def forward(p, log_q, gamma, length, hx):
    return _GPU.forward(p, log_q, gamma, length, hx)


def backward(dk, db, p, log_q, gamma, length, hx, needs=(True, True, True, True)):
    return _GPU.backward(dk, db, p, log_q, gamma, length, hx, needs)
