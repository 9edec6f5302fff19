"""Compiled CPU backend of fftconv ("cpu"): C++ with OpenMP, built with g++ on first use.

cpu_kernel.cpp runs each transform on a scratch buffer that stays in the core's cache, vectorised
across channels, two real row blocks per complex transform: x (and dy) are read once, y (and dx,
dk) written once. The torch backend's library FFTs make five to six passes over spectrum-sized
buffers in memory (the zero-padded copy, the spectrum, the product, the inverse, the slice's copy).
Transform size, zero padding and the adjoints are the torch backend's (ops/fftconv/torch_impl.py):
n = 2 * nextpow2(L); dx correlates dy with k; dk sums the correlation of dy with x over the batch.

Arithmetic is in float32 (float64 if x or k is float64) whatever the input dtypes, as in the torch
backend; inputs are converted to that dtype and made contiguous first. The library is compiled on
first use and cached (ops/_cpu_build.py); without a working compiler ``not_supported_reasons`` says
so and ``auto`` falls back to the torch backend.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import _cpu_build
from .._checks import device_reasons
from .torch_impl import compute_dtype

CONFIG_SPACE: dict = {}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
CXX = _cpu_build.CXX
FLAGS = _cpu_build.FLAGS

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _library():
    """The loaded library, or the exception that prevented building or loading it."""
    lib = _cpu_build.load(SOURCE, "fftconv", CXX, FLAGS)
    if not isinstance(lib, Exception):
        for tag in ("f32", "f64"):
            getattr(lib, f"mk_fftconv_fwd_{tag}").argtypes = [_P, _P, _P, _I, _I, _I, _C]
            getattr(lib, f"mk_fftconv_bwd_{tag}").argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _C]
    return lib


#: The longest L: a thread's scratch is ~4 n complex vectors of 128 bytes in the backward (two
#: transforms and four half spectra, n = 2 * nextpow2(L)), 128 MiB at this limit (n = 2**18),
#: whatever the number of channels. Beyond L = 16384 the buffers no longer fit the caches, and
#: cema's chunked form (no FFT) overtakes the FFT form (ops/cema/cpu_impl.py).
MAX_LEN = 1 << 17


def kernel_reasons(x) -> list[str]:
    """What keeps the kernel from running on x's device at all, whatever the length."""
    return device_reasons("cpu", "cpu", x=x) + _cpu_build.unsupported(_library(), CXX)


def _length_reason(L: int) -> list[str]:
    return [f"L = {L} > {MAX_LEN} (the cpu kernel's scratch grows with L; use backend='torch')"] if L > MAX_LEN else []


def not_supported_reasons(x, k=None) -> list[str]:
    return kernel_reasons(x) + _length_reason(x.shape[-1])


def _check_length(L: int) -> None:
    why = _length_reason(L)  # a direct call (cema's cpu backend) past not_supported_reasons
    if why:
        raise ValueError(f"the cpu fftconv kernel cannot take {why[0]}")


def _kernel(kind: str, work: torch.dtype):
    return _cpu_build.kernel(_library(), f"mk_fftconv_{kind}", work, "fftconv")


_as = _cpu_build.as_work


def forward(x, k, out_dtype=None):
    """y r(B D L) = causal conv of x r(B D L) with k r(D L), in ``out_dtype`` (default x's dtype)."""
    work = compute_dtype(x.dtype, k.dtype)
    out_dtype = out_dtype or x.dtype
    B, D, L = x.shape
    _check_length(L)
    xc, kc = _as(x, work), _as(k, work)  # held by name until the call returns
    y = torch.empty_like(xc)
    if y.numel():
        _kernel("fwd", work)(xc.data_ptr(), kc.data_ptr(), y.data_ptr(), B, D, L, torch.get_num_threads())
    return y.to(out_dtype)


def backward(dy, x, k, need_x=True, need_k=True):
    """-> (dx r(B D L) or None, dk r(D L) or None), both in the compute dtype."""
    work = compute_dtype(x.dtype, k.dtype)
    B, D, L = x.shape
    _check_length(L)
    dyc, xc, kc = _as(dy, work), _as(x, work), _as(k, work)
    dx = torch.empty_like(xc) if need_x else None
    dk = torch.empty_like(kc) if need_k else None
    if need_k and B == 0:
        dk.zero_()  # an empty batch: a zero sum
    if (need_x or need_k) and x.numel():
        _kernel("bwd", work)(dyc.data_ptr(), xc.data_ptr(), kc.data_ptr(), None if dx is None else dx.data_ptr(),
                             None if dk is None else dk.data_ptr(), B, D, L, torch.get_num_threads())
    return dx, dk
