"""Triton backend of fftconv: an FFT convolution whose every dense factor is a 16-point DFT matrix.

Three paths, chosen by length (``_plan``): a direct Toeplitz product for L <= ``direct_max_len``;
the tile path for FFT sizes N <= 4096 (256 A points, A in 1/2/4/8/16, whole row pair and k's
spectrum in registers; grid (D, chunks of batch row pairs), ``row_chunks``); the slice path for
8192 <= N <= 2**18 (N = R C: R slices of the C = 2048 point tile transform, a decimation in
frequency; grid (slices, D, chunks); the slices' inverse transforms combined through an fp32
workspace by the combine kernel, which also applies cema's epilogue). Two real rows are packed
into one complex row; k's spectrum is built once per program (tile) or once per call (slice), and
dk is summed over b without atomics (per-chunk partials added in a fixed order). Dots run in
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
#: for N = 4096 (scaled down with N, see ``tile_warps``; the slice path's 2048-point tiles take 4);
#: work_warps: the slice path's combine kernel; direct_warps.
#: Every config this backend may launch with (each AOT-compiled in tests for every tile size); the
#: first values are the default.
#: direct path up to direct_max_len (0: always the FFT); warps of the tile, combine and direct
#: kernels; work_bc columns per combine program (``combine_cols``)
CONFIG_SPACE_ALL_RELEASES: dict = {"direct_max_len": (64, 32, 0), "num_warps": (8,), "work_warps": (4,),
                                   "work_bc": (64,), "direct_warps": (4,)}
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
#: longest supported L (N = 2**18: slice path with R = 128)
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
#: tile size C of the slice path (N = R C > MAX_TILE_FFT, R = N / C slices of C-point tile
#: transforms): 2048, the largest tile whose transform fits 4 warps (two programs per SM)
SLICE_C = 2048
#: the most outputs (BJ blocks x BC columns) per combine program (``combine_cols``)
COMBINE_TILE = 2048
#: the combine kernel sums over the slices with [BJ, 16] @ [16, BC] dots (BJ >= 16) from this many
#: output blocks R / 2 on, below it with broadcast multiply-adds (BJ = R / 2, no padding): at R = 4
#: and 8 that issues 9x and 3x fewer instructions than the dots; at R = 16 about as many (sm_90 SASS,
#: docs/fft.md "Cost"), so the dots stay from there on
COMBINE_DOT_BJ = 8
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
        why += release_reasons("fftconv", x.device, **launch_path(x.shape[-1], x.dtype))
    return why


def launch_path(L: int, dtype=None) -> dict:
    """What RELEASE_PRUNES reads of a launch at length L of x in ``dtype``: the FFT path (tile: one
    program holds the transform; slice: the workspace passes beyond MAX_TILE_FFT), its FFT size N
    (the direct path's short lengths have a small N) and the kernels' load type ("bf16" / "fp32")."""
    N = fft_size(L)
    return {"path": "slice" if N > MAX_TILE_FFT else "tile", "N": N,
            "dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}


def fft_size(L: int) -> int:
    return max(MIN_FFT, 2 * (1 << (L - 1).bit_length()))


def tile_factor(N: int) -> int:
    """A of the tile path's N' = 256 A point transform for an N-point FFT: N itself, at least 256
    (a larger zero padding is still a linear convolution)."""
    return next(a for a in TILE_FACTORS if 256 * a >= N)


_TABLES: dict = {}

#: layout of the flat fp32 twiddle table (``twiddle_table``): the 4096th roots of unity (cos at 0,
#: sin at 4096: the slice path's W_R roots and ``opaque_zero``), then every factor of the tile
#: transform pre-arranged in the order of the tile that it multiplies, so that each level reads it
#: as a contiguous tile (a few cache lines per warp) instead of gathering scattered table entries
#: (up to 32 lines per warp-wide load, one L1 wavefront each: the gathers that bounded the
#: measured tile kernels, docs/fft.md "Cost"): the 16-point DFT matrix, the block-diagonal
#: diag(F_8, F_8), and per tile size A the W_16A twiddle of the [256, A] tile and the W_N twiddle of
#: the [16 A, 16] tile (cos then sin, 1024 A floats per A at ``TW_PLANES + 1024 (A - 1)``)
TW_F16 = 8192
TW_F8 = TW_F16 + 512
TW_PLANES = TW_F8 + 512
TW_SIZE = TW_PLANES + 1024 * (TILE_FACTORS[-1] * 2 - 1)


def twiddle_table(device) -> torch.Tensor:
    """Flat fp32 [TW_SIZE]: cos and sin of 2 pi e / 4096 (evaluated in float64 and rounded once),
    then the tile transform's factors as contiguous tiles of those same values (see TW_PLANES)."""
    key = str(device)
    if key not in _TABLES:
        e = torch.arange(4096, dtype=torch.float64) * (2 * math.pi / 4096)
        roots = torch.stack([torch.cos(e), torch.sin(e)]).to(torch.float32)      # [2, 4096]

        def plane(exp, log_m):
            """[2, *exp.shape] cos / sin of 2 pi exp / 2**log_m, read from the roots (bit-identical)."""
            return roots[:, (exp % (1 << log_m)) << (12 - log_m)]

        o = torch.arange(16)
        parts = [roots.reshape(-1), plane(o[:, None] * o[None, :], 4).reshape(-1)]
        same = (o[:, None] // 8) == (o[None, :] // 8)
        parts.append((plane((o[:, None] % 8) * (o[None, :] % 8), 3) * same).reshape(-1))
        for a in TILE_FACTORS:
            log_a = a.bit_length() - 1
            b = torch.arange(256)[:, None] // 16
            parts.append(plane(b * torch.arange(a)[None, :], log_a + 4).reshape(-1))           # [2, 256, a]
            r = torch.arange(16 * a)[:, None]
            parts.append(plane((r // a) * (r % a + a * o[None, :]), log_a + 8).reshape(-1))   # [2, 16 a, 16]
        table = torch.cat(parts)
        assert table.numel() == TW_SIZE
        _TABLES[key] = table.to(device).contiguous()
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
    TW_F16_C = tl.constexpr(TW_F16)
    TW_F8_C = tl.constexpr(TW_F8)
    TW_PLANES_C = tl.constexpr(TW_PLANES)

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
    def table_tile(tw_ptr, OFF: tl.constexpr, M: tl.constexpr, K: tl.constexpr):
        """The [M, K] cos and sin tiles stored row-major at ``OFF`` and ``OFF + M K`` of the table
        (positions rooted in ``opaque_zero``: re-read per use, never hoisted or held). The opaque term
        sits on the column index, which also keeps the loads scalar: rooting the rows only (4-wide
        vector loads) spilled the bf16 N = 2048 backward on sm_90, and both indices the fp32 one on
        sm_80 (16 B), with Triton 3.9; this form spills in neither."""
        o = tl.arange(0, M)[:, None] * K + (tl.arange(0, K)[None, :] + opaque_zero(tw_ptr))
        return tl.load(tw_ptr + OFF + o), tl.load(tw_ptr + OFF + M * K + o)

    @triton.jit
    def dft16(tw_ptr, SIGN: tl.constexpr):
        """The 16-point DFT matrix W_16^(-SIGN f n) = cos + SIGN i sin of 2 pi f n / 16 (symmetric) as
        (re, im, -im) [16, 16]: SIGN = -1 forward, +1 inverse; -im lets a complex product run as four
        accumulating dots with no negation of the data operand."""
        c, s = table_tile(tw_ptr, TW_F16_C, 16, 16)
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
        fr, s = table_tile(tw_ptr, TW_F8_C, 16, 16)                        # zero off the diagonal blocks
        fi = SIGN * s
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
            tc, ts = table_tile(tw_ptr, TW_PLANES_C + 1024 * (A - 1), 256, A)
            ar, ai = cmul(ar, ai, tc, SIGN * ts)
        return ar, ai

    @triton.jit
    def twiddle_n(tw_ptr, ar, ai, A: tl.constexpr, LOG_A: tl.constexpr, SIGN: tl.constexpr):
        """[(c, f0), f1] *= W_N^(-SIGN c (f0 + A f1))."""
        tl.debug_barrier()
        tc, ts = table_tile(tw_ptr, TW_PLANES_C + 1024 * (A - 1) + 512 * A, 16 * A, 16)
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
    def _tile_bwd_kernel(
        dy_ptr, x_ptr, k_ptr, tw_ptr, om_ptr, dx_ptr, dk_ptr, dom_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_X, NEED_K, HAS_SKIP, PAIRS,
        A: tl.constexpr, LOG_A: tl.constexpr,
    ):
        """Program (d, c): feature d, batch rows [2 PAIRS c, 2 PAIRS (c + 1)); dk and domega are this
        chunk's partial sums, stored at chunk c of [chunks, D, L] / [chunks, D] (the launcher adds
        the chunks in a fixed order: deterministic, no atomics).

        One pass over the pairs, three transforms per pair (dy, x, dx's inverse), each input read
        once: the skip term rides on k's spectrum and domega is read off the dk accumulator, so
        neither re-reads dy. Across x's transform three spectra are live (k's, the accumulator,
        dy's: 3 x 32 registers per thread at 4 warps and N = 2048, 8 warps and N = 4096). In this
        order (dy, x, then dx) no tile backward spills with Triton 3.9 and only the bf16 N = 2048
        one on sm_80 with 3.6 (8 B, pruned there); x first spilled 8 B with 3.9 (sm_80, bf16
        N = 2048), dx before x 8 B with 3.6 (docs/fft.md, "Keeping the registers in check")."""
        d = tl.program_id(0)
        c = tl.program_id(1)
        b_lo = c * (2 * PAIRS)
        b_hi = tl.minimum(B, b_lo + 2 * PAIRS)
        inv_n = 1.0 / (A * 256)
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        kr, ki = conj_spectrum(tw_ptr, k_ptr, d, L, NEED_X, A, LOG_A)
        kr += om * inv_n                       # the skip term: dx = IFFT(Z (conj(K) + omega) / N)
        acc_r = tl.zeros([16 * A, 16], dtype=tl.float32)          # sum_pairs Z conj(P)
        acc_i = acc_r
        need_x_tile = (NEED_K != 0) | (HAS_SKIP != 0)
        for b0 in range(b_lo, b_hi, 2):
            b_gr, b_gi = tile_pair(tw_ptr, dy_ptr, b0, d, B, L, syb, syd, syt, A)
            zr, zi = fftn(tw_ptr, b_gr, b_gi, A, LOG_A, DOT_PRECISION)
            if need_x_tile:
                b_xr, b_xi = tile_pair(tw_ptr, x_ptr, b0, d, B, L, sxb, sxd, sxt, A)
                pr, pi = fftn(tw_ptr, b_xr, b_xi, A, LOG_A, DOT_PRECISION)
                sr, si = cmul(zr, zi, pr, -pi)
                acc_r += sr
                acc_i += si
            if NEED_X != 0:
                sr, si = cmul(zr, zi, kr, ki)
                gr, gi = ifftn(tw_ptr, sr, si, A, LOG_A, DOT_PRECISION)
                o_n = tile_offsets(tw_ptr, A)
                row = (b0 * D + d).to(tl.int64) * L
                tl.store(dx_ptr + row + o_n, gr, mask=o_n < L)
                tl.store(dx_ptr + row + D * L + o_n, gi, mask=o_n < L * tl.minimum(B - 1 - b0, 1))
        if HAS_SKIP != 0:
            # domega = sum_t dy x = Re sum_f Z conj(P) / N (Parseval on the packed pairs), from acc
            tl.store(dom_ptr + c * D + d, tl.sum(tl.sum(acc_r, 1), 0) * inv_n)
        if NEED_K != 0:
            gr, gi = ifftn(tw_ptr, acc_r, acc_i, A, LOG_A, DOT_PRECISION)
            o_n = tile_offsets(tw_ptr, A)
            tl.store(dk_ptr + (c * D + d).to(tl.int64) * L + o_n, gr * inv_n, mask=o_n < L)

    # ------------------------------------------------------------------ slice path (N >= 8192)
    # N = R C, C = SLICE_C: X[R f + s] is the C-point DFT of the slice s's fold
    # u_s[m] = W_N^(m s) sum_j x[m + C j] W_R^(j s) (a decimation in frequency; j < R / 2, as
    # x is zero past L <= N / 2), so each (feature, slice, chunk of row pairs) program runs only
    # C-point tile transforms. The slices' inverse transforms v_s go through an fp32 workspace to
    # the combine kernel: y[m + C j] = sum_s W_R^(-j s) W_N^(-m s) v_s[m] (K carries the 1 / N).

    @triton.jit
    def table_root(tw_ptr, e, mask, R, LOG_R):
        """(cos, sin) of 2 pi e / R from the table, R = 2**LOG_R <= 4096 a runtime power of two; 0 where
        not ``mask`` (the padding rows / columns of the R-point DFT, not read)."""
        idx = (e & (R - 1)) << (12 - LOG_R)
        return tl.load(tw_ptr + idx, mask=mask, other=0.0), tl.load(tw_ptr + 4096 + idx, mask=mask, other=0.0)

    @triton.jit
    def fold_pair(tw_ptr, ptr, b0, d, B, L, s_b, s_d, s_t, s, R, LOG_N, LOG_R, A: tl.constexpr):
        """Slice s's fold of rows b0 (re) and b0 + 1 (im; zero when b0 + 1 = B) of feature d as the
        [256, A] tile of ``fftn``: one table root W_R^(j s) per block j of C positions, then the
        per-position W_N^(m s) (``twiddle``: N > 4096 is past the table)."""
        C: tl.constexpr = 256 * A
        o_n = tile_offsets(tw_ptr, A)
        ur = tl.zeros([256, A], dtype=tl.float32)
        ui = tl.zeros([256, A], dtype=tl.float32)
        p = ptr + (d.to(tl.int64) * 0 + b0) * s_b + d.to(tl.int64) * s_d
        m_1 = L * tl.minimum(B - 1 - b0, 1)                                  # row b0 + 1 exists
        for j in range(0, (L + C - 1) // C):
            idx = ((j * s) & (R - 1)) << (12 - LOG_R)
            cj = tl.load(tw_ptr + idx)
            sj = tl.load(tw_ptr + 4096 + idx)
            o_j = o_n + j * C
            br = tl.load(p + o_j * s_t, mask=o_j < L, other=0.0).to(tl.float32)
            bi = tl.load(p + s_b + o_j * s_t, mask=o_j < m_1, other=0.0).to(tl.float32)
            ur += br * cj + bi * sj                                         # (br + i bi) W_R^(-j s)
            ui += bi * cj - br * sj
        tc, ts = twiddle(o_n * s, LOG_N)
        return cmul(ur, ui, tc, -ts)

    @triton.jit
    def slice_offsets(tw_ptr, A: tl.constexpr):
        """[16 A, 16] row-major positions of ``fftn``'s spectrum tile (rooted in ``opaque_zero``)."""
        return (tl.arange(0, 16 * A)[:, None] + opaque_zero(tw_ptr)) * 16 + tl.arange(0, 16)[None, :]

    @triton.jit
    def _slice_spec_kernel(k_ptr, tw_ptr, ks_ptr, D, L, R, LOG_N, LOG_R, A: tl.constexpr, LOG_A: tl.constexpr):
        """Program (s, d): K[R f + s] / N of row d of k, stored as the [16 A, 16] spectrum tile (re,
        im planes) at ks[d, s] of [D, R, 2, C]: once per call, shared by every row pair."""
        C: tl.constexpr = 256 * A
        s = tl.program_id(0)                       # slices of one feature adjacent: x stays in L2
        d = tl.program_id(1)
        ur, ui = fold_pair(tw_ptr, k_ptr, 0, d, 1, L, 0, L, 1, s, R, LOG_N, LOG_R, A)
        kr, ki = fftn(tw_ptr, ur, ui, A, LOG_A, DOT_PRECISION)
        inv_n = 1.0 / (R * C).to(tl.float32)                               # exact: a power of two
        o_s = slice_offsets(tw_ptr, A)
        base = ks_ptr + (d * R + s).to(tl.int64) * (2 * C)
        tl.store(base + o_s, kr * inv_n)
        tl.store(base + C + o_s, ki * inv_n)

    @triton.jit
    def _slice_conv_kernel(
        x_ptr, ks_ptr, tw_ptr, v_ptr,
        B, D, L, sxb, sxd, sxt, CONJ, R, LOG_N, LOG_R, PAIRS,
        A: tl.constexpr, LOG_A: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        """Program (s, d, c): slice s of feature d for the row pairs of chunk c: v_s = IFFT_C(U_s K_s)
        (conj(K_s) when CONJ: dx) into v[pair, d, s] of [pairs, D, R, 2, C], K_s loaded once."""
        PF: tl.constexpr = BF16_OUT_DOT if OUT_BF16 else DOT_PRECISION
        C: tl.constexpr = 256 * A
        s = tl.program_id(0)                       # slices of one feature adjacent: x stays in L2
        d = tl.program_id(1)
        b_lo = tl.program_id(2) * (2 * PAIRS)
        b_hi = tl.minimum(B, b_lo + 2 * PAIRS)
        o_s = slice_offsets(tw_ptr, A)
        base = ks_ptr + (d * R + s).to(tl.int64) * (2 * C)
        kr = tl.load(base + o_s)
        ki = tl.load(base + C + o_s) * (1 - 2 * CONJ)
        for b0 in range(b_lo, b_hi, 2):
            ur, ui = fold_pair(tw_ptr, x_ptr, b0, d, B, L, sxb, sxd, sxt, s, R, LOG_N, LOG_R, A)
            zr, zi = fftn(tw_ptr, ur, ui, A, LOG_A, PF)
            zr, zi = cmul(zr, zi, kr, ki)
            vr, vi = ifftn(tw_ptr, zr, zi, A, LOG_A, PF)
            o_n = tile_offsets(tw_ptr, A)
            out = v_ptr + (((b0 // 2) * D + d) * R + s).to(tl.int64) * (2 * C)
            tl.store(out + o_n, vr)
            tl.store(out + C + o_n, vi)

    @triton.jit
    def _slice_dk_kernel(
        dy_ptr, x_ptr, tw_ptr, v_ptr, acc_ptr, dom_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_K, HAS_SKIP, R, LOG_N, LOG_R, PAIRS,
        A: tl.constexpr, LOG_A: tl.constexpr,
    ):
        """Program (s, d, c): slice s of sum over chunk c's pairs of Z conj(P) / N (Z, P: dy's and x's
        pair spectra), inverse-transformed into acc[c, d, s] of [chunks, D, R, 2, C] (the combine
        kernel turns it into chunk c's partial dk); P is parked in v[pair, d, s] while Z is
        transformed, so two transforms are never live at once. Slice 0 also sums domega's
        dy x of the chunk (dom[c, d])."""
        C: tl.constexpr = 256 * A
        s = tl.program_id(0)                       # slices of one feature adjacent: x stays in L2
        d = tl.program_id(1)
        c = tl.program_id(2)
        b_lo = c * (2 * PAIRS)
        b_hi = tl.minimum(B, b_lo + 2 * PAIRS)
        acc_r = tl.zeros([16 * A, 16], dtype=tl.float32)
        acc_i = acc_r
        dom = tl.sum(tl.sum(acc_r, 1), 0)
        l_dom = L * HAS_SKIP * (s == 0).to(tl.int32)                         # slice 0 sums domega
        for b0 in range(b_lo, b_hi, 2):
            if NEED_K != 0:
                o_s = slice_offsets(tw_ptr, A)
                park = v_ptr + (((b0 // 2) * D + d) * R + s).to(tl.int64) * (2 * C)
                ur, ui = fold_pair(tw_ptr, x_ptr, b0, d, B, L, sxb, sxd, sxt, s, R, LOG_N, LOG_R, A)
                pr, pi = fftn(tw_ptr, ur, ui, A, LOG_A, DOT_PRECISION)
                tl.store(park + o_s, pr)
                tl.store(park + C + o_s, pi)
                tl.debug_barrier()
                ur, ui = fold_pair(tw_ptr, dy_ptr, b0, d, B, L, syb, syd, syt, s, R, LOG_N, LOG_R, A)
                zr, zi = fftn(tw_ptr, ur, ui, A, LOG_A, DOT_PRECISION)
                o_s = slice_offsets(tw_ptr, A)
                pr = tl.load(park + o_s)
                pi = tl.load(park + C + o_s)
                sr, si = cmul(zr, zi, pr, -pi)
                acc_r += sr
                acc_i += si
                tl.debug_barrier()
            for j in range(0, (l_dom + C - 1) // C):                          # blocks of C positions
                b_gr, b_gi = tile_pair(tw_ptr, dy_ptr + j * (C) * syt, b0, d, B, l_dom - j * C,
                                       syb, syd, syt, A)
                b_xr, b_xi = tile_pair(tw_ptr, x_ptr + j * (C) * sxt, b0, d, B, l_dom - j * C,
                                       sxb, sxd, sxt, A)
                dom += tl.sum(tl.sum(b_gr * b_xr + b_gi * b_xi, 1), 0)
        if NEED_K != 0:
            inv_n = 1.0 / (R * C).to(tl.float32)
            gr, gi = ifftn(tw_ptr, acc_r * inv_n, acc_i * inv_n, A, LOG_A, DOT_PRECISION)
            o_n = tile_offsets(tw_ptr, A)
            out = acc_ptr + ((c * D + d) * R + s).to(tl.int64) * (2 * C)
            tl.store(out + o_n, gr)
            tl.store(out + C + o_n, gi)
        if HAS_SKIP != 0:
            tl.store(dom_ptr + c * D + d, dom, mask=s == 0)

    @triton.jit
    def _slice_out_kernel(
        v_ptr, tw_ptr, x_ptr, b_ptr, om_ptr, y_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP, HAS_IM, R, LOG_N, LOG_R,
        C: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        """Program (d, p, q): columns [q BC, (q + 1) BC) of pair p's rows 2p, 2p + 1 (the second only
        when HAS_IM): y[m + C j] = sum_s W_R^(-j s) W_N^(-m s) v_s[m] for the blocks j < BJ, as
        [BJ, 16] @ [16, BC] dots over 16 slices at a time (slices >= R masked) when BJ >= 16, else
        as broadcast multiply-adds slice by slice; then the epilogue (cema): + omega x + bias,
        rounded once into y's dtype."""
        d = tl.program_id(0)
        p = tl.program_id(1)
        b0 = p * (1 + HAS_IM)                      # dk's partials: one real row per "pair" (chunk)
        c0 = tl.program_id(2) * BC
        o_j = tl.arange(0, BJ) + opaque_zero(tw_ptr)
        o_f = tl.arange(0, 16)
        o_c = c0 + tl.arange(0, BC)
        src = v_ptr + (p * D + d).to(tl.int64) * R * (2 * C)
        accr = tl.zeros([BJ, BC], dtype=tl.float32)
        acci = tl.zeros([BJ, BC], dtype=tl.float32)
        if BJ >= 16:
            for f0 in range(0, R, 16):
                o_s = f0 + o_f
                m_a = (o_s[:, None] < R) & (o_c[None, :] < C)
                p_a = src + o_s[:, None] * (2 * C) + o_c[None, :]
                ar = tl.load(p_a, mask=m_a, other=0.0)
                ai = tl.load(p_a + C, mask=m_a, other=0.0)
                tc, ts = twiddle(o_s[:, None] * o_c[None, :], LOG_N)           # W_N^(-m s): conj
                ar, ai = cmul(ar, ai, tc, ts)
                fr, fs = table_root(tw_ptr, o_j[:, None] * o_s[None, :], o_s[None, :] < R, R, LOG_R)
                accr, acci = mm_left(fr, fs, -fs, ar, ai, accr, acci)
        else:
            # R = 2 BJ <= 8 slices: the sum as broadcast fp32 multiply-adds, one slice at a time (the
            # [16, 16] dots would be 16 / BJ x padded in j and 16 / R x in s: at R = 4 the dot form
            # issued 9 x the instructions, docs/fft.md "Cost")
            m_c = o_c < C
            for s in range(0, R):
                p_a = src + s * (2 * C) + o_c
                ar = tl.load(p_a, mask=m_c, other=0.0)
                ai = tl.load(p_a + C, mask=m_c, other=0.0)
                tc, ts = twiddle(o_c * s, LOG_N)                              # W_N^(-m s): conj
                ar, ai = cmul(ar, ai, tc, ts)
                fr, fs = table_root(tw_ptr, o_j * s, o_j < BJ, R, LOG_R)      # W_R^(-j s)
                accr += fr[:, None] * ar[None, :] - fs[:, None] * ai[None, :]
                acci += fr[:, None] * ai[None, :] + fs[:, None] * ar[None, :]
        o_n = o_j[:, None] * C + o_c[None, :]
        m_n = (o_n < L) & (o_c[None, :] < C)
        m_1 = m_n & (o_n < L * tl.minimum(B - 1 - b0, 1) * HAS_IM)            # row b0 + 1 exists
        p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd + o_n * sxt
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        m_om = o_n < L * HAS_SKIP
        accr += om * tl.load(p_x, mask=m_n & m_om, other=0.0).to(tl.float32)
        acci += om * tl.load(p_x + sxb, mask=m_1 & m_om, other=0.0).to(tl.float32)
        row = (b0 * D + d).to(tl.int64) * L
        m_b = o_n < L * HAS_BIAS
        accr += tl.load(b_ptr + row + o_n, mask=m_n & m_b, other=0.0)
        acci += tl.load(b_ptr + row + D * L + o_n, mask=m_1 & m_b, other=0.0)
        store_rounded(y_ptr + row + o_n, accr, m_n, OUT_BF16)
        store_rounded(y_ptr + row + D * L + o_n, acci, m_1, OUT_BF16)

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
    """("direct", BL) | ("tile", A) | ("slice", A, R, BJ): the slice path's C = 256 A point tiles,
    R = N / C slices and BJ >= R / 2 output blocks per combine program (>= 16: the dot form)."""
    if L <= min(direct_max_len, DIRECT_MAX):
        return ("direct", max(16, triton.next_power_of_2(L)))
    N = fft_size(L)
    if N <= MAX_TILE_FFT:
        return ("tile", tile_factor(N))
    R = N // SLICE_C
    bj = max(2, R // 2)
    return ("slice", tile_factor(SLICE_C), R, bj if bj < COMBINE_DOT_BJ else max(16, bj))


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
        a, R, bj = plan[1:]
        C, dev = 256 * a, x.device
        tw, w, logs = twiddle_table(dev), tile_warps(256 * a, num_warps), (_log2(R * C), _log2(R))
        ks = slice_spectrum(k, a, R, w)
        pairs = (B + 1) // 2
        chunks, per = row_chunks(B, D * R, sm_count(dev))
        v = torch.empty(pairs, D, R, 2, C, dtype=torch.float32, device=dev)
        _slice_conv_kernel[(R, D, chunks)](x, ks, tw, v, B, D, L, *strides, 0, R, *logs, per, A=a, LOG_A=_log2(a),
                                           OUT_BF16=out_bf16, num_warps=w, num_stages=FFT_STAGES)
        bc = combine_cols(bj, work_bc, C)
        _slice_out_kernel[(D, pairs, C // bc)](v, tw, x, bias_t, om, y, B, D, L, *strides, *flags, 1, R, *logs,
                                               C=C, BJ=bj, BC=bc, OUT_BF16=out_bf16, num_warps=work_warps)
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
        a, R, bj = plan[1:]
        C, tw, w = 256 * a, twiddle_table(dev), tile_warps(256 * a, num_warps)
        logs = (_log2(R * C), _log2(R))
        pairs = (B + 1) // 2
        chunks, per = row_chunks(B, D * R, sm_count(dev))
        bc = combine_cols(bj, work_bc, C)
        v = torch.empty(pairs, D, R, 2, C, dtype=torch.float32, device=dev)   # parked P, then dx's slices
        if need_k or omega is not None:
            acc = torch.empty(chunks, D, R, 2, C, dtype=torch.float32, device=dev) if need_k else k
            dom_c = torch.empty(chunks, D, dtype=torch.float32, device=dev) if omega is not None and chunks > 1 else dom
            _slice_dk_kernel[(R, D, chunks)](dy, x, tw, v, acc, dom_c, *shape, *flags[1:], R, *logs, per, A=a,
                                             LOG_A=_log2(a), num_warps=w, num_stages=FFT_STAGES)
            if need_k:
                # chunk c's partial dk (one real row per chunk), added below in a fixed order
                dk_c = torch.empty(chunks, D, L, dtype=torch.float32, device=dev) if chunks > 1 else dk
                _slice_out_kernel[(D, chunks, C // bc)](acc, tw, k, k, k, dk_c, chunks, D, L, 0, 0, 0, 0, 0, 0, R,
                                                        *logs, C=C, BJ=bj, BC=bc, OUT_BF16=False,
                                                        num_warps=work_warps)
                if chunks > 1:
                    torch.sum(dk_c, 0, out=dk)
            if omega is not None and chunks > 1:
                torch.sum(dom_c, 0, out=dom)
        if need_x:
            ks = slice_spectrum(k, a, R, w)
            strides = dy.stride()
            _slice_conv_kernel[(R, D, chunks)](dy, ks, tw, v, B, D, L, *strides, 1, R, *logs, per, A=a,
                                               LOG_A=_log2(a), OUT_BF16=False, num_warps=w, num_stages=FFT_STAGES)
            _slice_out_kernel[(D, pairs, C // bc)](v, tw, dy, k, om, dx, B, D, L, *strides, 0, flags[2], 1, R, *logs,
                                                   C=C, BJ=bj, BC=bc, OUT_BF16=False, num_warps=work_warps)
    return (dx if need_x else None, dk if need_k else None, dom if omega is not None else None)


def combine_cols(bj: int, work_bc: int, C: int) -> int:
    """Columns per combine program. The dot form (BJ >= 16): ``work_bc``, at most C and at most
    COMBINE_TILE / BJ (the [BJ, BC] accumulators: BJ = 64 with 64 columns spilled 24-96 B with
    Triton 3.9). The multiply-add form (BJ < 16): COMBINE_TILE / BJ, at most C (16 outputs per
    thread at 4 warps, so the per-column twiddle and loads are not replicated over the threads)."""
    if bj < 16:
        return min(C, COMBINE_TILE // bj)
    return max(16, min(work_bc, C, COMBINE_TILE // bj))


def slice_spectrum(k, a: int, R: int, warps: int) -> torch.Tensor:
    """[D, R, 2, C] fp32: slice s of k's N = R C point spectrum / N (``_slice_spec_kernel``), once per call."""
    D, L = k.shape
    C = 256 * a
    ks = torch.empty(D, R, 2, C, dtype=torch.float32, device=k.device)
    _slice_spec_kernel[(R, D)](k, twiddle_table(k.device), ks, D, L, R, _log2(R * C), _log2(R), A=a, LOG_A=_log2(a),
                               num_warps=warps, num_stages=FFT_STAGES)
    return ks


def forward(x, k, out_dtype=None, **config):
    """y r(B D L) = causal conv of x r(B D L) with k r(D L), in ``out_dtype`` (default x's dtype)."""
    return conv_fwd(x, k, out_dtype=out_dtype, **config)


def backward(dy, x, k, need_x=True, need_k=True, **config):
    """-> (dx r(B D L) or None, dk r(D L) or None), both float32 (the compute dtype)."""
    dx, dk, _ = conv_bwd(dy, x, k, need_x, need_k, **config)
    return dx, dk
