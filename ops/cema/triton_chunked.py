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
from .._vandermonde import exact_powers

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_common import store_rounded

#: the state lanes (N padded to a dot's minimum K of 16): N <= NP runs chunked
NP = 16
#: the dots' precision: fp32 accuracy from three TF32 tensor-core products
PREC = "tf32x3"


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
    def _load_powers(a_ptr, pw_ptr, d, BM: tl.constexpr, NP: tl.constexpr, FLIP: tl.constexpr):
        """a = q**C re/im [NP]; a**i re/im [BM, NP] (row i, or row BM-1-i with FLIP); a**BM as
        hi + lo pairs re/im [NP] (lo: the float64 value's rounding error, so the carry from block
        to block has no systematic error from rounding a**BM)."""
        n_r = tl.arange(0, NP)
        m_r = tl.arange(0, BM)
        a_off = d * 6 * NP + n_r
        rows = (BM - 1 - m_r) if FLIP else m_r
        pw_off = (d * 2 * BM + rows[:, None]) * NP + n_r[None, :]
        return (tl.load(a_ptr + a_off), tl.load(a_ptr + a_off + NP), tl.load(pw_ptr + pw_off),
                tl.load(pw_ptr + pw_off + BM * NP), tl.load(a_ptr + a_off + 2 * NP), tl.load(a_ptr + a_off + 3 * NP),
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
    def _block_states(U_re, U_im, S_re, S_im, a_re, a_im, P_re, P_im, ah_re, ah_im, al_re, al_im,
                      BM: tl.constexpr, NP: tl.constexpr):
        """The states entering the block's BM chunks (rows of [BM, NP]) from S entering its first,
        and S after its last, in two levels (as ops/cema/chunked.py's chunk_scan): the block's
        own scan from zero, loc[i+1] = a loc[i] + U[i] (at most BM steps with the rounded a), then
        S_in[i] = a**i S + loc[i] with exact powers and S_next = a**BM S + loc[BM]."""
        m_r = tl.arange(0, BM)
        loc_re = tl.zeros([BM, NP], dtype=tl.float32)
        loc_im = tl.zeros([BM, NP], dtype=tl.float32)
        l_re = tl.zeros([NP], dtype=tl.float32)
        l_im = tl.zeros([NP], dtype=tl.float32)
        for i in tl.static_range(BM):
            here = m_r[:, None] == i
            loc_re = tl.where(here, l_re[None, :], loc_re)
            loc_im = tl.where(here, l_im[None, :], loc_im)
            u_re = tl.sum(tl.where(here, U_re, 0.0), axis=0)
            u_im = tl.sum(tl.where(here, U_im, 0.0), axis=0)
            l_re, l_im = a_re * l_re - a_im * l_im + u_re, a_re * l_im + a_im * l_re + u_im
        Sin_re = P_re * S_re[None, :] - P_im * S_im[None, :] + loc_re
        Sin_im = P_re * S_im[None, :] + P_im * S_re[None, :] + loc_im
        c_re = al_re * S_re - al_im * S_im + l_re
        c_im = al_re * S_im + al_im * S_re + l_im
        return Sin_re, Sin_im, ah_re * S_re - ah_im * S_im + c_re, ah_re * S_im + ah_im * S_re + c_im

    @triton.jit
    def _fwd_kernel(x_ptr, y_ptr, k_ptr, win_ptr, wout_ptr, a_ptr, pw_ptr, hx_ptr, omega_ptr, D, L, N, nblk,
                    C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, HAS_HX: tl.constexpr,
                    OUT_BF16: tl.constexpr, PREC: tl.constexpr):
        row = tl.program_id(0)
        d = row % D
        s_r = tl.arange(0, C)
        m_r = tl.arange(0, BM)
        T, Wi_re, Wi_im, Wo_re, Wo_im = _load_tables(k_ptr, win_ptr, wout_ptr, d, C, NP)
        a_re, a_im, P_re, P_im, ah_re, ah_im, al_re, al_im = _load_powers(a_ptr, pw_ptr, d, BM, NP, False)
        om = tl.load(omega_ptr + d)
        S_re, S_im = _initial_state(hx_ptr, row, N, NP, HAS_HX)
        base = row.to(tl.int64) * L
        for blk in range(0, nblk):
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            tmask = t < L
            X = tl.load(x_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
            Y = tl.dot(X, T, input_precision=PREC)
            U_re = tl.dot(X, Wi_re, input_precision=PREC)
            U_im = tl.dot(X, Wi_im, input_precision=PREC)
            Sin_re, Sin_im, S_re, S_im = _block_states(U_re, U_im, S_re, S_im, a_re, a_im, P_re, P_im,
                                                       ah_re, ah_im, al_re, al_im, BM, NP)
            Y = tl.dot(Sin_re, Wo_re, Y, input_precision=PREC)
            Y = tl.dot(-Sin_im, Wo_im, Y, input_precision=PREC)
            store_rounded(y_ptr + base + t, Y + om * X, tmask, OUT_BF16)

    @triton.jit
    def _bwd_scan_kernel(x_ptr, g_ptr, dx_ptr, s_ptr, du_ptr, dhx_ptr, k_ptr, win_ptr, wout_ptr, a_ptr, pw_ptr,
                         hx_ptr, omega_ptr, D, L, N, nblk,
                         C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, HAS_HX: tl.constexpr,
                         OUT_BF16: tl.constexpr, PREC: tl.constexpr):
        row = tl.program_id(0)
        d = row % D
        s_r = tl.arange(0, C)
        n_r = tl.arange(0, NP)
        m_r = tl.arange(0, BM)
        T, Wi_re, Wi_im, Wo_re, Wo_im = _load_tables(k_ptr, win_ptr, wout_ptr, d, C, NP)
        om = tl.load(omega_ptr + d)
        S_re, S_im = _initial_state(hx_ptr, row, N, NP, HAS_HX)
        base = row.to(tl.int64) * L
        # S and dU of chunk c at [row, c, (re, im), n]
        sbase = row.to(tl.int64) * nblk * BM * 2 * NP
        # pass 1: the state entering every chunk
        a_re, a_im, P_re, P_im, ah_re, ah_im, al_re, al_im = _load_powers(a_ptr, pw_ptr, d, BM, NP, False)
        for blk in range(0, nblk):
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            X = tl.load(x_ptr + base + t, mask=t < L, other=0.0).to(tl.float32)
            U_re = tl.dot(X, Wi_re, input_precision=PREC)
            U_im = tl.dot(X, Wi_im, input_precision=PREC)
            Sin_re, Sin_im, S_re, S_im = _block_states(U_re, U_im, S_re, S_im, a_re, a_im, P_re, P_im,
                                                       ah_re, ah_im, al_re, al_im, BM, NP)
            so = sbase + (blk * BM + m_r[:, None]) * 2 * NP + n_r[None, :]
            tl.store(s_ptr + so, Sin_re)
            tl.store(s_ptr + so + NP, Sin_im)
        # pass 2: backwards over the chunks, the adjoint scan G[c] = dS[c] + conj(a) G[c+1] in the
        # same two levels: the block's own scan from zero, then conj(a)**(BM-1-i) G entering from
        # the next block (exact powers, Pf: the table's rows reversed) and the carry with conj(a**BM)
        a_re, a_im, Pf_re, Pf_im, ah_re, ah_im, al_re, al_im = _load_powers(a_ptr, pw_ptr, d, BM, NP, True)
        G_re = tl.zeros([NP], dtype=tl.float32)
        G_im = tl.zeros([NP], dtype=tl.float32)
        for j in range(0, nblk):
            blk = nblk - 1 - j
            t = (blk * BM + m_r[:, None]) * C + s_r[None, :]
            tmask = t < L
            g = tl.load(g_ptr + base + t, mask=tmask, other=0.0).to(tl.float32)
            dS_re = tl.dot(g, tl.trans(Wo_re), input_precision=PREC)     # g @ Wout^H, Wout^H = (Wo_re - i Wo_im)^T
            dS_im = -tl.dot(g, tl.trans(Wo_im), input_precision=PREC)
            loc_re = tl.zeros([BM, NP], dtype=tl.float32)
            loc_im = tl.zeros([BM, NP], dtype=tl.float32)
            l_re = tl.zeros([NP], dtype=tl.float32)
            l_im = tl.zeros([NP], dtype=tl.float32)
            for ii in tl.static_range(BM):
                here = m_r[:, None] == BM - 1 - ii
                loc_re = tl.where(here, l_re[None, :], loc_re)
                loc_im = tl.where(here, l_im[None, :], loc_im)
                ds_re = tl.sum(tl.where(here, dS_re, 0.0), axis=0)
                ds_im = tl.sum(tl.where(here, dS_im, 0.0), axis=0)
                l_re, l_im = a_re * l_re + a_im * l_im + ds_re, a_re * l_im - a_im * l_re + ds_im
            # dU[i] = G[i+1] = loc[i+1] + conj(a**(BM-1-i)) G_next
            dU_re = Pf_re * G_re[None, :] + Pf_im * G_im[None, :] + loc_re
            dU_im = Pf_re * G_im[None, :] - Pf_im * G_re[None, :] + loc_im
            c_re = al_re * G_re + al_im * G_im + l_re
            c_im = al_re * G_im - al_im * G_re + l_im
            G_re, G_im = ah_re * G_re + ah_im * G_im + c_re, ah_re * G_im - ah_im * G_re + c_im
            so = sbase + (blk * BM + m_r[:, None]) * 2 * NP + n_r[None, :]
            tl.store(du_ptr + so, dU_re)
            tl.store(du_ptr + so + NP, dU_im)
            dxb = tl.dot(g, tl.trans(T), input_precision=PREC)
            dxb = tl.dot(dU_re, tl.trans(Wi_re), dxb, input_precision=PREC)
            dxb = tl.dot(dU_im, tl.trans(Wi_im), dxb, input_precision=PREC)
            store_rounded(dx_ptr + base + t, dxb + om * g, tmask, OUT_BF16)
        po = row.to(tl.int64) * 2 * NP + n_r
        tl.store(dhx_ptr + po, G_re)
        tl.store(dhx_ptr + po + NP, G_im)

    @triton.jit
    def _bwd_sums_kernel(x_ptr, g_ptr, s_ptr, du_ptr, dk_ptr, aw_ptr, wi_ptr, pc_ptr, domega_ptr, B, D, L, nblk,
                         C: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr):
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
                dT = tl.dot(tl.trans(g), X, dT, input_precision=PREC)
                A_re = tl.dot(tl.trans(S_re), g, A_re, input_precision=PREC)
                A_im = tl.dot(tl.trans(S_im), g, A_im, input_precision=PREC)
                Wa_re = tl.dot(tl.trans(X), dU_re, Wa_re, input_precision=PREC)
                Wa_im = tl.dot(tl.trans(X), dU_im, Wa_im, input_precision=PREC)
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


class Tables:
    """The per-feature tables both passes read, from exact float64 powers rounded once to fp32:
    k [D, C] = k[:C], win [D, 2, C, NP] (re, im of Win), wout [D, 2, NP, C]; a [D, 6, NP]: re, im
    of a = q**C, then of a**BM rounded (hi) and of its rounding error (lo); pw [D, 2, BM, NP] =
    a**0 .. a**(BM-1); P c(D N C+1) = q**0 .. q**C (complex128) for the host finish."""

    def __init__(self, p, log_q, gamma, C, BM):
        D, N = p.shape
        self.P = P = exact_powers(log_q.to(torch.complex128), torch.arange(C + 1, device=p.device))
        self.p, self.gamma = p.to(torch.float64), gamma.to(torch.complex128)
        k = ((self.p * self.gamma).unsqueeze(-1) * P[..., :C]).real.sum(1)                       # [D, C]
        win = (self.p.unsqueeze(-1) * P[..., :C].flip(-1)).transpose(1, 2)                       # [D, C, N]
        wout = self.gamma.unsqueeze(-1) * P[..., 1:]                                            # [D, N, C]
        pad = NP - N
        win = torch.nn.functional.pad(win, (0, pad))
        wout = torch.nn.functional.pad(wout, (0, 0, 0, pad))
        f32 = torch.float32
        A = exact_powers(log_q.to(torch.complex128), torch.arange(BM + 1, device=p.device) * C)  # a**0 .. a**BM
        A = torch.nn.functional.pad(A, (0, 0, 0, pad))                                      # [D, NP, BM+1]
        a, last = A[..., 1], A[..., BM]
        hi = last.to(torch.complex64).to(torch.complex128)
        self.k = k.to(f32).contiguous()
        self.win = torch.stack((win.real, win.imag), 1).to(f32).contiguous()
        self.wout = torch.stack((wout.real, wout.imag), 1).to(f32).contiguous()
        self.a = torch.stack((a.real, a.imag, hi.real, hi.imag, (last - hi).real, (last - hi).imag),
                             1).to(f32).contiguous()
        self.pw = torch.stack((A[..., :BM].real, A[..., :BM].imag), 1).transpose(2, 3).to(f32).contiguous()


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
                           OUT_BF16=dx_dtype == torch.bfloat16, PREC=PREC, num_warps=chunk_warps)
    dp = dlq = dgamma = domega = None
    if need_p or need_lq or need_gamma or need_omega:
        dk = torch.empty(D, C, dtype=f32, device=dev)
        aw = torch.empty(D, 2, NP, C, dtype=f32, device=dev)
        wi = torch.empty(D, 2, C, NP, dtype=f32, device=dev)
        pc = torch.empty(D, 2, NP, dtype=f32, device=dev)
        dom = torch.empty(D, dtype=f32, device=dev)
        _bwd_sums_kernel[(D,)](x, dy, S, dU, dk, aw, wi, pc, dom, B, D, L, nblk, C=C, NP=NP, BM=BM, PREC=PREC,
                               num_warps=chunk_warps)
        dp, dlq, dgamma = finish(tab, N, dk, aw, wi, pc)
        domega = dom
    dh = dhx[..., :N].view(B, D, 2, N)
    return (dx if need_x else None, dp if need_p else None, dlq if need_lq else None,
            dgamma if need_gamma else None, domega if need_omega else None,
            torch.complex(dh[:, :, 0], dh[:, :, 1]) if need_hx and hx is not None else None)


def finish(tab: Tables, N, dk, aw, wi, pc):
    """(dp, dlog_q, dgamma) from the kernels' per-feature sums, in float64 (ops/cema/chunked.py's
    chunked_conv_bwd formulas): through k[:C] = Re sum p gamma q**j, Wout = gamma q**(s+1),
    Win = p q**(C-1-s') and the chunk step a = q**C; the adjoint of q**j = exp(j log_q) is
    j conj(q**j)."""
    P, p, gamma = tab.P, tab.p, tab.gamma
    C = P.shape[-1] - 1
    f64 = torch.float64
    dk, aw, wi, pc = dk.to(f64), aw.to(f64)[:, :, :N], wi.to(f64)[..., :N], pc.to(f64)[..., :N]
    dP = torch.zeros_like(P)
    dA = (dk.unsqueeze(1) * P[..., :C].conj()).sum(-1)                                 # d(p gamma) [D, N]
    dP[..., :C] += (p * gamma).conj().unsqueeze(-1) * dk.unsqueeze(1)
    dp = (dA * gamma.conj()).real
    dgamma = dA * p
    dWo = torch.complex(aw[:, 0], -aw[:, 1])                                             # [D, N, C]
    dgamma = dgamma + (dWo * P[..., 1:].conj()).sum(-1)
    dP[..., 1:] += gamma.conj().unsqueeze(-1) * dWo
    dWi = torch.complex(wi[:, 0], wi[:, 1]).transpose(1, 2)                              # [D, N, C]
    dp = dp + (dWi * P[..., :C].flip(-1).conj()).sum(-1).real
    dP[..., :C] += (p.unsqueeze(-1) * dWi).flip(-1)
    dP[..., C] += torch.complex(pc[:, 0], pc[:, 1])
    j = torch.arange(C + 1, device=P.device, dtype=f64)
    dlq = (dP * P.conj() * j).sum(-1)
    return dp, dlq, dgamma
