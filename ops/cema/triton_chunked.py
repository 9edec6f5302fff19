"""The chunked form of the Triton cema: CEMA's convolution and the bias of hx as tensor-core dots
over chunks of C steps, no FFT (the form of ops/cema/chunked.py, fused into three kernels).

With t = c C + s (s < C), per (b, d) row (docs/math.md, "The chunked form"):

    y[c]   = X[c] @ T + Re(S[c] @ Wout) + omega x[c]     T[s', s] = k[s - s'] (s >= s'), k[:C] only
    U[c]   = X[c] @ Win                                   Win[s', n] = p_n q_n**(C-1-s')
    S[c+1] = a S[c] + U[c],  S[0] = hx (or 0)             a = q**C,  Wout[n, s] = gamma_n q_n**(s+1)

Forward (:func:`_fwd_kernel`, one program per row): blocks of BM chunks; per block three dots
give X T and U (real and imaginary columns), a sequential scan over the block's BM chunk states
(N lanes, a complex multiply-add per chunk; two levels, see Numerics), then two dots add the
states' part. Every dot is tf32x3 (three TF32 products: fp32 accuracy on tensor cores). The
tables (k[:C], Win, Wout, the powers of a: O(D N C)) are built on the host in float64 from exact
powers and rounded once.

Backward, with g = dy (split in two kernels so that neither spills registers):

* :func:`_bwd_scan_kernel` (one program per row): pass 1 runs the states forward and stores every
  chunk's entering state S[c]; pass 2 runs backward over the chunks: dS[c] = g[c] @ Wout^H, the
  adjoint scan G[c] = dS[c] + conj(a) G[c+1], dx[c] = g[c] @ T^T + Re(dU[c] @ Win^H) + omega g[c]
  with dU[c] = G[c+1] (the gradient of U[c]), stored with S; dhx = G[0].
* :func:`_bwd_sums_kernel` (one program per feature d, looping over b: a deterministic sum, no
  atomics): dk[j] = sum g[., s] x[., s - j] within chunks (the diagonal sums of sum g^T X, taken in
  the kernel), A = sum S^T g, Wi = sum X^T dU, pc = sum dU conj(S) and domega = sum g x.

The host then finishes dp, dlog_q and dgamma from those O(D N C) sums with the formulas of
ops/cema/chunked.py (:func:`finish`). What the backward writes besides dx: S and dU, 2 x 2N
floats per chunk and row (2 N / C of x's fp32 size each), and O(D N C) sums.

Numerics. A one-level scan with a rounded to fp32 carries that rounding into every state it runs
through (a**n with n times its error: 2e-5 norm-wise at L = 2**16, 1 - |q| = 1e-5, measured
before this was changed), so both scans run in two levels, as ops/cema/chunked.py's chunk_scan:
each block of BM chunks is scanned from zero (at most BM steps with the rounded a), its states get
a**i times the state entering the block from exact powers a**0 .. a**(BM-1), and the carry from
block to block multiplies by a**BM held as two fp32 numbers (hi + lo), which removes the
systematic error of rounding it (bench/cema_forms.py accuracy --triton; docs/math.md).
"""
from __future__ import annotations

import torch

from .._triton_common import HAVE_TRITON
from .._vandermonde import _TWO_PI

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_common import store_rounded

    #: 2 pi in float64, the period exact_powers reduces the phase by
    TWO_PI = tl.constexpr(_TWO_PI)

#: the state lanes (N padded to a dot's minimum K of 16): N <= NP runs chunked
NP = 16
#: the dots' precision: fp32 accuracy from three TF32 tensor-core products
PREC = "tf32x3"
#: warps of the tables kernel (one small program per feature)
TABLE_WARPS = 4


def unserved_reasons(x, p) -> list[str]:
    """Why the chunked kernels cannot run this call (then the FFT form runs), [] when they can."""
    why = []
    if p.shape[1] > NP:
        why.append(f"N = {p.shape[1]} > {NP} state lanes")
    if x.dtype not in (torch.bfloat16, torch.float32):   # the dtypes compiled ahead of time
        why.append(f"x has dtype {x.dtype}")
    return why


if HAVE_TRITON:

    @triton.jit
    def _load_tables(k_ptr, win_ptr, wout_ptr, d, C: tl.constexpr, NP: tl.constexpr):
        """T [C, C], Win re/im [C, NP], Wout re/im [NP, C] of feature d."""
        s_r = tl.arange(0, C)
        n_r = tl.arange(0, NP)
        diff = s_r[None, :] - s_r[:, None]
        T = tl.load(k_ptr + d * C + diff, mask=diff >= 0, other=0.0)
        win_off = (d * 2 * C + s_r[:, None]) * NP + n_r[None, :]
        wout_off = (d * 2 * NP + n_r[:, None]) * C + s_r[None, :]
        return (T, tl.load(win_ptr + win_off), tl.load(win_ptr + win_off + C * NP), tl.load(wout_ptr + wout_off),
                tl.load(wout_ptr + wout_off + NP * C))

    @triton.jit
    def _load_powers(a_ptr, pw_ptr, d, BM: tl.constexpr, NP: tl.constexpr):
        """a = q**C re/im [NP]; a**i and a**(BM-i) re/im [BM, NP] (row i); a**BM as hi + lo pairs
        re/im [NP] (lo: the float64 value's rounding error, so the carry from block to block has no
        systematic error from rounding a**BM)."""
        n_r = tl.arange(0, NP)
        m_r = tl.arange(0, BM)
        a_off = d * 6 * NP + n_r
        pw_off = (d * 2 * (BM + 1) + m_r[:, None]) * NP + n_r[None, :]
        pf_off = (d * 2 * (BM + 1) + BM - m_r[:, None]) * NP + n_r[None, :]
        im = (BM + 1) * NP
        return (tl.load(a_ptr + a_off), tl.load(a_ptr + a_off + NP),
                tl.load(pw_ptr + pw_off), tl.load(pw_ptr + pw_off + im), tl.load(pw_ptr + pf_off),
                tl.load(pw_ptr + pf_off + im), tl.load(a_ptr + a_off + 2 * NP), tl.load(a_ptr + a_off + 3 * NP),
                tl.load(a_ptr + a_off + 4 * NP), tl.load(a_ptr + a_off + 5 * NP))

    @triton.jit
    def _initial_state(hx_ptr, row, N, NP: tl.constexpr, HAS_HX: tl.constexpr):
        n_r = tl.arange(0, NP)
        if HAS_HX:
            m = n_r < N
            return (tl.load(hx_ptr + (row * N + n_r) * 2, mask=m, other=0.0),
                    tl.load(hx_ptr + (row * N + n_r) * 2 + 1, mask=m, other=0.0))
        return tl.zeros([NP], dtype=tl.float32), tl.zeros([NP], dtype=tl.float32)

    @triton.jit
    def _tf32(v):
        """v rounded to the nearest TF32 value (10 mantissa bits, ties away: cvt.rna.tf32.f32)."""
        return ((v.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)

    @triton.jit
    def _dot(A, B, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, PREC: tl.constexpr):
        """acc + A @ B to fp32 accuracy. An operand marked exact holds TF32 values (a bfloat16 x or
        dy read as fp32); the other one is split into TF32 hi + lo, so that every product's operands
        are TF32 values (the hardware's operand rounding changes nothing): two TF32 products, or
        one when both are exact, instead of tf32x3's three and its split of both operands."""
        if A_EXACT and B_EXACT:
            return tl.dot(A, B, acc, input_precision="tf32")
        elif A_EXACT:
            hi = _tf32(B)
            acc = tl.dot(A, hi, acc, input_precision="tf32")
            return tl.dot(A, _tf32(B - hi), acc, input_precision="tf32")
        elif B_EXACT:
            hi = _tf32(A)
            acc = tl.dot(hi, B, acc, input_precision="tf32")
            return tl.dot(_tf32(A - hi), B, acc, input_precision="tf32")
        else:
            return tl.dot(A, B, acc, input_precision=PREC)

    @triton.jit
    def _affine_then(ar1, ai1, br1, bi1, ar2, ai2, br2, bi2):
        """Two affine maps of the state, S -> A S + b (complex A, b as re/im pairs), applied first the
        left one, then the right one: S -> A2 (A1 S + b1) + b2. Associative: the scans' combine."""
        return (ar1 * ar2 - ai1 * ai2, ar1 * ai2 + ai1 * ar2,
                ar2 * br1 - ai2 * bi1 + br2, ar2 * bi1 + ai2 * br1 + bi2)

    @triton.jit
    def _block_scan(V_re, V_im, a_re, a_im, BM: tl.constexpr, NP: tl.constexpr, REVERSE: tl.constexpr):
        """Per state lane, I[i] = sum over j <= i of a**(i-j) V[j] (REVERSE: over j >= i of
        a**(j-i) V[j]) down the BM rows of V: a log-depth associative scan of the maps S -> a S + V[j]
        (the exponents at most BM - 1: the rounding of a does not compound beyond one block)."""
        A_re = tl.zeros([BM, NP], dtype=tl.float32) + a_re[None, :]
        A_im = tl.zeros([BM, NP], dtype=tl.float32) + a_im[None, :]
        _, _, I_re, I_im = tl.associative_scan((A_re, A_im, V_re, V_im), 0, _affine_then, reverse=REVERSE)
        return I_re, I_im

    @triton.jit
    def _weighted_rows(W_re, W_im, V_re, V_im):
        """sum over the rows i of W[i] V[i] (complex, per state lane): [NP] re, im."""
        return tl.sum(W_re * V_re - W_im * V_im, axis=0), tl.sum(W_re * V_im + W_im * V_re, axis=0)

    @triton.jit
    def _fwd_states(x_ptr, base, t, L, Wi_re, Wi_im, a_re, a_im, P_re, P_im, Pf_re, Pf_im, ah_re, ah_im, al_re,
                    al_im, R_re, R_im, C: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr,
                    X_EXACT: tl.constexpr):
        """The states entering the block's BM chunks and the carry R of the next block.

        The chunks' inputs are taken one chunk late (xs = x at t - C, 0 before the row starts), so
        the inclusive scan I of U' = xs Win gives the exclusive sums the states need:
        S_in[i] = a**i R + I[i] (P = a**i), where R = hx in the first block, and the next block's
        R = a**BM R + sum_j a**(BM-j) U'[j] (Pf = a**(BM-j)) carries everything before the chunk that
        enters it as its row 0 of U'. Every power that crosses a block is exact (from float64; a**BM
        as hi + lo: no systematic rounding error from block to block); only the block's own scan
        runs through at most BM - 1 powers of the rounded a (ops/cema/chunked.py's two levels)."""
        xs = tl.load(x_ptr + base + t - C, mask=(t >= C) & (t - C < L), other=0.0).to(tl.float32)
        zero = tl.zeros([BM, NP], dtype=tl.float32)
        U_re = _dot(xs, Wi_re, zero, X_EXACT, False, PREC)
        U_im = _dot(xs, Wi_im, zero, X_EXACT, False, PREC)
        I_re, I_im = _block_scan(U_re, U_im, a_re, a_im, BM, NP, False)
        Sin_re = P_re * R_re[None, :] - P_im * R_im[None, :] + I_re
        Sin_im = P_re * R_im[None, :] + P_im * R_re[None, :] + I_im
        c_re, c_im = _weighted_rows(Pf_re, Pf_im, U_re, U_im)
        c_re += al_re * R_re - al_im * R_im
        c_im += al_re * R_im + al_im * R_re
        return Sin_re, Sin_im, ah_re * R_re - ah_im * R_im + c_re, ah_re * R_im + ah_im * R_re + c_im

    @triton.jit
    def _fwd_kernel(x_ptr, y_ptr, k_ptr, win_ptr, wout_ptr, a_ptr, pw_ptr, hx_ptr, omega_ptr, D, L, N, nblk,
                    C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, HAS_HX: tl.constexpr,
                    OUT_BF16: tl.constexpr, PREC: tl.constexpr):
        row = tl.program_id(0)
        d = row % D
        s_r = tl.arange(0, C)
        m_r = tl.arange(0, BM)
        T, Wi_re, Wi_im, Wo_re, Wo_im = _load_tables(k_ptr, win_ptr, wout_ptr, d, C, NP)
        a_re, a_im, P_re, P_im, Pf_re, Pf_im, ah_re, ah_im, al_re, al_im = _load_powers(a_ptr, pw_ptr, d, BM, NP)
        om = tl.load(omega_ptr + d)
        R_re, R_im = _initial_state(hx_ptr, row, N, NP, HAS_HX)
        base = row.to(tl.int64) * L
        for blk in range(0, nblk):
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            tmask = t < L
            X = tl.load(x_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
            Y = _dot(X, T, tl.zeros([BM, C], dtype=tl.float32), OUT_BF16, False, PREC)
            Sin_re, Sin_im, R_re, R_im = _fwd_states(x_ptr, base, t, L, Wi_re, Wi_im, a_re, a_im, P_re, P_im,
                                                     Pf_re, Pf_im, ah_re, ah_im, al_re, al_im, R_re, R_im,
                                                     C, BM, NP, PREC, OUT_BF16)
            Y = tl.dot(Sin_re, Wo_re, Y, input_precision=PREC)
            Y = tl.dot(-Sin_im, Wo_im, Y, input_precision=PREC)
            store_rounded(y_ptr + base + t, Y + om * X, tmask, OUT_BF16)

    @triton.jit
    def _bwd_scan_kernel(x_ptr, g_ptr, dx_ptr, s_ptr, du_ptr, dhx_ptr, k_ptr, win_ptr, wout_ptr, a_ptr, pw_ptr,
                         hx_ptr, omega_ptr, D, L, N, nblk,
                         C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, HAS_HX: tl.constexpr,
                         OUT_BF16: tl.constexpr, PREC: tl.constexpr, X_EXACT: tl.constexpr):
        row = tl.program_id(0)
        d = row % D
        s_r = tl.arange(0, C)
        n_r = tl.arange(0, NP)
        m_r = tl.arange(0, BM)
        T, Wi_re, Wi_im, Wo_re, Wo_im = _load_tables(k_ptr, win_ptr, wout_ptr, d, C, NP)
        om = tl.load(omega_ptr + d)
        R_re, R_im = _initial_state(hx_ptr, row, N, NP, HAS_HX)
        base = row.to(tl.int64) * L
        # S and dU of chunk c at [row, c, (re, im), n]
        sbase = row.to(tl.int64) * nblk * BM * 2 * NP
        a_re, a_im, P_re, P_im, Pf_re, Pf_im, ah_re, ah_im, al_re, al_im = _load_powers(a_ptr, pw_ptr, d, BM, NP)
        # pass 1: the state entering every chunk
        for blk in range(0, nblk):
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            Sin_re, Sin_im, R_re, R_im = _fwd_states(x_ptr, base, t, L, Wi_re, Wi_im, a_re, a_im, P_re, P_im,
                                                     Pf_re, Pf_im, ah_re, ah_im, al_re, al_im, R_re, R_im,
                                                     C, BM, NP, PREC, X_EXACT)
            so = sbase + (blk * BM + m_r[:, None]) * 2 * NP + n_r[None, :]
            tl.store(s_ptr + so, Sin_re)
            tl.store(s_ptr + so + NP, Sin_im)
        # pass 2: backwards over the chunks, the adjoint scan G[c] = dS[c] + conj(a) G[c+1] with
        # dS = g Wout^H, and dU[c] = G[c+1]. Mirroring the forward: the chunks' dS are taken one
        # chunk early (gs = g at t + C), so the reverse inclusive scan J of gs Wout^H gives
        # dU[i] = J[i] + conj(a)**(BM-i) K with K = G[1] of the block after (exact powers, Pf),
        # and this block's K = sum_j conj(a)**j dS'[j] + conj(a**BM) K (exact powers P; hi + lo).
        K_re = tl.zeros([NP], dtype=tl.float32)
        K_im = tl.zeros([NP], dtype=tl.float32)
        for j in range(0, nblk):
            blk = nblk - 1 - j
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            tmask = t < L
            gs = tl.load(g_ptr + base + t + C, mask=t + C < L, other=0.0).to(tl.float32)
            zero = tl.zeros([BM, NP], dtype=tl.float32)
            dS_re = _dot(gs, tl.trans(Wo_re), zero, X_EXACT, False, PREC)   # g @ Wout^H, Wout^H = (Wo_re - i Wo_im)^T
            dS_im = -_dot(gs, tl.trans(Wo_im), zero, X_EXACT, False, PREC)
            J_re, J_im = _block_scan(dS_re, dS_im, a_re, -a_im, BM, NP, True)
            dU_re = Pf_re * K_re[None, :] + Pf_im * K_im[None, :] + J_re
            dU_im = Pf_re * K_im[None, :] - Pf_im * K_re[None, :] + J_im
            l_re, l_im = _weighted_rows(P_re, -P_im, dS_re, dS_im)
            K_re, K_im = (ah_re * K_re + ah_im * K_im + (al_re * K_re + al_im * K_im + l_re),
                          ah_re * K_im - ah_im * K_re + (al_re * K_im - al_im * K_re + l_im))
            so = sbase + (blk * BM + m_r[:, None]) * 2 * NP + n_r[None, :]
            tl.store(du_ptr + so, dU_re)
            tl.store(du_ptr + so + NP, dU_im)
            g = tl.load(g_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
            dxb = _dot(g, tl.trans(T), tl.zeros([BM, C], dtype=tl.float32), X_EXACT, False, PREC)
            dxb = tl.dot(dU_re, tl.trans(Wi_re), dxb, input_precision=PREC)
            dxb = tl.dot(dU_im, tl.trans(Wi_im), dxb, input_precision=PREC)
            store_rounded(dx_ptr + base + t, dxb + om * g, tmask, OUT_BF16)
        # dhx = G[0] = dS[0] + conj(a) G[1], dS[0] = g[0:C] Wout^H of the row's first chunk
        g0 = tl.load(g_ptr + base + s_r, mask=s_r < L, other=0.0).to(tl.float32)
        G_re = tl.sum(Wo_re * g0[None, :], axis=1) + a_re * K_re + a_im * K_im
        G_im = -tl.sum(Wo_im * g0[None, :], axis=1) + a_re * K_im - a_im * K_re
        po = row.to(tl.int64) * 2 * NP + n_r
        tl.store(dhx_ptr + po, G_re)
        tl.store(dhx_ptr + po + NP, G_im)

    @triton.jit
    def _bwd_sums_kernel(x_ptr, g_ptr, s_ptr, du_ptr, dk_ptr, aw_ptr, wi_ptr, pc_ptr, domega_ptr, B, D, L, nblk,
                         C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
                         X_EXACT: tl.constexpr):
        d = tl.program_id(0)
        s_r = tl.arange(0, C)
        n_r = tl.arange(0, NP)
        m_r = tl.arange(0, BM)
        dT = tl.zeros([C, C], dtype=tl.float32)
        A_re = tl.zeros([NP, C], dtype=tl.float32)
        A_im = tl.zeros([NP, C], dtype=tl.float32)
        Wa_re = tl.zeros([C, NP], dtype=tl.float32)
        Wa_im = tl.zeros([C, NP], dtype=tl.float32)
        pc_re = tl.zeros([NP], dtype=tl.float32)
        pc_im = tl.zeros([NP], dtype=tl.float32)
        om = tl.zeros([C], dtype=tl.float32)
        for b in range(0, B):
            row = b * D + d
            base = row.to(tl.int64) * L
            sbase = row.to(tl.int64) * nblk * BM * 2 * NP
            for blk in range(0, nblk):
                t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
                tmask = t < L
                X = tl.load(x_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
                so = sbase + (blk * BM + m_r[:, None]) * 2 * NP + n_r[None, :]
                S_re = tl.load(s_ptr + so)
                S_im = tl.load(s_ptr + so + NP)
                dU_re = tl.load(du_ptr + so)
                dU_im = tl.load(du_ptr + so + NP)
                dT = _dot(tl.trans(g), X, dT, X_EXACT, X_EXACT, PREC)
                A_re = _dot(tl.trans(S_re), g, A_re, False, X_EXACT, PREC)
                A_im = _dot(tl.trans(S_im), g, A_im, False, X_EXACT, PREC)
                Wa_re = _dot(tl.trans(X), dU_re, Wa_re, X_EXACT, False, PREC)
                Wa_im = _dot(tl.trans(X), dU_im, Wa_im, X_EXACT, False, PREC)
                pc_re += tl.sum(dU_re * S_re + dU_im * S_im, axis=0)
                pc_im += tl.sum(dU_im * S_re - dU_re * S_im, axis=0)
                om += tl.sum(g * X, axis=0)
        # dk[j] = sum of dT's j-th diagonal (dT[s, s - j]): C masked reductions, once per program
        diff = s_r[:, None] - s_r[None, :]
        dk = tl.zeros([C], dtype=tl.float32)
        for j in range(0, C):
            dk = tl.where(s_r == j, tl.sum(tl.sum(tl.where(diff == j, dT, 0.0), axis=1), axis=0), dk)
        tl.store(dk_ptr + d * C + s_r, dk)
        ao = (d.to(tl.int64) * 2 * NP + n_r[:, None]) * C + s_r[None, :]
        tl.store(aw_ptr + ao, A_re)
        tl.store(aw_ptr + ao + NP * C, A_im)
        wo = (d.to(tl.int64) * 2 * C + s_r[:, None]) * NP + n_r[None, :]
        tl.store(wi_ptr + wo, Wa_re)
        tl.store(wi_ptr + wo + C * NP, Wa_im)
        po = d * 2 * NP + n_r
        tl.store(pc_ptr + po, pc_re)
        tl.store(pc_ptr + po + NP, pc_im)
        tl.store(domega_ptr + d, tl.sum(om, axis=0))


    @triton.jit
    def _cos_sin(x):
        """cos x and sin x in float64 for |x| < 2 pi (a phase after fmod), within ~2 ulp: x reduced
        by the nearest multiple k of pi/2 (Cody-Waite: pi/2 in two parts, k pi/2's first part
        exact for |k| <= 4) to |r| <= pi/4, where the Taylor series to r**17 / r**16 leave < 1e-17.
        Triton's float64 sin/cos (libdevice) keep a local-memory array for huge arguments, which
        the AOT discipline counts as spilling; phases here are never huge."""
        k = tl.floor(x * 0.6366197723675814 + 0.5)                   # x / (pi/2), nearest
        r = (x - k * 1.5707963267341256) - k * 6.077100506506192e-11
        r2 = r * r
        sn = r + r * r2 * (-1.6666666666666666e-01 + r2 * (8.3333333333333332e-03 + r2 * (
            -1.9841269841269841e-04 + r2 * (2.7557319223985893e-06 + r2 * (-2.5052108385441720e-08 + r2 * (
                1.6059043836821613e-10 + r2 * (-7.6471637318198164e-13 + r2 * 2.8114572543455206e-15)))))))
        cs = 1.0 + r2 * (-0.5 + r2 * (4.1666666666666664e-02 + r2 * (-1.3888888888888889e-03 + r2 * (
            2.4801587301587302e-05 + r2 * (-2.7557319223985888e-07 + r2 * (2.0876756987868100e-09 + r2 * (
                -1.1470745597729725e-11 + r2 * 4.7794773323873853e-14)))))))
        quad = k.to(tl.int32) & 3                                      # x = r + quad pi/2 (mod 2 pi)
        c = tl.where(quad == 0, cs, tl.where(quad == 1, -sn, tl.where(quad == 2, -cs, sn)))
        s = tl.where(quad == 0, sn, tl.where(quad == 1, cs, tl.where(quad == 2, -sn, -cs)))
        return c, s

    @triton.jit
    def _power(lr, li, e):
        """q**e = exp(e log_q) in float64 as ops/_vandermonde.exact_powers evaluates it: the
        exponent formed in float64 (exact), the phase reduced by fmod(., 2 pi), exp clamped at -746."""
        mag = tl.exp(tl.maximum(lr * e, -746.0))
        ph = (li * e) % TWO_PI
        c, s = _cos_sin(ph)
        return mag * c, mag * s

    @triton.jit
    def _load_coefficients(p_ptr, lq_ptr, g_ptr, d, n_r, nm, N):
        """Feature d's float64 log q (re, im), p and gamma (re, im) as [NP, 1] columns (lanes n >= N
        zero)."""
        lr = tl.load(lq_ptr + (d * N + n_r) * 2, mask=nm, other=0.0)[:, None]
        li = tl.load(lq_ptr + (d * N + n_r) * 2 + 1, mask=nm, other=0.0)[:, None]
        pv = tl.load(p_ptr + d * N + n_r, mask=nm, other=0.0)[:, None]
        gr = tl.load(g_ptr + (d * N + n_r) * 2, mask=nm, other=0.0)[:, None]
        gi = tl.load(g_ptr + (d * N + n_r) * 2 + 1, mask=nm, other=0.0)[:, None]
        return lr, li, pv, gr, gi

    @triton.jit
    def _tables_kernel(p_ptr, lq_ptr, g_ptr, k_ptr, win_ptr, wout_ptr, a_ptr, pw_ptr, N,
                       C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
        """One program per feature d: the tables of :class:`Tables` from float64 powers, each entry
        rounded once to fp32 (lanes n >= N zero)."""
        d = tl.program_id(0)
        n_r = tl.arange(0, NP)
        s_r = tl.arange(0, C)
        i_r = tl.arange(0, 2 * BM)   # a**i for i <= BM (BM + 1 is no power of two)
        nm = n_r < N
        lr, li, pv, gr, gi = _load_coefficients(p_ptr, lq_ptr, g_ptr, d, n_r, nm, N)
        e = s_r.to(tl.float64)[None, :]
        Pr, Pi = _power(lr, li, e)                                   # q**s [NP, C]
        tl.store(k_ptr + d * C + s_r, tl.sum(pv * (gr * Pr - gi * Pi), axis=0).to(tl.float32))
        Pr1, Pi1 = _power(lr, li, e + 1.0)                           # q**(s+1)
        wo = (d * 2 * NP + n_r[:, None]) * C + s_r[None, :]
        tl.store(wout_ptr + wo, (gr * Pr1 - gi * Pi1).to(tl.float32))
        tl.store(wout_ptr + wo + NP * C, (gr * Pi1 + gi * Pr1).to(tl.float32))
        Fr, Fi = _power(lr, li, (C - 1.0) - e)                       # q**(C-1-s)
        wi = (d * 2 * C + s_r[None, :]) * NP + n_r[:, None]                  # win[d, ., s, n]
        tl.store(win_ptr + wi, (pv * Fr).to(tl.float32))
        tl.store(win_ptr + wi + C * NP, (pv * Fi).to(tl.float32))
        Ar, Ai = _power(lr, li, (i_r * C).to(tl.float64)[None, :])  # a**i [NP, 2 BM]
        Ar = tl.where(nm[:, None], Ar, 0.0)   # lanes n >= N: 0, as every other table there
        Ai = tl.where(nm[:, None], Ai, 0.0)
        po = (d * 2 * (BM + 1) + i_r[None, :]) * NP + n_r[:, None]           # pw[d, ., i, n]
        im = i_r[None, :] <= BM
        tl.store(pw_ptr + po, Ar.to(tl.float32), mask=im)
        tl.store(pw_ptr + po + (BM + 1) * NP, Ai.to(tl.float32), mask=im)
        ar, ai = _power(lr, li, C * 1.0)
        ar, ai = tl.where(nm[:, None], ar, 0.0), tl.where(nm[:, None], ai, 0.0)
        lr_, li_ = _power(lr, li, BM * C * 1.0)                      # a**BM: hi + lo
        lr_, li_ = tl.where(nm[:, None], lr_, 0.0), tl.where(nm[:, None], li_, 0.0)
        hr, hi_ = lr_.to(tl.float32), li_.to(tl.float32)
        ao = d * 6 * NP + n_r[:, None]
        tl.store(a_ptr + ao, ar.to(tl.float32))
        tl.store(a_ptr + ao + NP, ai.to(tl.float32))
        tl.store(a_ptr + ao + 2 * NP, hr)
        tl.store(a_ptr + ao + 3 * NP, hi_)
        tl.store(a_ptr + ao + 4 * NP, (lr_ - hr.to(tl.float64)).to(tl.float32))
        tl.store(a_ptr + ao + 5 * NP, (li_ - hi_.to(tl.float64)).to(tl.float32))

    @triton.jit
    def _finish_kernel(p_ptr, lq_ptr, g_ptr, dk_ptr, aw_ptr, wi_ptr, pc_ptr, dp_ptr, dlq_ptr, dg_ptr, N,
                       C: tl.constexpr, NP: tl.constexpr):
        """One program per feature d: (dp, dlog_q, dgamma) in float64 from the sums kernel's dk[:C],
        A = sum S^T g (dWout = A_re - i A_im), Wi = sum X^T dU (dWin) and pc, through
        k[:C] = Re sum p gamma q**j, Wout = gamma q**(s+1), Win = p q**(C-1-s) and a = q**C
        (ops/cema/chunked.py's chunked_conv_bwd): with dP[j] the gradient of q**j,
        dlog_q = sum_j j dP[j] conj(q**j), each of dP's four sources summed over its own index."""
        d = tl.program_id(0)
        n_r = tl.arange(0, NP)
        s_r = tl.arange(0, C)
        nm = n_r < N
        lr, li, pv, gr, gi = _load_coefficients(p_ptr, lq_ptr, g_ptr, d, n_r, nm, N)
        e = s_r.to(tl.float64)[None, :]
        Pr, Pi = _power(lr, li, e)                                           # q**s
        P1r, P1i = _power(lr, li, e + 1.0)                                   # q**(s+1)
        Fr, Fi = _power(lr, li, (C - 1.0) - e)                               # q**(C-1-s)
        dk = tl.load(dk_ptr + d * C + s_r).to(tl.float64)[None, :]
        wo = (d * 2 * NP + n_r[:, None]) * C + s_r[None, :]
        awr = tl.load(aw_ptr + wo).to(tl.float64)
        awi = tl.load(aw_ptr + wo + NP * C).to(tl.float64)
        wi = (d * 2 * C + s_r[None, :]) * NP + n_r[:, None]
        wir = tl.load(wi_ptr + wi).to(tl.float64)
        wii = tl.load(wi_ptr + wi + C * NP).to(tl.float64)
        # d(p gamma) = dA = sum_s dk[s] conj(q**s)
        dAr = tl.sum(dk * Pr, axis=1)[:, None]
        dAi = -tl.sum(dk * Pi, axis=1)[:, None]
        # dWout conj(q**(s+1)) and dWin conj(q**(C-1-s)), per (n, s)
        Wr = awr * P1r - awi * P1i
        Wi = -awr * P1i - awi * P1r
        Vr = wir * Fr + wii * Fi
        Vi = wii * Fr - wir * Fi
        dp = dAr * gr + dAi * gi + tl.sum(Vr, axis=1)[:, None]
        dgr = dAr * pv + tl.sum(Wr, axis=1)[:, None]
        dgi = dAi * pv + tl.sum(Wi, axis=1)[:, None]
        # dlog_q: j conj(p gamma) dk[j] conj(q**j) (j = s), (s+1) conj(gamma) dWout[s] conj(q**(s+1)),
        # (C-1-s) p dWin[s] conj(q**(C-1-s)), and C pc conj(q**C)
        kr = pv * dk * (gr * Pr - gi * Pi)
        ki = -pv * dk * (gr * Pi + gi * Pr)
        lqr = tl.sum(e * kr + (e + 1.0) * (gr * Wr + gi * Wi) + ((C - 1.0) - e) * pv * Vr, axis=1)
        lqi = tl.sum(e * ki + (e + 1.0) * (gr * Wi - gi * Wr) + ((C - 1.0) - e) * pv * Vi, axis=1)
        Cr, Ci = _power(lr, li, C * 1.0)
        pcr = tl.load(pc_ptr + d * 2 * NP + n_r).to(tl.float64)[:, None]
        pci = tl.load(pc_ptr + d * 2 * NP + NP + n_r).to(tl.float64)[:, None]
        lqr += tl.sum(C * (pcr * Cr + pci * Ci), axis=1)
        lqi += tl.sum(C * (pci * Cr - pcr * Ci), axis=1)
        o = d * N + n_r
        tl.store(dp_ptr + o, tl.sum(dp, axis=1), mask=nm)
        tl.store(dlq_ptr + o * 2, lqr, mask=nm)
        tl.store(dlq_ptr + o * 2 + 1, lqi, mask=nm)
        tl.store(dg_ptr + o * 2, tl.sum(dgr, axis=1), mask=nm)
        tl.store(dg_ptr + o * 2 + 1, tl.sum(dgi, axis=1), mask=nm)


class Tables:
    """The per-feature tables both passes read, from exact float64 powers rounded once to fp32:
    k [D, C] = k[:C], win [D, 2, C, NP] (re, im of Win), wout [D, 2, NP, C]; a [D, 6, NP]: re, im
    of a = q**C, then of a**BM rounded (hi) and of its rounding error (lo); pw [D, 2, BM+1, NP] =
    a**0 .. a**BM. One launch (:func:`_tables_kernel`) writes them all into one buffer; the float64
    coefficients stay for :func:`finish`."""

    def __init__(self, p, log_q, gamma, C, BM):
        D, N = p.shape
        f32, f64 = torch.float32, torch.float64
        self.p, self.gamma = p.to(f64).contiguous(), gamma.to(torch.complex128).contiguous()
        self.lq = torch.view_as_real(log_q.to(torch.complex128).contiguous())
        # one buffer, one allocation: k [D, C], win [D, 2, C, NP], wout [D, 2, NP, C], a [D, 6, NP],
        # pw [D, 2, BM+1, NP]
        sizes = (C, 2 * C * NP, 2 * NP * C, 6 * NP, 2 * (BM + 1) * NP)
        buf = torch.empty(D * sum(sizes), dtype=f32, device=p.device)
        self.k, self.win, self.wout, self.a, self.pw = (t.view(D, -1) for t in buf.split([D * n for n in sizes]))
        _tables_kernel[(D,)](self.p, self.lq, torch.view_as_real(self.gamma), self.k, self.win, self.wout, self.a,
                             self.pw, N, C=C, NP=NP, BM=BM, num_warps=TABLE_WARPS)


def _hx_pairs(hx, tab):
    """hx c(B D N) as fp32 (re, im) pairs; without hx an fp32 table (never read: HAS_HX is off),
    so that the pointer's type is the one the AOT variants declare."""
    return tab.a if hx is None else torch.view_as_real(hx.to(torch.complex64).contiguous())


def _blocks(L, C, BM):
    return -(-L // (C * BM))


def conv_fwd(x, p, log_q, gamma, omega, hx, *, chunk, chunk_block, chunk_warps):
    """y r(B D L) in x's dtype: the causal convolution with k, the bias of hx and omega x, rounded once."""
    B, D, L = x.shape
    x = x.contiguous()
    tab = Tables(p, log_q, gamma, chunk, chunk_block)
    y = torch.empty_like(x)
    _fwd_kernel[(B * D,)](x, y, tab.k, tab.win, tab.wout, tab.a, tab.pw, _hx_pairs(hx, tab),
                          omega.to(torch.float32).contiguous(),
                          D, L, p.shape[1], _blocks(L, chunk, chunk_block), C=chunk, NP=NP, BM=chunk_block,
                          HAS_HX=hx is not None, OUT_BF16=x.dtype == torch.bfloat16, PREC=PREC,
                          num_warps=chunk_warps)
    return y


def conv_bwd(dy, x, p, log_q, gamma, omega, hx, needs, dx_dtype, *, chunk, chunk_block, chunk_warps):
    """(dx r(B D L) in ``dx_dtype``, dp, dlog_q, dgamma, domega, dhx) of :func:`conv_fwd`; None where
    ``needs`` (x, p, log_q, gamma, omega, hx) says so."""
    need_x, need_p, need_lq, need_gamma, need_omega, need_hx = needs
    B, D, L = x.shape
    N = p.shape[1]
    C, BM = chunk, chunk_block
    x, dy = x.contiguous(), dy.contiguous()
    tab = Tables(p, log_q, gamma, C, BM)
    nblk = _blocks(L, C, BM)
    dev, f32 = x.device, torch.float32
    R = B * D
    dx = torch.empty(B, D, L, dtype=dx_dtype, device=dev)
    S = torch.empty(R, nblk * BM, 2, NP, dtype=f32, device=dev)
    dU = torch.empty_like(S)
    dhx = torch.empty(R, 2, NP, dtype=f32, device=dev)
    omega32 = omega.to(f32).contiguous()
    _bwd_scan_kernel[(R,)](x, dy, dx, S, dU, dhx, tab.k, tab.win, tab.wout, tab.a, tab.pw,
                           _hx_pairs(hx, tab), omega32,
                           D, L, N, nblk, C=C, NP=NP, BM=BM, HAS_HX=hx is not None,
                           OUT_BF16=dx_dtype == torch.bfloat16, PREC=PREC, X_EXACT=x.dtype == torch.bfloat16,
                           num_warps=chunk_warps)
    dp = dlq = dgamma = domega = None
    if need_p or need_lq or need_gamma or need_omega:
        dk = torch.empty(D, C, dtype=f32, device=dev)
        aw = torch.empty(D, 2, NP, C, dtype=f32, device=dev)
        wi = torch.empty(D, 2, C, NP, dtype=f32, device=dev)
        pc = torch.empty(D, 2, NP, dtype=f32, device=dev)
        dom = torch.empty(D, dtype=f32, device=dev)
        _bwd_sums_kernel[(D,)](x, dy, S, dU, dk, aw, wi, pc, dom, B, D, L, nblk, C=C, NP=NP, BM=BM, PREC=PREC,
                               X_EXACT=x.dtype == torch.bfloat16,
                               num_warps=chunk_warps)
        dp, dlq, dgamma = finish(tab, N, dk, aw, wi, pc)
        domega = dom
    dh = dhx[..., :N].view(B, D, 2, N)
    return (dx if need_x else None, dp if need_p else None, dlq if need_lq else None,
            dgamma if need_gamma else None, domega if need_omega else None,
            torch.complex(dh[:, :, 0], dh[:, :, 1]) if need_hx and hx is not None else None)


def finish(tab: Tables, N, dk, aw, wi, pc):
    """(dp r(D N) float64, dlog_q and dgamma c(D N) complex128) from the sums kernel's per-feature
    sums: one launch of :func:`_finish_kernel`."""
    D, C = dk.shape
    dp = torch.empty(D, N, dtype=torch.float64, device=dk.device)
    dlq = torch.empty(D, N, dtype=torch.complex128, device=dk.device)
    dgamma = torch.empty_like(dlq)
    _finish_kernel[(D,)](tab.p, tab.lq, torch.view_as_real(tab.gamma), dk, aw, wi, pc, dp, torch.view_as_real(dlq),
                         torch.view_as_real(dgamma), N, C=C, NP=NP, num_warps=TABLE_WARPS)
    return dp, dlq, dgamma
