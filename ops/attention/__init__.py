"""Attention with bottom-right causal, chunked (Megalodon), blockwise-causal (LeX) masks, DropKey
and Mega's Laplace attention function, as one autograd op.

Why one op for all of them: every variant is "scores, a visibility mask, an attention function,
P v", and a fused backend must never materialise the L x S matrix, so the masks have to be
known to the kernel rather than added as a tensor. The semantics (docs/math.md,
attention) are in :func:`attention`'s docstring.

The DropKey mask is a pure function of (seed, b, h, i, j) (``ops/dropkey_rule.py``): the
forward saves only the resolved seed and the backward regenerates the identical mask.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.autograd.function import once_differentiable

from .._checks import REAL_DTYPES, check_choice, check_float, check_int, check_same_dtype, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends
from ..dropkey_rule import resolve_seed

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


@dataclass(frozen=True)
class AttentionParams:
    """The non-tensor arguments, validated; passed unchanged to a backend's fwd and bwd."""

    scale: float
    causal: bool
    chunk_size: int | None
    block_causal: bool
    dropkey_p: float
    seed: int
    attn_fn: str


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, params: AttentionParams, impl):
        kw = {**asdict(params), **impl.config}
        o, lse = impl.module.attention_fwd(q, k, v, **kw)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.kw, ctx.impl = kw, impl
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.impl.module.attention_bwd(do, q, k, v, o, lse, **ctx.kw)
        return dq, dk, dv, None, None


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
    # Validate an explicit seed always; draw one only when DropKey is on (no RNG use otherwise).
    seed = resolve_seed(seed) if (seed is not None or dropkey_p > 0.0) else 0
    impl = BACKENDS.select(backend, {"q": q, "k": k, "v": v, "chunk_size": chunk_size, "causal": causal,
                                     "block_causal": block_causal, "dropkey": dropkey_p > 0.0},
                           device=q.device, dtype=q.dtype)
    params = AttentionParams(scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn)
    return AttentionFunction.apply(q, k, v, params, impl)
