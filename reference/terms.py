"""The magnitude of the terms of a computation: the scale its rounding errors take.

An output that is a sum of products of the inputs (every CEMA stage, the convolution, their
gradients) is computed by any algorithm from the same terms, and rounding perturbs each term by a
few units in the last place, so the error is bounded by a multiple of u times the sum of the
terms' absolute values, not of the output's own value, which cancels when the terms have mixed
signs (domega = sum dy x over a single channel, say). For such a multilinear computation that sum
is the same computation evaluated on the inputs' absolute values, which is how each reference's
``*_terms`` function obtains it: with ``modulus`` of every input and ``modulus_log`` of a
logarithm (|exp(z)| = exp(Re z)). Nonlinear ops (TimestepNorm) derive their magnitudes by hand,
next to their reference.
"""
import numpy as np


def modulus(a):
    """|a| elementwise, in float64 (None stays None)."""
    return None if a is None else np.abs(np.asarray(a)).astype(np.float64)


def modulus_log(log_q):
    """log |exp(log_q)| = Re log_q: the logarithm of the modulus that ``exp(log_q)`` has."""
    return None if log_q is None else np.real(np.asarray(log_q, dtype=np.complex128)).astype(np.float64)
