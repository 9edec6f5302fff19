"""Triton backend of attention: flash-style forward and backward, no L x S matrix anywhere.

Layouts: q (B L H dh), k (B S H dh), v (B S H dv) are read in place (made contiguous first);
one program owns one (batch, head) plane and one block of rows.

* Forward ``_attn_fwd_kernel``: a program takes BLOCK_M query rows and walks the key blocks
  they can see at all (the visible key range of the block: causal end, chunk start/end, the
  previous chunk with block_causal; blocks outside it are never loaded). Per key block: the
  BLOCK_M x BLOCK_N scores by ``tl.dot`` (fp32 accumulation), the visibility mask and the
  DropKey rule (``ops.dropkey_rule``, regenerated from (seed, b, h, i, j) in uint32, the same
  bits as the torch backend; b is read from the launcher's per-row batch index ``bidx``, arange(B)
  or a packed call's document indices), then an online softmax (running max and sum, fp32) or Laplace
  (no normalisation), and ``acc += P v``. Softmax saves lse = m + log(l) per row ([B, H, L]
  fp32, -inf for a row with no visible kept key, whose output is 0).
* Backward: ``_attn_bwd_delta_kernel`` computes delta = rowsum(dO * O) (softmax only);
  ``_attn_bwd_dkdv_kernel`` owns BLOCK_N keys and walks the query blocks that can see them,
  recomputing P = exp(s - lse) (Laplace: P and its derivative), accumulating dV = P^T dO and
  dK = dS^T (scale q); ``_attn_bwd_dq_kernel`` owns BLOCK_M queries and walks their key blocks
  accumulating dQ = scale dS K. Every program writes only its own rows: no atomics, results
  do not depend on scheduling.
* Wide values (dv > ``max_block_dv``, e.g. the 7B config's dv = 2048 with dh = 256) are tiled
  over dv by the LAUNCHER: the forward grid gets a third axis of dv tiles (each recomputes the
  scores of its rows; lse is written by tile 0 only), dV is a separate launch of the dk/dv kernel
  with one program per (key block, dv tile) and dK off, and dK/dQ sum dP = dO V^T over dv
  tiles in a loop inside the kernel. The extra cost is the QK^T recomputation per dv tile.

Numerics: inputs are converted to fp32 right after loading (the interpreter cannot compute on
bf16; docs/verification.md), every product is accumulated in fp32, and each output is rounded once on
store (bf16 by integer round-to-nearest-even). On the GPU the dots of fp16/bf16 inputs use TF32
(the tests round them so in the interpreter too: tests/device_model.py): its 10-bit mantissa holds q, k, v and dO exactly (q is
multiplied by ``scale`` after the dot, not before, for that reason), so only P and dS are
rounded (to 10 bits), below the output's own rounding. fp32 inputs use "tf32x3" (each operand a
TF32 head and tail, three products: fp32-accurate, ~1e-6 relative, where plain TF32 would give
~1e-3); holding head and tail doubles the operand registers, so fp32 gets smaller tiles
(``_tiles(exact=True)``), and fp32 with dh > 128 is refused on the GPU: its backward tiles spill
even at 16 x 16 (measured with the AOT check), so those inputs go to the cuda or torch backend.
Keeping the operands in fp32 doubles their registers and shared memory compared with bf16
operands: the tiles are sized for that (``_tiles``), which makes the backward tiles small (16-32
rows/keys).
"""
from __future__ import annotations

import torch

from .._triton_common import HAVE_TRITON, device_reasons, dtype_reasons, grid_launches, store_rounded, tl, triton
from ..dropkey_rule import seed_key, threshold
from . import laplace

#: Every config this backend may launch with (each AOT-compiled in tests); the first values are
#: the default. BLOCK_M: query rows per program (forward, dq) and per inner step (dk/dv); BLOCK_N:
#: keys per inner step (forward, dq) and per program (dk/dv); num_stages: forward; num_stages_bwd:
#: backward kernels. num_warps = 8 because 4 spilled in several backward and dh = 128 forward
#: variants, and num_stages_bwd = 1 because 2 spilled in dq at dh = 256. maxnreg_bwd: the register
#: cap handed to ptxas for the backward kernels: without it ptxas caps these 256-thread kernels at
#: 128 registers on sm_80 and some spill; 255 (the hardware limit) removes the spills
#: (bench/results/aot_archs.json).
CONFIG_SPACE: dict = {"BLOCK_M": [64], "BLOCK_N": [64], "num_warps": [8], "num_stages": [2], "num_stages_bwd": [1],
                      "maxnreg_bwd": [255]}
DEFAULT_CONFIG = {name: values[0] for name, values in CONFIG_SPACE.items()}
#: pipeline stages of the forward for fp32 inputs (tf32x3 dots), whatever num_stages says: with a
#: second stage's buffers ptxas keeps these 256-thread kernels at 128 registers on sm_80 and the
#: packed Laplace forward at dh = 64 spills; three dots per product make it compute-bound, so the
#: prefetch that a second stage buys matters least here
EXACT_FWD_STAGES = 1

#: fp32 inputs (tf32x3 dots) on the GPU: head dims up to this (AOT-verified without spills)
MAX_EXACT_HEAD_DIM = 128
#: head dims up to this are one register tile; q / k rows are never split
MAX_HEAD_DIM = 256
#: value dims up to this are one tile; wider v is tiled over dv by the launcher (see module doc)
MAX_BLOCK_DV = 128
#: score tiles and [rows, d] tiles are shrunk so that rows * max(d tile) stays under this (registers)
MAX_TILE_ELEMS = 64 * 128


def not_supported_reasons(q, k, v, **_) -> list[str]:
    why = device_reasons(q, op="attention") + dtype_reasons("q", q)
    if q.dim() == 4 and q.shape[-1] > MAX_HEAD_DIM:
        why.append(f"head dim dh = {q.shape[-1]} > {MAX_HEAD_DIM} (one register tile); use backend='torch'")
    elif q.dim() == 4 and q.is_cuda and _exact(q.dtype) and q.shape[-1] > MAX_EXACT_HEAD_DIM:
        why.append(f"float32 q with head dim dh = {q.shape[-1]} > {MAX_EXACT_HEAD_DIM}: the fp32-accurate "
                   f"(tf32x3) backward tiles spill registers there; use bfloat16/float16 or backend='cuda'/'torch'")
    return why


if HAVE_TRITON:
    from .._triton_common import dropkey_row_keys, mix32  # the DropKey rule in uint32

    MU_C = tl.constexpr(laplace.MU)
    INV_C = tl.constexpr(laplace.INV)
    PDF_C = tl.constexpr(laplace.PDF)
    HALF_INV_VAR_C = tl.constexpr(laplace.HALF_INV_VAR)

    @triton.jit
    def _floor_div(x, c):
        """floor(x / c) for c > 0 (Triton's // truncates toward 0; positions can be negative when S < L)."""
        return tl.where(x >= 0, x // c, -((c - 1 - x) // c))

    @triton.jit
    def _allowed(o_i, o_j, L, S, shift, causal, chunk, bc):
        """Visibility of (query i, key j) on broadcast index tensors (see ops/attention/__init__)."""
        pos = o_i + shift  # bottom-right alignment: query i sits at key position i + S - L
        ok = (o_i < L) & (o_j < S)
        ok = ok & ((causal == 0) | (o_j <= pos))
        c = tl.maximum(chunk, 1)
        cp = _floor_div(pos, c)
        cj = o_j // c  # j >= 0
        ok = ok & ((chunk == 0) | (cj == cp) | ((bc != 0) & (cj == cp - 1)))
        return ok

    @triton.jit
    def _keep(row_key, o_j, thr):
        """DropKey keep-mask from per-row keys and key indices, broadcast like them (dropkey_rule)."""
        return mix32(row_key ^ o_j.to(tl.uint32)) >= thr

    @triton.jit
    def _rule_bh(bidx_ptr, b, h, H):
        """The plane index b' * H + h the DropKey rule hashes, b' = bidx[b] (the launcher passes
        arange(B), or a packed call's document index of each row)."""
        return tl.load(bidx_ptr + b).to(tl.int64) * H + h

    @triton.jit
    def _rows(cu_ptr, b, L, S, PACKED: tl.constexpr):
        """(first query step, query length, first key step, key length) of row b: batch row b of
        (B, L) queries and (B, S) keys, or document b of a packed row (its own queries and keys)."""
        if PACKED:
            start = tl.load(cu_ptr + b)
            n = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
            return start, n, start, n
        else:
            return b.to(tl.int64) * L, L, b.to(tl.int64) * S, S

    @triton.jit
    def _stats_row(b, h, H, L, row_q, PACKED: tl.constexpr):
        """Offset of the per-query statistics (lse, delta) of (row b, head h) in their (B, H, L)
        array; packed, the (1, H, L) array at the document's start."""
        if PACKED:
            return h.to(tl.int64) * L + row_q
        else:
            return (b * H + h).to(tl.int64) * L

    @triton.jit
    def _key_range(i0, L, S, shift, causal, chunk, bc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys [lo, hi) that query rows [i0, i0 + BLOCK_M) can see at all; lo aligned down to BLOCK_N."""
        p0 = i0 + shift
        p1 = tl.minimum(i0 + BLOCK_M, L) - 1 + shift
        hi = tl.where(causal != 0, tl.minimum(S, p1 + 1), S)
        c = tl.maximum(chunk, 1)
        lo = tl.where(chunk != 0, (_floor_div(p0, c) - bc) * c, 0)
        hi = tl.where(chunk != 0, tl.minimum(hi, (_floor_div(p1, c) + 1) * c), hi)
        lo = tl.maximum(lo, 0)
        return (lo // BLOCK_N) * BLOCK_N, hi

    @triton.jit
    def _query_range(j0, L, S, shift, causal, chunk, bc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Queries [lo, hi) that can see any of keys [j0, j0 + BLOCK_N); lo aligned down to BLOCK_M."""
        j1 = tl.minimum(j0 + BLOCK_N, S)  # last key + 1
        lo = tl.where(causal != 0, j0 - shift, 0)  # pos_i >= j0
        c = tl.maximum(chunk, 1)
        lo = tl.where(chunk != 0, tl.maximum(lo, (j0 // c) * c - shift), lo)
        hi = tl.where(chunk != 0, ((j1 - 1) // c + 1 + bc) * c - shift, L)
        hi = tl.minimum(hi, L)
        lo = tl.maximum(lo, 0)
        return (lo // BLOCK_M) * BLOCK_M, hi

    @triton.jit
    def _erfc_pos(x):
        """erfc(x) for x >= 0 with ~1e-7 relative error everywhere (Chebyshev-fitted exponent,
        Numerical Recipes' erfcc): keeps the Laplace tail's relative accuracy where
        0.5 * (1 + erf(z)) would cancel to 0 (tl.math has no erfc)."""
        t = 1.0 / (1.0 + 0.5 * x)
        y = -x * x - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
            -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
                -0.82215223 + t * 0.17087277))))))))
        return t * tl.exp(y)

    @triton.jit
    def _laplace(s):
        """0.5 * (1 + erf(z)), z = (s - mu) / (sigma sqrt 2), as 0.5 erfc(-z) for z < 0."""
        z = (s - MU_C) * INV_C
        e = _erfc_pos(tl.abs(z))
        return tl.where(z < 0, 0.5 * e, 1.0 - 0.5 * e)

    @triton.jit
    def _laplace_grad(s):
        x = s - MU_C
        return PDF_C * tl.exp(-x * x * HALF_INV_VAR_C)

    @triton.jit
    def _attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bidx_ptr, cu_ptr,
        L, S, H, DH, DV, shift, causal, chunk, bc, seed_k, thr_i, scale, Y0, Z0,
        OUT_BF16: tl.constexpr, DROP: tl.constexpr, LAPLACE: tl.constexpr, PREC: tl.constexpr,
        PACKED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # Y0, Z0: the first (row, head) plane and dv tile of this launch (grid_launches splits
        # grids above CUDA's y/z limit of 65535 into several launches)
        pid_m, bh, pid_d = tl.program_id(0), Y0 + tl.program_id(1), Z0 + tl.program_id(2)
        b, h = bh // H, bh % H
        row_q, Lq, row_k, Sk = _rows(cu_ptr, b, L, S, PACKED)
        i0 = pid_m * BLOCK_M
        if PACKED:
            if i0 >= Lq:  # the grid spans the longest document: past a shorter one's end, no work
                return
        o_i = i0 + tl.arange(0, BLOCK_M)
        m_i = o_i < Lq
        o_dh = tl.arange(0, BLOCK_DH)
        m_dh = o_dh < DH
        o_dv = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
        m_dv = o_dv < DV
        rq, rv = H * DH, H * DV  # row strides of (B, T, H, d)
        p_q = q_ptr + (row_q * rq + h * DH) + o_i[:, None].to(tl.int64) * rq + o_dh[None, :]
        b_q = tl.load(p_q, mask=m_i[:, None] & m_dh[None, :], other=0.0).to(tl.float32)  # [BM, BDH]
        k_base = k_ptr + (row_k * rq + h * DH)
        v_base = v_ptr + (row_k * rv + h * DV)
        if DROP:
            row_key = dropkey_row_keys(seed_k, _rule_bh(bidx_ptr, b, h, H), H, o_i)
            thr = thr_i.to(tl.uint32, bitcast=True)
        lo, hi = _key_range(i0, Lq, Sk, shift, causal, chunk, bc, BLOCK_M, BLOCK_N)
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for j0 in range(lo, hi, BLOCK_N):
            o_j = j0 + tl.arange(0, BLOCK_N)
            m_j = o_j < Sk
            b_kt = tl.load(k_base + o_j[None, :].to(tl.int64) * rq + o_dh[:, None],
                           mask=m_j[None, :] & m_dh[:, None], other=0.0).to(tl.float32)  # [BDH, BN]
            b_s = tl.dot(b_q, b_kt, input_precision=PREC) * scale  # [BM, BN]
            ok = _allowed(o_i[:, None], o_j[None, :], Lq, Sk, shift, causal, chunk, bc)
            if DROP:
                ok = ok & _keep(row_key[:, None], o_j[None, :], thr)
            b_v = tl.load(v_base + o_j[:, None].to(tl.int64) * rv + o_dv[None, :],
                          mask=m_j[:, None] & m_dv[None, :], other=0.0).to(tl.float32)  # [BN, BDV]
            if LAPLACE:
                b_p = tl.where(ok, _laplace(b_s), 0.0)
            else:
                b_s = tl.where(ok, b_s, float("-inf"))
                m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: exp(-inf) = 0
                b_p = tl.exp(b_s - m_use[:, None])
                alpha = tl.exp(b_m - m_use)
                b_l = b_l * alpha + tl.sum(b_p, axis=1)
                b_acc = b_acc * alpha[:, None]
                b_m = m_new
            b_acc += tl.dot(b_p, b_v, input_precision=PREC)
        if not LAPLACE:
            has = b_l > 0.0  # a row with no visible kept key outputs 0 and has lse = -inf
            b_acc = b_acc * tl.where(has, 1.0 / tl.where(has, b_l, 1.0), 0.0)[:, None]
            lse = tl.where(has, b_m + tl.log(tl.where(has, b_l, 1.0)), float("-inf"))
            n_lse = tl.where(pid_d == 0, Lq, 0)  # one dv tile writes lse (all compute the same)
            tl.store(lse_ptr + _stats_row(b, h, H, L, row_q, PACKED) + o_i, lse, mask=o_i < n_lse)
        p_o = o_ptr + (row_q * rv + h * DV) + o_i[:, None].to(tl.int64) * rv + o_dv[None, :]
        store_rounded(p_o, b_acc, m_i[:, None] & m_dv[None, :], OUT_BF16)

    @triton.jit
    def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, cu_ptr, L, H, DV, Y0, PACKED: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
        """delta[b, h, i] = sum_d dO * O (fp32), the softmax backward's row term."""
        pid_m, bh = tl.program_id(0), Y0 + tl.program_id(1)
        b, h = bh // H, bh % H
        row_q, Lq, _, _ = _rows(cu_ptr, b, L, L, PACKED)
        if PACKED:
            if pid_m * BLOCK_M >= Lq:
                return
        o_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_i = o_i < Lq
        rv = H * DV
        base = (row_q * rv + h * DV) + o_i[:, None].to(tl.int64) * rv
        b_d = tl.zeros([BLOCK_M], tl.float32)
        for d0 in range(0, DV, BLOCK_DV):
            o_d = d0 + tl.arange(0, BLOCK_DV)
            msk = m_i[:, None] & (o_d[None, :] < DV)
            b_o = tl.load(o_ptr + base + o_d[None, :], mask=msk, other=0.0).to(tl.float32)
            b_g = tl.load(do_ptr + base + o_d[None, :], mask=msk, other=0.0).to(tl.float32)
            b_d += tl.sum(b_o * b_g, axis=1)
        tl.store(delta_ptr + _stats_row(b, h, H, L, row_q, PACKED) + o_i, b_d, mask=m_i)

    @triton.jit
    def _attn_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, bidx_ptr, cu_ptr,
        L, S, H, DH, DV, shift, causal, chunk, bc, seed_k, thr_i, scale, Y0, Z0,
        OUT_BF16: tl.constexpr, DROP: tl.constexpr, LAPLACE: tl.constexpr, PREC: tl.constexpr,
        PACKED: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, ONE_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        """One program: BLOCK_N keys of one (b, h) [and one dv tile]; scores held transposed
        ([BN, BM]) so dV = P^T dO and dK = dS^T q are plain dots."""
        pid_n, bh, pid_d = tl.program_id(0), Y0 + tl.program_id(1), Z0 + tl.program_id(2)
        b, h = bh // H, bh % H
        row_q, Lq, row_k, Sk = _rows(cu_ptr, b, L, S, PACKED)
        j0 = pid_n * BLOCK_N
        if PACKED:
            if j0 >= Sk:
                return
        o_j = j0 + tl.arange(0, BLOCK_N)
        m_j = o_j < Sk
        o_dh = tl.arange(0, BLOCK_DH)
        m_dh = o_dh < DH
        o_dv = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's dv tile (dV output)
        m_dv = o_dv < DV
        rq, rv = H * DH, H * DV
        q_base = q_ptr + (row_q * rq + h * DH)
        do_base = do_ptr + (row_q * rv + h * DV)
        v_base = v_ptr + (row_k * rv + h * DV)
        stats = _stats_row(b, h, H, L, row_q, PACKED)
        b_k = tl.load(k_ptr + (row_k * rq + h * DH) + o_j[:, None].to(tl.int64) * rq + o_dh[None, :],
                      mask=m_j[:, None] & m_dh[None, :], other=0.0).to(tl.float32)  # [BN, BDH]
        if COMPUTE_DK and ONE_DV:
            b_v = tl.load(v_base + o_j[:, None].to(tl.int64) * rv + o_dv[None, :],
                          mask=m_j[:, None] & m_dv[None, :], other=0.0).to(tl.float32)  # [BN, BDV]
        if DROP:
            thr = thr_i.to(tl.uint32, bitcast=True)
            rule_bh = _rule_bh(bidx_ptr, b, h, H)
        b_dk = tl.zeros([BLOCK_N, BLOCK_DH], tl.float32)
        b_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        lo, hi = _query_range(j0, Lq, Sk, shift, causal, chunk, bc, BLOCK_M, BLOCK_N)
        for i0 in range(lo, hi, BLOCK_M):
            o_i = i0 + tl.arange(0, BLOCK_M)
            m_i = o_i < Lq
            b_qt = tl.load(q_base + o_i[None, :].to(tl.int64) * rq + o_dh[:, None],
                           mask=m_i[None, :] & m_dh[:, None], other=0.0).to(tl.float32)  # [BDH, BM]
            b_st = tl.dot(b_k, b_qt, input_precision=PREC) * scale  # [BN, BM] scores, transposed
            ok = _allowed(o_i[None, :], o_j[:, None], Lq, Sk, shift, causal, chunk, bc)
            if DROP:
                ok = ok & _keep(dropkey_row_keys(seed_k, rule_bh, H, o_i)[None, :], o_j[:, None], thr)
            if LAPLACE:
                b_pt = tl.where(ok, _laplace(b_st), 0.0)
                b_gt = tl.where(ok, _laplace_grad(b_st), 0.0)
            else:
                lse = tl.load(lse_ptr + stats + o_i, mask=m_i, other=0.0)
                lse = tl.where(lse == float("-inf"), float("inf"), lse)  # empty row: P = exp(-inf) = 0
                b_pt = tl.where(ok, tl.exp(b_st - lse[None, :]), 0.0)
            if COMPUTE_DV or ONE_DV:
                b_do = tl.load(do_base + o_i[:, None].to(tl.int64) * rv + o_dv[None, :],
                               mask=m_i[:, None] & m_dv[None, :], other=0.0).to(tl.float32)  # [BM, BDV]
            if COMPUTE_DV:
                b_dv += tl.dot(b_pt, b_do, input_precision=PREC)
            if COMPUTE_DK:
                if ONE_DV:
                    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)  # [BN, BM]
                else:
                    b_dpt = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                    for d0 in range(0, DV, BLOCK_DV):
                        o_d = d0 + tl.arange(0, BLOCK_DV)
                        m_d = o_d < DV
                        b_vc = tl.load(v_base + o_j[:, None].to(tl.int64) * rv + o_d[None, :],
                                       mask=m_j[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BDV]
                        b_dot = tl.load(do_base + o_i[None, :].to(tl.int64) * rv + o_d[:, None],
                                        mask=m_i[None, :] & m_d[:, None], other=0.0).to(tl.float32)  # [BDV, BM]
                        b_dpt += tl.dot(b_vc, b_dot, input_precision=PREC)
                if LAPLACE:
                    b_dst = b_dpt * b_gt
                else:
                    delta = tl.load(delta_ptr + stats + o_i, mask=m_i, other=0.0)
                    b_dst = b_pt * (b_dpt - delta[None, :])
                b_dk += tl.dot(b_dst, tl.trans(b_qt), input_precision=PREC)  # dS^T q (scaled on store)
        if COMPUTE_DK:
            p_dk = dk_ptr + (row_k * rq + h * DH) + o_j[:, None].to(tl.int64) * rq + o_dh[None, :]
            store_rounded(p_dk, b_dk * scale, m_j[:, None] & m_dh[None, :], OUT_BF16)
        if COMPUTE_DV:
            p_dv = dv_ptr + (row_k * rv + h * DV) + o_j[:, None].to(tl.int64) * rv + o_dv[None, :]
            store_rounded(p_dv, b_dv, m_j[:, None] & m_dv[None, :], OUT_BF16)

    @triton.jit
    def _attn_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, bidx_ptr, cu_ptr,
        L, S, H, DH, DV, shift, causal, chunk, bc, seed_k, thr_i, scale, Y0,
        OUT_BF16: tl.constexpr, DROP: tl.constexpr, LAPLACE: tl.constexpr, PREC: tl.constexpr,
        PACKED: tl.constexpr, ONE_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (b, h); dQ = scale dS K over their visible key blocks."""
        pid_m, bh = tl.program_id(0), Y0 + tl.program_id(1)
        b, h = bh // H, bh % H
        row_q, Lq, row_k, Sk = _rows(cu_ptr, b, L, S, PACKED)
        i0 = pid_m * BLOCK_M
        if PACKED:
            if i0 >= Lq:
                return
        o_i = i0 + tl.arange(0, BLOCK_M)
        m_i = o_i < Lq
        o_dh = tl.arange(0, BLOCK_DH)
        m_dh = o_dh < DH
        o_dv = tl.arange(0, BLOCK_DV)
        m_dv = o_dv < DV
        rq, rv = H * DH, H * DV
        q_off = (row_q * rq + h * DH) + o_i[:, None].to(tl.int64) * rq + o_dh[None, :]
        b_q = tl.load(q_ptr + q_off, mask=m_i[:, None] & m_dh[None, :], other=0.0).to(tl.float32)
        k_base = k_ptr + (row_k * rq + h * DH)
        v_base = v_ptr + (row_k * rv + h * DV)
        do_base = do_ptr + (row_q * rv + h * DV)
        if ONE_DV:
            b_do = tl.load(do_base + o_i[:, None].to(tl.int64) * rv + o_dv[None, :],
                           mask=m_i[:, None] & m_dv[None, :], other=0.0).to(tl.float32)  # [BM, BDV]
        if DROP:
            row_key = dropkey_row_keys(seed_k, _rule_bh(bidx_ptr, b, h, H), H, o_i)
            thr = thr_i.to(tl.uint32, bitcast=True)
        if not LAPLACE:
            stats = _stats_row(b, h, H, L, row_q, PACKED)
            lse = tl.load(lse_ptr + stats + o_i, mask=m_i, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
            delta = tl.load(delta_ptr + stats + o_i, mask=m_i, other=0.0)
        b_dq = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
        lo, hi = _key_range(i0, Lq, Sk, shift, causal, chunk, bc, BLOCK_M, BLOCK_N)
        for j0 in range(lo, hi, BLOCK_N):
            o_j = j0 + tl.arange(0, BLOCK_N)
            m_j = o_j < Sk
            b_kt = tl.load(k_base + o_j[None, :].to(tl.int64) * rq + o_dh[:, None],
                           mask=m_j[None, :] & m_dh[:, None], other=0.0).to(tl.float32)  # [BDH, BN]
            b_s = tl.dot(b_q, b_kt, input_precision=PREC) * scale  # [BM, BN]
            ok = _allowed(o_i[:, None], o_j[None, :], Lq, Sk, shift, causal, chunk, bc)
            if DROP:
                ok = ok & _keep(row_key[:, None], o_j[None, :], thr)
            if ONE_DV:
                b_vt = tl.load(v_base + o_j[None, :].to(tl.int64) * rv + o_dv[:, None],
                               mask=m_j[None, :] & m_dv[:, None], other=0.0).to(tl.float32)  # [BDV, BN]
                b_dp = tl.dot(b_do, b_vt, input_precision=PREC)
            else:
                b_dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for d0 in range(0, DV, BLOCK_DV):
                    o_d = d0 + tl.arange(0, BLOCK_DV)
                    m_d = o_d < DV
                    b_doc = tl.load(do_base + o_i[:, None].to(tl.int64) * rv + o_d[None, :],
                                    mask=m_i[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BDV]
                    b_vt = tl.load(v_base + o_j[None, :].to(tl.int64) * rv + o_d[:, None],
                                   mask=m_j[None, :] & m_d[:, None], other=0.0).to(tl.float32)  # [BDV, BN]
                    b_dp += tl.dot(b_doc, b_vt, input_precision=PREC)
            if LAPLACE:
                b_ds = tl.where(ok, b_dp * _laplace_grad(b_s), 0.0)
            else:
                b_p = tl.where(ok, tl.exp(b_s - lse[:, None]), 0.0)
                b_ds = b_p * (b_dp - delta[:, None])
            b_dq += tl.dot(b_ds, tl.trans(b_kt), input_precision=PREC)  # [BM, BDH]
        store_rounded(dq_ptr + q_off, b_dq * scale, m_i[:, None] & m_dh[None, :], OUT_BF16)


# ---------------------------------------------------------------------------------------------
# Launchers


def _pow2(n, least=16):
    """Smallest power of two >= n and >= ``least`` (tl.dot needs every dimension >= 16)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def _shrink(rows, width, budget):
    """Halve ``rows`` (not below 16) until rows x width <= budget."""
    while rows > 16 and rows * width > budget:
        rows //= 2
    return max(16, rows)


def _tiles(dh, dv, BLOCK_M, BLOCK_N, exact=False):
    """Tiles a launch uses for head dims (dh, dv): a dict with BLOCK_DH, BLOCK_DV, ONE_DV and
    (rows, keys) per kernel: "fwd", "dq" (rows per program, keys per step) and "dkdv" (queries per
    step, keys per program).

    BLOCK_DH covers dh in one tile; BLOCK_DV covers dv in one tile up to MAX_BLOCK_DV, else dv is
    tiled (ONE_DV False). Everything is fp32 in registers (operands included, see the module
    doc), so the row counts shrink with the head dims: the forward holds [rows, max(d)] tiles,
    the backward kernels hold four [rows, d] tiles (q/k, do/v, and two accumulators) per program,
    hence the smaller budget, 16 query rows and the halved key step (the largest sizes measured
    not to spill on sm_80/sm_90, test_triton_aot).

    ``exact`` (fp32 inputs, dots in "tf32x3"): every operand is also held as a TF32 head and tail,
    so the forward tiles get a quarter of the budget, dv tiles half the width, and the backward
    steps 16 keys or queries."""
    budget, max_dv, key_step = (MAX_TILE_ELEMS // 4, MAX_BLOCK_DV // 2, 4) if exact else (MAX_TILE_ELEMS, MAX_BLOCK_DV, 2)
    bdh = _pow2(dh)
    one = _pow2(dv) <= max_dv
    bdv = _pow2(dv) if one else max_dv
    fwd = (_shrink(BLOCK_M, max(bdh, bdv), budget), _shrink(BLOCK_N, max(bdh, bdv), budget))
    dq = (max(16, BLOCK_M // 4), max(16, BLOCK_N // key_step))
    dkdv = (max(16, BLOCK_M // 4), _shrink(BLOCK_N, bdh + bdv, budget // 2))
    return {"BLOCK_DH": bdh, "BLOCK_DV": bdv, "ONE_DV": one, "fwd": fwd, "dq": dq, "dkdv": dkdv}


def _i32(u):
    """A uint32 value as the int32 with the same bits (kernels bitcast it back)."""
    return u - (1 << 32) if u >= (1 << 31) else u


def _common(q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed):
    """Runtime scalars shared by every kernel, and the DROP flag."""
    L, S = q.shape[1], k.shape[1]
    thr = threshold(dropkey_p) if dropkey_p > 0.0 else 0
    args = (S - L, int(bool(causal)), int(chunk_size or 0), int(bool(block_causal and chunk_size)),
            _i32(seed_key(seed)), _i32(thr), float(scale))
    return args, thr > 0


def _exact(dtype) -> bool:
    """fp32 inputs get fp32-accurate dots ("tf32x3"), the half types TF32 (see the module doc)."""
    return dtype in (torch.float32, "fp32")


def _prec(dtype):
    """Dot precision on the GPU (see the module doc)."""
    return "tf32x3" if _exact(dtype) else "tf32"


def _rule_batch_index(batch_index, B, device):
    """The (B,) int64 batch indices the kernels' DropKey rule hashes: ``batch_index`` (a packed
    call's document of each row) or each row's own index."""
    if batch_index is None:
        return torch.arange(B, dtype=torch.int64, device=device)
    return batch_index.to(device=device, dtype=torch.int64).contiguous()


def _row_grid(q, k, cu_seqlens, max_seqlen):
    """(rows, query span, key span) of the launch grids: the batch rows and their lengths, or the
    documents of a packed row and the longest one (a program past its document's end
    returns at once)."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[1], k.shape[1]
    if max_seqlen is None:
        raise ValueError("a packed Triton attention call needs max_seqlen, the longest document's length")
    return cu_seqlens.shape[0] - 1, max_seqlen, max_seqlen


#: Packed rows (cu_seqlens, max_seqlen) run natively: one program row per document.
PACKED_NATIVE = True


def forward(q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                  BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, num_stages_bwd=1, maxnreg_bwd=255,
                  batch_index=None, cu_seqlens=None, max_seqlen=None):
    """Returns (o r(B L H dv) in q's dtype, lse r(B H L) fp32, or None for laplace).

    ``batch_index`` (B,) int64 or None: the batch index b of each row in the DropKey rule
    (None: b is the row itself). ``cu_seqlens`` (n + 1,) int64 with values already checked, and
    ``max_seqlen`` (host int): q, k, v are one packed row (B = 1, S = L) of n documents, each
    attending within itself with DropKey's b = its index."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, L, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    o = torch.empty((B, L, H, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device) if attn_fn == "softmax" else None
    if o.numel() == 0 and (lse is None or lse.numel() == 0):
        return o, lse
    rows, span, _ = _row_grid(q, k, cu_seqlens, max_seqlen)
    if rows * span == 0:
        return o, lse
    t = _tiles(dh, dv, BLOCK_M, BLOCK_N, exact=_exact(q.dtype))
    (bm, bn), bdh, bdv = t["fwd"], t["BLOCK_DH"], t["BLOCK_DV"]
    args, drop = _common(q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed)
    bidx = _rule_batch_index(batch_index, rows, q.device)
    for grid, y0, z0 in grid_launches(triton.cdiv(span, bm), rows * H, max(1, triton.cdiv(dv, bdv))):
        _attn_fwd_kernel[grid](
            q, k, v, o, lse if lse is not None else o, bidx, cu_seqlens, L, S, H, dh, dv, *args, y0, z0,
            OUT_BF16=q.dtype == torch.bfloat16, DROP=drop, LAPLACE=attn_fn == "laplace", PREC=_prec(q.dtype),
            PACKED=cu_seqlens is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_DH=bdh, BLOCK_DV=bdv, num_warps=num_warps,
            num_stages=EXACT_FWD_STAGES if _exact(q.dtype) else num_stages,
        )
    return o, lse


def backward(do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                  BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, num_stages_bwd=1, maxnreg_bwd=255,
                  batch_index=None, cu_seqlens=None, max_seqlen=None):
    """Returns (dq, dk, dv) in the input dtype, recomputing the probabilities tile by tile
    (``batch_index``, ``cu_seqlens``, ``max_seqlen``: as for forward)."""
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    B, L, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rows, span_q, span_k = _row_grid(q, k, cu_seqlens, max_seqlen)
    if rows * H == 0 or (span_q == 0 and span_k == 0):
        return dq, dk, dvv
    t = _tiles(dh, dv, BLOCK_M, BLOCK_N, exact=_exact(q.dtype))
    bdh, bdv, one = t["BLOCK_DH"], t["BLOCK_DV"], t["ONE_DV"]
    args, drop = _common(q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed)
    is_laplace = attn_fn == "laplace"
    flags = dict(OUT_BF16=q.dtype == torch.bfloat16, DROP=drop, LAPLACE=is_laplace, PREC=_prec(q.dtype),
                 PACKED=cu_seqlens is not None, BLOCK_DH=bdh, BLOCK_DV=bdv, num_warps=num_warps,
                 num_stages=num_stages_bwd, maxnreg=maxnreg_bwd)
    bm_q, bn_q = t["dq"]
    bm_k, bn_k = t["dkdv"]
    delta = None
    if not is_laplace and span_q > 0:
        delta = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
        oc = o.contiguous()
        for grid, y0, _ in grid_launches(triton.cdiv(span_q, bm_q), rows * H):
            _attn_bwd_delta_kernel[grid[:2]](
                oc, do, delta, cu_seqlens, L, H, dv, y0, PACKED=cu_seqlens is not None, BLOCK_M=bm_q,
                BLOCK_DV=bdv, num_warps=num_warps, num_stages=num_stages_bwd, maxnreg=maxnreg_bwd)
    # Softmax needs lse/delta pointers; Laplace passes q as a never-read placeholder.
    lse_p = lse if lse is not None else q
    delta_p = delta if delta is not None else q
    ptrs = (q, k, v, do, lse_p, delta_p)
    bidx = _rule_batch_index(batch_index, rows, q.device)
    if span_k > 0:
        nb = triton.cdiv(span_k, bn_k)
        kv = dict(BLOCK_M=bm_k, BLOCK_N=bn_k, **flags)
        # one dv tile: dk and dv together; else dk with dP summed over dv tiles in-kernel, then dv
        # with one program per (key block, dv tile)
        passes = [(True, True, 1)] if one else [(True, False, 1), (False, True, triton.cdiv(dv, bdv))]
        for compute_dk, compute_dv, tiles in passes:
            for grid, y0, z0 in grid_launches(nb, rows * H, tiles):
                _attn_bwd_dkdv_kernel[grid](*ptrs, dk, dvv, bidx, cu_seqlens, L, S, H, dh, dv, *args, y0, z0,
                                            COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv, ONE_DV=one, **kv)
    if span_q > 0:
        for grid, y0, _ in grid_launches(triton.cdiv(span_q, bm_q), rows * H):
            _attn_bwd_dq_kernel[grid[:2]](*ptrs, dq, bidx, cu_seqlens, L, S, H, dh, dv, *args, y0, ONE_DV=one,
                                          BLOCK_M=bm_q, BLOCK_N=bn_q, **flags)
    return dq, dk, dvv
