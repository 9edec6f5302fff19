"""CUDA backend of ema_hidden: the kernels are cuda/cema.cuh (tiled analysis of x into V, W, the
finishing kernel h = p V + q^L hx; backward: tiled synthesis of dx and the per-coefficient
gradients from the saved sums); this file is their whole launch path (GPU runtime or emulator,
same records). Sizing and argument checks are cema_kernel's (same header).

x float32 or bfloat16 is read as is (widened on load); float64 x with float64 p is summed in
double, with float32 p it is cast to float32 first (the torch backend computes x in p's dtype too).
"""
from __future__ import annotations

import torch

from ...cuda import launch as cuda_launch
from ...cuda import runtime
from ..cema_kernel import cuda_impl as C

#: (x's C++ type, p's dtype) the analysis takes; float64 x with float32 p is cast to float32 first
X_REAL = [(x, r) for x in cuda_launch.CPP_TYPES for r in C.REAL if (x, r) != (torch.float64, torch.float32)]
KERNELS = ([C.analysis_kernel("kAnalysisHidden", cuda_launch.CPP_TYPES[x], r, w) for x, r in X_REAL for w in (False, True)]
           + [C.finish_kernel("ema_hidden_finish_kernel", r) for r in C.REAL]
           + [C.synth_kernel("kSynthHiddenDx", r) for r in C.REAL]
           + [C.finish_kernel("ema_hidden_coef_kernel", r) for r in C.REAL])


def launch_fwd(launcher, x, p, log_q, hx, weighted=False):
    """(h c(B D N), V c(B D N), W c(B D N) or None) in p's precision."""
    if x.dtype not in cuda_launch.CPP_TYPES:
        raise TypeError(f"the CUDA ema_hidden takes float32, bfloat16 or float64 x, got {x.dtype}")
    B, D, n = x.shape
    N = p.shape[1]
    C.check_length(N, n)
    pc = C.coef_p(p)
    real, cdt = p.dtype, C.COMPLEX[p.dtype]
    lq, h0 = C.cplx(log_q, "log_q", real), C.cplx(hx, "hx", real)
    if x.dtype == torch.float64 and real == torch.float32:
        x = x.to(torch.float32)
    xc = x.contiguous()
    dev = x.device
    h = torch.empty(B, D, N, dtype=cdt, device=dev)
    V = torch.empty(B, D, N, dtype=cdt, device=dev)
    W = torch.empty(B, D, N, dtype=cdt, device=dev) if weighted else None
    ws = C.workspace(real, B, D, N, n, dev)
    if B == 0 or D == 0 or N == 0:
        return h, V, W
    P = cuda_launch.ptr
    rv = lambda t: P(torch.view_as_real(t)) if t is not None else 0  # noqa: E731
    Y = C.blocks_along(C.analysis_tiles(real, N, n), D)
    cuda_launch.launch(launcher, C.analysis_kernel("kAnalysisHidden", cuda_launch.CPP_TYPES[xc.dtype], real, weighted), (D, Y),
             C.THREADS, 0, [("ptr", P(xc)), ("ptr", P(xc)), ("ptr", P(lq)), ("ptr", P(ws)), ("i32", D), ("i32", N),
                            ("i64", n), ("i32", B), ("bool", False)], dev)
    cuda_launch.launch(launcher, C.finish_kernel("ema_hidden_finish_kernel", real), C.finish_grid(B * D * N), C.FINISH_THREADS,
             0, [("ptr", P(ws)), ("ptr", P(pc)), ("ptr", P(lq)), ("ptr", P(h0)), ("ptr", rv(h)), ("ptr", rv(V)),
                 ("ptr", rv(W)), ("i32", B), ("i32", D), ("i32", N), ("i64", n), ("i32", Y)], dev)
    return h, V, W


def launch_bwd(launcher, dh, p, log_q, hx, V, W, length, needs=(True, True, True, True)):
    """(dx r(B D L) in p's dtype or None, dp r(D N), dlog_q c(D N), dhx c(B D N) or None) from the saved V, W."""
    need_x, need_p, need_lq, _ = needs
    B, D, N = dh.shape
    n = int(length)
    C.check_length(N, n)
    pc = C.coef_p(p)
    real, cdt = p.dtype, C.COMPLEX[p.dtype]
    dhc, lq, h0 = C.cplx(dh, "dh", real), C.cplx(log_q, "log_q", real), C.cplx(hx, "hx", real)
    v = C.cplx(V, "V", real) if need_p else None
    w = C.cplx(W, "W", real) if need_lq else None
    if need_p and v is None:
        raise ValueError("ema_hidden_bwd: dp needs the forward's sums V")
    if need_lq and w is None:
        raise ValueError("ema_hidden_bwd: dlog_q needs the forward's weighted sums W "
                         "(run the forward with weighted=True)")
    dev = dh.device
    dx = torch.empty(B, D, n, dtype=real, device=dev) if need_x else None
    dp = torch.empty(D, N, dtype=real, device=dev)
    dlq = torch.empty(D, N, dtype=cdt, device=dev)
    dhx = torch.empty(B, D, N, dtype=cdt, device=dev) if hx is not None else None
    if D == 0:
        return dx, dp, dlq, dhx
    P = cuda_launch.ptr
    rv = lambda t: P(torch.view_as_real(t)) if t is not None else 0  # noqa: E731
    if dx is not None and B > 0:
        cuda_launch.launch(launcher, C.synth_kernel("kSynthHiddenDx", real),
                 (D, C.blocks_along(C.synth_tiles(real, N, n), D)), C.THREADS, 0,
                 [("ptr", P(pc)), ("ptr", P(lq)), ("ptr", 0), ("ptr", P(dhc)), ("ptr", 0), ("ptr", P(dx)),
                  ("i32", D), ("i32", N), ("i64", n), ("i32", B), ("bool", False)], dev)
    if N > 0:
        cuda_launch.launch(launcher, C.finish_kernel("ema_hidden_coef_kernel", real), C.finish_grid(D * N), C.FINISH_THREADS, 0,
                 [("ptr", P(dhc)), ("ptr", P(pc)), ("ptr", P(lq)), ("ptr", P(h0)), ("ptr", P(v)), ("ptr", P(w)),
                  ("ptr", P(dp)), ("ptr", rv(dlq)), ("ptr", rv(dhx)), ("i32", B), ("i32", D), ("i32", N), ("i64", n),
                  ("bool", bool(need_p)), ("bool", bool(need_lq))], dev)
    return dx, dp, dlq, dhx


class EmaHiddenBackend(C.CemaBackendBase):
    """ema_hidden on cuda/cema.cuh: V, W by tiled analysis of x (fp32 or bf16; also fp64, summed in double
    with float64 p, cast to fp32 with float32 p as the torch backend does), dx by tiled synthesis."""

    def not_supported_reasons(self, x, p, log_q=None, hx=None, **_other_inputs) -> list[str]:
        reasons = self._cema_reasons({"x": x, "p": p, "log_q": log_q, "hx": hx}, p, p.shape[-1], x.shape[-1])
        reasons += self._dtype_reason("x", x, "the CUDA ema_hidden takes")
        return reasons

    def forward(self, x, p, log_q, hx, weighted=False):
        return launch_fwd(self.ext, x, p, log_q, hx, weighted)

    def backward(self, dh, p, log_q, hx, V, W, length, needs=(True, True, True, True)):
        return launch_bwd(self.ext, dh, p, log_q, hx, V, W, length, needs)


# The backend module's names over the GPU launcher (tests build EmaHiddenBackend over the emulator).
_GPU = EmaHiddenBackend(runtime.gpu_launcher)
CONFIG_SPACE: dict = EmaHiddenBackend.CONFIG_SPACE
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(*args, **inputs) -> list[str]:
    return _GPU.not_supported_reasons(*args, **inputs)


def forward(x, p, log_q, hx, weighted=False):
    return _GPU.forward(x, p, log_q, hx, weighted)


def backward(dh, p, log_q, hx, V, W, length, needs=(True, True, True, True)):
    return _GPU.backward(dh, p, log_q, hx, V, W, length, needs)
