"""Reference rotary / xPos (see ops/rotary for the definition).

Angles in long double (x86: 64-bit mantissa) from the exact split t * theta = t * theta_hi +
t * theta_lo (theta_hi: 22 significant bits, so t * theta_hi is exact for |t| < 2^31) and the angle
addition formula, so the reference is exact to ~1e-19 at any position below 2^31; theta_j itself is
the float64 value base ** (-2j / d) (C library pow, as in the op). The xPos scale is measured from
the reference position r (None: the middle of each row of positions, as in the op)."""
import math

import numpy as np


def _offsets(pos, reference):
    """t - r as int64, broadcast to [P', L]."""
    if reference is None:
        if pos.shape[-1] == 0:
            return pos
        lo, hi = pos.min(axis=-1, keepdims=True), pos.max(axis=-1, keepdims=True)
        return pos - (lo + (hi - lo) // 2)
    return pos - np.asarray(reference, dtype=np.int64)


def _factors(positions, dim, base, xpos_scale_base, xpos_downscale, xpos_reference=None):
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim == 1:
        pos = pos[None]
    theta = [float(base) ** (-2.0 * j / dim) for j in range(dim // 2)]
    theta_hi = np.array([math.floor(t * 2.0 ** 22) / 2.0 ** 22 for t in theta], dtype=np.longdouble)
    theta_lo = np.array(theta, dtype=np.longdouble) - theta_hi
    t = pos.astype(np.longdouble)[..., None]
    a_hi, a_lo = t * theta_hi, t * theta_lo  # [P, L, d/2]
    cos = np.cos(a_hi) * np.cos(a_lo) - np.sin(a_hi) * np.sin(a_lo)
    sin = np.sin(a_hi) * np.cos(a_lo) + np.cos(a_hi) * np.sin(a_lo)
    f = cos.astype(np.float64) + 1j * sin.astype(np.float64)
    if xpos_scale_base is not None:
        j = np.arange(dim // 2, dtype=np.float64)
        zeta = (2.0 * j + 0.4 * dim) / (1.4 * dim)
        sign = -1.0 if xpos_downscale else 1.0
        off = _offsets(pos, xpos_reference).astype(np.float64)
        f = f * zeta ** (sign * off[..., None] / xpos_scale_base)
    return f[:, :, None, :]  # [P, L, 1, d/2]


def rotary(x, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False, xpos_reference=None):
    """x: (B, L, H, d) real -> rotated x, float64."""
    x = np.asarray(x, dtype=np.float64)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    out = z * _factors(positions, x.shape[-1], base, xpos_scale_base, xpos_downscale, xpos_reference)
    y = np.empty_like(x)
    y[..., 0::2], y[..., 1::2] = out.real, out.imag
    return y


def rotary_bwd(dy, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False, xpos_reference=None):
    """Gradient w.r.t. x: per pair the transpose of the real 2x2 map, i.e. multiply by conj(f)."""
    dy = np.asarray(dy, dtype=np.float64)
    g = dy[..., 0::2] + 1j * dy[..., 1::2]
    out = g * np.conj(_factors(positions, dy.shape[-1], base, xpos_scale_base, xpos_downscale, xpos_reference))
    dx = np.empty_like(dy)
    dx[..., 0::2], dx[..., 1::2] = out.real, out.imag
    return dx


def rotary_terms(x, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False, xpos_reference=None):
    """The magnitude of the terms of :func:`rotary` (reference/terms.py): per pair
    (|x_even| + |x_odd|) |f|, the size of both products each output sums."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    f = np.abs(_factors(positions, x.shape[-1], base, xpos_scale_base, xpos_downscale, xpos_reference))
    pair = (x[..., 0::2] + x[..., 1::2]) * f
    y = np.empty_like(x)
    y[..., 0::2], y[..., 1::2] = pair, pair
    return y


def rotary_bwd_terms(dy, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False, xpos_reference=None):
    """The magnitude of the terms of :func:`rotary_bwd` (the same map transposed)."""
    return rotary_terms(dy, positions, base, xpos_scale_base, xpos_downscale, xpos_reference)
