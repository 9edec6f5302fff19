"""PyTorch backend of rotary: one fused elementwise expression over adjacent pairs."""
from __future__ import annotations

import torch

from .._checks import acc_dtype

DEFAULT_CONFIG: dict = {}


def not_supported_reasons(x) -> list[str]:
    return []  # every device and dtype torch supports


def _complex_table(cos: torch.Tensor, sin: torch.Tensor, conjugate: bool, heads: int) -> torch.Tensor:
    """cos + i sin, or its conjugate, [P, L, 1, d/2] or [P, L, heads, d/2].

    When cos and sin are the real and imaginary views of the first half of a (2, ...) complex
    tensor whose second half is its conjugate (the tables rotary() caches, marked with the views'
    layout and the version they were filled at), the half itself: the same memory, so nothing to
    build; for several heads, that half repeated over the heads, built once per head count and
    kept beside it. A multiply broadcasting the table over the heads runs an inner loop of d/2
    elements (~4x slower per element on the CPU than one over a contiguous [L, heads, d/2] table,
    whose dimensions coalesce with x's). Any write through cos or sin since bumps the shared
    version: then the conjugate half and the repeated tables are not trusted and are built again."""
    base = cos._base
    mark = None if base is None or base is not sin._base else base.__dict__.get("_rotary_tables")
    if (mark is not None and cos.storage_offset() == 0 and sin.storage_offset() == 1
            and cos.shape == mark[0] and cos.stride() == mark[1] and sin.stride() == mark[1]):
        if mark[2] != base._version:
            return torch.conj_physical(base[0]) if conjugate else base[0]
        half = base[1] if conjugate else base[0]
        if heads == 1:
            return half
        per_head = base.__dict__.setdefault("_rotary_per_head", {})
        table = per_head.get((heads, conjugate))
        if table is None:
            table = per_head[(heads, conjugate)] = half.expand(*half.shape[:-2], heads, half.shape[-1]).contiguous()
        return table
    rot = torch.complex(cos, sin)
    # cos - i sin; a lazy conj() view would be copied inside the multiply, slower
    return torch.conj_physical(rot) if conjugate else rot


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    # One complex multiply per pair: x[2j] + i x[2j+1] times (cos + i sign sin), in fp32 (fp64 for
    # fp64), rounded once on return. Real-arithmetic formulations on strided (..., 2) views ran
    # 7x slower on CPU (a pass and a temporary per product, and no vectorised inner loop).
    xa = x.to(acc_dtype(x.dtype)).contiguous()
    if xa.storage_offset() % 2:  # view_as_complex needs pairs aligned to a complex element
        xa = xa.clone()
    rot = _complex_table(cos, sin, sign < 0, xa.shape[-2])  # [P, L, 1 or H, d/2]
    out = torch.view_as_real(torch.view_as_complex(xa.view(*xa.shape[:-1], -1, 2)) * rot)
    return out.flatten(-2).to(x.dtype)


def rotary_fwd(x, cos, sin):
    return _rotate(x, cos, sin, 1.0)


def rotary_bwd(dy, cos, sin):
    # The map is x -> R x per pair with R = scale * rotation; its adjoint is scale * rotation^T.
    return _rotate(dy, cos, sin, -1.0)
