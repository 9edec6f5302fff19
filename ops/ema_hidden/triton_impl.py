"""Triton backend of ema_hidden: reverse-layout Vandermonde analysis (forward) and synthesis (dx).

Exponents e(j) = L-1-j. As in ``ops/_vandermonde.py`` the sequence is padded at the FRONT to M*T
positions (T = BLOCK_R, M = ceil(L/T)) so that position j' = m*T + r has e = (M-1-m) T + (T-1-r):
q**e = q**((M-1-m)T) * q**(T-1-r), both powers exact (see cema_kernel/triton_impl.py: 64-bit
fixed-point phase times the integer exponent, mod 2**64, and exp of an fp32 exponent). Padding is
never stored: masked loads/stores at j = j' - pad outside [0, L).

* forward, one program per d (loops over b and over all of L, deterministic reductions):
      P = x[BM, T] @ q**(T-1-r)[T, N],  P1 = (x (T-1-r)) @ q**(T-1-r)     (fp32 IEEE dots)
      V = sum_m q**((M-1-m)T) P,  W = sum_m q**((M-1-m)T) ((M-1-m)T P + P1)
      h = p V + q**L hx              (q**L one more exact power; hx / W are runtime 0-1 flags
                                      applied as masks, so one compiled kernel serves every case)
  x is read once in its own dtype (bf16/fp16 converted to fp32 right after the load).
* backward dx[b, d, j] = Re sum_n conj(dh) p q**e(j): tiles [BM, T] per (d, row block), the
  [N, T] Q1 tile built once per program and shared by every batch row; dp, dlog_q, dhx are
  O(B D N) products of the saved V, W (as in the torch backend) done in torch. dx is returned in
  float32 like the torch backend's; the autograd Function rounds it once to x's dtype.

Bytes: forward reads x once (plus O(B D N) coefficients) and writes h, V (, W); backward reads
dh, p, log|q|, F once per program and writes dx once (bench/triton_bytes.py: 1.00x / 1.05x total).
Configs as cema_kernel: 32 x 32 tiles, n tile 16 or 32 (N <= 32), the analysis (forward) kernel
with 8 warps, the synthesis (dx) kernel with 4: no variant spills on sm_80 / sm_90.
"""
from __future__ import annotations

import torch

from .._complex import interleaved
from .._triton_common import HAVE_TRITON, device_reasons, dtype_reasons, grid_launches, tl, triton
from ..cema_kernel.triton_impl import MAX_LENGTH, MAX_N, block_n, phase_fraction
from .torch_impl import coefficient_grads

#: every config this backend may launch with (the tuner chooses among them; each is AOT-compiled
#: in tests); the first values are the default
CONFIG_SPACE: dict = {"block_m": (32,), "block_r": (32,), "num_warps": (4,), "analysis_warps": (8,)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def not_supported_reasons(x=None, p=None, log_q=None, hx=None, **_) -> list[str]:
    why = device_reasons(x, op="ema_hidden") + dtype_reasons("x", x, X_DTYPES)
    if p.shape[-1] > MAX_N:
        why.append(f"N = {p.shape[-1]} > {MAX_N} (the n tile is compiled for 16 and 32; use backend='torch')")
    if p.dtype != torch.float32:
        why.append(f"p has dtype {p.dtype}; the Triton ema_hidden takes float32 coefficients "
                   "(use backend='torch' for float64)")
    if x.shape[-1] + 1 >= MAX_LENGTH:
        why.append(f"L = {x.shape[-1]} >= 2**24 - 1: exponents would not be exact in fp32 (use backend='torch')")
    return why


if HAVE_TRITON:
    from .._triton_common import cmul
    from ..cema_kernel.triton_impl import analyze_tile, load_coefficients, qpow, synth_tile

    @triton.jit
    def _ema_hidden_fwd_kernel(
        x_ptr, p_ptr, lq_ptr, f_ptr, hx_ptr, h_ptr, v_ptr, w_ptr,
        D, N, L, B, M, HAS_HX, WEIGHTED,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_r = tl.arange(0, BLOCK_R)
        o_n, m_n, o_c, b_a, b_f, b_p = load_coefficients(lq_ptr, f_ptr, p_ptr, d, N, BLOCK_N)
        pad = M * BLOCK_R - L
        # [T, BN] q**(T-1-r) and (T-1-r) q**(T-1-r)
        e1 = BLOCK_R - 1 - o_r
        q1r, q1i = qpow(b_a[None, :], b_f[None, :], e1[:, None])
        e1f = e1.to(tl.float32)
        m_hx = o_n < N * HAS_HX      # runtime 0/1 flags as masks: one compiled kernel for every case
        m_w = o_n < N * WEIGHTED
        qlr, qli = qpow(b_a, b_f, L + 0 * o_n)
        for bi in range(B):
            row = (bi * D + d).to(tl.int64)
            vr = tl.zeros([BLOCK_N], dtype=tl.float32)
            vi = tl.zeros([BLOCK_N], dtype=tl.float32)
            wr = tl.zeros([BLOCK_N], dtype=tl.float32)
            wi = tl.zeros([BLOCK_N], dtype=tl.float32)
            for m0 in range(0, M, BLOCK_M):
                o_m = m0 + tl.arange(0, BLOCK_M)
                o_j = o_m[:, None] * BLOCK_R + o_r[None, :] - pad          # [BM, T] real position
                m_j = (o_j >= 0) & (o_j < L)
                b_x = tl.load(x_ptr + row * L + o_j, mask=m_j, other=0.0).to(tl.float32)
                e2 = tl.where(o_m < M, (M - 1 - o_m) * BLOCK_R, 0)
                q2r, q2i = qpow(b_a[None, :], b_f[None, :], e2[:, None])
                ar, ai, a1r, a1i = analyze_tile(b_x, e1f, q1r, q1i, q2r, q2i, e2.to(tl.float32))
                vr += ar
                vi += ai
                wr += a1r
                wi += a1i
            o_h = row * N + o_n
            hr = b_p * vr
            hi = b_p * vi
            b_hr = tl.load(hx_ptr + 2 * o_h, mask=m_hx, other=0.0)
            b_hi = tl.load(hx_ptr + 2 * o_h + 1, mask=m_hx, other=0.0)
            xr, xi = cmul(qlr, qli, b_hr, b_hi)
            hr += xr
            hi += xi
            tl.store(h_ptr + 2 * o_h, hr, mask=m_n)
            tl.store(h_ptr + 2 * o_h + 1, hi, mask=m_n)
            tl.store(v_ptr + 2 * o_h, vr, mask=m_n)
            tl.store(v_ptr + 2 * o_h + 1, vi, mask=m_n)
            tl.store(w_ptr + 2 * o_h, wr, mask=m_w)
            tl.store(w_ptr + 2 * o_h + 1, wi, mask=m_w)

    @triton.jit
    def _ema_hidden_dx_kernel(
        dh_ptr, p_ptr, lq_ptr, f_ptr, dx_ptr,
        D, N, L, B, M, Y0,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        d = tl.program_id(0)
        o_m = (Y0 + tl.program_id(1)) * BLOCK_M + tl.arange(0, BLOCK_M)  # Y0: see grid_launches
        o_r = tl.arange(0, BLOCK_R)
        o_n, m_n, o_c, b_a, b_f, b_p = load_coefficients(lq_ptr, f_ptr, p_ptr, d, N, BLOCK_N)
        pad = M * BLOCK_R - L
        q1r, q1i = qpow(b_a[:, None], b_f[:, None], (BLOCK_R - 1 - o_r)[None, :])   # [BN, T]
        e2 = tl.where(o_m < M, (M - 1 - o_m) * BLOCK_R, 0)
        q2r, q2i = qpow(b_a[None, :], b_f[None, :], e2[:, None])                     # [BM, BN]
        o_j = o_m[:, None] * BLOCK_R + o_r[None, :] - pad
        m_j = (o_j >= 0) & (o_j < L)
        for bi in range(B):
            row = (bi * D + d).to(tl.int64)
            o_h = row * N + o_n
            # coefficient conj(dh) p
            cr = tl.load(dh_ptr + 2 * o_h, mask=m_n, other=0.0) * b_p
            ci = -tl.load(dh_ptr + 2 * o_h + 1, mask=m_n, other=0.0) * b_p
            ar, ai = cmul(q2r, q2i, cr[None, :], ci[None, :])
            tl.store(dx_ptr + row * L + o_j, synth_tile(ar, ai, q1r, q1i), mask=m_j)


def forward(x, p, log_q, hx, weighted=False, *, block_m=32, block_r=32, num_warps=4, analysis_warps=8):
    """-> (h c(B D N), V c(B D N), W c(B D N) or None); same contract as the torch backend."""
    B, D, L = x.shape
    N = p.shape[1]
    x, p = x.contiguous(), p.contiguous()
    lq, f = interleaved(log_q), phase_fraction(log_q)
    cdt = log_q.dtype
    h = torch.empty(B, D, N, dtype=cdt, device=x.device)
    V = torch.empty(B, D, N, dtype=cdt, device=x.device)
    W = torch.empty(B, D, N, dtype=cdt, device=x.device) if weighted else None
    hr, vr = torch.view_as_real(h), torch.view_as_real(V)
    wr = torch.view_as_real(W) if weighted else vr
    hxr = interleaved(hx) if hx is not None else lq
    M = triton.cdiv(L, block_r)
    _ema_hidden_fwd_kernel[(D,)](
        x, p, lq, f, hxr, hr, vr, wr, D, N, L, B, M, int(hx is not None), int(bool(weighted)),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n(N), num_warps=analysis_warps,
    )
    return h, V, W


def backward(dh, p, log_q, hx, V, W, length, needs=(True, True, True, True), *, block_m=32, block_r=32,
                   num_warps=4, analysis_warps=8):
    """-> (dx r(B D L) float32 or None, dp r(D N), dlog_q c(D N), dhx c(B D N) or None)."""
    need_x, need_p, need_lq, need_hx = needs
    L = int(length)
    B, D, N = dh.shape
    dx = None
    if need_x:
        dx = torch.empty(B, D, L, dtype=p.dtype, device=p.device)
        M = triton.cdiv(L, block_r)
        args = (interleaved(dh), p.contiguous(), interleaved(log_q), phase_fraction(log_q), dx, D, N, L, B, M)
        for grid, y0, _ in grid_launches(D, triton.cdiv(M, block_m)):
            _ema_hidden_dx_kernel[grid[:2]](*args, y0, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n(N),
                                            num_warps=num_warps)
    # the O(B D N) coefficient gradients are small products of the saved sums: shared with torch
    return (dx, *coefficient_grads(dh, p, log_q, hx, V, W, L, need_p, need_lq))
