"""Attention with bottom-right causal, chunked (Megalodon), blockwise-causal (LeX) masks, DropKey
and Mega's Laplace attention function, as one op (``torch.ops.megalodon_kernels.attention``).

Why one op for all of them: every variant is "scores, a visibility mask, an attention function,
P v", and a fused backend must never materialise the L x S matrix, so the masks have to be
known to the kernel rather than added as a tensor. The semantics (docs/math.md,
attention) are in :func:`attention`'s docstring.

The DropKey mask is a pure function of (seed, b, h, i, j) (``ops/dropkey_rule.py``): the
forward returns the seed it used (an int64 CPU tensor) and the backward regenerates the identical
mask from it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, acc_dtype, check_choice, check_float, check_int, check_same_dtype, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, custom_op, empty_like
from ..dropkey_rule import DRAW_SEED, resolve_seed, seed_tensor, seed_tensor_like, seed_value

__all__ = ["attention", "ATTN_FNS"]

BACKENDS = OpBackends("attention", {
    "cuda": "megalodon_kernels.ops.attention.cuda_impl",
    "torch": "megalodon_kernels.ops.attention.torch_impl",
    "triton": "megalodon_kernels.ops.attention.triton_impl",
})

autotune.register(
    "attention",
    key=lambda q, k, v, chunk_size, causal, block_causal, dropkey: {
        "H": q.shape[2], "dh": q.shape[3], "dv": v.shape[3], "L": autotune.pow2_bucket(q.shape[1]),
        "S": autotune.pow2_bucket(k.shape[1]), "C": chunk_size or 0, "causal": causal,
        "block_causal": block_causal, "dropkey": dropkey},
    # cuda: "auto" = the CuTe flash kernel where it supports the inputs, else cuBLAS + dropkey_softmax
    space={"cuda": {"path": ["auto", "matmul"]},
           "triton": {"BLOCK_M": [64], "BLOCK_N": [64], "num_warps": [8], "num_stages": [2], "num_stages_bwd": [1],
                      "maxnreg_bwd": [255]},
           "torch": {"block_q": [128, 64, 256], "chunks_per_step": [64, 0, 4, 16], "max_block_elems": [1 << 22]}},
)
ATTN_FNS = ("softmax", "laplace")


def _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, backend):
    return BACKENDS.select(backend, {"q": q, "k": k, "v": v, "chunk_size": chunk_size, "causal": causal,
                                     "block_causal": block_causal, "dropkey": dropkey_p > 0.0},
                           device=q.device, dtype=q.dtype)


def _fwd_fake(q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend):
    B, L, H, _ = q.shape
    o = q.new_empty(B, L, H, v.shape[-1])
    lse = q.new_empty(B, H, L, dtype=acc_dtype(q.dtype)) if attn_fn == "softmax" else absent(q, acc_dtype(q.dtype))
    return o, lse, seed_tensor_like()


@custom_op("attention", _fwd_fake, tags=(torch.Tag.nondeterministic_seeded,))
def attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, chunk_size: Optional[int],
                 block_causal: bool, dropkey_p: float, seed: int, attn_fn: str,
                 backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (o, and for the backward lse r(B H L) in the accumulation dtype (a placeholder for
    laplace) and the seed used, an int64 CPU tensor (1,)). ``seed`` = DRAW_SEED draws one from
    torch's default generator here, at run time (so compiled and eager draw the same seeds)."""
    impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, backend)
    seed = resolve_seed(None) if seed == DRAW_SEED else seed
    o, lse = impl.module.attention_fwd(q, k, v, scale=scale, causal=causal, chunk_size=chunk_size,
                                       block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                                       **impl.config)
    acc = acc_dtype(q.dtype)
    lse = lse.to(acc) if attn_fn == "softmax" else absent(q, acc)
    return o, lse, seed_tensor(seed)


def _bwd_fake(do, q, k, v, o, lse, seed, scale, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend):
    return tuple(empty_like(t) for t in (q, k, v))


@custom_op("attention_bwd", _bwd_fake)
def attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, scale: float,
                     causal: bool, chunk_size: Optional[int], block_causal: bool, dropkey_p: float, attn_fn: str,
                     backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv) in the inputs' dtypes; ``seed`` is the forward's seed tensor."""
    impl = _select(q, k, v, causal, chunk_size, block_causal, dropkey_p, backend)
    dq, dk, dv = impl.module.attention_bwd(
        do, q, k, v, o, lse if attn_fn == "softmax" else None, scale=scale, causal=causal, chunk_size=chunk_size,
        block_causal=block_causal, dropkey_p=dropkey_p, seed=seed_value(seed), attn_fn=attn_fn, **impl.config)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _setup(ctx, inputs, output):
    q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend = inputs
    o, lse, seed_t = output
    ctx.save_for_backward(q, k, v, o, lse, seed_t)
    ctx.args = (scale, causal, chunk_size, block_causal, dropkey_p, attn_fn, backend)


def _backward(ctx, do, _dlse, _dseed):
    q, k, v, o, lse, seed_t = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, seed_t, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float = 1.0, causal: bool = True,
              chunk_size: int | None = None, block_causal: bool = False, dropkey_p: float = 0.0, seed=None,
              attn_fn: str = "softmax", backend: str = "auto") -> torch.Tensor:
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

    Example::

        # Megalodon: causal attention within chunks of 2048; LeX: add block_causal=True.
        o = attention(q, k, v, chunk_size=2048, dropkey_p=0.1, seed=step)
        # Decoding with a KV cache: q (B, 1, H, dh), k/v (B, cache + 1, H, d).
        o = attention(q_new, k_all, v_all)
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
    return attention_op(q, k, v, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, backend)[0]
