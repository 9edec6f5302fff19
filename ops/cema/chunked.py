"""The chunked form of CEMA's convolution: small matmuls and a scan over chunk states instead of FFTs.

With chunks of C steps (t = c*C + s, s < C) the causal convolution of x with the kernel
k[j] = Re sum_n p_n gamma_n q_n**j, plus the bias of the initial state hx, splits into

    y[c, s] = sum_{s' <= s} k[s - s'] x[c, s']              within the chunk: a C x C Toeplitz matmul
            + Re sum_n gamma_n q_n**(s+1) S[c, n]            from the state at the chunk's start

    S[0] = hx (or 0),   S[c+1] = q**C S[c] + U[c],   U[c, n] = sum_{s'} p_n q_n**(C-1-s') x[c, s']

(the state-space / convolution duality of Mamba-2, here for a diagonal complex state of size N).
Per channel the work is three batched real matmuls, [nc, C] @ [C, C], [nc, C] @ [C, 2N] and
[nc, 2N] @ [2N, C] (a complex weight is its real and imaginary columns), and a scan over the
nc = L/C chunk states: O(L (C + 4N)) flops per channel against the FFT path's O(L log L), but all
of it in GEMMs on the CPU, no transforms and no complex spectra; only q**0 .. q**C are evaluated.

Numerics. The powers come from :func:`progression_powers` / :func:`exact_powers` (float64,
rounded once). The scan is a recurrence over chunks, so its rounding error grows with the number
of chunks it runs through; it runs in one level up to ``SCAN_BLOCK`` chunks, and in two beyond: blocks of SCAN_BLOCK chunks
scanned from zero (all blocks at once), then the block carries, each added to its block's chunks
with exact powers q**(C (i+1)). Any state is then at most SCAN_BLOCK + nc / SCAN_BLOCK
multiply-adds from exact (~320 at L = 2**20, C = 64), not nc. (The two-level pass is not used
below that: its block-wide complex products with broadcast powers run ~5x slower per element on
the CPU than the one-level steps, whose cost at these sizes is mostly per-call overhead.)

The backward is the same pieces transposed: the matmuls' adjoints, the scan run in reverse with
conj(q**C), and the coefficient gradients through the O(D N C) power rows (the adjoint of
q**j = exp(j log_q) is j conj(q**j)). Nothing is saved between the passes but the inputs: the
chunk states are recomputed (one [nc, C] @ [C, 2N] matmul and the scan).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._vandermonde import exact_powers, progression_powers
from .._toeplitz import diagonal_sums, toeplitz, toeplitz_t

class Chunked:
    """The per-call pieces both passes share: the chunked x and the power rows.

    Shapes: x r(B D L) -> xs r(B D nc C) (zero-padded to nc*C steps: causal, so the padding only
    reaches outputs that are cut off); P c(D N C+1) = q**0 .. q**C.
    """

    def __init__(self, x, p, log_q, gamma, chunk, cd):
        B, D, L = x.shape
        self.B, self.D, self.L, self.N = B, D, L, p.shape[1]
        self.C = C = min(chunk, L)
        self.nc = nc = -(-L // C)
        xc = x.to(cd)
        if nc * C != L:
            xc = F.pad(xc, (0, nc * C - L))
        self.xs = xc.contiguous().view(B, D, nc, C)
        ccd = torch.complex128 if cd == torch.float64 else torch.complex64
        self.p, self.gamma, self.log_q = p.to(cd), gamma.to(ccd), log_q.to(ccd)
        self.P = progression_powers(self.log_q, C + 1)                                 # [D, N, C+1]
        self.kc = (self.p * self.gamma).unsqueeze(-1).mul(self.P[..., :C]).real.sum(1)   # [D, C] = k[:C]

    # ---- weights as real matrices: a complex weight w of N rows becomes 2N real ones, each
    # complex entry's (real, imaginary) pair adjacent, so a product is a view_as_complex away ---
    def w_in(self):
        """[D, C, 2N]: U = x_chunk @ w_in is U c(.. N) as real pairs; w_in[s'] = p q**(C-1-s')."""
        w = self.p.unsqueeze(-1) * self.P[..., :self.C].flip(-1)                      # [D, N, C]
        return torch.view_as_real(w).permute(0, 2, 1, 3).reshape(self.D, self.C, 2 * self.N)

    def w_out(self):
        """[D, 2N, C]: S as real pairs @ w_out = Re sum_n gamma_n q_n**(s+1) S_n (rows Re w, -Im w)."""
        w = self.gamma.unsqueeze(-1) * self.P[..., 1:]                                # [D, N, C]
        return torch.view_as_real(w.conj_physical()).transpose(-1, -2).reshape(self.D, 2 * self.N, self.C)

    def has_states(self, hx) -> bool:
        return self.nc > 1 or hx is not None

    def states(self, hx, w_in):
        """S c(B D nc N): the state entering each chunk."""
        B, D, N, nc = self.B, self.D, self.N, self.nc
        u = _batched(torch.bmm, self.xs, w_in, out=self.xs.new_empty(B, D, nc, 2 * N))
        z = torch.view_as_complex(u.view(B, D, nc, N, 2)).roll(1, 2)                 # U[c] enters chunk c+1
        z[:, :, 0] = 0 if hx is None else hx
        return chunk_scan(z, self.log_q, self.C)


def _batched(mm, a, w, out):
    """out[b] = mm(a[b], w) for a batch of [D, ...] operands sharing the per-channel weights w:
    one bmm per batch row, written in place (matmul's broadcasting would copy w B times)."""
    for b in range(a.shape[0]):
        mm(a[b], w, out=out[b])
    return out


#: Chunks scanned in one level; longer scans run in two (see the module docstring).
SCAN_BLOCK = 64


def _as_real(z):
    """c(..., N) -> r(..., 2N), (Re, Im) pairs: a view of a contiguous z."""
    return torch.view_as_real(z).flatten(-2)


def _batch_sum(a, w):
    """sum_b a[b] @ w[b] for [B, D, ...] operands: [D, ...]."""
    out = torch.bmm(a[0], w[0])
    for b in range(1, a.shape[0]):
        out.baddbmm_(a[b], w[b])
    return out


def chunk_scan(z, log_q, C, reverse=False):
    """s[c] = a s[c-1] + z[c] along dim 2 of z c(B D nc N), s[-1] = 0, with a = q**C (conj(a) and
    from the last chunk backwards with ``reverse``: the adjoint scan). One level up to SCAN_BLOCK
    chunks, two beyond (see the module docstring)."""
    B, D, nc, N = z.shape
    G = SCAN_BLOCK
    if nc <= G:
        a = exact_powers(log_q, torch.tensor([C], device=z.device))[..., 0]
        return _scan(z, a.conj() if reverse else a, reverse=reverse)
    if reverse:
        return chunk_scan(z.flip(2), log_q.conj_physical(), C).flip(2)
    nb = -(-nc // G)
    zb = F.pad(z, (0, 0, 0, nb * G - nc)).view(B, D, nb, G, N)
    a_pows = progression_powers(log_q, G, step=C, first=C)                            # [D, N, G]: a**1 .. a**G
    local = _scan(zb, a_pows[..., 0].unsqueeze(1), dim=3)                             # each block from zero
    carry = _scan(local[:, :, :, -1], a_pows[..., -1])                                # state after each block
    # chunk i of block m (m >= 1) gains a**(i+1) times the state after block m-1
    local[:, :, 1:] += carry[:, :, :-1].unsqueeze(3) * a_pows.transpose(1, 2).unsqueeze(1)
    return local.view(B, D, nb * G, N)[:, :, :nc]


def _scan(z, a, dim=2, reverse=False):
    """Sequential s[i] = a s[i-1] + z[i] along ``dim`` (from the end, s[i] = a s[i+1] + z[i], with
    ``reverse``); a broadcasts against one slice."""
    out = torch.empty_like(z)
    n = z.shape[dim]
    order = range(n - 1, -1, -1) if reverse else range(n)
    prev = None
    for i in order:
        if prev is None:
            prev = out.select(dim, i).copy_(z.select(dim, i))
        else:
            prev = torch.addcmul(z.select(dim, i), a, prev, out=out.select(dim, i))
    return out


def chunked_conv_fwd(x, p, log_q, gamma, hx, chunk, cd):
    """y r(B D L) in ``cd`` = causal conv of x with k plus the bias of hx (the cema output without
    its omega x term), computed chunk by chunk."""
    ch = Chunked(x, p, log_q, gamma, chunk, cd)
    B, D, nc, C = ch.xs.shape
    ys = ch.xs.new_empty(B, D, nc, C)
    _batched(torch.bmm, ch.xs, toeplitz_t(ch.kc), out=ys)        # within chunks
    if ch.has_states(hx):
        S = _as_real(ch.states(hx, ch.w_in()))                                         # [B, D, nc, 2N]
        w_out = ch.w_out()
        for b in range(B):
            ys[b].baddbmm_(S[b], w_out)                                                # from the states
    return ys.view(B, D, nc * C)[..., :ch.L]


def chunked_conv_bwd(dy, x, p, log_q, gamma, hx, needs, chunk, cd):
    """Gradients of :func:`chunked_conv_fwd`: (dx r(B D L) in cd, dp, dlog_q, dgamma, dhx), None
    where ``needs`` (x, p, log_q, gamma, hx) says so."""
    need_x, need_p, need_lq, need_gamma, need_hx = needs
    ch = Chunked(x, p, log_q, gamma, chunk, cd)
    B, D, nc, C = ch.xs.shape
    N, gamma = ch.N, ch.gamma
    g = dy.to(cd)
    if nc * C != ch.L:
        g = F.pad(g, (0, nc * C - ch.L))
    g = g.contiguous().view(B, D, nc, C)
    need_coef = need_p or need_lq or need_gamma
    dx = None
    if need_x:
        dx = ch.xs.new_empty(B, D, nc, C)
        _batched(torch.bmm, g, toeplitz(ch.kc), out=dx)
    dP = torch.zeros_like(ch.P) if need_coef else None                                # [D, N, C+1]
    dp = dgamma = dhx = None
    if need_coef:
        # within chunks: dT[d] = sum_b g[b, d]^T xs[b, d], then dk[j] = its j-th diagonal's sum
        dkc = diagonal_sums(_batch_sum(g.transpose(2, 3), ch.xs))                      # [D, C]
        dA = (dkc.unsqueeze(1) * ch.P[..., :C].conj()).sum(-1)                          # d(p gamma) [D, N]
        dP[..., :C] += (ch.p * gamma).conj().unsqueeze(-1) * dkc.unsqueeze(1)
        dp = (dA * gamma.conj()).real
        dgamma = dA * ch.p
    if ch.has_states(hx) and (need_x or need_coef or need_hx):
        w_in, w_out = ch.w_in(), ch.w_out()
        S = ch.states(hx, w_in)                                                         # [B, D, nc, N]
        dS = _batched(torch.bmm, g, w_out.transpose(1, 2), out=g.new_empty(B, D, nc, 2 * N))
        dS = torch.view_as_complex(dS.view(B, D, nc, N, 2))
        G = chunk_scan(dS, ch.log_q, C, reverse=True)    # G[c] = dS[c] + conj(q**C) G[c+1]: gradient of state c
        if need_hx and hx is not None:
            dhx = G[:, :, 0]
        if nc > 1:
            # U[c] enters chunk c+1; the last chunk's U reaches nothing (its gradient is 0)
            dU = G.roll(-1, 2)
            dU[:, :, -1] = 0
            dU = _as_real(dU)                                                            # [B, D, nc, 2N]
            if need_x:
                for b in range(B):
                    dx[b].baddbmm_(dU[b], w_in.transpose(1, 2))
        if need_coef:
            # from the states: w_out[s] = gamma q**(s+1)
            dWo = _batch_sum(_as_real(S).transpose(2, 3), g).view(D, N, 2, C)
            dWo = torch.complex(dWo[:, :, 0], -dWo[:, :, 1])                            # [D, N, C]
            dgamma = dgamma + (dWo * ch.P[..., 1:].conj()).sum(-1)
            dP[..., 1:] += gamma.conj().unsqueeze(-1) * dWo
            if nc > 1:
                # into the states: w_in[s'] = p q**(C-1-s'), and the step S[c+1] = q**C S[c] + U[c]
                dWi = _batch_sum(ch.xs.transpose(2, 3), dU).view(D, C, N, 2)
                dWi = torch.view_as_complex(dWi).transpose(1, 2)                         # [D, N, C]
                dp = dp + (dWi * ch.P[..., :C].flip(-1).conj()).sum(-1).real
                dP[..., :C] += (ch.p.unsqueeze(-1) * dWi).flip(-1)
                dP[..., C] += (G[:, :, 1:] * S[:, :, :-1].conj()).sum((0, 2))
    dlq = None
    if need_lq:
        j = torch.arange(C + 1, device=x.device, dtype=ch.P.real.dtype)
        dlq = (dP * ch.P.conj() * j).sum(-1)
    if dx is not None:
        dx = dx.view(B, D, nc * C)[..., :ch.L]
    return dx, dp, dlq, dgamma, dhx


#: Up to this many steps the chunked form's forward runs the recurrence itself: decoding feeds one
#: token per call, where the chunk matmuls, power rows and ema_hidden's tables cost far more in
#: per-op overhead than the step's few hundred flops; the backward is the chunked one.
RECURRENCE_MAX_LEN = 4


def recurrence_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted, cd):
    """The cema forward for L <= RECURRENCE_MAX_LEN, step by step:

        V_t = q V_(t-1) + x_t,   W_t = q (W_(t-1) + V_(t-1)),   h_t = p V_t + q**(t+1) hx,
        y_t = Re sum_n gamma_n h_t,n + omega x_t

    -> (y r(B D L) in cd, h c(B D N) or None, saved = (k r(D L), V, W)) with V, W the sums
    ema_hidden saves (V = sum_j q**(L-1-j) x_j, W its exponent-weighted twin; W None unless
    ``weighted``), all powers from :func:`exact_powers`."""
    B, D, L = x.shape
    ccd = torch.complex128 if cd == torch.float64 else torch.complex64
    P = exact_powers(log_q.to(ccd), torch.arange(L + 1, device=x.device))               # [D, N, L+1]
    q = P[..., 1]
    pc, gamma_c, xc = p.to(cd), gamma.to(ccd), x.to(cd)
    k = (p * gamma).unsqueeze(-1).mul(P[..., :L].to(log_q.dtype)).real.sum(1)           # [D, L] in p's dtype
    y = torch.empty(B, D, L, dtype=cd, device=x.device)
    V = torch.zeros(B, D, p.shape[1], dtype=ccd, device=x.device)
    W = torch.zeros_like(V) if weighted else None
    for t in range(L):
        xt = xc[..., t].unsqueeze(-1)                                                     # [B, D, 1]
        if weighted:
            W = q * (W + V)
        V = q * V + xt
        h = pc * V
        if hx is not None:
            h = h + P[..., t + 1] * hx
        y[..., t] = (gamma_c * h).real.sum(-1) + omega.to(cd) * xc[..., t]
    dt = log_q.dtype
    return y, (h.to(dt) if return_state else None), (k, V.to(dt), None if W is None else W.to(dt))
