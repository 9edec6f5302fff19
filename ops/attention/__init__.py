"""Attention with bottom-right causal, chunked (Megalodon), blockwise-causal (LeX) masks, DropKey
and Mega's Laplace attention function, as one op (``torch.ops.megalodon_kernels.attention``).

Why one op for all of them: every variant is "scores, a visibility mask, an attention function,
P v", and a fused backend must never materialise the L x S matrix, so the masks have to be
known to the kernel rather than added as a tensor. The semantics (docs/math.md,
attention) are in :func:`attention`'s docstring.

The DropKey mask is a pure function of (seed, b, h, i, j) (``ops/dropkey_rule.py``): the
forward returns the seed it used (an int64 CPU tensor) and the backward regenerates the identical
mask from it.

What the backward needs rides on the op's autograd node: q, k, v, o, lse and the seed, plus, for
an eager call autograd records, the tiles a backend kept (the torch backend's P or DropKey masks,
``tiles_out`` of ``torch_impl.forward``): a fourth output of the op that the node saves with the rest.

Packed rows (``cu_seqlens``): a backend that reads the document bounds itself (``PACKED_NATIVE``:
Triton, FlashAttention-varlen style, one program row per document) runs the packed row in one
call. The others run it as document rows (``ops/_packing.py``): each bucket of documents is
gathered into a zero-padded batch with every document at the start of its row, so a row's chunks
start at its document's start and the causal mask hides the padding (it comes after every valid
query); one backend call per bucket, then the valid rows are scattered back. Either way DropKey
hashes b = the document's index (the bucketed backends take ``batch_index``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, acc_dtype, check_choice, check_float, check_int, check_same_dtype, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, as_dtype, custom_op, empty_like, plain_eager, plain_tensor
from .._packing import check_cu_seqlens, document_bounds, plan
from ..dropkey_rule import DRAW_SEED, resolve_seed, seed_tensor, seed_tensor_like, seed_value

__all__ = ["attention", "ATTN_FNS"]

BACKENDS = OpBackends("attention", {
    "cuda": "megalodon_kernels.ops.attention.cuda_impl",
    "triton": "megalodon_kernels.ops.attention.triton_impl",
    "torch": "megalodon_kernels.ops.attention.torch_impl",
})

autotune.register(
    "attention",
    # attn_fn is not part of the key: the shipped tables were tuned for softmax and Laplace runs the
    # same tiles (a backend that cannot run Laplace says so in not_supported_reasons)
    key=lambda q, k, v, chunk_size, causal, block_causal, dropkey, attn_fn="softmax": {
        "H": q.shape[2], "dh": q.shape[3], "dv": v.shape[3], "L": autotune.pow2_bucket(q.shape[1]),
        "S": autotune.pow2_bucket(k.shape[1]), "C": chunk_size or 0, "causal": causal,
        "block_causal": block_causal, "dropkey": dropkey},
    space=BACKENDS.config_spaces,  # each backend module's CONFIG_SPACE, read on first use
)
ATTN_FNS = ("softmax", "laplace")


def _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend):
    # attn_fn is an input of the choice: the CUDA backend has Laplace attention on its flash path only
    return BACKENDS.select(backend, {"q": q, "k": k, "v": v, "chunk_size": chunk_size, "causal": causal,
                                     "block_causal": block_causal, "dropkey": dropkey_p > 0.0,
                                     "attn_fn": attn_fn},
                           device=q.device, dtype=q.dtype)


def _document_rows(cu_seqlens, L, dropkey_p):
    """(bucket, extra backend kwargs) of a packed row: the documents' rows (left-aligned, row
    length the next power of two of the document's length, so a row's chunks are the document's
    own) and, with DropKey, each row's document index as the rule's batch index."""
    for bucket in plan(cu_seqlens, L).buckets:
        yield bucket, ({"batch_index": bucket.docs} if dropkey_p > 0.0 else {})


def _native(cu_seqlens, L) -> dict:
    """The packed-row arguments of a backend whose kernels read the document bounds themselves
    (``PACKED_NATIVE``): the checked bounds and the longest document (its query grid)."""
    return {"cu_seqlens": document_bounds(cu_seqlens, L), "max_seqlen": plan(cu_seqlens, L).longest}


def _packed_fwd(q, k, v, cu_seqlens, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend):
    """(o r(1 L H dv), lse r(1 H L) or None for laplace) of a packed call: one backend call per
    bucket of document rows (the backend chosen for the rows' shapes), valid rows scattered back."""
    L, H = q.shape[1], q.shape[2]
    impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
    if getattr(impl.module, "PACKED_NATIVE", False):
        return impl.module.forward(q, k, v, scale=scale, causal=causal, chunk_size=chunk_size,
                                         block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                                         **_native(cu_seqlens, L), **impl.config)
    o = q.new_empty(1, L, H, v.shape[-1])
    lse = q.new_empty(1, H, L, dtype=acc_dtype(q.dtype)) if attn_fn == "softmax" else None
    for bucket, extra in _document_rows(cu_seqlens, L, dropkey_p):
        qr, kr, vr = (bucket.rows(t, 1) for t in (q, k, v))
        impl = _select(qr, kr, vr, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
        o_rows, lse_rows = impl.module.forward(qr, kr, vr, scale=scale, causal=causal, chunk_size=chunk_size,
                                                     block_causal=block_causal, dropkey_p=dropkey_p, seed=seed,
                                                     attn_fn=attn_fn, **extra, **impl.config)
        bucket.put(o_rows, o, 1)
        if lse is not None:
            bucket.put(lse_rows, lse, 2)
    return o, lse


def _packed_bwd(do, q, k, v, o, lse, cu_seqlens, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                attn_fn, backend):
    """(dq, dk, dv) of a packed call. The padded query rows of a document row have q = dO = O = 0
    (and lse = 0), so their dS is 0 and they add nothing to dk / dv; the causal mask keeps the
    padded keys out of every valid row."""
    L = q.shape[1]
    impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)  # the forward's choice
    if getattr(impl.module, "PACKED_NATIVE", False):
        return impl.module.backward(do, q, k, v, o, lse, scale=scale, causal=causal, chunk_size=chunk_size,
                                         block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                                         **_native(cu_seqlens, L), **impl.config)
    dq, dk, dv = (empty_like(t) for t in (q, k, v))
    for bucket, extra in _document_rows(cu_seqlens, L, dropkey_p):
        dor, qr, kr, vr, orr = (bucket.rows(t, 1) for t in (do, q, k, v, o))
        lser = None if lse is None else bucket.rows(lse, 2)
        impl = _select(qr, kr, vr, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
        grads = impl.module.backward(dor, qr, kr, vr, orr, lser, scale=scale, causal=causal,
                                          chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                                          seed=seed, attn_fn=attn_fn, **extra, **impl.config)
        for rows, out in zip(grads, (dq, dk, dv)):
            bucket.put(rows, out, 1)
    return dq, dk, dv


def _keeps_tiles(impl) -> bool:
    """Whether the chosen backend can keep tiles for its backward (the torch backend)."""
    return getattr(impl.module, "KEEPS_TILES", False)


def _fwd_fake(q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend, cu_seqlens=None,
              keep_tiles=False):
    if keep_tiles:
        raise ValueError("attention: keep_tiles=True is for eager calls (the kept tiles' size depends on the "
                         "backend's tiling); a traced call keeps nothing")
    B, L, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    o = q.new_empty(B, L, H, v.shape[-1])
    lse = q.new_empty(B, H, L, dtype=acc) if attn_fn == "softmax" else absent(q, acc)
    return o, lse, seed_tensor_like(), absent(q, acc)


@custom_op("attention", _fwd_fake, tags=(torch.Tag.nondeterministic_seeded,))
def attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, chunk_size: Optional[int],
                 block_causal: bool, dropkey_p: float, seed: int, attn_fn: str, backend: str,
                 cu_seqlens: Optional[Tensor] = None,
                 keep_tiles: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (o, and for the backward: lse r(B H L) in the accumulation dtype (empty for laplace), the
    seed used (an int64 CPU tensor (1,)) and the tiles the backend kept (empty: none)).
    ``seed`` = DRAW_SEED draws one from torch's default generator here, at run time (so compiled
    and eager draw the same seeds). With ``cu_seqlens`` (B = 1, S = L) every document attends
    within itself (_packed_fwd). ``keep_tiles``: an eager call autograd records, whose backend
    may keep tiles for the backward (module doc)."""
    acc = acc_dtype(q.dtype)
    seed = resolve_seed(None) if seed == DRAW_SEED else seed
    tiles = None
    if cu_seqlens is not None:
        o, lse = _packed_fwd(q, k, v, cu_seqlens, scale=scale, causal=causal, chunk_size=chunk_size,
                             block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                             backend=backend)
    else:
        impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
        kept = []  # the tiles the backend keeps, if asked to
        extra = {"tiles_out": kept} if keep_tiles and _keeps_tiles(impl) else {}
        o, lse = impl.module.forward(q, k, v, scale=scale, causal=causal, chunk_size=chunk_size,
                                     block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                                     **extra, **impl.config)
        tiles = kept[0] if kept else None
    lse = as_dtype(lse, acc) if attn_fn == "softmax" else absent(q, acc)
    return o, lse, seed_tensor(seed), absent(q, acc) if tiles is None else tiles


def _bwd_fake(do, q, k, v, o, lse, seed, scale, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend,
              cu_seqlens=None, tiles=None):
    return tuple(empty_like(t) for t in (q, k, v))


@custom_op("attention_bwd", _bwd_fake)
def attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, scale: float,
                     causal: bool, chunk_size: Optional[int], block_causal: bool, dropkey_p: float, attn_fn: str,
                     backend: str, cu_seqlens: Optional[Tensor] = None,
                     tiles: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv) in the inputs' dtypes; ``seed`` and ``tiles`` are the forward's outputs."""
    lse = lse if attn_fn == "softmax" else None
    if cu_seqlens is not None:
        return _packed_bwd(do, q, k, v, o, lse, cu_seqlens, scale=scale, causal=causal, chunk_size=chunk_size,
                           block_causal=block_causal, dropkey_p=dropkey_p, seed=seed_value(seed), attn_fn=attn_fn,
                           backend=backend)
    impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
    kept = {"tiles": tiles} if tiles is not None and _keeps_tiles(impl) else {}
    dq, dk, dv = impl.module.backward(
        do, q, k, v, o, lse, scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
        dropkey_p=dropkey_p, seed=seed_value(seed), attn_fn=attn_fn, **kept, **impl.config)
    return as_dtype(dq, q.dtype), as_dtype(dk, k.dtype), as_dtype(dv, v.dtype)


class _Options(NamedTuple):
    """The forward's non-tensor arguments the backward op takes, in its order."""

    scale: float
    causal: bool
    chunk_size: Optional[int]
    block_causal: bool
    dropkey_p: float
    attn_fn: str
    backend: str


def _setup(ctx, inputs, output):
    q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, _seed, attn_fn, backend, cu_seqlens, _keep = inputs
    o, lse, seed_t, tiles = output
    ctx.save_for_backward(q, k, v, o, lse, seed_t, cu_seqlens, tiles if tiles.numel() else None)
    ctx.options = _Options(scale, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)
    ctx.mark_non_differentiable(lse, seed_t, tiles)  # residuals: no gradient (fewer outputs for autograd)
    ctx.set_materialize_grads(False)  # o is the one differentiable output: no zeros for the others


def _backward(ctx, do, _dlse, _dseed, _dtiles):
    if do is None:  # an undefined gradient of o (grads are not zero-filled, see _setup): none for the inputs
        return (None,) * len(ctx.needs_input_grad)
    q, k, v, o, lse, seed_t, cu_seqlens, tiles = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, seed_t, *ctx.options, cu_seqlens, tiles)
    return dq, dk, dv, *(None,) * (len(ctx.needs_input_grad) - 3)  # the other inputs take no gradient


attention_op.register_autograd(_backward, setup_context=_setup)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float = 1.0, causal: bool = True,
              chunk_size: int | None = None, block_causal: bool = False, dropkey_p: float = 0.0, seed=None,
              attn_fn: str = "softmax", backend: str = "auto", cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention o = P v with causal / chunked / blockwise-causal masks and DropKey.

    Args:
        q: r(B L H dh) queries; float16/bfloat16/float32/float64.
        k: r(B S H dh) keys, same dtype and device as q.
        v: r(B S H dv) values, same dtype and device as q.
        scale: finite float multiplying q.k (upstream Megalodon uses 1.0 and pre-scales q).
        causal: bottom-right aligned causal mask (see below).
        chunk_size: None, or C > 0 for block-diagonal attention over chunks of C key positions.
        block_causal: with chunk_size only: each query also sees the previous chunk (LeX).
        dropkey_p: DropKey drop probability in [0, 1); 0 disables it.
        seed: int in [0, 2**63 - 1] or None; with dropkey_p > 0, None draws one from torch's
            default generator (so ``torch.manual_seed`` makes it reproducible).
        attn_fn: "softmax" or "laplace" (Mega).
        backend: "auto", "torch", "triton" or "cuda".
        cu_seqlens: None, or an integer tensor (n + 1,) on q's device delimiting n documents
            packed in one row (0 first, non-decreasing, L last; empty documents allowed): q, k, v
            of batch size 1 with S == L, causal=True. Every document attends only within itself,
            exactly as if run on its own (see below).

    Returns:
        o: r(B L H dv) in q's dtype.

    Semantics, for query index i in [0, L) and key index j in [0, S):

    * Query i sits at key position pos_i = i + (S - L) (bottom-right alignment: S > L is a KV
      cache of S - L earlier keys; S < L leaves the first L - S rows with no causal key).
    * visible(i, j) = (not causal or j <= pos_i) and, if chunk_size = C is given,
      chunk(j) == chunk(pos_i), or with block_causal chunk(j) in {chunk(pos_i) - 1, chunk(pos_i)},
      where chunk(t) = floor(t / C) (floor also for negative t).
    * DropKey: keep(b, h, i, j) = ``ops.dropkey_rule.keep_mask(seed, dropkey_p, b, h, i, j)`` with
      i, j the query and key indices of THIS call. A dropped logit becomes -inf BEFORE the
      attention function; nothing is rescaled. The backward regenerates the same mask from the
      saved seed.
    * s_ij = scale * q_i . k_j (per batch and head). softmax: P_i = softmax of s_i over the
      visible and kept keys; a row with none has P_i = 0, so o_i = 0 (and zero gradients).
      laplace: P_ij = 0.5 * (1 + erf((s_ij - mu) / (sigma * sqrt 2))) on visible and kept
      entries and 0 elsewhere, mu = sqrt(1/2), sigma = sqrt(1 / (4 pi)), not normalised.
    * o_i = sum_j P_ij v_j, computed in fp32 (fp64 for fp64 inputs), rounded once to q's dtype.
    * Packed (``cu_seqlens``): for the document [s, e) every index above is taken within the
      document (i - s, j - s), keys of other documents are never visible, chunks of C start at
      s, and DropKey uses b = the document's index: a packed call equals the padded batch call
      whose row d holds document d (same seed), and each document's output equals a call on that
      document alone (without DropKey). Runs as document rows, one backend call per bucket of
      row lengths (docs/math.md, attention).

    Example::

        # Megalodon: causal attention within chunks of 2048; LeX: add block_causal=True.
        o = attention(q, k, v, chunk_size=2048, dropkey_p=0.1, seed=step)
        # Decoding with a KV cache: q (B, 1, H, dh), k/v (B, cache + 1, H, d).
        o = attention(q_new, k_all, v_all)
        # Documents of 100, 23 and 900 tokens packed into one row (batch size 1, L = 1023):
        cu = torch.tensor([0, 100, 123, 1023], device=q.device)
        o = attention(q, k, v, chunk_size=2048, cu_seqlens=cu)
    """
    check_tensor("q", q, (None, None, None, None), REAL_DTYPES, dims="(B, L, H, dh)")
    B, L, H, dh = q.shape
    check_tensor("k", k, (B, None, H, dh), REAL_DTYPES, device=q.device, dims="(B, S, H, dh)")
    S = k.shape[1]
    check_tensor("v", v, (B, S, H, None), REAL_DTYPES, device=q.device, dims="(B, S, H, dv)")
    check_same_dtype(("q", "k", "v"), (q, k, v))
    scale = check_float("scale", scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    _check_bool("causal", causal)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, minimum=1)
    _check_bool("block_causal", block_causal)
    if block_causal and chunk_size is None:
        raise ValueError("block_causal=True needs chunk_size (the key block length); got chunk_size=None")
    dropkey_p = check_float("dropkey_p", dropkey_p, low=0.0, high=1.0, high_open=True)
    check_choice("attn_fn", attn_fn, ATTN_FNS)
    # Validate an explicit seed always; with DropKey on and no seed, the op draws one (DRAW_SEED).
    seed = resolve_seed(seed) if seed is not None else (DRAW_SEED if dropkey_p > 0.0 else 0)
    check_backend(backend)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch=B, length=L, device=q.device, batch_arg="q")
        if S != L:
            raise ValueError(f"with cu_seqlens, k and v must be the same packed row as q: k has S = {S} keys but q "
                             f"has L = {L} queries")
        if not causal:
            raise ValueError("packed attention (cu_seqlens) is causal-only: with causal=False a document row's "
                             "padded keys would be visible; pass causal=True or unpack the documents")
    # an eager call autograd records may keep tiles for its backward (module doc); a traced one may
    # not (their size depends on the backend's tiling, which its fake implementation cannot know)
    keep_tiles = (cu_seqlens is None and torch.is_grad_enabled()
                  and (q.requires_grad or k.requires_grad or v.requires_grad) and plain_eager(profiler_ok=True)
                  and plain_tensor(q))  # meta or fake tensors run the fake, which keeps nothing
    return attention_op(q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend,
                        cu_seqlens, keep_tiles)[0]
