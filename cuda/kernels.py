"""Tensor-level API over the compiled CUDA launchers (real extension or CPU emulator) of the ops
without a launch description yet: dropkey_softmax and attention (the others launch from their
``ops/<op>/cuda_impl.py``, see cuda/launch.py).

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

import torch

#: Element types the kernels take (codes of mk::DType in common.cuh).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: The same plus float64, for the ops whose kernels also run in double (double accumulation);
#: an op's launcher passes ``fp64=True`` to :func:`dtype_code` once its kernels have it.
FP64_DTYPE_CODES = {**DTYPE_CODES, torch.float64: 4}


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


def _batch_index(batch_index, B: int, device) -> torch.Tensor | None:
    """A DropKey batch index (B,) as the kernels read it (contiguous int64 on ``device``), or None."""
    if batch_index is None:
        return None
    if batch_index.shape != (B,):
        raise ValueError(f"batch_index must have shape ({B},), got {tuple(batch_index.shape)}")
    return batch_index.to(device=device, dtype=torch.int64).contiguous()


# ------------------------------------------------------------------------------------------------
# --- attention ---
# ------------------------------------------------------------------------------------------------

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
def attention_flash_fwd(ext, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                        batch_index=None):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 or None for Laplace) by the flash kernel.
    ``batch_index`` (B,): the DropKey batch index of each row (None: the row)."""
    _check_device(ext, q, k, v)
    B, L, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    D = flash_head_dim(dh)
    tile = flash_dv_tile(ext, q.dtype, dh)
    ldv = -(-dv // tile) * tile
    qp, kp, vp = _pad_last(q, D), _pad_last(k, D), _pad_last(v, ldv)
    o = torch.empty(B, L, H, ldv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    bidx = _batch_index(batch_index, B, q.device)
    ext.flash_attention_fwd(ATTN_DTYPE_CODES[q.dtype], _ptr(qp), _ptr(kp), _ptr(vp), _ptr(o), _ptr(lse), B, L, S, H,
                            D, ldv, float(scale),
                            *_flash_mask_args(causal, chunk_size, block_causal, attn_fn, dropkey_p, seed),
                            _ptr(bidx), _stream(qp))
    o = o if ldv == dv else o[..., :dv].contiguous()
    return o, (None if attn_fn == "laplace" else lse)


@_on_device_of_first_tensor
def attention_flash_bwd(ext, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                        attn_fn, batch_index=None):
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
    bidx = _batch_index(batch_index, B, q.device)
    ext.flash_attention_bwd(ATTN_DTYPE_CODES[q.dtype], _ptr(qp), _ptr(kp), _ptr(vp), _ptr(dop), _ptr(lse_f),
                            _ptr(delta), _ptr(dq), _ptr(dk), _ptr(dvp), B, L, S, H, D, ldv, float(scale),
                            *_flash_mask_args(causal, chunk_size, block_causal, attn_fn, dropkey_p, seed),
                            _ptr(bidx), _stream(qp))
    cut = lambda x, n: x if x.shape[-1] == n else x[..., :n].contiguous()  # noqa: E731
    return cut(dq, dh), cut(dk, dh), cut(dvp, dv)
# --- end attention ---
