"""Compiled CPU backend of TimestepNorm ("cpu"): C++ with OpenMP, built with g++ on first use.

TimestepNorm's statistics are a sequential recurrence over time, so on a CPU the natural kernel is
one streaming pass per (row, group) with O(1) state: cpu_kernel.cpp runs it (Welford/Chan merges
in double with Kahan compensation, relative to the torch backend's shift K), and the backward's
reverse scan likewise, one OpenMP task per (row, group). The torch backend instead builds every
prefix with a log-depth parallel scan, many passes over [L, G] and x-sized temporaries.

A row is a batch row or, with ``cu_seqlens``, a document of the packed row (its start and length
are passed to the kernel): packed rows cost what one row of their total length costs.

The library is compiled on first use and cached (ops/_cpu_build.py); without a working compiler
``not_supported_reasons`` says so and ``auto`` falls back to the torch backend. x is computed in
float32 (float64 for float64 x; bfloat16/float16 are converted), statistics in double; the kernel
writes the statistics and saved residuals in the accumulation dtype.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import _cpu_build
from .._checks import device_reasons
from . import Saved

CONFIG_SPACE: dict = {}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
CXX = _cpu_build.CXX
FLAGS = _cpu_build.FLAGS

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_FWD_ARGS = [_P, _P, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _C, ctypes.c_double, _P, _P, _P, _P, _P, _P, _P, _P,
             _P, _C]
_BWD_ARGS = [_P, _P, _P, _I, _P, _P, _I, _I, _I, _P, _C, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _C]


@functools.lru_cache(maxsize=None)
def _library():
    """The loaded library, or the exception that prevented building or loading it."""
    lib = _cpu_build.load(SOURCE, "timestep_norm", CXX, FLAGS)
    if not isinstance(lib, Exception):
        for tag in ("f32", "f64"):
            getattr(lib, f"mk_tsn_fwd_{tag}").argtypes = _FWD_ARGS
            getattr(lib, f"mk_tsn_bwd_{tag}").argtypes = _BWD_ARGS
    return lib


def not_supported_reasons(x, num_groups=None, packed=False) -> list[str]:
    return device_reasons("cpu", "cpu", x=x) + _cpu_build.unsupported(_library(), CXX)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()  # None: a NULL pointer (argtypes convert the int)


def _rows(cu_seqlens):
    """(starts, lengths) int64 of the kernel's rows when they are a packed row's documents; None
    for a batch (the kernel's uniform rows: row r at step r * L, L steps, no arrays to build)."""
    if cu_seqlens is None:
        return None, None
    cu = cu_seqlens.to(torch.int64).contiguous()
    return cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous()


def _kernel(kind: str, work: torch.dtype):
    return _cpu_build.kernel(_library(), f"mk_tsn_{kind}", work, "TimestepNorm")


# per-call overhead counts at model sizes: inputs already in the wanted dtype and layout pass as they are
_as = _cpu_build.as_work


def _side(ts) -> tuple[list, int]:
    """Side inputs as the kernel reads them, float32 or float64 (bf16 / f16 widened exactly), and the
    kernel's mask of which are float64 (bit i: ts[i]); it widens them to double itself."""
    out, mask = [], 0
    for i, t in enumerate(ts):
        if t.dtype == torch.float64:
            mask |= 1 << i
            out.append(t.contiguous())
        else:
            out.append(_as(t, torch.float32))
    return out, mask


def forward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
                      cu_seqlens=None):
    """Returns (y, count, mean, var, saved), ``saved`` in the torch backend's layout (x, scale, mu,
    rstd, gmu, padding_mask, prev_count, prev_mean - K, K); mu and gmu are relative to K. The
    kernel writes the statistics in the accumulation dtype (= its work dtype) itself."""
    B, L, D = x.shape
    G = num_groups
    work = torch.float64 if x.dtype == torch.float64 else torch.float32  # = the accumulation dtype
    xc = _as(x, work)
    starts, lengths = _rows(cu_seqlens)
    rows = B if starts is None else starts.shape[0]
    y = torch.empty_like(xc)
    mu, rstd, gmu = (torch.empty(B, L, G, dtype=work) for _ in range(3))
    K, mean, var, mu0 = (torch.empty(rows, G, dtype=work) for _ in range(4))
    count = torch.empty(rows, dtype=torch.int64)
    pad = padding_mask.contiguous().view(torch.uint8)
    # every converted input is held by a name until the call returns (a pointer alone keeps nothing alive)
    (sc, bi, pm, pv), f64 = _side((scale, bias, prev_mean, prev_var))
    pc = _as(prev_count, torch.int64)
    _kernel("fwd", work)(
        xc.data_ptr(), pad.data_ptr(), rows, _ptr(starts), _ptr(lengths), L, D, G, sc.data_ptr(), bi.data_ptr(),
        pc.data_ptr(), pm.data_ptr(), pv.data_ptr(), f64, float(eps), y.data_ptr(), mu.data_ptr(), rstd.data_ptr(),
        gmu.data_ptr(), K.data_ptr(), count.data_ptr(), mean.data_ptr(), var.data_ptr(), mu0.data_ptr(),
        torch.get_num_threads())
    saved = Saved(x, scale, mu, rstd, gmu, padding_mask, prev_count, mu0, K)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), count, mean, var, saved


def backward(dy, dmean, dvar, saved, num_groups, cu_seqlens=None):
    """Returns (dx, dscale, dbias, dprev_mean, dprev_var)."""
    x, scale, mu, rstd, gmu, padding_mask, prev_count, mu0, K = saved
    B, L, D = x.shape
    G = num_groups
    work = torch.float64 if x.dtype == torch.float64 else torch.float32  # = the accumulation dtype
    xc, dyc = _as(x, work), _as(dy, work)
    starts, lengths = _rows(cu_seqlens)
    rows = B if starts is None else starts.shape[0]
    dx = torch.empty_like(xc)
    dscale, dbias = (torch.empty(D, dtype=torch.float64) for _ in range(2))
    dprev_mean, dprev_var = (torch.empty(rows, G, dtype=torch.float64) for _ in range(2))
    pad = padding_mask.contiguous().view(torch.uint8)
    # held until the call returns; the residuals are already in the work dtype (no copies)
    (sc,), f64 = _side((scale,))
    ins = [_as(t, work) for t in (mu, rstd, gmu, mu0, K)] + [_as(prev_count, torch.int64)] + \
        [_as(t, work) for t in (dmean, dvar)]
    _kernel("bwd", work)(
        xc.data_ptr(), dyc.data_ptr(), pad.data_ptr(), rows, _ptr(starts), _ptr(lengths), L, D, G, sc.data_ptr(), f64,
        *[t.data_ptr() for t in ins], dx.data_ptr(), dscale.data_ptr(), dbias.data_ptr(), dprev_mean.data_ptr(),
        dprev_var.data_ptr(), torch.get_num_threads())
    return dx, dscale, dbias, dprev_mean, dprev_var
