"""Tensor-level API over the compiled CUDA launchers (real extension or CPU emulator).

Every function takes the extension module ``ext`` first: the product extension built by setup.py
(``megalodon_kernels.cuda._C``, CUDA tensors) or the emulator extension from
:func:`megalodon_kernels.cuda.build.load_emulator` (CPU tensors). The launchers take raw pointers
and sizes, so this module owns every tensor decision: dtype checks, contiguity, output
allocation (``torch.empty``: tests poison it with NaN, so an unwritten element shows), fp32
side inputs, the CUDA stream. Signatures mirror the ``*_fwd``/``*_bwd`` functions of the
ops' torch backends with ``ext`` in front, so an ``ops/<op>/cuda_impl.py`` is a thin shim.

This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

#: Element types the kernels take (codes of mk::DType in common.cuh).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: fftconv: longest L handled in one block per row (N = 16384 complex points, 128 KiB smem).
FFTCONV_MAX_LEN = 16384


def dtype_code(t: torch.Tensor, name: str) -> int:
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"the CUDA kernels take float32 or bfloat16 {name}, got {t.dtype}")
    return DTYPE_CODES[t.dtype]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _stream(t: torch.Tensor) -> int:
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _check_device(ext, *tensors: torch.Tensor) -> None:
    want = "cpu" if ext.EMULATOR else "cuda"
    for t in tensors:
        if t is not None and t.device.type != want:
            raise ValueError(f"{'the CPU emulator' if ext.EMULATOR else 'the CUDA extension'} needs {want} tensors, "
                             f"got a tensor on {t.device}")


def _on_device_of_first_tensor(fn):
    """Launch on the device of the first tensor argument (the launchers use the current device)."""
    @functools.wraps(fn)
    def wrapper(ext, *args, **kwargs):
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        guard = torch.cuda.device(t.device) if t is not None and t.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            return fn(ext, *args, **kwargs)

    return wrapper


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


# ------------------------------------------------------------------------------------------------
# dropkey_softmax
# ------------------------------------------------------------------------------------------------

def _bhls(shape) -> tuple[int, int, int, int]:
    L, S = shape[-2:]
    H = shape[-3] if len(shape) >= 3 else 1
    return math.prod(shape[:-3]), H, L, S


@_on_device_of_first_tensor
def dropkey_softmax_fwd(ext, scores: torch.Tensor, *, causal: bool, dropkey_p: float, seed: int) -> torch.Tensor:
    code = dtype_code(scores, "scores")
    _check_device(ext, scores)
    x = scores.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    Bf, Hf, L, S = _bhls(x.shape)
    ext.dropkey_softmax_fwd(code, _ptr(x), _ptr(y), Bf, Hf, L, S, bool(causal), float(dropkey_p), int(seed),
                            _stream(x))
    return y


@_on_device_of_first_tensor
def dropkey_softmax_bwd(ext, dy: torch.Tensor, y: torch.Tensor, *, causal: bool, **_unused) -> torch.Tensor:
    code = dtype_code(y, "y")
    _check_device(ext, dy, y)
    yc, dyc = y.contiguous(), dy.to(y.dtype).contiguous()
    dx = torch.empty(yc.shape, dtype=y.dtype, device=y.device)
    Bf, Hf, L, S = _bhls(yc.shape)
    ext.dropkey_softmax_bwd(code, _ptr(yc), _ptr(dyc), _ptr(dx), Bf, Hf, L, S, bool(causal), _stream(yc))
    return dx


# ------------------------------------------------------------------------------------------------
# rotary
# ------------------------------------------------------------------------------------------------

@_on_device_of_first_tensor
def _rotary(ext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, conjugate: bool) -> torch.Tensor:
    code = dtype_code(x, "x")
    _check_device(ext, x, cos, sin)
    B, L, H, d = x.shape
    half = d // 2
    P = cos.shape[0]  # tables (P, L, 1, d/2), P = 1 or B
    c = _f32(cos).reshape(P, L, half)
    s = _f32(sin).reshape(P, L, half)
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    ext.rotary(code, conjugate, _ptr(xc), _ptr(c), _ptr(s), _ptr(y), B, L, H, half, P, _stream(xc))
    return y


def rotary_fwd(ext, x, cos, sin):
    return _rotary(ext, x, cos, sin, False)


def rotary_bwd(ext, dy, cos, sin):
    return _rotary(ext, dy, cos, sin, True)


# ------------------------------------------------------------------------------------------------
# timestep_norm
# ------------------------------------------------------------------------------------------------

@_on_device_of_first_tensor
def timestep_norm_fwd(ext, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps):
    """Returns (y, count, mean, var, saved) like the torch backend; mean/var fp32."""
    code = dtype_code(x, "x")
    _check_device(ext, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask)
    B, L, D = x.shape
    G = int(num_groups)
    dev = x.device
    xc = x.contiguous()
    scale_f, bias_f = _f32(scale), _f32(bias)
    pc = prev_count.to(torch.int64).contiguous()
    pm, pv = _f32(prev_mean), _f32(prev_var)
    mask = padding_mask.to(torch.bool).contiguous()
    y = torch.empty(xc.shape, dtype=x.dtype, device=dev)
    count = torch.empty(B, dtype=torch.int64, device=dev)
    mean = torch.empty(B, G, dtype=torch.float32, device=dev)
    var = torch.empty(B, G, dtype=torch.float32, device=dev)
    cummean = torch.empty(B, L, G, dtype=torch.float32, device=dev)
    cumrstd = torch.empty(B, L, G, dtype=torch.float32, device=dev)
    ws = torch.empty(max(1, ext.timestep_norm_workspace_floats(B, L, D, G)), dtype=torch.float32, device=dev)
    ext.timestep_norm_fwd(code, _ptr(xc), _ptr(scale_f), _ptr(bias_f), _ptr(pc), _ptr(pm), _ptr(pv), _ptr(mask),
                          _ptr(y), _ptr(count), _ptr(mean), _ptr(var), _ptr(cummean), _ptr(cumrstd), _ptr(ws),
                          B, L, D, G, float(eps), _stream(xc))
    saved = (xc, scale_f, pc, pm, mask, cummean, cumrstd)
    return y, count, mean, var, saved


def timestep_norm_bwd(ext, dy, dmean, dvar, saved, num_groups):
    """Returns (dx (x's dtype), dscale, dbias, dprev_mean, dprev_var) (fp32)."""
    xc = saved[0]
    guard = torch.cuda.device(xc.device) if xc.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        return _timestep_norm_bwd(ext, dy, dmean, dvar, saved, num_groups)


def _timestep_norm_bwd(ext, dy, dmean, dvar, saved, num_groups):
    xc, scale_f, pc, pm, mask, cummean, cumrstd = saved
    code = dtype_code(xc, "x")
    B, L, D = xc.shape
    G = int(num_groups)
    dev = xc.device
    dyc = (torch.zeros_like(xc) if dy is None else dy.to(xc.dtype)).contiguous()
    dm = torch.zeros(B, G, dtype=torch.float32, device=dev) if dmean is None else _f32(dmean)
    dv = torch.zeros(B, G, dtype=torch.float32, device=dev) if dvar is None else _f32(dvar)
    _check_device(ext, dyc, dm, dv)
    dx = torch.empty(xc.shape, dtype=xc.dtype, device=dev)
    dscale = torch.empty(D, dtype=torch.float32, device=dev)
    dbias = torch.empty(D, dtype=torch.float32, device=dev)
    dpm = torch.empty(B, G, dtype=torch.float32, device=dev)
    dpv = torch.empty(B, G, dtype=torch.float32, device=dev)
    ws = torch.empty(max(1, ext.timestep_norm_workspace_floats(B, L, D, G)), dtype=torch.float32, device=dev)
    ext.timestep_norm_bwd(code, _ptr(dyc), _ptr(dm), _ptr(dv), _ptr(xc), _ptr(scale_f), _ptr(pc), _ptr(pm),
                          _ptr(mask), _ptr(cummean), _ptr(cumrstd), _ptr(dx), _ptr(dscale), _ptr(dbias), _ptr(dpm),
                          _ptr(dpv), _ptr(ws), B, L, D, G, _stream(xc))
    return dx, dscale, dbias, dpm, dpv


# ------------------------------------------------------------------------------------------------
# fftconv
# ------------------------------------------------------------------------------------------------

@_on_device_of_first_tensor
def fftconv_spectrum(ext, k: torch.Tensor) -> torch.Tensor:
    """rfft of each kernel row, zero-padded to 2N: (D, N + 1) complex64."""
    D, L = k.shape
    N = ext.fftconv_fft_size(L)
    kc = _f32(k)
    kf = torch.empty(D, N + 1, dtype=torch.complex64, device=k.device)
    ext.fftconv_kernel_spectrum(_ptr(kc), _ptr(kf), D, L, _stream(kc))
    return kf


@_on_device_of_first_tensor
def fftconv_fwd(ext, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    code = dtype_code(x, "x")
    _check_device(ext, x, k)
    B, D, L = x.shape
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xc = x.contiguous()
    kf = fftconv_spectrum(ext, k)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    ext.fftconv_fwd(code, _ptr(xc), _ptr(kf), _ptr(y), B, D, L, _stream(xc))
    return y


@_on_device_of_first_tensor
def fftconv_bwd(ext, dy, x, k, need_x: bool = True, need_k: bool = True,
                max_workspace_bytes: int = 256 << 20):
    """(dx in x's dtype or None, dk float32 or None). The dk product spectra are summed over
    batch slices so the workspace stays under ``max_workspace_bytes``."""
    code = dtype_code(x, "x")
    _check_device(ext, dy, x, k)
    B, D, L = x.shape
    dev = x.device
    if x.numel() == 0:  # nothing to convolve: dk is an empty sum
        return (torch.empty(x.shape, dtype=x.dtype, device=dev) if need_x else None,
                torch.zeros(D, L, dtype=torch.float32, device=dev) if need_k else None)
    N = ext.fftconv_fft_size(L)
    xc, dyc = x.contiguous(), dy.to(x.dtype).contiguous()
    kf = fftconv_spectrum(ext, k)
    dx = torch.empty(xc.shape, dtype=x.dtype, device=dev) if need_x else None
    dk = torch.empty(D, L, dtype=torch.float32, device=dev) if need_k else None
    if not need_k:
        ext.fftconv_bwd_dx(code, _ptr(dyc), _ptr(xc), _ptr(kf), _ptr(dx), 0, B, D, L, _stream(xc))
        return dx, None
    row_bytes = D * (N + 1) * 8
    nb = max(1, min(B, max_workspace_bytes // max(1, row_bytes)))
    prod = torch.empty(nb, D, N + 1, dtype=torch.complex64, device=dev)
    acc = torch.empty(D, N + 1, dtype=torch.complex64, device=dev) if nb < B else None
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        ext.fftconv_bwd_dx(code, _ptr(dyc[b0:b1]), _ptr(xc[b0:b1]), _ptr(kf), _ptr(dx[b0:b1]) if dx is not None else 0,
                           _ptr(prod), b1 - b0, D, L, _stream(xc))
        ext.fftconv_bwd_dk(_ptr(prod), _ptr(acc), _ptr(dk), b1 - b0, D, L, b0 > 0, b1 == B, _stream(xc))
    return dx, dk
