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


class Magnitude:
    """A value with the magnitude of its terms, propagated to first order through a nonlinear
    formula: for every operation, the magnitudes of its operands times the size of its partial
    derivatives (a + b: Ma + Mb; a b: |b| Ma + |a| Mb; a / b: Ma / |b| + |a| Mb / b^2;
    sqrt(a): Ma / (2 sqrt(a))). An input's magnitude is its absolute value, a plain array is an
    exact constant. Relative perturbations of size u of every input and intermediate result then
    move the output by at most about u times its magnitude: the scale a formula's rounding takes
    (TimestepNorm's x - mean cancels: the mean's own terms, not the small difference, set it)."""

    __array_priority__ = 1000   # numpy defers to these operators

    def __init__(self, value, mag=None):
        self.value = np.asarray(value, dtype=np.float64)
        self.mag = np.abs(self.value) if mag is None else np.asarray(mag, dtype=np.float64)

    @staticmethod
    def _parts(other):
        if isinstance(other, Magnitude):
            return other.value, other.mag
        return np.asarray(other, dtype=np.float64), 0.0

    def __add__(self, other):
        v, m = self._parts(other)
        return Magnitude(self.value + v, self.mag + m)

    __radd__ = __add__

    def __sub__(self, other):
        v, m = self._parts(other)
        return Magnitude(self.value - v, self.mag + m)

    def __rsub__(self, other):
        v, m = self._parts(other)
        return Magnitude(v - self.value, self.mag + m)

    def __neg__(self):
        return Magnitude(-self.value, self.mag)

    def __mul__(self, other):
        v, m = self._parts(other)
        return Magnitude(self.value * v, np.abs(v) * self.mag + np.abs(self.value) * m)

    __rmul__ = __mul__

    def __truediv__(self, other):
        v, m = self._parts(other)
        return Magnitude(self.value / v, self.mag / np.abs(v) + np.abs(self.value) * m / v ** 2)

    def __rtruediv__(self, other):
        v, m = self._parts(other)
        return Magnitude(v / self.value, m / np.abs(self.value) + np.abs(v) * self.mag / self.value ** 2)

    def __pow__(self, k: int):
        return Magnitude(self.value ** k, abs(k) * np.abs(self.value) ** (k - 1) * self.mag)

    def __getitem__(self, index):
        return Magnitude(self.value[index], np.broadcast_to(self.mag, self.value.shape)[index])

    def sqrt(self):
        root = np.sqrt(self.value)
        return Magnitude(root, self.mag / (2 * root))

    def sum(self, axis):
        return Magnitude(self.value.sum(axis=axis), np.broadcast_to(self.mag, self.value.shape).sum(axis=axis))

    def mean(self, axis):
        n = self.value.shape[axis]
        return Magnitude(self.value.mean(axis=axis), np.broadcast_to(self.mag, self.value.shape).sum(axis=axis) / n)

    def reshape(self, *shape):
        return Magnitude(self.value.reshape(*shape), np.broadcast_to(self.mag, self.value.shape).reshape(*shape))

    @staticmethod
    def where(cond, a, b):
        (va, ma), (vb, mb) = Magnitude._parts(a), Magnitude._parts(b)
        return Magnitude(np.where(cond, va, vb), np.where(cond, ma, mb))
