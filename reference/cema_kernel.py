"""Reference CEMA kernel and bias (docs/math.md, CEMA kernel), forward and backward, float64 NumPy.

    k[d, j]    = Re sum_n p[d,n] gamma[d,n] q[d,n]**j                j < L
    b[b, d, t] = Re sum_n gamma[d,n] hx[b,d,n] q[d,n]**(t+1)         t < L

with q = exp(log_q); every power is its own ``np.exp(e * log_q)``. b is the free response of the
EMA recurrence h_t = p x_t + q h_{t-1} to the initial state h_{-1} = hx, and k its impulse
response, so the CEMA output is y = causal_conv(x, k) + b (+ omega x).

Gradients are taken with respect to log_q (not q): d q**e / d log_q = e q**e. Complex gradients
follow PyTorch's convention: if dL = Re(c dz) then grad_z = conj(c).
"""
import numpy as np

from .terms import modulus, modulus_log


def _c128(a):
    return np.asarray(a, dtype=np.complex128)


def cema_kernel(p, log_q, gamma, length, hx=None):
    """p r(D N), log_q c(D N), gamma c(D N), length L, hx c(B D N) or None -> (k r(D L), b r(B D L) or None)."""
    p = np.asarray(p, dtype=np.float64)
    log_q, gamma = _c128(log_q), _c128(gamma)
    D, N = p.shape
    j = np.arange(length, dtype=np.float64)
    k = np.zeros((D, length))
    for d in range(D):
        for n in range(N):
            k[d] += (p[d, n] * gamma[d, n] * np.exp(j * log_q[d, n])).real
    if hx is None:
        return k, None
    hx = _c128(hx)
    b = np.zeros((hx.shape[0], D, length))
    for bb in range(hx.shape[0]):
        for d in range(D):
            for n in range(N):
                b[bb, d] += (gamma[d, n] * hx[bb, d, n] * np.exp((j + 1) * log_q[d, n])).real
    return k, b


def cema_kernel_bwd(dk, db, p, log_q, gamma, length, hx=None):
    """Gradients of sum(dk*k) + sum(db*b): (dp r(D N), dlog_q c(D N), dgamma c(D N), dhx c(B D N) or None).

    dk r(D L) or None, db r(B D L) or None. With S = sum_j dk_j q**j and S1 = sum_j dk_j j q**j:
    dL = Re sum_n [S gamma dp + S p dgamma + S1 p gamma dlog_q]; the bias adds the same with
    T = sum_t db_t q**(t+1), T1 = sum_t db_t (t+1) q**(t+1) and coefficient gamma*hx.
    """
    p = np.asarray(p, dtype=np.float64)
    log_q, gamma = _c128(log_q), _c128(gamma)
    D, N = p.shape
    j = np.arange(length, dtype=np.float64)
    dp = np.zeros((D, N))
    dlog_q = np.zeros((D, N), dtype=np.complex128)
    dgamma = np.zeros((D, N), dtype=np.complex128)
    dhx = None if hx is None else np.zeros(np.shape(hx), dtype=np.complex128)
    for d in range(D):
        for n in range(N):
            if dk is not None:
                qj = np.exp(j * log_q[d, n])
                S = np.sum(dk[d] * qj)
                S1 = np.sum(dk[d] * j * qj)
                dp[d, n] += (S * gamma[d, n]).real
                dgamma[d, n] += np.conj(S * p[d, n])
                dlog_q[d, n] += np.conj(S1 * p[d, n] * gamma[d, n])
            if db is not None and hx is not None:
                qt = np.exp((j + 1) * log_q[d, n])
                for bb in range(dhx.shape[0]):
                    T = np.sum(db[bb, d] * qt)
                    T1 = np.sum(db[bb, d] * (j + 1) * qt)
                    h = complex(hx[bb, d, n])
                    dgamma[d, n] += np.conj(T * h)
                    dlog_q[d, n] += np.conj(T1 * gamma[d, n] * h)
                    dhx[bb, d, n] = np.conj(T * gamma[d, n])
    return dp, dlog_q, dgamma, dhx


def cema_kernel_terms(p, log_q, gamma, length, hx=None):
    """The magnitude of the terms of (k, b) (reference.terms): sum_n |p gamma| |q|**j and the like."""
    return cema_kernel(modulus(p), modulus_log(log_q), modulus(gamma), length, modulus(hx))


def cema_kernel_bwd_terms(dk, db, p, log_q, gamma, length, hx=None):
    """The magnitude of the terms of (dp, dlog_q, dgamma, dhx)."""
    return cema_kernel_bwd(modulus(dk), modulus(db), modulus(p), modulus_log(log_q), modulus(gamma), length,
                           modulus(hx))
