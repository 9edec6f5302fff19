"""Reference rotary / xPos (see ops/rotary for the definition)."""
import numpy as np


def _factors(positions, dim, base, xpos_scale_base, xpos_downscale):
    pos = np.asarray(positions, dtype=np.float64)
    if pos.ndim == 1:
        pos = pos[None]
    j = np.arange(dim // 2, dtype=np.float64)
    angle = pos[..., None] * base ** (-2.0 * j / dim)  # [P, L, d/2]
    f = np.exp(1j * angle)
    if xpos_scale_base is not None:
        zeta = (2.0 * j + 0.4 * dim) / (1.4 * dim)
        sign = -1.0 if xpos_downscale else 1.0
        f = f * zeta ** (sign * pos[..., None] / xpos_scale_base)
    return f[:, :, None, :]  # [P, L, 1, d/2]


def rotary(x, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False):
    """x: (B, L, H, d) real -> rotated x, float64."""
    x = np.asarray(x, dtype=np.float64)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    out = z * _factors(positions, x.shape[-1], base, xpos_scale_base, xpos_downscale)
    y = np.empty_like(x)
    y[..., 0::2], y[..., 1::2] = out.real, out.imag
    return y


def rotary_bwd(dy, positions, base=10000.0, xpos_scale_base=None, xpos_downscale=False):
    """Gradient w.r.t. x: per pair the transpose of the real 2x2 map, i.e. multiply by conj(f)."""
    dy = np.asarray(dy, dtype=np.float64)
    g = dy[..., 0::2] + 1j * dy[..., 1::2]
    out = g * np.conj(_factors(positions, dy.shape[-1], base, xpos_scale_base, xpos_downscale))
    dx = np.empty_like(dy)
    dx[..., 0::2], dx[..., 1::2] = out.real, out.imag
    return dx
