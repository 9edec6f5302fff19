"""Reference causal long convolution (docs/math.md, fftconv), forward and backward, float64 NumPy.

    y[b, d, t] = sum_{s <= t} k[d, t-s] x[b, d, s]        t < L

a linear (not circular) convolution truncated to L. Its adjoints are cross-correlations:
dx[s] = sum_{t >= s} dy[t] k[t-s] and dk[j] = sum_b sum_{t >= j} dy[b, t] x[b, t-j].
"""
import numpy as np

from .terms import modulus


def fftconv(x, k):
    """x r(B D L), k r(D L) -> y r(B D L)."""
    x = np.asarray(x, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    L = x.shape[-1]
    y = np.zeros_like(x)
    for t in range(L):
        # k[t], k[t-1], ..., k[0] against x[0..t]
        y[:, :, t] = np.sum(k[None, :, t::-1] * x[:, :, : t + 1], axis=-1)
    return y


def fftconv_bwd(dy, x, k):
    """Gradients of sum(dy*y): (dx r(B D L), dk r(D L))."""
    dy = np.asarray(dy, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    L = x.shape[-1]
    dx = np.zeros_like(x)
    dk = np.zeros_like(k)
    for s in range(L):
        dx[:, :, s] = np.sum(dy[:, :, s:] * k[None, :, : L - s], axis=-1)
    for j in range(L):
        dk[:, j] = np.sum(dy[:, :, j:] * x[:, :, : L - j], axis=(0, 2))
    return dx, dk


def fftconv_terms(x, k):
    """The magnitude of the terms of y (reference.terms): the convolution of |x| and |k|."""
    return fftconv(modulus(x), modulus(k))


def fftconv_bwd_terms(dy, x, k):
    """The magnitude of the terms of (dx, dk): the correlations of |dy| with |k| and |x|."""
    return fftconv_bwd(modulus(dy), modulus(x), modulus(k))
