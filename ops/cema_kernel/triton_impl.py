"""Triton backend of cema_kernel: Vandermonde synthesis / analysis tiles over (d, j), powers built in-kernel.

Layout. A program owns one feature d and a tile of BLOCK_M x BLOCK_R positions j = m*T + r
(T = BLOCK_R). With q**j = q**(m T) * q**r (the two-level rule of ``ops/_vandermonde.py``):

* forward  k[d, mT + r] = Re sum_n (u q**(mT))[m, n] q**r[n, r]   = [BM, N] @ [N, T] real/imag dots
           (u = p gamma), and the bias b[b, d, mT + r] with coefficient gamma hx_b and q**(mT + 1):
           the hx bias is fused (same Q1 tile, one extra pair of dots per batch row);
* backward P[m, n] = sum_r dk[m, r] q**r and P1 = sum_r dk r q**r ([BM, T] @ [T, N] dots), then
           S = sum_m q**(mT) P, S1 = sum_m q**(mT) (mT P + P1); same for db with q**(mT + 1). One
           program per d loops over all of L, so the reductions are deterministic and no partial
           sums go through memory; dp, dlog_q, dgamma, dhx are finished in the kernel.
  Nothing of size D*N*L exists anywhere: the [N, T] tile q**r is built once per program and the
  [BM, N] tile q**(mT) once per row block.

Powers (the accuracy rule). Every power is exp(e log|q|) * cis(2 pi frac(e phi)) for an exact integer
exponent e < 2**24, evaluated on its own -- never by repeated multiplication, never j*arg(q) in fp32:

* the phase: the launcher turns arg(q) into phi = arg(q) / (2 pi) mod 1 in float64 and stores it as a
  64-bit fixed-point fraction F (units of 2**-64 turns; error ~1e-19 turns). In the kernel
  e * F mod 2**64 is EXACT (wrapping int64 multiply), so the reduced phase of any j carries only the
  error of F times e (< 1e-12 turns at e = 2**20). Its top 32 bits are split in integers into the
  nearest quarter turn and a remainder |x| <= pi/4 (fp32 rounding <= 4.7e-8 rad), whose sin/cos are
  short Taylor polynomials (truncation < 2e-9), rotated by the quarter turn exactly: as good as
  rounding a float64 power once to fp32, with no libdevice (and no local memory) on the GPU.
* the magnitude: exp(e * a) with a = log|q| fp32 (exact) and e*a rounded once in fp32: relative error
  |e a| 2**-24, i.e. an absolute error <= max_x x e**-x 2**-24 = 2.2e-8 relative to 1.
* a power is then the product of at most two such values (q**(mT) * q**r), as in the torch backend.

Bytes (memory-bound): forward reads p, log|q|, gamma, F (D*N) and hx (B*D*N) once per program and
writes k and b once; backward reads dk, db once and writes the D*N / B*D*N gradients once
(bench/triton_bytes.py: 1.00-1.01x of that ideal).

Configs. BLOCK_M = 32 rows x BLOCK_R = T = 32 positions per tile; the n tile BLOCK_N is 16 or 32
(N <= 32; Megalodon uses N = 16). fp32 tl.dot with input_precision="ieee" runs on FMA units, each
thread holding a K-long slice of both operands, so register pressure grows with K: the synthesis
kernel (2 dots, K = BLOCK_N) runs with 4 warps, the analysis kernels (4 dots, K = T, plus the
[BM, BN] power tile) with ``analysis_warps`` = 8, which keeps every variant under 255 registers
without spills on sm_80 and sm_90.
"""
from __future__ import annotations

import math

import torch

from .._complex import interleaved
from .._triton_common import HAVE_TRITON, device_reasons, grid_launches, tl, triton

#: every config this backend may launch with (the tuner chooses among them; each is AOT-compiled
#: in tests); the first values are the default
CONFIG_SPACE: dict = {"block_m": (32,), "block_r": (32,), "num_warps": (4,), "analysis_warps": (8,)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

#: exponents must stay exact in fp32 (e < 2**24)
MAX_LENGTH = 1 << 24
#: the n tile (BLOCK_N, the K extent of the dots) is a power of two in N_TILES, so N <= MAX_N
N_TILES = (16, 32)
MAX_N = N_TILES[-1]


def not_supported_reasons(p=None, log_q=None, gamma=None, length=None, hx=None, **_) -> list[str]:
    why = device_reasons(p, op="cema_kernel")
    if p.shape[-1] > MAX_N:
        why.append(f"N = {p.shape[-1]} > {MAX_N} (the n tile is compiled for 16 and 32; use backend='torch')")
    if p.dtype != torch.float32:
        why.append(f"p has dtype {p.dtype}; the Triton cema_kernel takes float32 coefficients "
                   "(use backend='torch' for float64)")
    if length is not None and length + 1 >= MAX_LENGTH:
        why.append(f"length {length} >= 2**24 - 1: exponents would not be exact in fp32 (use backend='torch')")
    return why


def phase_fraction(log_q: torch.Tensor) -> torch.Tensor:
    """arg(q) / (2 pi) mod 1 as a 64-bit fixed-point fraction (int64, two's complement), from float64.

    The kernels multiply it by an integer exponent modulo 2**64 (exact), which is the phase
    reduction mod 2 pi done without rounding."""
    phi = log_q.imag.to(torch.float64) / (2.0 * math.pi)
    phi = phi - torch.floor(phi)                                   # [0, 1), exact
    x = phi * 2.0 ** 32                                            # exact scaling
    hi = torch.floor(x)
    lo = torch.floor((x - hi) * 2.0 ** 32)                         # the remaining (<= 21) bits, exact
    hi = torch.where(hi >= 2.0 ** 31, hi - 2.0 ** 32, hi)          # signed top word: wraps like uint64
    return (hi.to(torch.int64) * (1 << 32) + lo.to(torch.int64)).contiguous()


if HAVE_TRITON:
    from .._triton_common import cmul, sincos_quarter

    @triton.jit
    def load_coefficients(lq_ptr, f_ptr, p_ptr, d, N, BLOCK_N: tl.constexpr):
        """Row d of the coefficients: (n offsets, n mask, coefficient index d*N + n, log|q|,
        the 64-bit phase fraction of arg(q)/2pi, p); padded n lanes read 0 (q**e = 1, p = 0)."""
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < N
        o_c = d * N + o_n
        b_a = tl.load(lq_ptr + 2 * o_c, mask=m_n, other=0.0)
        b_f = tl.load(f_ptr + o_c, mask=m_n, other=0)
        b_p = tl.load(p_ptr + o_c, mask=m_n, other=0.0)
        return o_n, m_n, o_c, b_a, b_f, b_p

    @triton.jit
    def qpow(a, f, e):
        """q**e for log|q| = a (fp32), phase fraction f (int64, 2**-64 turns) and integer exponent e."""
        mag = tl.exp(e.to(tl.float32) * a)
        top = (e.to(tl.int64) * f) >> 32                  # exact mod 2**64; turns in units of 2**-32
        k = (top + (1 << 29)) >> 30                       # nearest quarter turn
        rem = (top - k * (1 << 30)).to(tl.int32)          # |rem| <= 2**29: |angle| <= pi/4
        s, c = sincos_quarter(rem.to(tl.float32) * 1.4629180792671596e-09)   # 2 pi / 2**32
        kq = (k & 3).to(tl.int32)
        swap = (kq & 1) == 1
        cs = tl.where(swap, s, c)
        sn = tl.where(swap, c, s)
        cs = tl.where((kq == 1) | (kq == 2), -cs, cs)
        sn = tl.where(kq >= 2, -sn, sn)
        return mag * cs, mag * sn

    @triton.jit
    def synth_tile(ar, ai, q1r, q1i):
        """Re sum_n A[m, n] Q1[n, r] as two real fp32 dots (IEEE, not TF32)."""
        out = tl.dot(ar, q1r, input_precision="ieee")
        return out - tl.dot(ai, q1i, input_precision="ieee")

    @triton.jit
    def analyze_tile(w, e1, q1r, q1i, q2r, q2i, e2):
        """For w [BM, T] against Q1 [T, BN] (inner exponents e1 [T]) and Q2 [BM, BN] (outer e2 [BM]):
        returns (sum_m Q2 P, sum_m Q2 (e2 P + P1)) as four [BN] vectors (re, im, re, im), with
        P = w @ Q1 and P1 = (w e1) @ Q1 (the exponent weight goes on the data tile, not on Q1)."""
        we = w * e1[None, :]
        pr = tl.dot(w, q1r, input_precision="ieee")
        pi = tl.dot(w, q1i, input_precision="ieee")
        p1r = tl.dot(we, q1r, input_precision="ieee") + e2[:, None] * pr
        p1i = tl.dot(we, q1i, input_precision="ieee") + e2[:, None] * pi
        sr, si = cmul(q2r, q2i, pr, pi)
        s1r, s1i = cmul(q2r, q2i, p1r, p1i)
        return tl.sum(sr, 0), tl.sum(si, 0), tl.sum(s1r, 0), tl.sum(s1i, 0)

    @triton.jit
    def _cema_fwd_kernel(
        p_ptr, lq_ptr, f_ptr, g_ptr, hx_ptr, k_ptr, b_ptr,
        D, N, L, B, Y0,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_m = (Y0 + tl.program_id(1)) * BLOCK_M + tl.arange(0, BLOCK_M)  # Y0: see grid_launches
        o_r = tl.arange(0, BLOCK_R)
        o_n, m_n, o_c, b_a, b_f, b_p = load_coefficients(lq_ptr, f_ptr, p_ptr, d, N, BLOCK_N)
        b_gr = tl.load(g_ptr + 2 * o_c, mask=m_n, other=0.0)
        b_gi = tl.load(g_ptr + 2 * o_c + 1, mask=m_n, other=0.0)
        # [BN, T] q**r, and [BM, BN] q**(mT): rows past the end get exponent 0 (finite, masked on store)
        q1r, q1i = qpow(b_a[:, None], b_f[:, None], o_r[None, :])
        e2 = tl.where(o_m * BLOCK_R < L, o_m * BLOCK_R, 0)
        q2r, q2i = qpow(b_a[None, :], b_f[None, :], e2[:, None])
        ar, ai = cmul(q2r, q2i, (b_p * b_gr)[None, :], (b_p * b_gi)[None, :])
        o_j = o_m[:, None] * BLOCK_R + o_r[None, :]                 # [BM, T]
        m_j = o_j < L
        tl.store(k_ptr + d.to(tl.int64) * L + o_j, synth_tile(ar, ai, q1r, q1i), mask=m_j)
        if B > 0:  # B = 0: no hx, no bias
            # the bias uses q**(t+1) = q**(mT+1) q**r: one more exact power per row, same Q1 tile
            s2r, s2i = qpow(b_a[None, :], b_f[None, :], e2[:, None] + 1)
            for bi in range(B):
                o_h = (bi * D + d).to(tl.int64) * N + o_n
                b_hr = tl.load(hx_ptr + 2 * o_h, mask=m_n, other=0.0)
                b_hi = tl.load(hx_ptr + 2 * o_h + 1, mask=m_n, other=0.0)
                cr, ci = cmul(b_gr, b_gi, b_hr, b_hi)
                ar, ai = cmul(s2r, s2i, cr[None, :], ci[None, :])
                p_b = b_ptr + (bi * D + d).to(tl.int64) * L + o_j
                tl.store(p_b, synth_tile(ar, ai, q1r, q1i), mask=m_j)

    @triton.jit
    def _cema_bwd_kernel(
        dk_ptr, db_ptr, p_ptr, lq_ptr, f_ptr, g_ptr, hx_ptr,
        dp_ptr, dlq_ptr, dg_ptr, dhx_ptr,
        D, N, L, B, LK,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_r = tl.arange(0, BLOCK_R)
        o_n, m_n, o_c, b_a, b_f, b_p = load_coefficients(lq_ptr, f_ptr, p_ptr, d, N, BLOCK_N)
        b_gr = tl.load(g_ptr + 2 * o_c, mask=m_n, other=0.0)
        b_gi = tl.load(g_ptr + 2 * o_c + 1, mask=m_n, other=0.0)
        # [T, BN] q**r; r is the d/dlog_q weight of the inner exponent
        q1r, q1i = qpow(b_a[None, :], b_f[None, :], o_r[:, None])
        e1 = o_r.to(tl.float32)
        # LK = L with dk, 0 without (then S = S1 = 0 and only the bias terms remain)
        sr = tl.zeros([BLOCK_N], dtype=tl.float32)
        si = tl.zeros([BLOCK_N], dtype=tl.float32)
        s1r = tl.zeros([BLOCK_N], dtype=tl.float32)
        s1i = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j0 in range(0, LK, BLOCK_M * BLOCK_R):
            o_m = j0 // BLOCK_R + tl.arange(0, BLOCK_M)
            o_j = o_m[:, None] * BLOCK_R + o_r[None, :]
            w = tl.load(dk_ptr + d.to(tl.int64) * L + o_j, mask=o_j < L, other=0.0).to(tl.float32)
            e2 = tl.where(o_m * BLOCK_R < L, o_m * BLOCK_R, 0)
            q2r, q2i = qpow(b_a[None, :], b_f[None, :], e2[:, None])
            ar, ai, a1r, a1i = analyze_tile(w, e1, q1r, q1i, q2r, q2i, e2.to(tl.float32))
            sr += ar
            si += ai
            s1r += a1r
            s1i += a1i
        ur = b_p * b_gr
        ui = b_p * b_gi
        dpv = sr * b_gr - si * b_gi                               # Re(S gamma)
        dgr = sr * b_p                                            # conj(S p)
        dgi = -si * b_p
        dlr, dli = cmul(s1r, s1i, ur, ui)                         # conj(S1 p gamma)
        dli = -dli
        # B = 0 when db is absent (or there is no hx)
        for bi in range(B):
            tr = tl.zeros([BLOCK_N], dtype=tl.float32)
            ti = tl.zeros([BLOCK_N], dtype=tl.float32)
            t1r = tl.zeros([BLOCK_N], dtype=tl.float32)
            t1i = tl.zeros([BLOCK_N], dtype=tl.float32)
            row = (bi * D + d).to(tl.int64)
            for j0 in range(0, L, BLOCK_M * BLOCK_R):
                o_m = j0 // BLOCK_R + tl.arange(0, BLOCK_M)
                o_j = o_m[:, None] * BLOCK_R + o_r[None, :]
                w = tl.load(db_ptr + row * L + o_j, mask=o_j < L, other=0.0).to(tl.float32)
                e2 = tl.where(o_m * BLOCK_R < L, o_m * BLOCK_R, 0) + 1   # q**(t+1)
                q2r, q2i = qpow(b_a[None, :], b_f[None, :], e2[:, None])
                ar, ai, a1r, a1i = analyze_tile(w, e1, q1r, q1i, q2r, q2i, e2.to(tl.float32))
                tr += ar
                ti += ai
                t1r += a1r
                t1i += a1i
            o_h = row * N + o_n
            b_hr = tl.load(hx_ptr + 2 * o_h, mask=m_n, other=0.0)
            b_hi = tl.load(hx_ptr + 2 * o_h + 1, mask=m_n, other=0.0)
            xr, xi = cmul(tr, ti, b_gr, b_gi)                        # dhx = conj(T gamma)
            tl.store(dhx_ptr + 2 * o_h, xr, mask=m_n)
            tl.store(dhx_ptr + 2 * o_h + 1, -xi, mask=m_n)
            xr, xi = cmul(tr, ti, b_hr, b_hi)                        # dgamma += conj(T hx)
            dgr += xr
            dgi -= xi
            cr, ci = cmul(b_gr, b_gi, b_hr, b_hi)                    # dlog_q += conj(T1 gamma hx)
            xr, xi = cmul(t1r, t1i, cr, ci)
            dlr += xr
            dli -= xi
        tl.store(dp_ptr + o_c, dpv, mask=m_n)
        tl.store(dg_ptr + 2 * o_c, dgr, mask=m_n)
        tl.store(dg_ptr + 2 * o_c + 1, dgi, mask=m_n)
        tl.store(dlq_ptr + 2 * o_c, dlr, mask=m_n)
        tl.store(dlq_ptr + 2 * o_c + 1, dli, mask=m_n)


def block_n(N: int) -> int:
    """Padded N: a power of two >= 16 (the K / N extent of tl.dot)."""
    return max(16, triton.next_power_of_2(N))


def forward(p, log_q, gamma, length, hx, *, block_m=32, block_r=32, num_warps=4, analysis_warps=8):
    """-> (k r(D L), b r(B D L) or None) in float32; same contract as the torch backend."""
    D, N = p.shape
    L = int(length)
    p = p.contiguous()
    lq, g, f = interleaved(log_q), interleaved(gamma), phase_fraction(log_q)
    k = torch.empty(D, L, dtype=p.dtype, device=p.device)
    B = 0 if hx is None else hx.shape[0]
    hxr = interleaved(hx) if hx is not None else g
    b = torch.empty(B, D, L, dtype=p.dtype, device=p.device) if hx is not None else k
    M = triton.cdiv(L, block_r)
    for grid, y0, _ in grid_launches(D, triton.cdiv(M, block_m)):
        _cema_fwd_kernel[grid[:2]](p, lq, f, g, hxr, k, b, D, N, L, B, y0,
                                   BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n(N), num_warps=num_warps)
    return k, (b if hx is not None else None)


def backward(dk, db, p, log_q, gamma, length, hx, needs=(True, True, True, True), *, block_m=32,
                    block_r=32, num_warps=4, analysis_warps=8):
    """-> (dp r(D N), dlog_q c(D N), dgamma c(D N), dhx c(B D N) or None); dk/db may be None."""
    D, N = p.shape
    L = int(length)
    p = p.contiguous()
    lq, g, f = interleaved(log_q), interleaved(gamma), phase_fraction(log_q)
    has_dk = dk is not None
    has_db = db is not None and hx is not None
    dk = dk.to(torch.float32).contiguous() if has_dk else p
    B = hx.shape[0] if hx is not None else 0
    dbc = db.to(torch.float32).contiguous() if has_db else p
    hxr = interleaved(hx) if hx is not None else g
    dp = torch.empty(D, N, dtype=p.dtype, device=p.device)
    dlq = torch.empty(D, N, dtype=log_q.dtype, device=p.device)
    dgamma = torch.empty(D, N, dtype=gamma.dtype, device=p.device)
    dhx = None
    if hx is not None:
        dhx = (torch.empty if has_db else torch.zeros)(hx.shape, dtype=hx.dtype, device=p.device)
    dhxr = torch.view_as_real(dhx) if has_db else dp
    _cema_bwd_kernel[(D,)](
        dk, dbc, p, lq, f, g, hxr, dp, torch.view_as_real(dlq), torch.view_as_real(dgamma), dhxr,
        D, N, L, B if has_db else 0, L if has_dk else 0,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n(N), num_warps=analysis_warps,
    )
    return dp, dlq, dgamma, dhx
