"""Triton backend of fftconv: a four-step (Monarch) FFT built from small dense DFT matrix products.

Transform. The convolution runs on complex FFTs of size N = max(256, 2 * nextpow2(L)) (N >= 2L - 1,
so the circular product of the zero-padded rows never wraps into t < L). A length-N DFT is split as
in FlashFFTConv: with n = N2 n1 + n2 and frequency f = f1 + N1 f2,

    X[f1 + N1 f2] = sum_n2 W_N2^(n2 f2) * W_N^(n2 f1) * sum_n1 W_N1^(n1 f1) x[N2 n1 + n2]

i.e. on the [N1, N2] tile of x: a [N1, N1] @ [N1, N2] DFT-matrix product, an elementwise twiddle,
and a [N1, N2] @ [N2, N2] product (``fft2``); the inverse runs the same steps backwards with conjugated
matrices (``ifft2``), returning the natural order. Spectra stay in the permuted (f1, f2) order:
every pointwise product pairs two spectra in the same order, so no digit reversal is ever done.
Complex values are (re, im) planes, every complex matrix product is 4 real ``tl.dot`` with fp32
accumulation. Dot precision (DOT_PRECISION, env FFTCONV_DOT at import): "tf32x3" on the GPU (tensor
cores; each fp32 operand split into a TF32 head and tail, 3 products, only tail*tail dropped: about
3 * 2**-22 relative per product, ~1e-6 on y after the two or three dot levels, under the 2e-5 fp32
budget; plain TF32 would be ~1e-3). The interpreter ignores the precision and computes exact fp32
products, so the tests measure the algorithm, not TF32 rounding.

Real rows in pairs. All rows are real, so two rows are packed into one complex row (row b in re,
row b+1 in im): conv with the real k is linear, so IFFT(FFT(x_b + i x_b+1) K) = y_b + i y_b+1, and
for the k gradient, Re IFFT(sum_pairs Z conj(P)) with Z, P the packed dy and x spectra equals
sum_b corr(dy_b, x_b) exactly (the cross terms are purely imaginary). Half the transforms of a
real-to-complex scheme, with no Hermitian unpacking step.

Twiddles. The tile DFT matrices and the inner twiddles (all powers of the 4096th root of unity) are
gathered from a [2, 4096] fp32 table of cos/sin evaluated in float64 on the host (``twiddle_table``,
exact to half an ulp). The column-level twiddles W_N^(f c) of the workspace path (N up to 2**18) are
computed exact-angle: (f c mod N) in integers, the nearest quarter turn applied as an exact rotation,
the remainder (|angle| <= pi/4) rounded once to fp32 and evaluated with cema_kernel's short Taylor
polynomials (truncation < 2e-9); no libdevice, no error growth with N.

Two layouts (both one program per feature d, looping over the batch pairs, so k's spectrum is
computed once per d and reused for every batch row, and the k gradient sums over b in registers /
in the program's own workspace: deterministic, no atomics):

* tile path, N <= 4096: square tiles N1 = N2 in {16, 32, 64} (N rounded up to 256, 1024 or 4096:
  more zero padding is still a linear convolution; three compiled sizes, at most 2x the FLOPs). The
  whole row pair, k's spectrum (and in the backward the dk accumulator) live in registers; x (and
  dy) are read once, y (dx, dk) written once.
* workspace path, 8192 <= N <= 2**18: N = R * C with C = 64 * 64 and R = N / 4096 <= 64 (a 64-row
  dot tile, rows >= R masked). A column pass (R-point DFT matrix on [64, BC] column tiles, then the
  W_N twiddle) writes the row pair to a per-d fp32 workspace, a row pass runs the 64 x 64 tile FFT on
  each of the R rows of length C, multiplies by k's spectrum (kept in the workspace) and runs the
  inverse, and an inverse column pass produces the output. Three levels, every factor <= 64; the
  passes go through global memory because 2 N fp32 (2 MB at N = 2**18) cannot stay on chip;
  ``tl.debug_barrier`` orders the passes inside the program (one program per d owns its workspace:
  4 N fp32 per d forward, 8 N backward, as much as torch.fft's spectra of the same rows).

FLOPs per pair of (b, d) rows: one complex transform of the tile path is two complex matrix
products, 8 N (N1 + N2) real flops (N = 4096: 4.2 MFLOP) versus
~5 N log2 N = 0.25 MFLOP for a radix-2 FFT; a convolution is 3 transforms (k's amortised over B).
The dense DFT factors trade ~16x the FLOPs for tensor-core-shaped work, as FlashFFTConv does.
Workspace path: 8 N (64 + 128) per transform.

Known GPU limit (AOT, tf32x3, measured with ops/_triton_aot.compile_all): direct and 16 x 16 tile
variants fit (<= 249 registers, no spills, sm_80 and sm_90); every N1 >= 32 variant SPILLS: the
register fragments of the 4 dots of a complex product (K-long, split hi/lo) exceed 255 registers
(32 x 32: 255 regs + 0.8-1.2 KB local; 64 x 64 and workspace: sm_90 255 regs + 2.6-4.4 KB local,
sm_80 18-27 KB stack). More warps or plain TF32 do not fix it (the K extent per warp is the
problem); staging one DFT operand through shared memory in K chunks, or 16-wide factors in more
levels, is the fix. Not done.

Bytes (python -m megalodon_kernels.bench.triton_bytes --ops fftconv cema; interpreter byte counter,
fp32, B=4 D=2; "unique" = distinct addresses, "total" = every access):
* tile path (L = 2048): unique = ideal exactly (x, k / dy, x, k read once; y / dx, dk written once,
  plus the twiddle-table entries the transform uses); total / ideal = 7.2 (fwd), 7.5 (bwd): the
  DFT matrices and twiddles are re-gathered from the 32 KB table for every transform (L1 hits on a
  GPU, never DRAM); the data itself moves once.
* direct path (L = 64): unique = ideal; total 4.5x / 12.3x (the Toeplitz / lagged-x gathers, L1).
* workspace path (measured, B=2 D=1 L=8192, one pair, k's spectrum not amortised): total / ideal =
  14.6 (fwd), 15.5 (bwd). Per pair and forward the data passes are x 2L + 2N written (column pass),
  2N read + 2N k spectrum + 2N written (row pass), 2N read + y 2L (inverse column pass) = 4L + 10N =
  24L floats vs 4L ideal, plus the table re-reads of the row FFTs: the price of N not fitting on chip.

Short L: the direct path (L <= ``direct_max_len``) is an elementwise Toeplitz product per d (O(L^2),
cheaper than a 256-point FFT there); ``direct_max_len = 0`` forces the FFT path (tests use both).
"""
from __future__ import annotations

import math
import os

import torch

from ...autotune import registry as autotune
from .._triton_common import HAVE_TRITON, device_reasons, dtype_reasons, tl, triton

#: direct_max_len: the Toeplitz path for L <= it (at most DIRECT_MAX); num_warps: tile-path warps
#: for N = 4096 (scaled down with N, see ``tile_warps``); work_warps: workspace path; direct_warps.
#: Every config this backend may launch with, declared with the op's autotune registration in
#: __init__.py (each AOT-compiled in tests for every tile size); the first values are the default.
CONFIG_SPACE = autotune.get("fftconv").space["triton"]
DEFAULT_CONFIG = {name: values[0] for name, values in CONFIG_SPACE.items()}
#: Correct (interpreter-verified) but its FFT tiles of 32x32 and more spill registers on sm_80/sm_90
#: (tests/test_triton_aot.py lists them): auto prefers the cuda and torch backends until they do not.
AUTO_PRIORITY = False

X_DTYPES = (torch.bfloat16, torch.float32)
#: the direct path's tile widths (BLOCK_L); direct_max_len <= DIRECT_MAX
DIRECT_TILES = (16, 32, 64)
DIRECT_MAX = DIRECT_TILES[-1]
#: the smallest FFT (16 x 16 tile: tl.dot needs 16-wide operands) and the largest in registers
MIN_FFT = 256
MAX_TILE_FFT = 4096
#: longest supported L (N = 2**18: workspace path with R = 64)
MAX_LENGTH = 1 << 17
#: (N1, N2) tile shapes of the tile path
TILE_SHAPES = ((16, 16), (32, 32), (64, 64))
#: column-pass dot tile BR of the workspace path (R = N / 4096 <= 64, rows >= R masked)
WORK_ROWS = (64,)
WORK_C1 = WORK_C2 = 64


def not_supported_reasons(x=None, k=None, **_) -> list[str]:
    why = device_reasons(x) + dtype_reasons("x", x, X_DTYPES)
    if k is not None:
        why += dtype_reasons("k", k, (torch.bfloat16, torch.float16, torch.float32))
    if x.shape[-1] > MAX_LENGTH:
        why.append(f"L = {x.shape[-1]} > {MAX_LENGTH} (FFT size up to 2**18; use backend='torch')")
    return why


def fft_size(L: int) -> int:
    return max(MIN_FFT, 2 * (1 << (L - 1).bit_length()))


def tile_shape(N: int) -> tuple[int, int]:
    """Square tiles only (N rounded up to 16**2, 32**2 or 64**2: a larger zero padding is still a
    linear convolution), so three compiled tile sizes serve every L; at most 2x the FLOPs."""
    n1 = 1 << (N.bit_length() // 2)
    return n1, n1


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
    from .._triton_common import store_rounded

    #: tensor-core fp32 emulation (3 TF32 products per product, fp32 accumulation): see the docstring
    DOT_PRECISION = tl.constexpr(os.environ.get("FFTCONV_DOT", "tf32x3"))
    from ..cema_kernel.triton_impl import sincos_quarter

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
    def cmul(ar, ai, br, bi):
        return ar * br - ai * bi, ar * bi + ai * br

    @triton.jit
    def cdot(ar, ai, br, bi):
        """Complex matrix product as 4 real fp32 dots (IEEE)."""
        re = tl.dot(ar, br, input_precision=DOT_PRECISION) - tl.dot(ai, bi, input_precision=DOT_PRECISION)
        im = tl.dot(ar, bi, input_precision=DOT_PRECISION) + tl.dot(ai, br, input_precision=DOT_PRECISION)
        return re, im

    @triton.jit
    def table_twiddle(tw_ptr, e, LOG_M: tl.constexpr):
        """(cos, sin) of 2 pi e / 2**LOG_M (LOG_M <= 12) from the host's float64-exact fp32 table of
        the 4096th roots of unity (e reduced mod M in integers): half-ulp exact values for one gather
        each instead of ~30 ALU ops; the 32 KB table stays L1/L2 resident."""
        idx = (e & ((1 << LOG_M) - 1)) << (12 - LOG_M)          # table index of e / M in 4096ths
        return tl.load(tw_ptr + idx), tl.load(tw_ptr + 4096 + idx)

    @triton.jit
    def dft_matrix(tw_ptr, M: tl.constexpr, LOG_M: tl.constexpr):
        """W_M^(f n) = cos - i sin of 2 pi f n / M as (re, im) [M, M] (symmetric)."""
        o = tl.arange(0, M)
        c, s = table_twiddle(tw_ptr, o[:, None] * o[None, :], LOG_M)
        return c, -s

    @triton.jit
    def fft2(tw_ptr, xr, xi, N1: tl.constexpr, N2: tl.constexpr, LOG_N1: tl.constexpr, LOG_N2: tl.constexpr):
        """Forward DFT of the [N1, N2] tile x[N2 n1 + n2] -> X[f1 + N1 f2] at [f1, f2]."""
        f1r, f1i = dft_matrix(tw_ptr, N1, LOG_N1)
        ar, ai = cdot(f1r, f1i, xr, xi)                                   # [f1, n2]
        tc, ts = table_twiddle(tw_ptr, tl.arange(0, N1)[:, None] * tl.arange(0, N2)[None, :], LOG_N1 + LOG_N2)
        ar, ai = cmul(ar, ai, tc, -ts)
        f2r, f2i = dft_matrix(tw_ptr, N2, LOG_N2)
        return cdot(ar, ai, f2r, f2i)                                     # [f1, f2]

    @triton.jit
    def ifft2(tw_ptr, yr, yi, N1: tl.constexpr, N2: tl.constexpr, LOG_N1: tl.constexpr, LOG_N2: tl.constexpr):
        """Unnormalised inverse of ``fft2``: [f1, f2] spectrum -> N * x at [n1, n2]."""
        f2r, f2i = dft_matrix(tw_ptr, N2, LOG_N2)
        ar, ai = cdot(yr, yi, f2r, -f2i)                                  # [f1, n2]
        tc, ts = table_twiddle(tw_ptr, tl.arange(0, N1)[:, None] * tl.arange(0, N2)[None, :], LOG_N1 + LOG_N2)
        ar, ai = cmul(ar, ai, tc, ts)
        f1r, f1i = dft_matrix(tw_ptr, N1, LOG_N1)
        return cdot(f1r, -f1i, ar, ai)                                    # [n1, n2]

    # ------------------------------------------------------------------ tile path (N <= 4096)

    @triton.jit
    def _tile_fwd_kernel(
        x_ptr, k_ptr, tw_ptr, b_ptr, om_ptr, y_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP,
        N1: tl.constexpr, N2: tl.constexpr, LOG_N1: tl.constexpr, LOG_N2: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_n = tl.arange(0, N1)[:, None] * N2 + tl.arange(0, N2)[None, :]      # [N1, N2] position
        m_n = o_n < L
        b_k = tl.load(k_ptr + d.to(tl.int64) * L + o_n, mask=m_n, other=0.0).to(tl.float32)
        kr, ki = fft2(tw_ptr, b_k, tl.zeros([N1, N2], dtype=tl.float32), N1, N2, LOG_N1, LOG_N2)
        inv_n = 1.0 / (N1 * N2)                                               # exact: a power of two
        kr = kr * inv_n
        ki = ki * inv_n
        m_bias = o_n < L * HAS_BIAS             # runtime flags as bounds: one compiled kernel
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        for b0 in range(0, B, 2):
            m_1 = o_n < L * tl.minimum(B - 1 - b0, 1)                        # row b0+1 exists
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd + o_n * sxt
            b_xr = tl.load(p_x, mask=m_n, other=0.0).to(tl.float32)
            b_xi = tl.load(p_x + sxb, mask=m_1, other=0.0).to(tl.float32)
            sr, si = fft2(tw_ptr, b_xr, b_xi, N1, N2, LOG_N1, LOG_N2)
            sr, si = cmul(sr, si, kr, ki)
            yr, yi = ifft2(tw_ptr, sr, si, N1, N2, LOG_N1, LOG_N2)
            # fused epilogue (cema): omega x from the tile already in registers, plus the bias rows
            row = (b0 * D + d).to(tl.int64) * L
            yr += om * b_xr + tl.load(b_ptr + row + o_n, mask=m_bias, other=0.0)
            yi += om * b_xi + tl.load(b_ptr + row + D * L + o_n, mask=m_bias & m_1, other=0.0)
            store_rounded(y_ptr + row + o_n, yr, m_n, OUT_BF16)
            store_rounded(y_ptr + row + D * L + o_n, yi, m_1, OUT_BF16)

    @triton.jit
    def _tile_bwd_kernel(
        dy_ptr, x_ptr, k_ptr, tw_ptr, om_ptr, dx_ptr, dk_ptr, dom_ptr,
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_X, NEED_K, HAS_SKIP,
        N1: tl.constexpr, N2: tl.constexpr, LOG_N1: tl.constexpr, LOG_N2: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_n = tl.arange(0, N1)[:, None] * N2 + tl.arange(0, N2)[None, :]
        m_n = o_n < L
        inv_n = 1.0 / (N1 * N2)
        zero = tl.zeros([N1, N2], dtype=tl.float32)
        b_k = tl.load(k_ptr + d.to(tl.int64) * L + o_n, mask=o_n < L * NEED_X, other=0.0).to(tl.float32)
        kr, ki = fft2(tw_ptr, b_k, zero, N1, N2, LOG_N1, LOG_N2)
        kr = kr * inv_n
        ki = -ki * inv_n                                          # conj(K) / N: correlation
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        acc_r = zero                                              # sum_pairs Z conj(P)
        acc_i = zero
        dom = tl.sum(tl.sum(zero, 1), 0)
        need_x_tile = (NEED_K != 0) | (HAS_SKIP != 0)
        for b0 in range(0, B, 2):
            m_1 = o_n < L * tl.minimum(B - 1 - b0, 1)                        # row b0+1 exists
            p_dy = dy_ptr + (d.to(tl.int64) * 0 + b0) * syb + d.to(tl.int64) * syd + o_n * syt
            b_gr = tl.load(p_dy, mask=m_n, other=0.0).to(tl.float32)
            b_gi = tl.load(p_dy + syb, mask=m_1, other=0.0).to(tl.float32)
            zr, zi = fft2(tw_ptr, b_gr, b_gi, N1, N2, LOG_N1, LOG_N2)
            row = (b0 * D + d).to(tl.int64) * L
            if NEED_X != 0:
                sr, si = cmul(zr, zi, kr, ki)
                gr, gi = ifft2(tw_ptr, sr, si, N1, N2, LOG_N1, LOG_N2)
                tl.store(dx_ptr + row + o_n, gr + om * b_gr, mask=m_n)
                tl.store(dx_ptr + row + D * L + o_n, gi + om * b_gi, mask=m_1)
            if need_x_tile:
                p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd + o_n * sxt
                b_xr = tl.load(p_x, mask=m_n, other=0.0).to(tl.float32)
                b_xi = tl.load(p_x + sxb, mask=m_1, other=0.0).to(tl.float32)
                dom += tl.sum(tl.sum(b_gr * b_xr + b_gi * b_xi, 1), 0)
                if NEED_K != 0:
                    pr, pi = fft2(tw_ptr, b_xr, b_xi, N1, N2, LOG_N1, LOG_N2)
                    sr, si = cmul(zr, zi, pr, -pi)
                    acc_r += sr
                    acc_i += si
        if NEED_K != 0:
            gr, gi = ifft2(tw_ptr, acc_r, acc_i, N1, N2, LOG_N1, LOG_N2)
            tl.store(dk_ptr + d.to(tl.int64) * L + o_n, gr * inv_n, mask=m_n)
        if HAS_SKIP != 0:
            tl.store(dom_ptr + d, dom)

    # ------------------------------------------------------------------ workspace path (N >= 8192)

    @triton.jit
    def col_fwd(src_ptr, s_b, s_t, HAS_IM, dst_ptr, L, R, LOG_N,
                BR: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
        """Column pass: for n = C r + c, A[f, c] = W_N^(f c) sum_r W_R^(f r) src[n] (src row pair:
        re at src_ptr, im at src_ptr + s_b when the 0/1 flag HAS_IM), written to dst planes (re at dst, im at
        dst + R C) at f C + c."""
        o_r = tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        m_f = o_r < R
        fr, fi = twiddle(o_r[:, None] * o_r[None, :] * C, LOG_N)           # W_R = W_N^C, [f, r]
        fr = tl.where(m_f[:, None] & m_f[None, :], fr, 0.0)
        fi = tl.where(m_f[:, None] & m_f[None, :], -fi, 0.0)
        for c0 in range(0, C, BC):
            o_n = o_r[:, None] * C + c0 + o_c[None, :]                         # [BR, BC]
            m_n = m_f[:, None] & (o_n < L)
            b_r = tl.load(src_ptr + o_n * s_t, mask=m_n, other=0.0).to(tl.float32)
            b_i = tl.load(src_ptr + s_b + o_n * s_t, mask=m_n & (o_n < L * HAS_IM), other=0.0).to(tl.float32)
            ar, ai = cdot(fr, fi, b_r, b_i)
            tc, ts = twiddle(o_r[:, None] * (c0 + o_c[None, :]), LOG_N)
            ar, ai = cmul(ar, ai, tc, -ts)
            m_s = m_f[:, None] & (o_c[None, :] < BC)
            tl.store(dst_ptr + o_n, ar, mask=m_s)
            tl.store(dst_ptr + R * C + o_n, ai, mask=m_s)

    @triton.jit
    def col_inv_tile(src_ptr, c0, R, LOG_N, BR: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
        """Inverse column pass on columns c0..c0+BC of the planes at src: out[r, c] =
        sum_f W_R^(-f r) W_N^(-f c) A[f, c] for the positions n = C r + c (unnormalised)."""
        o_r = tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        m_f = o_r < R
        o_n = o_r[:, None] * C + c0 + o_c[None, :]
        m_a = m_f[:, None] & (o_c[None, :] < BC)
        ar = tl.load(src_ptr + o_n, mask=m_a, other=0.0)
        ai = tl.load(src_ptr + R * C + o_n, mask=m_a, other=0.0)
        tc, ts = twiddle(o_r[:, None] * (c0 + o_c[None, :]), LOG_N)
        ar, ai = cmul(ar, ai, tc, ts)
        fr, fi = twiddle(o_r[:, None] * o_r[None, :] * C, LOG_N)             # conj W_R: +sin
        fr = tl.where(m_f[:, None] & m_f[None, :], fr, 0.0)
        fi = tl.where(m_f[:, None] & m_f[None, :], fi, 0.0)
        return cdot(fr, fi, ar, ai)

    @triton.jit
    def row_load(src_ptr, f, R, C1: tl.constexpr, C2: tl.constexpr):
        o_c = f * (C1 * C2) + tl.arange(0, C1)[:, None] * C2 + tl.arange(0, C2)[None, :]
        return tl.load(src_ptr + o_c), tl.load(src_ptr + R * C1 * C2 + o_c), o_c

    @triton.jit
    def _work_fwd_kernel(
        x_ptr, k_ptr, tw_ptr, b_ptr, om_ptr, y_ptr, ws_ptr,
        B, D, L, sxb, sxd, sxt, HAS_BIAS, HAS_SKIP, R, LOG_N,
        BR: tl.constexpr, BC: tl.constexpr, OUT_BF16: tl.constexpr,
    ):
        C1: tl.constexpr = 64
        C2: tl.constexpr = 64
        C: tl.constexpr = C1 * C2
        d = tl.program_id(0)
        N = R * C
        w_k = ws_ptr + d.to(tl.int64) * (4 * N)                   # k spectrum planes (re, im)
        w_x = w_k + 2 * N                                         # row-pair planes
        inv_n = 1.0 / N.to(tl.float32)
        # k's spectrum, once per d: column pass, then the row FFTs in place (scaled by 1/N)
        col_fwd(k_ptr + d.to(tl.int64) * L, 0, 1, 0, w_k, L, R, LOG_N, BR, BC, C)
        tl.debug_barrier()
        for f in range(R):
            sr, si, o_c = row_load(w_k, f, R, C1, C2)
            sr, si = fft2(tw_ptr, sr, si, C1, C2, 6, 6)
            tl.store(w_k + o_c, sr * inv_n)
            tl.store(w_k + N + o_c, si * inv_n)
        tl.debug_barrier()
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        o_r = tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        for b0 in range(0, B, 2):
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd
            col_fwd(p_x, sxb, sxt, tl.minimum(B - 1 - b0, 1), w_x, L, R, LOG_N, BR, BC, C)
            tl.debug_barrier()
            for f in range(R):
                sr, si, o_f = row_load(w_x, f, R, C1, C2)
                sr, si = fft2(tw_ptr, sr, si, C1, C2, 6, 6)
                kr, ki, _ = row_load(w_k, f, R, C1, C2)
                sr, si = cmul(sr, si, kr, ki)
                sr, si = ifft2(tw_ptr, sr, si, C1, C2, 6, 6)
                tl.store(w_x + o_f, sr)
                tl.store(w_x + N + o_f, si)
            tl.debug_barrier()
            row = (b0 * D + d).to(tl.int64) * L
            for c0 in range(0, C, BC):
                yr, yi = col_inv_tile(w_x, c0, R, LOG_N, BR, BC, C)
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
        B, D, L, syb, syd, syt, sxb, sxd, sxt, NEED_X, NEED_K, HAS_SKIP, R, LOG_N,
        BR: tl.constexpr, BC: tl.constexpr,
    ):
        C1: tl.constexpr = 64
        C2: tl.constexpr = 64
        C: tl.constexpr = C1 * C2
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
            col_fwd(k_ptr + d.to(tl.int64) * L, 0, 1, 0, w_k, L, R, LOG_N, BR, BC, C)
            tl.debug_barrier()
            for f in range(R):
                sr, si, o_f = row_load(w_k, f, R, C1, C2)
                sr, si = fft2(tw_ptr, sr, si, C1, C2, 6, 6)
                tl.store(w_k + o_f, sr * inv_n)
                tl.store(w_k + N + o_f, -si * inv_n)
        om = tl.load(om_ptr + d, mask=tl.full([], HAS_SKIP, tl.int32) != 0, other=0.0).to(tl.float32)
        dom = tl.sum(tl.zeros([BR], dtype=tl.float32), 0)
        for b0 in range(0, B, 2):
            tl.debug_barrier()
            p_dy = dy_ptr + (d.to(tl.int64) * 0 + b0) * syb + d.to(tl.int64) * syd
            p_x = x_ptr + (d.to(tl.int64) * 0 + b0) * sxb + d.to(tl.int64) * sxd
            has_1 = tl.minimum(B - 1 - b0, 1)                       # 1: row b0+1 exists
            col_fwd(p_dy, syb, syt, has_1, w_z, L, R, LOG_N, BR, BC, C)
            if NEED_K != 0:
                col_fwd(p_x, sxb, sxt, has_1, w_p, L, R, LOG_N, BR, BC, C)
            if HAS_SKIP != 0:                                     # domega = sum dy x
                for c0 in range(0, C, BC):
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
                zr, zi, o_f = row_load(w_z, f, R, C1, C2)
                zr, zi = fft2(tw_ptr, zr, zi, C1, C2, 6, 6)
                if NEED_K != 0:
                    pr, pi, _ = row_load(w_p, f, R, C1, C2)
                    pr, pi = fft2(tw_ptr, pr, pi, C1, C2, 6, 6)
                    sr, si = cmul(zr, zi, pr, -pi)
                    m_acc = tl.full([C1, C2], b0, tl.int32) > 0        # first pair: overwrite
                    sr += tl.load(w_s + o_f, mask=m_acc, other=0.0)
                    si += tl.load(w_s + N + o_f, mask=m_acc, other=0.0)
                    tl.store(w_s + o_f, sr)
                    tl.store(w_s + N + o_f, si)
                if NEED_X != 0:
                    kr, ki, _ = row_load(w_k, f, R, C1, C2)
                    sr, si = cmul(zr, zi, kr, ki)
                    sr, si = ifft2(tw_ptr, sr, si, C1, C2, 6, 6)
                    tl.store(w_z + o_f, sr)
                    tl.store(w_z + N + o_f, si)
            tl.debug_barrier()
            if NEED_X != 0:
                row = (b0 * D + d).to(tl.int64) * L
                for c0 in range(0, C, BC):
                    gr, gi = col_inv_tile(w_z, c0, R, LOG_N, BR, BC, C)
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
                sr, si, o_f = row_load(w_s, f, R, C1, C2)
                sr, si = ifft2(tw_ptr, sr, si, C1, C2, 6, 6)
                tl.store(w_s + o_f, sr)
                tl.store(w_s + N + o_f, si)
            tl.debug_barrier()
            for c0 in range(0, C, BC):
                gr, gi = col_inv_tile(w_s, c0, R, LOG_N, BR, BC, C)
                o_n = o_r[:, None] * C + c0 + o_c[None, :]
                m_n = (o_r[:, None] < R) & (o_n < L)
                tl.store(dk_ptr + d.to(tl.int64) * L + o_n, gr * inv_n, mask=m_n)
        if HAS_SKIP != 0:
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
    """("direct", BL) | ("tile", N1, N2) | ("work", R, BR)."""
    if L <= min(direct_max_len, DIRECT_MAX):
        return ("direct", max(16, triton.next_power_of_2(L)))
    N = fft_size(L)
    if N <= MAX_TILE_FFT:
        return ("tile", *tile_shape(N))
    R = N // (WORK_C1 * WORK_C2)
    return ("work", R, WORK_ROWS[-1])


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
        n1, n2 = plan[1:]
        _tile_fwd_kernel[(D,)](x, k, twiddle_table(x.device), bias_t, om, y, B, D, L, *strides, *flags,
                               N1=n1, N2=n2, LOG_N1=_log2(n1), LOG_N2=_log2(n2), OUT_BF16=out_bf16,
                               num_warps=tile_warps(n1 * n2, num_warps))
    else:
        R, BR = plan[1:]
        N = R * WORK_C1 * WORK_C2
        ws = torch.empty(D, 4 * N, dtype=torch.float32, device=x.device)
        _work_fwd_kernel[(D,)](x, k, twiddle_table(x.device), bias_t, om, y, ws, B, D, L, *strides, *flags, R, _log2(N),
                               BR=BR, BC=work_bc, OUT_BF16=out_bf16, num_warps=work_warps)
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
        n1, n2 = plan[1:]
        _tile_bwd_kernel[(D,)](*targs, *shape, *flags, N1=n1, N2=n2, LOG_N1=_log2(n1), LOG_N2=_log2(n2),
                               num_warps=tile_warps(n1 * n2, num_warps))
    else:
        R, BR = plan[1:]
        N = R * WORK_C1 * WORK_C2
        ws = torch.empty(D, 8 * N, dtype=torch.float32, device=dev)
        _work_bwd_kernel[(D,)](*targs, ws, *shape, *flags, R, _log2(N), BR=BR, BC=work_bc, num_warps=work_warps)
    return (dx if need_x else None, dk if need_k else None, dom if omega is not None else None)


def fftconv_fwd(x, k, out_dtype=None, **config):
    """y r(B D L) = causal conv of x r(B D L) with k r(D L), in ``out_dtype`` (default x's dtype)."""
    return conv_fwd(x, k, out_dtype=out_dtype, **config)


def fftconv_bwd(dy, x, k, need_x=True, need_k=True, **config):
    """-> (dx r(B D L) or None, dk r(D L) or None), both float32 (the compute dtype)."""
    dx, dk, _ = conv_bwd(dy, x, k, need_x, need_k, **config)
    return dx, dk


# ---------------------------------------------------------------------- AOT + bytes

def aot_variants(space=None):
    """Every kernel x config x tile size x x dtype this backend can launch (``space``: one config, for
    the autotuner's AOT pruning; direct_max_len only selects which direct tiles are reachable)."""
    from itertools import product

    space = CONFIG_SPACE if space is None else space
    variants = []
    for values in product(*(space[k] for k in ("num_warps", "work_warps", "work_bc", "direct_warps"))):
        cfg = dict(zip(("num_warps", "work_warps", "work_bc", "direct_warps"), values))
        longest = max(space["direct_max_len"])
        tiles = tuple(bl for bl in DIRECT_TILES if longest > 0 and bl <= max(16, triton.next_power_of_2(longest)))
        variants += _variants(cfg, tiles)
    return variants


def _variants(cfg, direct_tiles):
    from .._triton_aot import Variant

    variants = []
    fwd_ints = (("B", "i32"), ("D", "i32"), ("L", "i32"), ("sxb", "i32"), ("sxd", "i32"), ("sxt", "i32"),
                ("HAS_BIAS", "i32"), ("HAS_SKIP", "i32"))
    bwd_ints = (("B", "i32"), ("D", "i32"), ("L", "i32"), ("syb", "i32"), ("syd", "i32"), ("syt", "i32"),
                ("sxb", "i32"), ("sxd", "i32"), ("sxt", "i32"), ("NEED_X", "i32"), ("NEED_K", "i32"),
                ("HAS_SKIP", "i32"))
    div16 = frozenset({"D", "L", "sxb", "sxd", "syb", "syd"})
    for dt in ("fp32", "bf16"):
        fwd_ptrs = (("x_ptr", f"*{dt}"), ("k_ptr", "*fp32"), ("b_ptr", "*fp32"), ("om_ptr", "*fp32"),
                    ("y_ptr", f"*{dt}"))
        bwd_ptrs = (("dy_ptr", f"*{dt}"), ("x_ptr", f"*{dt}"), ("k_ptr", "*fp32"), ("om_ptr", "*fp32"),
                    ("dx_ptr", "*fp32"), ("dk_ptr", "*fp32"), ("dom_ptr", "*fp32"))
        out_bf16 = dt == "bf16"
        for bl in direct_tiles:
            variants.append(Variant(
                op="fftconv", kernel="_direct_fwd_kernel", fn=_direct_fwd_kernel, arg_types=fwd_ptrs + fwd_ints,
                constexprs=(("BL", bl), ("OUT_BF16", out_bf16)), div16=div16, num_warps=cfg["direct_warps"],
                label=f"direct fwd x={dt} L<={bl}"))
            variants.append(Variant(
                op="fftconv", kernel="_direct_bwd_kernel", fn=_direct_bwd_kernel, arg_types=bwd_ptrs + bwd_ints,
                constexprs=(("BL", bl),), div16=div16, num_warps=cfg["direct_warps"],
                label=f"direct bwd x={dt} L<={bl}"))
        fwd_ptrs_t = fwd_ptrs + (("tw_ptr", "*fp32"),)
        bwd_ptrs_t = bwd_ptrs + (("tw_ptr", "*fp32"),)
        for n1, n2 in TILE_SHAPES:
            tile = (("N1", n1), ("N2", n2), ("LOG_N1", _log2(n1)), ("LOG_N2", _log2(n2)))
            w = tile_warps(n1 * n2, cfg["num_warps"])
            variants.append(Variant(
                op="fftconv", kernel="_tile_fwd_kernel", fn=_tile_fwd_kernel, arg_types=fwd_ptrs_t + fwd_ints,
                constexprs=tile + (("OUT_BF16", out_bf16),), div16=div16, num_warps=w,
                label=f"tile fwd x={dt} N={n1}x{n2} warps={w}"))
            variants.append(Variant(
                op="fftconv", kernel="_tile_bwd_kernel", fn=_tile_bwd_kernel, arg_types=bwd_ptrs_t + bwd_ints,
                constexprs=tile, div16=div16, num_warps=w, label=f"tile bwd x={dt} N={n1}x{n2} warps={w}"))
        for br in WORK_ROWS:
            work = (("R", "i32"), ("LOG_N", "i32"))
            variants.append(Variant(
                op="fftconv", kernel="_work_fwd_kernel", fn=_work_fwd_kernel,
                arg_types=fwd_ptrs_t + (("ws_ptr", "*fp32"),) + fwd_ints + work,
                constexprs=(("BR", br), ("BC", cfg["work_bc"]), ("OUT_BF16", out_bf16)), div16=div16,
                num_warps=cfg["work_warps"],
                label=f"work fwd x={dt} BR={br} warps={cfg['work_warps']}"))
            variants.append(Variant(
                op="fftconv", kernel="_work_bwd_kernel", fn=_work_bwd_kernel,
                arg_types=bwd_ptrs_t + (("ws_ptr", "*fp32"),) + bwd_ints + work,
                constexprs=(("BR", br), ("BC", cfg["work_bc"])), div16=div16, num_warps=cfg["work_warps"],
                label=f"work bwd x={dt} BR={br} warps={cfg['work_warps']}"))
    return variants


def table_bytes(n1: int) -> int:
    """Bytes of the distinct twiddle-table entries (cos and sin) an n1 x n1 tile transform reads: the
    n1-point DFT matrix and the inner twiddles (f1 n2 mod n1**2); the table's other entries are never
    touched at this size, so they are not part of the ideal."""
    m = n1 * n1
    idx = {(a * b % n1) * (4096 // n1) for a in range(n1) for b in range(n1)}
    idx |= {(a * b % m) * (4096 // m) for a in range(n1) for b in range(n1)}
    return 2 * 4 * len(idx)


def bytes_cases():
    """Medium-shape launches for the interpreter byte counter (bench/triton_bytes.py): the tile path
    and the direct path. Ideal: x, k (dy) read once, y (dx, dk) written once, plus, on the tile path,
    the twiddle-table entries the transform uses (``table_bytes``; read once, their re-reads per
    transform are L1 hits on a GPU and show only in the "total" column)."""
    from ...bench.triton_bytes import nbytes

    cfg = dict(DEFAULT_CONFIG)
    gen = torch.Generator().manual_seed(0)
    for B, D, L in ((4, 2, 2048), (4, 2, 64)):
        x = torch.randn(B, D, L, generator=gen)
        k = torch.randn(D, L, generator=gen)
        dy = torch.randn(B, D, L, generator=gen)
        path = _plan(L, cfg["direct_max_len"])[0]

        table = table_bytes(_plan(L, cfg["direct_max_len"])[1]) if path == "tile" else 0

        def fwd(x=x, k=k, table=table):
            return nbytes(x, k, fftconv_fwd(x, k, **cfg)) + table

        def bwd(x=x, k=k, dy=dy, table=table):
            return nbytes(dy, x, k, *fftconv_bwd(dy, x, k, True, True, **cfg)) + table

        yield f"fftconv fwd ({path})", f"B={B} D={D} L={L} fp32", fwd
        yield f"fftconv bwd ({path})", f"B={B} D={D} L={L} fp32", bwd
