"""Triton backend of dropkey_softmax: row-blocked fused causal mask + DropKey + softmax.

Scores are viewed as (Bf * Hf, L, S) rows. One program owns ``BLOCK_M`` consecutive rows of one
(b, h) plane and a ``BLOCK_S``-wide window of keys, with BLOCK_M * BLOCK_S = ``block_elems``.

* One-pass (``S <= BLOCK_S``, the common case): each row is loaded once (only its causally
  visible keys), masked with the bottom-right causal rule and the DropKey hash regenerated
  from ``ops.dropkey_rule`` in uint32 arithmetic (wrapping multiplies: bit-identical to
  ``keep_mask``), exponentiated in fp32 and written once, rounded once. Bytes: read the
  visible scores once + write y once = the ideal.
* Multi-pass (``S > BLOCK_S``): an online (max, sum) sweep over key windows, then a second
  sweep that re-reads the scores and writes y. Bytes ~ 2 reads + 1 write.

A row with no visible kept key is all 0 (its sum is 0, not NaN); an allowed entry that is
+-inf or NaN propagates like torch.softmax. The backward dscores = y (dy - sum_j y dy) needs
no mask replay (masked/dropped entries have y = 0), also one pass when S <= BLOCK_S.
"""
from __future__ import annotations

import math

import torch

from .._triton_common import (HAVE_TRITON, device_reasons, dtype_reasons, grid_launches, quiet_masked_lanes, store_rounded,
                              tl, triton)
from ..dropkey_rule import seed_key, threshold

#: every config this backend may launch with (the tuner chooses among them; each is AOT-compiled
#: in tests); the first values are the default
CONFIG_SPACE: dict = {"block_elems": [4096], "num_warps": [8]}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}
#: key-window widths a launch can use: the smallest one >= S runs one pass, else the widest runs multi-pass
BLOCK_S_TIERS = (64, 512, 4096)


def not_supported_reasons(scores) -> list[str]:
    why = device_reasons(scores, op="dropkey_softmax") + dtype_reasons("scores", scores)
    if not why and scores.numel() >= 2**31:
        why.append("scores has >= 2**31 elements (int32 row offsets); use backend='torch'")
    return why


if HAVE_TRITON:
    from .._triton_common import dropkey_row_keys, mix32  # the DropKey rule in uint32

    @triton.jit
    def _keep(row_key, o_j, thr):
        """Keep-mask [BM, BS] from per-row keys [BM] (uint32) and key indices [BS]."""
        u = mix32(row_key[:, None] ^ o_j[None, :].to(tl.uint32))
        return u >= thr

    @triton.jit
    def _row_block(L, S, shift, Y0, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's query rows: (row indices [BM], row mask, row start offsets, and the end
        of the key range any of them can see - keys past it are never read, written as 0). Its
        plane is Y0 + program_id(1): grid_launches splits more than 65535 planes into launches."""
        bh = Y0 + tl.program_id(1)
        o_i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query rows
        m_i = o_i < L
        p_row = bh.to(tl.int64) * L * S + o_i.to(tl.int64) * S  # [BM] row starts
        if CAUSAL:
            hi = tl.minimum(S, tl.program_id(0) * BLOCK_M + BLOCK_M - 1 + shift + 1)
        else:
            hi = S
        return o_i, m_i, p_row, hi

    @triton.jit
    def _visible(o_i, m_i, o_j, S, shift, CAUSAL: tl.constexpr):
        """[BM, BS] (in bounds, causally visible): bottom-right alignment, key j <= i + S - L."""
        in_row = m_i[:, None] & (o_j[None, :] < S)
        vis = in_row
        if CAUSAL:
            vis = vis & (o_j[None, :] <= o_i[:, None] + shift)
        return in_row, vis

    @triton.jit
    def _dropkey_softmax_fwd_kernel(
        x_ptr, y_ptr, L, S, Hf, shift, seed_k, thr_i, Y0,
        OUT_BF16: tl.constexpr, CAUSAL: tl.constexpr, DROP: tl.constexpr, ONE_PASS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        o_i, m_i, p_row, hi = _row_block(L, S, shift, Y0, CAUSAL, BLOCK_M)
        thr = thr_i.to(tl.uint32, bitcast=True)
        if DROP:
            row_key = dropkey_row_keys(seed_k, Y0 + tl.program_id(1), Hf, o_i)
        if ONE_PASS:
            o_j = tl.arange(0, BLOCK_S)
            m_st, allowed = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
            b_x = tl.load(x_ptr + p_row[:, None] + o_j[None, :], mask=allowed, other=0.0).to(tl.float32)
            if DROP:
                allowed = allowed & _keep(row_key, o_j, thr)
            b_x = tl.where(allowed, b_x, float("-inf"))  # [BM, BS]
            b_m = tl.max(b_x, axis=1)
            b_e = tl.where(allowed, tl.exp(b_x - b_m[:, None]), 0.0)
            b_l = tl.sum(b_e, axis=1)
            n_ok = tl.sum(tl.where(allowed, 1.0, 0.0), axis=1)
            inv = tl.where(n_ok > 0, 1.0 / b_l, 0.0)  # one division per row
            b_y = b_e * inv[:, None]
            store_rounded(y_ptr + p_row[:, None] + o_j[None, :], b_y, m_st, OUT_BF16)
        else:
            b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            b_l = tl.zeros([BLOCK_M], tl.float32)
            n_ok = tl.zeros([BLOCK_M], tl.float32)
            for j0 in range(0, hi, BLOCK_S):
                o_j = j0 + tl.arange(0, BLOCK_S)
                _, allowed = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
                b_x = tl.load(x_ptr + p_row[:, None] + o_j[None, :], mask=allowed, other=0.0).to(tl.float32)
                if DROP:
                    allowed = allowed & _keep(row_key, o_j, thr)
                b_x = tl.where(allowed, b_x, float("-inf"))
                m_new = tl.maximum(b_m, tl.max(b_x, axis=1))
                # both -inf: nothing allowed yet, keep the (zero) sum as is
                alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(b_m - m_new))
                b_e = tl.where(allowed, tl.exp(b_x - m_new[:, None]), 0.0)
                b_l = b_l * alpha + tl.sum(b_e, axis=1)
                b_m = m_new
                n_ok += tl.sum(tl.where(allowed, 1.0, 0.0), axis=1)
            inv = tl.where(n_ok > 0, 1.0 / b_l, 0.0)
            for j0 in range(0, S, BLOCK_S):
                o_j = j0 + tl.arange(0, BLOCK_S)
                m_st, allowed = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
                b_x = tl.load(x_ptr + p_row[:, None] + o_j[None, :], mask=allowed, other=0.0).to(tl.float32)
                if DROP:
                    allowed = allowed & _keep(row_key, o_j, thr)
                b_y = tl.where(allowed, tl.exp(b_x - b_m[:, None]) * inv[:, None], 0.0)
                b_y = tl.where(n_ok[:, None] > 0, b_y, 0.0)
                store_rounded(y_ptr + p_row[:, None] + o_j[None, :], b_y, m_st, OUT_BF16)

    @triton.jit
    def _dropkey_softmax_bwd_kernel(
        dy_ptr, y_ptr, dx_ptr, L, S, shift, Y0,
        OUT_BF16: tl.constexpr, CAUSAL: tl.constexpr, ONE_PASS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        o_i, m_i, p_row, hi = _row_block(L, S, shift, Y0, CAUSAL, BLOCK_M)
        if ONE_PASS:
            o_j = tl.arange(0, BLOCK_S)
            m_st, vis = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
            p = p_row[:, None] + o_j[None, :]
            b_y = tl.load(y_ptr + p, mask=vis, other=0.0).to(tl.float32)
            b_g = tl.load(dy_ptr + p, mask=vis, other=0.0).to(tl.float32)
            b_d = tl.sum(b_y * b_g, axis=1)
            store_rounded(dx_ptr + p, b_y * (b_g - b_d[:, None]), m_st, OUT_BF16)
        else:
            b_d = tl.zeros([BLOCK_M], tl.float32)
            for j0 in range(0, hi, BLOCK_S):
                o_j = j0 + tl.arange(0, BLOCK_S)
                _, vis = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
                p = p_row[:, None] + o_j[None, :]
                b_y = tl.load(y_ptr + p, mask=vis, other=0.0).to(tl.float32)
                b_g = tl.load(dy_ptr + p, mask=vis, other=0.0).to(tl.float32)
                b_d += tl.sum(b_y * b_g, axis=1)
            for j0 in range(0, S, BLOCK_S):
                o_j = j0 + tl.arange(0, BLOCK_S)
                m_st, vis = _visible(o_i, m_i, o_j, S, shift, CAUSAL)
                p = p_row[:, None] + o_j[None, :]
                b_y = tl.load(y_ptr + p, mask=vis, other=0.0).to(tl.float32)
                b_g = tl.load(dy_ptr + p, mask=vis, other=0.0).to(tl.float32)
                store_rounded(dx_ptr + p, b_y * (b_g - b_d[:, None]), m_st, OUT_BF16)


def _shape3(t):
    L, S = t.shape[-2:]
    return math.prod(t.shape[:-2]), L, S, (t.shape[-3] if t.dim() >= 3 else 1)


def _tiling(S, block_elems):
    """(BLOCK_M, BLOCK_S, ONE_PASS) for rows of length S."""
    for bs in BLOCK_S_TIERS:
        if S <= bs:
            return max(1, block_elems // bs), bs, True
    bs = BLOCK_S_TIERS[-1]
    return max(1, block_elems // bs), bs, False


def _i32(u):
    """A uint32 value as the int32 with the same bits (kernels bitcast it back)."""
    return u - (1 << 32) if u >= (1 << 31) else u


def forward(scores, *, causal, dropkey_p, seed, block_elems=4096, num_warps=8):
    """y of the scores' shape and dtype."""
    x = scores.contiguous()
    BH, L, S, Hf = _shape3(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    bm, bs, one = _tiling(S, block_elems)
    thr = threshold(dropkey_p)
    with quiet_masked_lanes():  # rows with no visible key: -inf - -inf and 1 / 0, discarded
        for grid, y0, _ in grid_launches(triton.cdiv(L, bm), BH):
            _dropkey_softmax_fwd_kernel[grid[:2]](
                x, y, L, S, Hf, S - L, _i32(seed_key(seed)), _i32(thr), y0,
                OUT_BF16=x.dtype == torch.bfloat16, CAUSAL=bool(causal), DROP=thr > 0, ONE_PASS=one,
                BLOCK_M=bm, BLOCK_S=bs, num_warps=num_warps,
            )
    return y


def backward(dy, y, *, causal, dropkey_p, seed, block_elems=4096, num_warps=8):
    """dscores = y (dy - sum_j y dy); masked and dropped entries have y = 0, so no mask replay."""
    dy, y = dy.contiguous(), y.contiguous()
    BH, L, S, _ = _shape3(y)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if dx.numel() == 0:
        return dx
    bm, bs, one = _tiling(S, block_elems)
    for grid, y0, _ in grid_launches(triton.cdiv(L, bm), BH):
        _dropkey_softmax_bwd_kernel[grid[:2]](
            dy, y, dx, L, S, S - L, y0,
            OUT_BF16=y.dtype == torch.bfloat16, CAUSAL=bool(causal), ONE_PASS=one,
            BLOCK_M=bm, BLOCK_S=bs, num_warps=num_warps,
        )
    return dx
