"""Reference CEMA (complex exponential moving average; docs/math.md, cema), float64 NumPy.

Runs the defining recurrence directly, per time step:

    h_t = p x_t + q h_{t-1},   h_{-1} = hx (0 if None),   q = exp(log_q)
    y_t = Re sum_n gamma_n h_t,n + omega x_t

which the library computes as fftconv(x, k) + b + omega x with k, b from the CEMA kernel
(``reference.cema_kernel``); tests check the two agree. The backward is the adjoint recurrence:
a_t = grad of h_t = dy_t conj(gamma) + conj(q) a_{t+1} (a_{L-1} also receives dh), giving
dx_t = sum_n p Re a_t + omega dy_t, dp = sum x_t Re a_t, dlog_q = sum a_t conj(q h_{t-1}),
dgamma = sum dy_t conj(h_t), domega = sum dy_t x_t, dhx = conj(q) a_0 (PyTorch's complex convention).
"""
import numpy as np

from .terms import modulus, modulus_log


def _states(x, p, q, hx):
    B, D, L = x.shape
    h = np.zeros((B, D, p.shape[1]), dtype=np.complex128) if hx is None else np.array(hx, dtype=np.complex128)
    hs = [h]  # hs[t + 1] = h_t
    for t in range(L):
        h = p * x[:, :, t, None] + q * h
        hs.append(h)
    return hs


def cema(x, p, log_q, gamma, omega, hx=None, return_state=False):
    """x r(B D L), p r(D N), log_q c(D N), gamma c(D N), omega r(D), hx c(B D N)/None
    -> (y r(B D L), h c(B D N) if return_state else None)."""
    x = np.asarray(x, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    q = np.exp(np.asarray(log_q, dtype=np.complex128))
    gamma = np.asarray(gamma, dtype=np.complex128)
    omega = np.asarray(omega, dtype=np.float64)
    hs = _states(x, p, q, hx)
    y = np.zeros_like(x)
    for t in range(x.shape[-1]):
        y[:, :, t] = np.sum((gamma * hs[t + 1]).real, axis=-1) + omega * x[:, :, t]
    return y, (hs[-1] if return_state else None)


def cema_bwd(dy, dh, x, p, log_q, gamma, omega, hx=None, return_state=False):
    """Gradients of sum(dy*y) + Re sum(conj(dh) h): (dx, dp, dlog_q, dgamma, domega, dhx or None).

    dy r(B D L); dh c(B D N) or None (ignored unless return_state).
    """
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    q = np.exp(np.asarray(log_q, dtype=np.complex128))
    gamma = np.asarray(gamma, dtype=np.complex128)
    omega = np.asarray(omega, dtype=np.float64)
    B, D, L = x.shape
    N = p.shape[1]
    hs = _states(x, p, q, hx)
    a = np.zeros((B, D, N), dtype=np.complex128)
    if return_state and dh is not None:
        a = a + np.asarray(dh, dtype=np.complex128)
    dx = np.zeros_like(x)
    dp = np.zeros((D, N))
    dlog_q = np.zeros((D, N), dtype=np.complex128)
    dgamma = np.zeros((D, N), dtype=np.complex128)
    domega = np.zeros(D)
    for t in range(L - 1, -1, -1):
        g = dy[:, :, t, None]
        a = a + g * np.conj(gamma)
        dgamma += np.sum(g * np.conj(hs[t + 1]), axis=0)
        dx[:, :, t] = np.sum(p * a.real, axis=-1) + omega * dy[:, :, t]
        dp += np.sum(x[:, :, t, None] * a.real, axis=0)
        dlog_q += np.sum(a * np.conj(q * hs[t]), axis=0)
        domega += np.sum(dy[:, :, t] * x[:, :, t], axis=0)
        a = a * np.conj(q)
    return dx, dp, dlog_q, dgamma, domega, (None if hx is None else a)


def cema_terms(x, p, log_q, gamma, omega, hx=None, return_state=False):
    """The magnitude of the terms of (y, h) (reference.terms): the recurrence on absolute values."""
    return cema(modulus(x), modulus(p), modulus_log(log_q), modulus(gamma), modulus(omega), modulus(hx),
                return_state)


def cema_bwd_terms(dy, dh, x, p, log_q, gamma, omega, hx=None, return_state=False):
    """The magnitude of the terms of every gradient of :func:`cema_bwd`."""
    return cema_bwd(modulus(dy), modulus(dh), modulus(x), modulus(p), modulus_log(log_q), modulus(gamma),
                    modulus(omega), modulus(hx), return_state)
