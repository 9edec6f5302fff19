"""Triton backend of fftconv: an FFT convolution whose every dense factor is a 16-point DFT matrix.

Three paths, chosen by length (``_plan``): a direct Toeplitz product for L <= ``direct_max_len``;
the tile path for FFT sizes N <= 4096 (256 A points, A in 1/2/4/8/16, whole row pair and k's
spectrum in registers; grid (D, chunks of batch row pairs), ``row_chunks``); the workspace path for
8192 <= N <= 2**18 (four steps: column pass, row pass with the 4096-point tile transform, inverse
column pass, through a per-feature fp32 workspace; one program per feature). Two real rows are
packed into one complex row; a program builds k's spectrum once for all its pairs, and dk is summed
over b without atomics (the tile path's per-chunk partials added in a fixed order). Dots run in
``DOT_PRECISION`` ("tf32x3" unless env FFTCONV_DOT says otherwise; the bf16-output tile forward in
``BF16_OUT_DOT``). The algorithms, twiddles, register discipline, costs and limits are described in
docs/fft.md.
"""
from __future__ import annotations

import math
import os

import torch

from .._triton_common import (HAVE_TRITON, device_reasons, dtype_reasons, release_config_space, release_reasons, tl,
                              triton)

#: direct_max_len: the Toeplitz path for L <= it (at most DIRECT_MAX); num_warps: tile-path warps
#: for N = 4096 (scaled down with N, see ``tile_warps``); work_warps: workspace path; direct_warps.
#: Every config this backend may launch with (each AOT-compiled in tests for every tile size); the
#: first values are the default.
#: direct path up to direct_max_len (0: always the FFT); warps of the tile, workspace and direct
#: kernels; work_bc columns per workspace-pass program
CONFIG_SPACE_ALL_RELEASES: dict = {"direct_max_len": (64, 32, 0), "num_warps": (8,), "work_warps": (8,),
                                   "work_bc": (16,), "direct_warps": (4,)}
#: what the installed Triton may launch: CONFIG_SPACE_ALL_RELEASES less the values an older release
#: compiles to spilling code (_triton_common.RELEASE_PRUNES; the AOT report compiles all of them)
CONFIG_SPACE: dict = release_config_space("fftconv", CONFIG_SPACE_ALL_RELEASES)
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}
X_DTYPES = (torch.bfloat16, torch.float32)
#: the direct path's tile widths (BLOCK_L); direct_max_len <= DIRECT_MAX
DIRECT_TILES = (16, 32, 64)
DIRECT_MAX = DIRECT_TILES[-1]
#: the smallest FFT (16 x 16 tile: tl.dot needs 16-wide operands) and the largest in registers
MIN_FFT = 256
MAX_TILE_FFT = 4096
#: longest supported L (N = 2**18: workspace path with R = 64)
MAX_LENGTH = 1 << 17
#: first-stage sizes A of the tile path's N = 256 A point transforms (N = 256 .. 4096: every power
#: of two, so no length pays more than the 2x zero padding of the linear convolution itself)
TILE_FACTORS = (1, 2, 4, 8, 16)
#: the tile path's grid: programs over (feature, chunk of batch row pairs), enough chunks for this
#: many programs per SM when the batch allows (docs/fft.md, "The row-tiled grid")
PROGRAMS_PER_SM = 4
#: the fewest row pairs a chunk gets: each chunk re-reads k (4 L bytes per feature) and, in the
#: backward, writes and re-reads a partial dk (8 L bytes), against at least 8 rows x 3 L x 2-4 bytes
#: of the chunk's own inputs and outputs: at most ~17% (bf16) / ~8% (fp32) over the ideal
MIN_CHUNK_PAIRS = 4
#: the SM count the interpreter plans with (CPU tensors: no device to ask); small, so that a
#: test's few features split a batch of >= 2 MIN_CHUNK_PAIRS pairs (tests lower that minimum);
#: chunks <= 4 x SMs stays far below the grid's y limit
INTERPRETER_SMS = 1
#: column-pass dot tile BR of the workspace path (R = N / 4096 <= 64, rows >= R masked)
WORK_ROWS = (64,)
#: row length C of the workspace path (one 16 x 16 x 16 tile transform per row)
WORK_C = 4096
#: software-pipelining depth of the FFT kernels: 1 (no prefetch buffers: the column passes' chunk
#: loads feed dots, and a second stage holds the next chunk in registers next to the accumulators)
FFT_STAGES = 1


def not_supported_reasons(x=None, k=None, **_) -> list[str]:
    why = device_reasons(x, op="fftconv") + dtype_reasons("x", x, X_DTYPES)
    if k is not None:
        why += dtype_reasons("k", k, (torch.bfloat16, torch.float16, torch.float32))
    if x.shape[-1] > MAX_LENGTH:
        why.append(f"L = {x.shape[-1]} > {MAX_LENGTH} (FFT size up to 2**18; use backend='torch')")
    else:
        why += release_reasons("fftconv", x.device, **launch_path(x.shape[-1]))
    return why


def launch_path(L: int) -> dict:
    """What RELEASE_PRUNES reads of a launch at length L: the FFT path (tile: one program holds
    the transform; work: the workspace passes beyond MAX_TILE_FFT) and its FFT size N (the
    direct path's short lengths have a small N)."""
    N = fft_size(L)
    return {"path": "work" if N > MAX_TILE_FFT else "tile", "N": N}


def fft_size(L: int) -> int:
    return max(MIN_FFT, 2 * (1 << (L - 1).bit_length()))


def tile_factor(N: int) -> int:
    """A of the tile path's N' = 256 A point transform for an N-point FFT: N itself, at least 256
    (a larger zero padding is still a linear convolution)."""
    return next(a for a in TILE_FACTORS if 256 * a >= N)


_TABLES: dict = {}


def twiddle_table(device) -> torch.Tensor:
    """[2, 4096] fp32: cos and sin of 2 pi e / 4096, evaluated in float64 and rounded once."""
    key = str(device)
    if key not in _TABLES:
        e = torch.arange(4096, dtype=torch.float64) * (2 * math.pi / 4096)
        _TABLES[key] = torch.stack([torch.cos(e), torch.sin(e)]).to(torch.float32).to(device).contiguous()
    return _TABLES[key]


def tile_warps(N: int, num_warps: int) -> int:
    """Warps of the tile path: ``num_warps`` at N = 4096, fewer for smaller tiles (>= 4)."""
    return max(4, min(num_warps, num_warps * N // MAX_TILE_FFT))


if HAVE_TRITON:
    from .._triton_common import cmul, sincos_quarter, store_rounded

    #: tensor-core fp32 emulation (3 TF32 products per product, fp32 accumulation): see docs/fft.md, Precision
    DOT_PRECISION = tl.constexpr(os.environ.get("FFTCONV_DOT", "tf32x3"))
    #: the tile forward's dots when y is rounded to bf16: one TF32 product (operand error 2^-11, about
    #: 1e-3 of the scale after the transforms, against bf16's own 2^-9 rounding and its 2e-2 budget)
    #: instead of three; the gradients keep DOT_PRECISION (dk is returned in k's dtype, fp32)
    BF16_OUT_DOT = tl.constexpr(os.environ.get("FFTCONV_DOT_BF16", "tf32"))

    @triton.jit
    def twiddle(e, LOG_M):
        """(cos, sin) of 2 pi e / 2**LOG_M for integer e >= 0 (LOG_M >= 3): e reduced mod M exactly,
        the nearest quarter turn applied as an exact rotation, the rest (|angle| <= pi/4) rounded once."""
        i = e & ((1 << LOG_M) - 1)
        q = (i + (1 << (LOG_M - 3))) >> (LOG_M - 2)          # nearest quarter turn, 0..4
        rem = i - (q << (LOG_M - 2))                          # |rem| <= M/8
        m = (i * 0 + (1 << LOG_M)).to(tl.float32)           # (a tensor whether LOG_M is constexpr or not)
        ang = rem.to(tl.float32) * (6.283185307179586 / m)    # 2 pi / 2**k: exact scaling, one rounding
        s, c = sincos_quarter(ang)
        q = q & 3
        swap = (q & 1) == 1
        cs = tl.where(swap, s, c)
        sn = tl.where(swap, c, s)
        cs = tl.where((q == 1) | (q == 2), -cs, cs)
        sn = tl.where(q >= 2, -sn, sn)
        return cs, sn

    @triton.jit
    def table_twiddle(tw_ptr, e, LOG_M: tl.constexpr):
        """(cos, sin) of 2 pi e / 2**LOG_M (LOG_M <= 12) from the host's float64-exact fp32 table of
        the 4096th roots of unity (e reduced mod M in integers): half-ulp exact values for one gather
        each instead of ~30 ALU ops; the 32 KB table stays L1/L2 resident."""
        idx = (e & ((1 << LOG_M) - 1)) << (12 - LOG_M)          # table index of e / M in 4096ths
        return tl.load(tw_ptr + idx), tl.load(tw_ptr + 4096 + idx)

    @triton.jit
    def opaque_zero(tw_ptr):
        """0, as (table[0] = cos 0 = 1) != 1: the compiler cannot fold it, so the index arithmetic rooted
        in it is neither hoisted out of the loop over row pairs nor shared between transforms."""
        return (tl.load(tw_ptr) != 1.0).to(tl.int32)

    @triton.jit
    def tile_offsets(tw_ptr, A: tl.constexpr):
        """[256, A] positions j + 256 a, rooted in ``opaque_zero`` so that each use recomputes them
        (a few integer ops) instead of holding 16-32 registers across the transforms."""
        return tl.arange(0, 256)[:, None] + (tl.arange(0, A)[None, :] + opaque_zero(tw_ptr)) * 256

    @triton.jit
    def tile_pair(tw_ptr, ptr, b0, d, B, L, s_b, s_d, s_t, A: tl.constexpr):
        """Rows b0 and b0 + 1 (zeros when b0 + 1 = B) of feature d as fp32 [256, A] tiles (zero past L)."""
        o_n = tile_offsets(tw_ptr, A)
        p = ptr + (d.to(tl.int64) * 0 + b0) * s_b + d.to(tl.int64) * s_d + o_n * s_t
        b_r = tl.load(p, mask=o_n < L, other=0.0).to(tl.float32)
        b_i = tl.load(p + s_b, mask=o_n < L * tl.minimum(B - 1 - b0, 1), other=0.0).to(tl.float32)
        return b_r, b_i

    @triton.jit
    def dft16(tw_ptr, SIGN: tl.constexpr):
        """The 16-point DFT matrix W_16^(-SIGN f n) = cos + SIGN i sin of 2 pi f n / 16 (symmetric) as
        (re, im, -im) [16, 16]: SIGN = -1 forward, +1 inverse; -im lets a complex product run as four
        accumulating dots with no negation of the data operand."""
        o = tl.arange(0, 16) + opaque_zero(tw_ptr)
        c, s = table_twiddle(tw_ptr, o[:, None] * o[None, :], 4)
        return c, SIGN * s, -SIGN * s

    @triton.jit
    def mm_right(xr, xi, fr, fi, fin, P: tl.constexpr):
        """[M, 16] @ [16, 16] complex: 4 accumulating K = 16 real dots (fin = -fi) in precision P."""
        re = -tl.dot(xi, fi, input_precision=P)
        re = tl.dot(xr, fr, re, input_precision=P)
        im = tl.dot(xr, fi, input_precision=P)
        im = tl.dot(xi, fr, im, input_precision=P)
        return re, im

    @triton.jit
    def mm_left(fr, fi, fin, xr, xi, accr, acci):
        """acc + [M, 16] @ [16, BC] complex, the left operand a (small) DFT matrix (fin = -fi)."""
        re = tl.dot(fr, xr, accr, input_precision=DOT_PRECISION)
        re = tl.dot(fin, xi, re, input_precision=DOT_PRECISION)
        im = tl.dot(fr, xi, acci, input_precision=DOT_PRECISION)
        im = tl.dot(fi, xr, im, input_precision=DOT_PRECISION)
        return re, im

    @triton.jit
    def rot(x, P: tl.constexpr, Q: tl.constexpr, R: tl.constexpr):
        """[(p, q), r] -> [(q, r), p] of the [P Q, R] tile: the next contraction index goes last."""
        return tl.reshape(tl.permute(tl.reshape(x, [P, Q, R]), (1, 2, 0)), [Q * R, P])

    @triton.jit
    def unrot(x, P: tl.constexpr, Q: tl.constexpr, R: tl.constexpr):
        """Inverse of ``rot``: [(q, r), p] -> [(p, q), r]."""
        return tl.reshape(tl.permute(tl.reshape(x, [Q, R, P]), (2, 0, 1)), [P * Q, R])

    @triton.jit
    def radix4(xr, xi, SIGN: tl.constexpr):
        """4-point DFT along the last axis of [256, 4] (exact: additions and +-i swaps), through
        split/join (no dot: K = 4 is below tl.dot's minimum)."""
        pr, qr = tl.split(tl.reshape(xr, [256, 2, 2]))                    # a = 2 a1 + a0: a0 = 0 / 1
        pi, qi = tl.split(tl.reshape(xi, [256, 2, 2]))
        x0r, x2r = tl.split(pr)
        x1r, x3r = tl.split(qr)
        x0i, x2i = tl.split(pi)
        x1i, x3i = tl.split(qi)
        sr = x0r + x2r
        si = x0i + x2i
        tr = x0r - x2r
        ti = x0i - x2i
        ur = x1r + x3r
        ui = x1i + x3i
        vr = x1r - x3r
        vi = x1i - x3i
        # X0 = s + u, X2 = s - u, X1 = t + SIGN i v, X3 = t - SIGN i v, joined as [256, f0 // 2, f0 % 2]
        yr = tl.join(tl.join(sr + ur, sr - ur), tl.join(tr - SIGN * vi, tr + SIGN * vi))
        yi = tl.join(tl.join(si + ui, si - ui), tl.join(ti + SIGN * vr, ti - SIGN * vr))
        return tl.reshape(yr, [256, 4]), tl.reshape(yi, [256, 4])

    @triton.jit
    def radix2(xr, xi):
        """2-point DFT along the last axis of [256, 2] (exact; the same both ways)."""
        x0r, x1r = tl.split(xr)
        x0i, x1i = tl.split(xi)
        return tl.join(x0r + x1r, x0r - x1r), tl.join(x0i + x1i, x0i - x1i)

    @triton.jit
    def level8(tw_ptr, xr, xi, SIGN: tl.constexpr, P: tl.constexpr):
        """8-point DFT along the last axis of [256, 8] as ONE K = 16 dot: the tile viewed as [128, 16]
        (rows 2r and 2r + 1 side by side) times the block-diagonal diag(F_8, F_8) (a dot needs K >= 16;
        half its products are by zero, cheaper than a radix-8 of splits and joins)."""
        tl.debug_barrier()
        o = tl.arange(0, 16) + opaque_zero(tw_ptr)
        c, s = table_twiddle(tw_ptr, (o[:, None] % 8) * (o[None, :] % 8), 3)
        same = (o[:, None] // 8) == (o[None, :] // 8)
        fr = tl.where(same, c, 0.0)
        fi = tl.where(same, SIGN * s, 0.0)
        re, im = mm_right(tl.reshape(xr, [128, 16]), tl.reshape(xi, [128, 16]), fr, fi, -fi, P)
        return tl.reshape(re, [256, 8]), tl.reshape(im, [256, 8])

    @triton.jit
    def stage_a(tw_ptr, xr, xi, A: tl.constexpr, SIGN: tl.constexpr, P: tl.constexpr):
        """The A-point DFT along the last axis of [256, A] (16: a K = 16 dot level; 8: a block-diagonal
        dot; 4: radix4; 2: radix2; 1: none)."""
        if A == 16:
            return level16(tw_ptr, xr, xi, SIGN, P)
        elif A == 8:
            return level8(tw_ptr, xr, xi, SIGN, P)
        elif A == 4:
            return radix4(xr, xi, SIGN)
        elif A == 2:
            return radix2(xr, xi)
        else:
            return xr, xi

    @triton.jit
    def level16(tw_ptr, xr, xi, SIGN: tl.constexpr, P: tl.constexpr):
        """[M, 16] @ the 16-point DFT matrix. The barrier (and ``opaque_zero``) keep the matrix's
        table loads and TF32 head/tail split (48 registers per thread) from being hoisted or shared
        between levels, transforms and loop iterations: each level's fragments live only during its dots."""
        tl.debug_barrier()
        fr, fi, fin = dft16(tw_ptr, SIGN)
        return mm_right(xr, xi, fr, fi, fin, P)

    @triton.jit
    def twiddle_a(tw_ptr, ar, ai, A: tl.constexpr, LOG_A: tl.constexpr, SIGN: tl.constexpr):
        """[(b, c), f0] *= W_16A^(-SIGN b f0) (A > 1)."""
        if A > 1:
            tl.debug_barrier()
            b = (tl.arange(0, 256)[:, None] + opaque_zero(tw_ptr)) // 16
            tc, ts = table_twiddle(tw_ptr, b * tl.arange(0, A)[None, :], LOG_A + 4)
            ar, ai = cmul(ar, ai, tc, SIGN * ts)
        return ar, ai

    @triton.jit
    def twiddle_n(tw_ptr, ar, ai, A: tl.constexpr, LOG_A: tl.constexpr, SIGN: tl.constexpr):
        """[(c, f0), f1] *= W_N^(-SIGN c (f0 + A f1))."""
        tl.debug_barrier()
        o_r = tl.arange(0, 16 * A)[:, None] + opaque_zero(tw_ptr)
        tc, ts = table_twiddle(tw_ptr, (o_r // A) * (o_r % A + A * tl.arange(0, 16)[None, :]), LOG_A + 8)
        return cmul(ar, ai, tc, SIGN * ts)

    @triton.jit
    def fftn(tw_ptr, xr, xi, A: tl.constexpr, LOG_A: tl.constexpr, P: tl.constexpr):
        """Forward DFT of N = 256 A points, x[16 b + c + 256 a] as the [256, A] tile (16 b + c, a),
        -> X[f0 + A f1 + 16 A f2] as the [16 A, 16] tile (16 f0 + f1, f2)."""
        ar, ai = stage_a(tw_ptr, xr, xi, A, -1, P)                           # [(b, c), f0]
        ar, ai = twiddle_a(tw_ptr, ar, ai, A, LOG_A, -1)
        ar, ai = level16(tw_ptr, rot(ar, 16, 16, A), rot(ai, 16, 16, A), -1, P)   # [(c, f0), b] -> [(c, f0), f1]
        ar, ai = twiddle_n(tw_ptr, ar, ai, A, LOG_A, -1)
        return level16(tw_ptr, rot(ar, 16, A, 16), rot(ai, 16, A, 16), -1, P)    # [(f0, f1), c] -> [(f0, f1), f2]

    @triton.jit
    def ifftn(tw_ptr, yr, yi, A: tl.constexpr, LOG_A: tl.constexpr, P: tl.constexpr):
        """Unnormalised inverse of ``fftn``: [16 A, 16] spectrum -> N x as the [256, A] tile."""
        ar, ai = level16(tw_ptr, yr, yi, 1, P)                                # [(f0, f1), c]
        ar, ai = twiddle_n(tw_ptr, unrot(ar, 16, A, 16), unrot(ai, 16, A, 16), A, LOG_A, 1)   # [(c, f0), f1]
        ar, ai = level16(tw_ptr, ar, ai, 1, P)                                # [(c, f0), b]
        ar, ai = twiddle_a(tw_ptr, unrot(ar, 16, 16, A), unrot(ai, 16, 16, A), A, LOG_A, 1)   # [(b, c), f0]
        return stage_a(tw_ptr, ar, ai, A, 1, P)                               # [(b, c), a]

    # ------------------------------------------------------------------ tile path (N <= 4096)

    @triton.jit
    def _tile_fwd_kernel(
        x_ptr, k_ptr, tw_ptr, b_ptr, om_ptr, y_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP, PAIRS,
        A: tl.constexpr, LOG_A: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        """Program (d, c): feature d, batch rows [2 PAIRS c, 2 PAIRS (c + 1)) as row pairs; k's spectrum
        once per program, shared by its pairs."""
        PF: tl.constexpr = BF16_OUT_DOT if OUT_BF16 else DOT_PRECISION
        d = tl.program_id(0)
        b_lo = tl.program_id(1) * (2 * PAIRS)
        b_hi = tl.minimum(B, b_lo + 2 * PAIRS)
        o_n = tile_offsets(tw_ptr, A)                                          # [256, A] position
        m_n = o_n < L
        b_k = tl.load(k_ptr + d.to(tl.int64) * L + o_n, mask=m_n, other=0.0).to(tl.float32)
        kr, ki = fftn(tw_ptr, b_k, tl.zeros([256, A], dtype=tl.float32), A, LOG_A, PF)
        inv_n = 1.0 / (A * 256)                                               # exact: a power of two
        kr = kr * inv_n
        ki = ki * inv_n
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        for b0 in range(b_lo, b_hi, 2):
            o_n = tile_offsets(tw_ptr, A)
            m_n = o_n < L
            m_1 = o_n < L * tl.minimum(B - 1 - b0, 1)                        # row b0+1 exists
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd + o_n * sxt
            b_xr = tl.load(p_x, mask=m_n, other=0.0).to(tl.float32)
            b_xi = tl.load(p_x + sxb, mask=m_1, other=0.0).to(tl.float32)
            sr, si = fftn(tw_ptr, b_xr, b_xi, A, LOG_A, PF)
            sr, si = cmul(sr, si, kr, ki)
            yr, yi = ifftn(tw_ptr, sr, si, A, LOG_A, PF)
            o_n = tile_offsets(tw_ptr, A)
            m_n = o_n < L
            m_1 = o_n < L * tl.minimum(B - 1 - b0, 1)
            m_bias = o_n < L * HAS_BIAS             # runtime flags as bounds: one compiled kernel
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd + o_n * sxt
            # fused epilogue (cema): omega x, x re-read (an L1/L2 hit: holding the tile across the two
            # transforms would cost 2 N / threads registers, the margin that keeps N = 4096 spill-free)
            # plus the bias rows
            row = (b0 * D + d).to(tl.int64) * L
            m_om = o_n < L * HAS_SKIP
            yr += om * tl.load(p_x, mask=m_n & m_om, other=0.0).to(tl.float32)
            yi += om * tl.load(p_x + sxb, mask=m_1 & m_om, other=0.0).to(tl.float32)
            yr += tl.load(b_ptr + row + o_n, mask=m_bias, other=0.0)
            yi += tl.load(b_ptr + row + D * L + o_n, mask=m_bias & m_1, other=0.0)
            store_rounded(y_ptr + row + o_n, yr, m_n, OUT_BF16)
            store_rounded(y_ptr + row + D * L + o_n, yi, m_1, OUT_BF16)

    @triton.jit
    def conj_spectrum(tw_ptr, k_ptr, d, L, NEED_X, A: tl.constexpr, LOG_A: tl.constexpr):
        """conj(K) / N of row d of k (zero unless NEED_X: only dx uses it)."""
        o_n = tile_offsets(tw_ptr, A)
        b_k = tl.load(k_ptr + d.to(tl.int64) * L + o_n, mask=o_n < L * NEED_X, other=0.0).to(tl.float32)
        kr, ki = fftn(tw_ptr, b_k, tl.zeros([256, A], dtype=tl.float32), A, LOG_A, DOT_PRECISION)
        inv_n = 1.0 / (A * 256)
        return kr * inv_n, -ki * inv_n

    @triton.jit
    def dx_pair(tw_ptr, zr, zi, kr, ki, om, dy_ptr, dx_ptr, b0, d, B, D, L, syb, syd, syt, L_DY,
                A: tl.constexpr, LOG_A: tl.constexpr):
        """dx rows b0, b0 + 1 = IFFT(Z conj(K) / N) + omega dy, from dy's pair spectrum Z; dy is re-read
        for the skip term up to L_DY (0: its lanes are masked off, no traffic)."""
        sr, si = cmul(zr, zi, kr, ki)
        gr, gi = ifftn(tw_ptr, sr, si, A, LOG_A, DOT_PRECISION)
        b_gr, b_gi = tile_pair(tw_ptr, dy_ptr, b0, d, B, L_DY, syb, syd, syt, A)
        o_n = tile_offsets(tw_ptr, A)
        row = (b0 * D + d).to(tl.int64) * L
        tl.store(dx_ptr + row + o_n, gr + om * b_gr, mask=o_n < L)
        tl.store(dx_ptr + row + D * L + o_n, gi + om * b_gi, mask=o_n < L * tl.minimum(B - 1 - b0, 1))

    @triton.jit
    def _tile_bwd_kernel(
        dy_ptr, x_ptr, k_ptr, tw_ptr, om_ptr, dx_ptr, dk_ptr, dom_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_X, NEED_K, HAS_SKIP, PAIRS,
        A: tl.constexpr, LOG_A: tl.constexpr,
    ):
        """Program (d, c): feature d, batch rows [2 PAIRS c, 2 PAIRS (c + 1)); dk and domega are this
        chunk's partial sums, stored at chunk c of [chunks, D, L] / [chunks, D] (the launcher adds
        the chunks in a fixed order: deterministic, no atomics)."""
        d = tl.program_id(0)
        c = tl.program_id(1)
        b_lo = c * (2 * PAIRS)
        b_hi = tl.minimum(B, b_lo + 2 * PAIRS)
        o_n = tile_offsets(tw_ptr, A)
        m_n = o_n < L
        inv_n = 1.0 / (A * 256)
        zero = tl.zeros([256, A], dtype=tl.float32)
        ONE_PASS: tl.constexpr = A < 8
        if ONE_PASS:
            kr, ki = conj_spectrum(tw_ptr, k_ptr, d, L, NEED_X, A, LOG_A)
        else:
            kr = tl.zeros([16 * A, 16], dtype=tl.float32)                # computed before the dx pass
            ki = kr
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        acc_r = tl.zeros([16 * A, 16], dtype=tl.float32)          # sum_pairs Z conj(P)
        acc_i = acc_r
        dom = tl.sum(tl.sum(zero, 1), 0)
        need_x_tile = (NEED_K != 0) | (HAS_SKIP != 0)
        # dy's re-reads (for domega and the skip term) only with the skip term at N <= 1024; at
        # N >= 2048 they stay unmasked: the masks' extra live state made the 4096-point bf16
        # backward spill 8 B on sm_90 with Triton 3.6 (it reads dy twice more there instead)
        if ONE_PASS:
            l_dy = L * HAS_SKIP
        else:
            l_dy = L
        # N = 2048 and 4096: two passes over the pairs when dx is needed (the dy transform done twice),
        # since k's spectrum, the dk accumulator and dy's spectrum (3 x 32 registers per thread at 4
        # and 8 warps) next to a transform in flight exceed sm_80's 255 registers (N = 2048 in one
        # pass spilled 56-96 B with Triton 3.9); smaller tiles do it in one pass.
        for b0 in range(b_lo, b_hi, 2):
            if need_x_tile | ((NEED_X != 0) & ONE_PASS):
                b_gr, b_gi = tile_pair(tw_ptr, dy_ptr, b0, d, B, L, syb, syd, syt, A)
                zr, zi = fftn(tw_ptr, b_gr, b_gi, A, LOG_A, DOT_PRECISION)
                if need_x_tile:
                    # x read here, dy re-read (an L1/L2 hit) for domega alone, rather than held across
                    # the transforms (masked off without the skip term at N <= 1024, l_dy)
                    b_xr, b_xi = tile_pair(tw_ptr, x_ptr, b0, d, B, L, sxb, sxd, sxt, A)
                    b_gr, b_gi = tile_pair(tw_ptr, dy_ptr, b0, d, B, l_dy, syb, syd, syt, A)
                    dom += tl.sum(tl.sum(b_gr * b_xr + b_gi * b_xi, 1), 0)
                    if NEED_K != 0:
                        pr, pi = fftn(tw_ptr, b_xr, b_xi, A, LOG_A, DOT_PRECISION)
                        sr, si = cmul(zr, zi, pr, -pi)
                        acc_r += sr
                        acc_i += si
                if ONE_PASS:
                    if NEED_X != 0:
                        dx_pair(tw_ptr, zr, zi, kr, ki, om, dy_ptr, dx_ptr, b0, d, B, D, L, syb, syd, syt, l_dy,
                                A, LOG_A)
        if not ONE_PASS:
            if NEED_X != 0:
                kr, ki = conj_spectrum(tw_ptr, k_ptr, d, L, NEED_X, A, LOG_A)
                for b0 in range(b_lo, b_hi, 2):
                    b_gr, b_gi = tile_pair(tw_ptr, dy_ptr, b0, d, B, L, syb, syd, syt, A)
                    zr, zi = fftn(tw_ptr, b_gr, b_gi, A, LOG_A, DOT_PRECISION)
                    dx_pair(tw_ptr, zr, zi, kr, ki, om, dy_ptr, dx_ptr, b0, d, B, D, L, syb, syd, syt, l_dy,
                                A, LOG_A)
        if NEED_K != 0:
            gr, gi = ifftn(tw_ptr, acc_r, acc_i, A, LOG_A, DOT_PRECISION)
            tl.store(dk_ptr + (c * D + d).to(tl.int64) * L + o_n, gr * inv_n, mask=m_n)
        if HAS_SKIP != 0:
            tl.store(dom_ptr + c * D + d, dom)

    # ------------------------------------------------------------------ workspace path (N >= 8192)

    @triton.jit
    def table_root(tw_ptr, e, mask, R, LOG_R):
        """(cos, sin) of 2 pi e / R from the table, R = 2**LOG_R <= 4096 a runtime power of two; 0 where
        not ``mask`` (the padding rows / columns of the R-point DFT, not read)."""
        idx = (e & (R - 1)) << (12 - LOG_R)
        return tl.load(tw_ptr + idx, mask=mask, other=0.0), tl.load(tw_ptr + 4096 + idx, mask=mask, other=0.0)

    @triton.jit
    def col_fwd(tw_ptr, src_ptr, s_b, s_t, HAS_IM, dst_ptr, L, R, LOG_N,
                BR: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
        """Column pass: for n = C r + c, A[f, c] = W_N^(f c) sum_r W_R^(f r) src[n] (src row pair:
        re at src_ptr, im at src_ptr + s_b when the 0/1 flag HAS_IM), written to dst planes (re at dst, im at
        dst + R C) at f C + c. The R-point DFT runs in K = 16 chunks of r (rows >= R zero): [BR, 16] @
        [16, BC] dots accumulated in the [BR, BC] tile, each chunk loaded from memory when it is used."""
        for c0 in range(0, C, BC):
            o_f = tl.arange(0, BR) + opaque_zero(tw_ptr)      # per tile: nothing [BR, BC] held across tiles
            o_j = tl.arange(0, 16)
            o_c = tl.arange(0, BC)
            m_f = o_f < R
            accr = tl.zeros([BR, BC], dtype=tl.float32)
            acci = tl.zeros([BR, BC], dtype=tl.float32)
            for r0 in range(0, R, 16):
                o_r = r0 + o_j
                m_fr = m_f[:, None] & (o_r[None, :] < R)
                fr, fs = table_root(tw_ptr, o_f[:, None] * o_r[None, :], m_fr, R, LOG_N - 12)   # W_R^(f r)
                o_n = o_r[:, None] * C + c0 + o_c[None, :]                     # [16, BC]
                m_n = (o_r[:, None] < R) & (o_n < L)
                b_r = tl.load(src_ptr + o_n * s_t, mask=m_n, other=0.0).to(tl.float32)
                b_i = tl.load(src_ptr + s_b + o_n * s_t, mask=m_n & (o_n < L * HAS_IM), other=0.0).to(tl.float32)
                accr, acci = mm_left(fr, -fs, fs, b_r, b_i, accr, acci)
            tc, ts = twiddle(o_f[:, None] * (c0 + o_c[None, :]), LOG_N)
            ar, ai = cmul(accr, acci, tc, -ts)
            o_s = o_f[:, None] * C + c0 + o_c[None, :]
            m_s = m_f[:, None] & (o_c[None, :] < BC)
            tl.store(dst_ptr + o_s, ar, mask=m_s)
            tl.store(dst_ptr + R * C + o_s, ai, mask=m_s)

    @triton.jit
    def col_inv_tile(tw_ptr, src_ptr, c0, R, LOG_N, BR: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
        """Inverse column pass on columns c0..c0+BC of the planes at src: out[r, c] =
        sum_f W_R^(-f r) W_N^(-f c) A[f, c] for the positions n = C r + c (unnormalised), in K = 16
        chunks of f as ``col_fwd``."""
        o_r = tl.arange(0, BR) + opaque_zero(tw_ptr)
        o_j = tl.arange(0, 16)
        o_c = tl.arange(0, BC)
        m_r = o_r < R
        accr = tl.zeros([BR, BC], dtype=tl.float32)
        acci = tl.zeros([BR, BC], dtype=tl.float32)
        for f0 in range(0, R, 16):
            o_f = f0 + o_j
            o_n = o_f[:, None] * C + c0 + o_c[None, :]                         # [16, BC]
            m_a = (o_f[:, None] < R) & (o_c[None, :] < BC)
            ar = tl.load(src_ptr + o_n, mask=m_a, other=0.0)
            ai = tl.load(src_ptr + R * C + o_n, mask=m_a, other=0.0)
            tc, ts = twiddle(o_f[:, None] * (c0 + o_c[None, :]), LOG_N)
            ar, ai = cmul(ar, ai, tc, ts)
            m_rf = m_r[:, None] & (o_f[None, :] < R)
            fr, fs = table_root(tw_ptr, o_r[:, None] * o_f[None, :], m_rf, R, LOG_N - 12)   # conj W_R: +sin
            accr, acci = mm_left(fr, fs, -fs, ar, ai, accr, acci)
        return accr, acci

    @triton.jit
    def row_load(tw_ptr, src_ptr, f, R, C: tl.constexpr):
        """Row f (length C = 4096) of the planes at src in natural order, as the [256, 16] tile of fftn."""
        o_c = f * C + tile_offsets(tw_ptr, 16)
        return tl.load(src_ptr + o_c), tl.load(src_ptr + R * C + o_c), o_c

    @triton.jit
    def spec_offsets(tw_ptr):
        """[256, 16] row-major positions of a row spectrum (rooted in ``opaque_zero``, see tile_offsets)."""
        return (tl.arange(0, 256)[:, None] + opaque_zero(tw_ptr)) * 16 + tl.arange(0, 16)[None, :]

    @triton.jit
    def spec_load(tw_ptr, src_ptr, f, R, C: tl.constexpr):
        """Row f's spectrum, stored as fftn's [256, 16] tile (row-major)."""
        o_s = f * C + spec_offsets(tw_ptr)
        return tl.load(src_ptr + o_s), tl.load(src_ptr + R * C + o_s), o_s

    @triton.jit
    def _work_fwd_kernel(
        x_ptr, k_ptr, tw_ptr, b_ptr, om_ptr, y_ptr, ws_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP, R, LOG_N,
        BR: tl.constexpr, BC: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        C: tl.constexpr = 4096
        d = tl.program_id(0)
        N = R * C
        w_k = ws_ptr + d.to(tl.int64) * (4 * N)                   # k spectrum planes (re, im)
        w_x = w_k + 2 * N                                         # row-pair planes
        inv_n = 1.0 / N.to(tl.float32)
        # k's spectrum, once per d: column pass, then the row FFTs in place (scaled by 1/N)
        col_fwd(tw_ptr, k_ptr + d.to(tl.int64) * L, 0, 1, 0, w_k, L, R, LOG_N, BR, BC, C)
        tl.debug_barrier()
        for f in range(R):
            sr, si, _ = row_load(tw_ptr, w_k, f, R, C)
            sr, si = fftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
            o_s = f * C + spec_offsets(tw_ptr)
            tl.store(w_k + o_s, sr * inv_n)
            tl.store(w_k + N + o_s, si * inv_n)
        tl.debug_barrier()
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        o_r = tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        for b0 in range(0, B, 2):
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd
            col_fwd(tw_ptr, p_x, sxb, sxt, tl.minimum(B - 1 - b0, 1), w_x, L, R, LOG_N, BR, BC, C)
            tl.debug_barrier()
            for f in range(R):
                sr, si, _ = row_load(tw_ptr, w_x, f, R, C)
                sr, si = fftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
                kr, ki, _ = spec_load(tw_ptr, w_k, f, R, C)
                sr, si = cmul(sr, si, kr, ki)
                sr, si = ifftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
                o_f = f * C + tile_offsets(tw_ptr, 16)
                tl.store(w_x + o_f, sr)
                tl.store(w_x + N + o_f, si)
            tl.debug_barrier()
            row = (b0 * D + d).to(tl.int64) * L
            for c0 in range(0, C, BC):
                yr, yi = col_inv_tile(tw_ptr, w_x, c0, R, LOG_N, BR, BC, C)
                o_r = tl.arange(0, BR) + opaque_zero(tw_ptr)
                o_n = o_r[:, None] * C + c0 + o_c[None, :]
                m_n = (o_r[:, None] < R) & (o_n < L)
                m_1 = o_n < L * tl.minimum(B - 1 - b0, 1)                        # row b0+1 exists
                # fused epilogue (cema): omega x (x re-read from L2: the tile left registers two
                # passes ago) and the bias rows
                yr += om * tl.load(p_x + o_n * sxt, mask=m_n & (o_n < L * HAS_SKIP), other=0.0).to(tl.float32)
                yi += om * tl.load(p_x + sxb + o_n * sxt, mask=m_1 & (o_n < L * HAS_SKIP), other=0.0).to(tl.float32)
                yr += tl.load(b_ptr + row + o_n, mask=m_n & (o_n < L * HAS_BIAS), other=0.0)
                yi += tl.load(b_ptr + row + D * L + o_n, mask=m_1 & (o_n < L * HAS_BIAS), other=0.0)
                store_rounded(y_ptr + row + o_n, yr, m_n, OUT_BF16)
                store_rounded(y_ptr + row + D * L + o_n, yi, m_1, OUT_BF16)
            tl.debug_barrier()

    @triton.jit
    def _work_bwd_kernel(
        dy_ptr, x_ptr, k_ptr, tw_ptr, om_ptr, dx_ptr, dk_ptr, dom_ptr, ws_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, HAS_SKIP, DO_DOM, R, LOG_N,
        NEED_X: tl.constexpr, NEED_K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):
        """One backward pass of the workspace path: dx (NEED_X; + omega dy when HAS_SKIP) or dk
        (NEED_K); the launcher runs one launch per needed output, never both in one program (with
        both, the live state of the two row loops spilled on sm_90). DO_DOM: this launch also
        sums domega = sum dy x (exactly one launch does)."""
        C: tl.constexpr = 4096
        d = tl.program_id(0)
        N = R * C
        w_k = ws_ptr + d.to(tl.int64) * (8 * N)                   # conj(K)/N planes
        w_z = w_k + 2 * N                                         # dy pair spectrum, then dx
        w_p = w_k + 4 * N                                         # x pair spectrum
        w_s = w_k + 6 * N                                         # sum_pairs Z conj(P)
        inv_n = 1.0 / N.to(tl.float32)
        o_r = tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        if NEED_X != 0:
            col_fwd(tw_ptr, k_ptr + d.to(tl.int64) * L, 0, 1, 0, w_k, L, R, LOG_N, BR, BC, C)
            tl.debug_barrier()
            for f in range(R):
                sr, si, _ = row_load(tw_ptr, w_k, f, R, C)
                sr, si = fftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
                o_s = f * C + spec_offsets(tw_ptr)
                tl.store(w_k + o_s, sr * inv_n)
                tl.store(w_k + N + o_s, -si * inv_n)
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        dom = tl.sum(tl.zeros([BR], dtype=tl.float32), 0)
        for b0 in range(0, B, 2):
            tl.debug_barrier()
            p_dy = dy_ptr + (d.to(tl.int64) * 0 + b0) * syb + d.to(tl.int64) * syd
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd
            has_1 = tl.minimum(B - 1 - b0, 1)                       # 1: row b0+1 exists
            col_fwd(tw_ptr, p_dy, syb, syt, has_1, w_z, L, R, LOG_N, BR, BC, C)
            if NEED_K != 0:
                col_fwd(tw_ptr, p_x, sxb, sxt, has_1, w_p, L, R, LOG_N, BR, BC, C)
            if DO_DOM != 0:                                       # domega = sum dy x
                for c0 in range(0, C, BC):
                    o_r = tl.arange(0, BR) + opaque_zero(tw_ptr)
                    o_n = o_r[:, None] * C + c0 + o_c[None, :]
                    m_n = (o_r[:, None] < R) & (o_n < L)
                    m_1 = m_n & (o_n < L * has_1)
                    g0 = tl.load(p_dy + o_n * syt, mask=m_n, other=0.0).to(tl.float32)
                    g1 = tl.load(p_dy + syb + o_n * syt, mask=m_1, other=0.0).to(tl.float32)
                    x0 = tl.load(p_x + o_n * sxt, mask=m_n, other=0.0).to(tl.float32)
                    x1 = tl.load(p_x + sxb + o_n * sxt, mask=m_1, other=0.0).to(tl.float32)
                    dom += tl.sum(tl.sum(g0 * x0 + g1 * x1, 1), 0)
            tl.debug_barrier()
            for f in range(R):
                if NEED_K != 0:
                    # x's row spectrum first, parked in place in its workspace row, so that the two
                    # transforms of the product are never live at once (that spilled on sm_90)
                    pr, pi, _ = row_load(tw_ptr, w_p, f, R, C)
                    pr, pi = fftn(tw_ptr, pr, pi, 16, 4, DOT_PRECISION)
                    o_s = f * C + spec_offsets(tw_ptr)
                    tl.store(w_p + o_s, pr)
                    tl.store(w_p + N + o_s, pi)
                    tl.debug_barrier()
                zr, zi, _ = row_load(tw_ptr, w_z, f, R, C)
                zr, zi = fftn(tw_ptr, zr, zi, 16, 4, DOT_PRECISION)
                if NEED_K != 0:
                    pr, pi, o_s = spec_load(tw_ptr, w_p, f, R, C)
                    sr, si = cmul(zr, zi, pr, -pi)
                    m_acc = tl.full([256, 16], b0, tl.int32) > 0        # first pair: overwrite
                    sr += tl.load(w_s + o_s, mask=m_acc, other=0.0)
                    si += tl.load(w_s + N + o_s, mask=m_acc, other=0.0)
                    tl.store(w_s + o_s, sr)
                    tl.store(w_s + N + o_s, si)
                if NEED_X != 0:
                    kr, ki, _ = spec_load(tw_ptr, w_k, f, R, C)
                    sr, si = cmul(zr, zi, kr, ki)
                    sr, si = ifftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
                    o_f = f * C + tile_offsets(tw_ptr, 16)
                    tl.store(w_z + o_f, sr)
                    tl.store(w_z + N + o_f, si)
            tl.debug_barrier()
            if NEED_X != 0:
                row = (b0 * D + d).to(tl.int64) * L
                for c0 in range(0, C, BC):
                    gr, gi = col_inv_tile(tw_ptr, w_z, c0, R, LOG_N, BR, BC, C)
                    o_r = tl.arange(0, BR) + opaque_zero(tw_ptr)
                    o_n = o_r[:, None] * C + c0 + o_c[None, :]
                    m_n = (o_r[:, None] < R) & (o_n < L)
                    m_1 = m_n & (o_n < L * has_1)
                    gr += om * tl.load(p_dy + o_n * syt, mask=m_n & (o_n < L * HAS_SKIP), other=0.0).to(tl.float32)
                    gi += om * tl.load(p_dy + syb + o_n * syt, mask=m_1 & (o_n < L * HAS_SKIP), other=0.0).to(tl.float32)
                    tl.store(dx_ptr + row + o_n, gr, mask=m_n)
                    tl.store(dx_ptr + row + D * L + o_n, gi, mask=m_1)
        if NEED_K != 0:
            tl.debug_barrier()
            for f in range(R):
                sr, si, _ = spec_load(tw_ptr, w_s, f, R, C)
                sr, si = ifftn(tw_ptr, sr, si, 16, 4, DOT_PRECISION)
                o_f = f * C + tile_offsets(tw_ptr, 16)
                tl.store(w_s + o_f, sr)
                tl.store(w_s + N + o_f, si)
            tl.debug_barrier()
            for c0 in range(0, C, BC):
                gr, gi = col_inv_tile(tw_ptr, w_s, c0, R, LOG_N, BR, BC, C)
                o_r = tl.arange(0, BR) + opaque_zero(tw_ptr)
                o_n = o_r[:, None] * C + c0 + o_c[None, :]
                m_n = (o_r[:, None] < R) & (o_n < L)
                tl.store(dk_ptr + d.to(tl.int64) * L + o_n, gr * inv_n, mask=m_n)
        if DO_DOM != 0:
            tl.store(dom_ptr + d, dom)

    # ------------------------------------------------------------------ direct path (L <= 64)

    @triton.jit
    def _direct_fwd_kernel(
        x_ptr, k_ptr, b_ptr, om_ptr, y_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP,
        BL: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_t = tl.arange(0, BL)
        m_t = o_t < L
        lag = o_t[:, None] - o_t[None, :]                                     # [t, s]
        toe = tl.load(k_ptr + d.to(tl.int64) * L + lag, mask=(lag >= 0) & m_t[:, None], other=0.0).to(tl.float32)
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        for b in range(B):
            b_x = tl.load(x_ptr + (d.to(tl.int64) * 0 + b) * sxb + d.to(tl.int64) * sxd + o_t * sxt, mask=m_t,
                          other=0.0).to(tl.float32)
            row = (b * D + d).to(tl.int64) * L
            y = tl.sum(toe * b_x[None, :], 1) + om * b_x
            y += tl.load(b_ptr + row + o_t, mask=o_t < L * HAS_BIAS, other=0.0)
            store_rounded(y_ptr + row + o_t, y, m_t, OUT_BF16)

    @triton.jit
    def _direct_bwd_kernel(
        dy_ptr, x_ptr, k_ptr, om_ptr, dx_ptr, dk_ptr, dom_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_X, NEED_K, HAS_SKIP,
        BL: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_t = tl.arange(0, BL)
        m_t = o_t < L
        lag = o_t[:, None] - o_t[None, :]                                     # [t, s] / [t, j]
        m_lag = (lag >= 0) & m_t[:, None]
        toe = tl.load(k_ptr + d.to(tl.int64) * L + lag, mask=m_lag & (o_t[:, None] < L * NEED_X), other=0.0).to(tl.float32)
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        dk = tl.zeros([BL], dtype=tl.float32)
        dom = tl.sum(dk, 0)
        for b in range(B):
            p_x = x_ptr + (d.to(tl.int64) * 0 + b) * sxb + d.to(tl.int64) * sxd
            b_g = tl.load(dy_ptr + (d.to(tl.int64) * 0 + b) * syb + d.to(tl.int64) * syd + o_t * syt, mask=m_t,
                          other=0.0).to(tl.float32)
            if NEED_X != 0:
                row = (b * D + d).to(tl.int64) * L
                tl.store(dx_ptr + row + o_t, tl.sum(toe * b_g[:, None], 0) + om * b_g, mask=m_t)
            if NEED_K != 0:
                # x[t - j] as a [t, j] tile (gathered from the row, L <= 64 so it stays in L1)
                xs = tl.load(p_x + lag * sxt, mask=m_lag, other=0.0).to(tl.float32)
                dk += tl.sum(xs * b_g[:, None], 0)
            if HAS_SKIP != 0:
                dom += tl.sum(b_g * tl.load(p_x + o_t * sxt, mask=m_t, other=0.0).to(tl.float32), 0)
        if NEED_K != 0:
            tl.store(dk_ptr + d.to(tl.int64) * L + o_t, dk, mask=m_t)
        if HAS_SKIP != 0:
            tl.store(dom_ptr + d, dom)


# ---------------------------------------------------------------------- launchers

def _plan(L: int, direct_max_len: int):
    """("direct", BL) | ("tile", A) | ("work", R, BR)."""
    if L <= min(direct_max_len, DIRECT_MAX):
        return ("direct", max(16, triton.next_power_of_2(L)))
    N = fft_size(L)
    if N <= MAX_TILE_FFT:
        return ("tile", tile_factor(N))
    R = N // WORK_C
    return ("work", R, WORK_ROWS[-1])


_SMS: dict = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); ``INTERPRETER_SMS`` for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


def row_chunks(B: int, D: int, sms: int) -> tuple[int, int]:
    """(chunks, pairs per chunk) of the tile path's grid (D, chunks) on a device with ``sms`` SMs:
    the batch's row pairs split into as few chunks as give ``PROGRAMS_PER_SM`` programs per SM
    (each chunk recomputes k's spectrum and, in the backward, writes one partial dk), with at least
    ``MIN_CHUNK_PAIRS`` pairs per chunk."""
    pairs = (B + 1) // 2
    want = -(-PROGRAMS_PER_SM * sms // max(D, 1))
    per = max(1, -(-pairs // max(1, min(want, pairs // MIN_CHUNK_PAIRS))))
    return max(1, -(-pairs // per)), per


def _log2(n: int) -> int:
    return n.bit_length() - 1


def conv_fwd(x, k, bias=None, omega=None, out_dtype=None, *, direct_max_len, num_warps, work_warps,
             work_bc, direct_warps):
    """y = conv(x, k) (+ bias r(B D L) fp32) (+ omega[:, None] x), rounded once to ``out_dtype``."""
    B, D, L = x.shape
    out_dtype = out_dtype or x.dtype
    k = k.to(torch.float32).contiguous()
    y = torch.empty(B, D, L, dtype=out_dtype, device=x.device)
    bias_t = bias.to(torch.float32).contiguous() if bias is not None else k
    om = omega.contiguous() if omega is not None else k
    flags = (int(bias is not None), int(omega is not None))
    strides = x.stride()
    out_bf16 = out_dtype == torch.bfloat16
    plan = _plan(L, direct_max_len)
    if plan[0] == "direct":
        _direct_fwd_kernel[(D,)](x, k, bias_t, om, y, B, D, L, *strides, *flags,
                                 BL=plan[1], OUT_BF16=out_bf16, num_warps=direct_warps)
    elif plan[0] == "tile":
        a = plan[1]
        chunks, pairs = row_chunks(B, D, sm_count(x.device))
        _tile_fwd_kernel[(D, chunks)](x, k, twiddle_table(x.device), bias_t, om, y, B, D, L, *strides, *flags, pairs,
                                      A=a, LOG_A=_log2(a), OUT_BF16=out_bf16, num_warps=tile_warps(256 * a, num_warps),
                                      num_stages=FFT_STAGES)
    else:
        R, BR = plan[1:]
        N = R * WORK_C
        ws = torch.empty(D, 4 * N, dtype=torch.float32, device=x.device)
        _work_fwd_kernel[(D,)](x, k, twiddle_table(x.device), bias_t, om, y, ws, B, D, L, *strides, *flags, R, _log2(N),
                               BR=BR, BC=work_bc, OUT_BF16=out_bf16, num_warps=work_warps,
                               num_stages=FFT_STAGES)
    return y


def conv_bwd(dy, x, k, need_x=True, need_k=True, omega=None, *, direct_max_len, num_warps, work_warps,
             work_bc, direct_warps):
    """-> (dx fp32 (+ omega dy) or None, dk fp32 or None, domega = sum_{b,t} dy x fp32 or None)."""
    B, D, L = x.shape
    if dy.dtype != x.dtype:      # one compiled load type per kernel: compute both in fp32
        dy, x = dy.to(torch.float32), x.to(torch.float32)
    k = k.to(torch.float32).contiguous()
    dev = x.device
    dx = torch.empty(B, D, L, dtype=torch.float32, device=dev) if need_x else k
    dk = torch.empty(D, L, dtype=torch.float32, device=dev) if need_k else k
    dom = torch.empty(D, dtype=torch.float32, device=dev) if omega is not None else k
    om = omega.contiguous() if omega is not None else k
    flags = (int(bool(need_x)), int(bool(need_k)), int(omega is not None))
    args = (dy, x, k, om, dx, dk, dom)
    targs = (dy, x, k, twiddle_table(dev), om, dx, dk, dom)
    shape = (B, D, L, *dy.stride(), *x.stride())
    plan = _plan(L, direct_max_len)
    if plan[0] == "direct":
        _direct_bwd_kernel[(D,)](*args, *shape, *flags, BL=plan[1], num_warps=direct_warps)
    elif plan[0] == "tile":
        a = plan[1]
        chunks, pairs = row_chunks(B, D, sm_count(dev))
        # per-chunk partial sums of dk and domega (chunk c at [c]), added below in a fixed order
        dk_c = torch.empty(chunks, D, L, dtype=torch.float32, device=dev) if need_k and chunks > 1 else dk
        dom_c = torch.empty(chunks, D, dtype=torch.float32, device=dev) if omega is not None and chunks > 1 else dom
        _tile_bwd_kernel[(D, chunks)](dy, x, k, twiddle_table(dev), om, dx, dk_c, dom_c, *shape, *flags, pairs,
                                      A=a, LOG_A=_log2(a), num_warps=tile_warps(256 * a, num_warps),
                                      num_stages=FFT_STAGES)
        if chunks > 1:
            if need_k:
                torch.sum(dk_c, 0, out=dk)
            if omega is not None:
                torch.sum(dom_c, 0, out=dom)
    else:
        R, BR = plan[1:]
        N = R * WORK_C
        ws = torch.empty(D, 8 * N, dtype=torch.float32, device=dev)
        skip = int(omega is not None)
        # one launch per output (they share the workspace, in stream order); domega rides on the dk
        # launch, else on the dx launch, else on a launch that computes only domega
        passes = [p for p, need in (((True, False), need_x), ((False, True), need_k)) if need] or [(False, False)]
        for i, (px, pk) in enumerate(passes):
            do_dom = int(skip and i == len(passes) - 1)
            _work_bwd_kernel[(D,)](*targs, ws, *shape, skip, do_dom, R, _log2(N), NEED_X=px, NEED_K=pk, BR=BR,
                                   BC=work_bc, num_warps=work_warps, num_stages=FFT_STAGES)
    return (dx if need_x else None, dk if need_k else None, dom if omega is not None else None)


def forward(x, k, out_dtype=None, **config):
    """y r(B D L) = causal conv of x r(B D L) with k r(D L), in ``out_dtype`` (default x's dtype)."""
    return conv_fwd(x, k, out_dtype=out_dtype, **config)


def backward(dy, x, k, need_x=True, need_k=True, **config):
    """-> (dx r(B D L) or None, dk r(D L) or None), both float32 (the compute dtype)."""
    dx, dk, _ = conv_bwd(dy, x, k, need_x, need_k, **config)
    return dx, dk
