"""PyTorch backend of rotary: one fused elementwise expression over adjacent pairs."""
from __future__ import annotations

import torch

from .._checks import acc_dtype

DEFAULT_CONFIG: dict = {}


def not_supported_reasons(x) -> list[str]:
    return []  # every device and dtype torch supports


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    # [B, L, H, d/2, 2] view; compute in fp32 (fp64 for fp64) and round once on return.
    xp = x.to(acc_dtype(x.dtype)).unflatten(-1, (-1, 2))
    x0, x1 = xp[..., 0], xp[..., 1]
    s = sin * sign
    out = torch.stack((x0 * cos - x1 * s, x0 * s + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rotary_fwd(x, cos, sin):
    return _rotate(x, cos, sin, 1.0)


def rotary_bwd(dy, cos, sin):
    # The map is x -> R x per pair with R = scale * rotation; its adjoint is scale * rotation^T.
    return _rotate(dy, cos, sin, -1.0)
