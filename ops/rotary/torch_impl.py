"""PyTorch backend of rotary: one fused elementwise expression over adjacent pairs."""
from __future__ import annotations

import torch

from .._checks import acc_dtype
from .table_cache import TABLES

CONFIG_SPACE: dict = {}  # no knob: one fused expression
DEFAULT_CONFIG: dict = {}


def not_supported_reasons(x) -> list[str]:
    return []  # every device and dtype torch supports


def _complex_table(cos: torch.Tensor, sin: torch.Tensor, conjugate: bool, heads: int) -> torch.Tensor:
    """cos + i sin, or its conjugate, [P, L, 1, d/2] or [P, L, heads, d/2]: the table cache's
    complex form when cos and sin are its tables (rotary() of repeated positions), else built."""
    entry = TABLES.entry_of(cos, sin)
    if entry is not None:
        return entry.complex_table(conjugate, heads)
    rot = torch.complex(cos, sin)
    # cos - i sin; a lazy conj() view would be copied inside the multiply, slower
    return torch.conj_physical(rot) if conjugate else rot


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    # One complex multiply per pair: x[2j] + i x[2j+1] times (cos + i sign sin), in fp32 (fp64 for
    # fp64), rounded once on return: real arithmetic on strided (..., 2) views would cost a pass and
    # a temporary per product, with no vectorised inner loop on the CPU.
    xa = x.to(acc_dtype(x.dtype)).contiguous()
    if xa.storage_offset() % 2:  # view_as_complex needs pairs aligned to a complex element
        xa = xa.clone()
    rot = _complex_table(cos, sin, sign < 0, xa.shape[-2])  # [P, L, 1 or H, d/2]
    out = torch.view_as_real(torch.view_as_complex(xa.view(*xa.shape[:-1], -1, 2)) * rot)
    return out.flatten(-2).to(x.dtype)


def forward(x, cos, sin):
    return _rotate(x, cos, sin, 1.0)


def backward(dy, cos, sin):
    # The map is x -> R x per pair with R = scale * rotation; its adjoint is scale * rotation^T.
    return _rotate(dy, cos, sin, -1.0)
