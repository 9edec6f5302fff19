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
#: The same plus float64, for the ops whose kernels also run in double (double accumulation);
#: an op's launcher passes ``fp64=True`` to :func:`dtype_code` once its kernels have it.
FP64_DTYPE_CODES = {**DTYPE_CODES, torch.float64: 4}
#: fftconv: longest L handled in one block per row (N = 16384 complex points, 128 KiB smem);
#: longer L runs the multi-pass four-step FFT (cuda/fftconv_long.cuh) up to FFTCONV_MAX_LEN.
FFTCONV_ONE_BLOCK_MAX_LEN = 16384
FFTCONV_MAX_LEN = 1 << 27
#: The same in float64 (double arithmetic, complex128 values: 16 B per point, so one block holds
#: N = 8192 in the same 128 KiB and the multi-pass plan, 128 KiB per pass at most, ends at 2^25).
FFTCONV_FP64_ONE_BLOCK_MAX_LEN = 8192
FFTCONV_FP64_MAX_LEN = 1 << 25


def dtype_code(t: torch.Tensor, name: str, fp64: bool = False) -> int:
    codes = FP64_DTYPE_CODES if fp64 else DTYPE_CODES
    if t.dtype not in codes:
        raise TypeError(f"the CUDA kernels take {_dtype_names(fp64)} {name}, got {t.dtype}")
    return codes[t.dtype]


def _dtype_names(fp64: bool) -> str:
    return "float32, bfloat16 or float64" if fp64 else "float32 or bfloat16"


def _acc_dtype(like: torch.Tensor) -> torch.dtype:
    """The kernels' accumulation dtype for inputs like ``like``: float64 for float64, else float32."""
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _acc(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A side input (parameters, tables) in the accumulation dtype of ``like``; contiguous."""
    return t.to(_acc_dtype(like)).contiguous()


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
    """Probabilities in scores' dtype (float32, bfloat16, or float64 with fp64 exp and sums)."""
    code = dtype_code(scores, "scores", fp64=True)
    _check_device(ext, scores)
    x = scores.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    Bf, Hf, L, S = _bhls(x.shape)
    ext.dropkey_softmax_fwd(code, _ptr(x), _ptr(y), Bf, Hf, L, S, bool(causal), float(dropkey_p), int(seed),
                            _stream(x))
    return y


@_on_device_of_first_tensor
def dropkey_softmax_bwd(ext, dy: torch.Tensor, y: torch.Tensor, *, causal: bool, **_unused) -> torch.Tensor:
    code = dtype_code(y, "y", fp64=True)
    _check_device(ext, dy, y)
    yc, dyc = y.contiguous(), dy.to(y.dtype).contiguous()
    dx = torch.empty(yc.shape, dtype=y.dtype, device=y.device)
    Bf, Hf, L, S = _bhls(yc.shape)
    ext.dropkey_softmax_bwd(code, _ptr(yc), _ptr(dyc), _ptr(dx), Bf, Hf, L, S, bool(causal), _stream(yc))
    return dx


# ------------------------------------------------------------------------------------------------
# fftconv
# ------------------------------------------------------------------------------------------------

def fftconv_max_len(dtype: torch.dtype) -> int:
    """Longest L the CUDA fftconv takes for x of this dtype (2^27; 2^25 in float64)."""
    return FFTCONV_FP64_MAX_LEN if dtype == torch.float64 else FFTCONV_MAX_LEN


def _fftconv_real(x: torch.Tensor) -> tuple[int, torch.dtype, torch.dtype]:
    """(code, real dtype, complex dtype) of x's arithmetic: float64 x computes in double
    (k, dk and every spectrum in float64 / complex128), float32 and bfloat16 x in float32."""
    if x.dtype == torch.float64:
        return FP64_DTYPE_CODES[torch.float64], torch.float64, torch.complex128
    return DTYPE_CODES[torch.float32], torch.float32, torch.complex64


def _fftconv_workspace(ext, L: int, rows: int, max_workspace_bytes: int, device, code: int = 0):
    """(ws, ws_rows): the multi-pass FFT's workspace, ws_rows rows of N complex values of the
    arithmetic type ``code`` (complex64, or complex128 for float64: half the rows for the same
    bytes; the launchers walk the rows in chunks of ws_rows), capped at max_workspace_bytes but at
    least one row; (None, 0) up to the one-block limit (no workspace)."""
    row_floats = ext.fftconv_workspace_row_floats(L, code)
    if row_floats == 0 or rows == 0:
        return None, 0
    ws_rows = max(1, min(rows, max_workspace_bytes // (4 * row_floats)))
    return torch.empty(ws_rows, row_floats, dtype=torch.float32, device=device), ws_rows


@_on_device_of_first_tensor
def fftconv_spectrum(ext, k: torch.Tensor, max_workspace_bytes: int = 256 << 20, like: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """rfft of each kernel row, zero-padded to 2N: (D, N + 1) complex64, or complex128 when
    ``like`` (x) is float64 (above the one-block limit the bins are in the multi-pass layout of
    cuda/fftconv_long.cuh, which only these kernels read)."""
    D, L = k.shape
    N = ext.fftconv_fft_size(L)
    code, real, cplx = _fftconv_real(k if like is None else like)
    kc = k.to(real).contiguous()
    kf = torch.empty(D, N + 1, dtype=cplx, device=k.device)
    ws, ws_rows = _fftconv_workspace(ext, L, D, max_workspace_bytes, k.device, code)
    ext.fftconv_kernel_spectrum(code, _ptr(kc), _ptr(kf), D, L, _ptr(ws), ws_rows, _stream(kc))
    return kf


@_on_device_of_first_tensor
def fftconv_fwd(ext, x: torch.Tensor, k: torch.Tensor, max_workspace_bytes: int = 256 << 20) -> torch.Tensor:
    """y (x's dtype), computed in float32 (float64 for float64 x; k is converted to that type).
    Above the one-block limit a workspace of at most ``max_workspace_bytes`` (at least one row of
    N complex values) is walked in row chunks."""
    code = dtype_code(x, "x", fp64=True)
    _check_device(ext, x, k)
    B, D, L = x.shape
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xc = x.contiguous()
    kf = fftconv_spectrum(ext, k, max_workspace_bytes, like=x)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    ws, ws_rows = _fftconv_workspace(ext, L, B * D, max_workspace_bytes, x.device, code)
    ext.fftconv_fwd(code, _ptr(xc), _ptr(kf), _ptr(y), B, D, L, _ptr(ws), ws_rows, _stream(xc))
    return y


@_on_device_of_first_tensor
def fftconv_bwd(ext, dy, x, k, need_x: bool = True, need_k: bool = True,
                max_workspace_bytes: int = 256 << 20):
    """(dx in x's dtype or None, dk or None): dk float32, or float64 for float64 x. The dk product
    spectra are summed over batch slices so the workspace stays under ``max_workspace_bytes`` (at
    least one slice; above the one-block limit the multi-pass FFT's row workspace is capped by the
    same figure)."""
    code = dtype_code(x, "x", fp64=True)
    _check_device(ext, dy, x, k)
    rcode, real, cplx = _fftconv_real(x)
    B, D, L = x.shape
    dev = x.device
    if x.numel() == 0:  # nothing to convolve: dk is an empty sum
        return (torch.empty(x.shape, dtype=x.dtype, device=dev) if need_x else None,
                torch.zeros(D, L, dtype=real, device=dev) if need_k else None)
    N = ext.fftconv_fft_size(L)
    xc, dyc = x.contiguous(), dy.to(x.dtype).contiguous()
    kf = fftconv_spectrum(ext, k, max_workspace_bytes, like=x)
    dx = torch.empty(xc.shape, dtype=x.dtype, device=dev) if need_x else None
    dk = torch.empty(D, L, dtype=real, device=dev) if need_k else None
    if not need_k:
        ws, ws_rows = _fftconv_workspace(ext, L, B * D, max_workspace_bytes, dev, code)
        ext.fftconv_bwd_dx(code, _ptr(dyc), _ptr(xc), _ptr(kf), _ptr(dx), 0, B, D, L, _ptr(ws), ws_rows, _stream(xc))
        return dx, None
    row_bytes = D * (N + 1) * kf.element_size()
    nb = max(1, min(B, max_workspace_bytes // max(1, row_bytes)))
    prod = torch.empty(nb, D, N + 1, dtype=cplx, device=dev)
    acc = torch.empty(D, N + 1, dtype=cplx, device=dev) if nb < B else None
    ws, ws_rows = _fftconv_workspace(ext, L, max(nb * D, D), max_workspace_bytes, dev, code)
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        ext.fftconv_bwd_dx(code, _ptr(dyc[b0:b1]), _ptr(xc[b0:b1]), _ptr(kf), _ptr(dx[b0:b1]) if dx is not None else 0,
                           _ptr(prod), b1 - b0, D, L, _ptr(ws), ws_rows, _stream(xc))
        ext.fftconv_bwd_dk(rcode, _ptr(prod), _ptr(acc), _ptr(dk), b1 - b0, D, L, b0 > 0, b1 == B, _ptr(ws), ws_rows,
                           _stream(xc))
    return dx, dk


# ------------------------------------------------------------------------------------------------
# --- attention ---
# ------------------------------------------------------------------------------------------------

def _attn_visible(L: int, S: int, chunk_size, block_causal: bool, device) -> torch.Tensor | None:
    """(L, S) bool of the chunk / block_causal visibility (None without chunk_size); the causal
    part is left to the dropkey_softmax kernel. Query i sits at key position i + S - L."""
    if chunk_size is None:
        return None
    pos = torch.arange(L, device=device).view(L, 1) + (S - L)
    cp = torch.div(pos, chunk_size, rounding_mode="floor")
    cj = torch.div(torch.arange(S, device=device).view(1, S), chunk_size, rounding_mode="floor")
    return (cj == cp) | (cj == cp - 1) if block_causal else cj == cp


def _attn_probs(ext, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed):
    """(P (B, H, L, S), s (B, H, L, S)) of the matmul path (scores masked with -inf), both in
    _acc_dtype(q): float64 q/k/v run float64 matmuls and the fp64 dropkey_softmax kernel."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    acc = _acc_dtype(q)
    s = torch.matmul(q.transpose(1, 2).to(acc), k.transpose(1, 2).to(acc).transpose(-1, -2))
    s.mul_(scale)
    vis = _attn_visible(L, S, chunk_size, block_causal, q.device)
    if vis is not None:
        s.masked_fill_(~vis, float("-inf"))
    # The kernel's (flat batch, head, row, column) of a (B, H, L, S) tensor are the attention's (b, h, i, j).
    p = dropkey_softmax_fwd(ext, s, causal=causal, dropkey_p=dropkey_p, seed=seed)
    return p, s


def attention_matmul_fwd(ext, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 (fp64 for float64 q); -inf for rows with no
    visible kept key)."""
    _check_device(ext, q, k, v)
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        o = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype, device=q.device)
        return o, torch.full((B, H, L), float("-inf"), dtype=_acc_dtype(q), device=q.device)
    p, s = _attn_probs(ext, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed)
    o = torch.matmul(p, v.transpose(1, 2).to(p.dtype)).transpose(1, 2).to(q.dtype).contiguous()
    # lse from the largest probability: p_max = exp(s_max - lse) exactly where s is largest.
    pmax, idx = p.max(dim=-1, keepdim=True)
    lse = (s.gather(-1, idx) - pmax.log()).squeeze(-1)
    lse = lse.masked_fill(pmax.squeeze(-1) == 0, float("-inf"))
    return o, lse


def attention_matmul_bwd(ext, do, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed):
    """(dq, dk, dv) in the input dtypes; P is recomputed by the forward kernel (same DropKey mask)."""
    _check_device(ext, do, q, k, v)
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    p, _ = _attn_probs(ext, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed)
    acc = lambda x: x.transpose(1, 2).to(p.dtype)  # noqa: E731  (B, H, T, d) in _acc_dtype(q)
    dot, qt, kt, vt = acc(do), acc(q), acc(k), acc(v)
    dv = torch.matmul(p.transpose(-1, -2), dot)
    dp = torch.matmul(dot, vt.transpose(-1, -2)).contiguous()
    ds = dropkey_softmax_bwd(ext, dp, p, causal=causal)  # P (dP - rowsum(P dP)); 0 where P = 0
    dq = torch.matmul(ds, kt).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qt).mul_(scale)
    back = lambda x, like: x.transpose(1, 2).to(like.dtype).contiguous()  # noqa: E731
    return back(dq, q), back(dk, k), back(dv, v)
#: Element type codes of the flash attention launchers (float32 runs in the emulator only).
ATTN_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Padded head dims the flash kernels are compiled for.
FLASH_HEAD_DIMS = (64, 128, 256)


def flash_head_dim(dh: int) -> int | None:
    """The compiled head dim q/k are zero-padded to (None: dh > 256)."""
    return next((d for d in FLASH_HEAD_DIMS if dh <= d), None)


def flash_dv_tile(ext, dtype: torch.dtype, dh: int) -> int:
    """Columns of v per forward CTA for (dtype, dh); 0 when no flash kernel is compiled for them."""
    D = flash_head_dim(dh)
    if D is None or dtype not in ATTN_DTYPE_CODES:
        return 0
    return int(ext.flash_attention_dv_tile(ATTN_DTYPE_CODES[dtype], D))


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """Contiguous x with the last dim zero-padded to n (zeros change no dot product)."""
    if x.shape[-1] == n:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, n - x.shape[-1])).contiguous()


def _flash_mask_args(causal, chunk_size, block_causal, attn_fn, dropkey_p, seed):
    return (bool(causal), int(chunk_size or 0), bool(block_causal), attn_fn == "laplace", float(dropkey_p), int(seed))


@_on_device_of_first_tensor
def attention_flash_fwd(ext, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 or None for Laplace) by the flash kernel."""
    _check_device(ext, q, k, v)
    B, L, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    D = flash_head_dim(dh)
    tile = flash_dv_tile(ext, q.dtype, dh)
    ldv = -(-dv // tile) * tile
    qp, kp, vp = _pad_last(q, D), _pad_last(k, D), _pad_last(v, ldv)
    o = torch.empty(B, L, H, ldv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    ext.flash_attention_fwd(ATTN_DTYPE_CODES[q.dtype], _ptr(qp), _ptr(kp), _ptr(vp), _ptr(o), _ptr(lse), B, L, S, H,
                            D, ldv, float(scale),
                            *_flash_mask_args(causal, chunk_size, block_causal, attn_fn, dropkey_p, seed), _stream(qp))
    o = o if ldv == dv else o[..., :dv].contiguous()
    return o, (None if attn_fn == "laplace" else lse)


@_on_device_of_first_tensor
def attention_flash_bwd(ext, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                        attn_fn):
    """(dq, dk, dv) in the input dtypes by the flash backward kernels (P regenerated from lse)."""
    _check_device(ext, do, q, k, v, o)
    B, L, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    D = flash_head_dim(dh)
    tile = flash_dv_tile(ext, q.dtype, dh)
    ldv = -(-dv // tile) * tile
    laplace = attn_fn == "laplace"
    qp, kp, vp = _pad_last(q, D), _pad_last(k, D), _pad_last(v, ldv)
    dop = _pad_last(do.to(q.dtype), ldv)
    if laplace:
        lse_f = delta = torch.zeros(1, dtype=torch.float32, device=q.device)  # unused by the kernels
    else:
        lse_f = lse.to(torch.float32).contiguous()
        # delta = rowsum(dO * O) in fp32 (B, H, L): one elementwise pass, as the torch backend.
        delta = (do.to(torch.float32) * o.to(torch.float32)).sum(-1).transpose(1, 2).contiguous()
    dq = torch.empty(B, L, H, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    dvp = torch.empty(B, S, H, ldv, dtype=q.dtype, device=q.device)
    ext.flash_attention_bwd(ATTN_DTYPE_CODES[q.dtype], _ptr(qp), _ptr(kp), _ptr(vp), _ptr(dop), _ptr(lse_f),
                            _ptr(delta), _ptr(dq), _ptr(dk), _ptr(dvp), B, L, S, H, D, ldv, float(scale),
                            *_flash_mask_args(causal, chunk_size, block_causal, attn_fn, dropkey_p, seed), _stream(qp))
    cut = lambda x, n: x if x.shape[-1] == n else x[..., :n].contiguous()  # noqa: E731
    return cut(dq, dh), cut(dk, dh), cut(dvp, dv)
# --- end attention ---
