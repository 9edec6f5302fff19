"""Reference CEMA last hidden state (docs/math.md, ema_hidden), forward and backward, float64 NumPy.

    h[b, d, n] = p[d,n] sum_j q[d,n]**(L-1-j) x[b,d,j] + q[d,n]**L hx[b,d,n]

i.e. the state h_{L-1} of the recurrence h_t = p x_t + q h_{t-1}, h_{-1} = hx (0 if None): the
state that continues the EMA in the next segment. The forward runs that recurrence step by step
(the definition); the backward is the closed form, so the two are checked against each other by
the finite-difference test. Gradients are w.r.t. log_q, PyTorch's complex convention.
"""
import numpy as np

from .terms import modulus, modulus_log


def ema_hidden(x, p, log_q, hx=None):
    """x r(B D L), p r(D N), log_q c(D N), hx c(B D N) or None -> h c(B D N)."""
    x = np.asarray(x, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    q = np.exp(np.asarray(log_q, dtype=np.complex128))
    B, D, L = x.shape
    h = np.zeros((B, D, p.shape[1]), dtype=np.complex128) if hx is None else np.array(hx, dtype=np.complex128)
    for t in range(L):
        h = p * x[:, :, t, None] + q * h
    return h


def ema_hidden_bwd(dh, x, p, log_q, hx=None):
    """Gradients of Re sum conj(dh) h: (dx r(B D L), dp r(D N), dlog_q c(D N), dhx c(B D N) or None).

    With g = dh and e_j = L-1-j: dh/dx_j = p q**e_j, dh/dp = sum_j q**e_j x_j,
    dh/dlog_q = p sum_j e_j q**e_j x_j + L q**L hx, dh/dhx = q**L, each giving grad = conj(conj(g) * .).
    """
    x = np.asarray(x, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    log_q = np.asarray(log_q, dtype=np.complex128)
    g = np.asarray(dh, dtype=np.complex128)
    B, D, L = x.shape
    N = p.shape[1]
    e = (L - 1 - np.arange(L)).astype(np.float64)
    dx = np.zeros((B, D, L))
    dp = np.zeros((D, N))
    dlog_q = np.zeros((D, N), dtype=np.complex128)
    dhx = None if hx is None else np.zeros((B, D, N), dtype=np.complex128)
    for d in range(D):
        for n in range(N):
            qe = np.exp(e * log_q[d, n])          # q**(L-1-j), j = 0..L-1
            qL = np.exp(L * log_q[d, n])
            for b in range(B):
                gc = np.conj(g[b, d, n])
                dx[b, d] += (gc * p[d, n] * qe).real
                s = np.sum(qe * x[b, d])
                s1 = np.sum(e * qe * x[b, d])
                dp[d, n] += (gc * s).real
                dq = p[d, n] * s1
                if hx is not None:
                    dq += L * qL * hx[b, d, n]
                    dhx[b, d, n] = np.conj(gc * qL)
                dlog_q[d, n] += np.conj(gc * dq)
    return dx, dp, dlog_q, dhx


def ema_hidden_terms(x, p, log_q, hx=None):
    """The magnitude of the terms of h (reference.terms): the recurrence on |x|, |p|, |q|, |hx|."""
    return ema_hidden(modulus(x), modulus(p), modulus_log(log_q), modulus(hx))


def ema_hidden_bwd_terms(dh, x, p, log_q, hx=None):
    """The magnitude of the terms of (dx, dp, dlog_q, dhx)."""
    return ema_hidden_bwd(modulus(dh), modulus(x), modulus(p), modulus_log(log_q), modulus(hx))
