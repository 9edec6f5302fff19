"""Rotary position embedding (RoPE) and its length-extrapolatable xPos variant (LeX Transformer).

Pairs are ADJACENT features (x[..., 2j], x[..., 2j+1]) read as the complex number
x[2j] + i x[2j+1], the layout of upstream Megalodon (docs/math.md, rotary) and of torchscale's xPos.
For position t and pair j, with theta_j = base**(-2j/d)::

    out_j = zeta_j**(s * t / xpos_scale_base) * exp(i * t * theta_j) * x_j

where zeta_j = (2j + 0.4 d) / (1.4 d), s = +1 for queries and -1 for keys
(``xpos_downscale=True``), and the zeta factor is 1 when ``xpos_scale_base`` is None (plain
RoPE). With xPos, q_t . k_u then depends on t - u only, decaying with the distance.

Angles and scales are computed in float64 from the integer positions, then rounded once to the
compute dtype, so large positions (a long KV cache) keep fp32-accurate angles.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import INT_DTYPES, REAL_DTYPES, acc_dtype, check_float, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import custom_op, empty_like, plain_eager, plain_tensor

__all__ = ["rotary", "rotation_tables"]

BACKENDS = OpBackends("rotary", {
    "cuda": "megalodon_kernels.ops.rotary.cuda_impl",
    "triton": "megalodon_kernels.ops.rotary.triton_impl",
    "torch": "megalodon_kernels.ops.rotary.torch_impl",
})

autotune.register(
    "rotary",
    key=lambda x: {"H": x.shape[2], "d": x.shape[3], "L": autotune.pow2_bucket(x.shape[1])},
    space={"cuda": {}, "torch": {},
           "triton": {"block_rows": [16, 4], "block_pairs": [64, 128], "num_warps": [4]}},
)


def rotation_tables(positions: torch.Tensor, dim: int, base: float, xpos_scale_base, xpos_downscale: bool,
                    dtype: torch.dtype):
    """(cos, sin) of shape (P, L, 1, dim/2) with the xPos scale folded in; P = 1 or B."""
    pos = positions.to(torch.float64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    j = torch.arange(0, dim // 2, dtype=torch.float64, device=positions.device)
    inv_freq = base ** (-2.0 * j / dim)
    angle = pos[..., None] * inv_freq  # [P, L, d/2], exact-ish in float64
    cos, sin = torch.cos(angle), torch.sin(angle)
    if xpos_scale_base is not None:
        zeta = (2.0 * j + 0.4 * dim) / (1.4 * dim)
        sign = -1.0 if xpos_downscale else 1.0
        scale = torch.exp(torch.log(zeta) * (sign * pos[..., None] / xpos_scale_base))
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


#: Tables of recent calls, for the rotary() calls that repeat positions (q and k of every layer,
#: every step of a fixed length): (positions' dtype and shape, dim, base, xPos arguments, table
#: dtype) -> (a copy of the positions, cos, sin). An entry is used only if its positions EQUAL
#: the call's (a read of L integers), so a hit returns exactly what rotation_tables would.
_TABLES: dict = {}
_MAX_TABLES = 16


def _tables(positions, dim, base, xpos_scale_base, xpos_downscale, dtype):
    """rotation_tables, answered from _TABLES when the same positions were seen (CPU, plain
    eager only: comparing positions on a GPU would wait for it, and a traced or inference-mode
    call must build its own tensors). The cached tables are never handed out by the public
    rotation_tables, so nobody outside the op holds them to modify."""
    if (not positions.is_cpu or not plain_eager(profiler_ok=True) or not plain_tensor(positions)
            or torch.is_inference_mode_enabled()):
        return rotation_tables(positions, dim, base, xpos_scale_base, xpos_downscale, dtype)
    key = (positions.dtype, positions.shape, dim, base, xpos_scale_base, xpos_downscale, dtype)
    hit = _TABLES.get(key)
    if hit is not None and torch.equal(hit[0], positions):
        return hit[1], hit[2]
    cos, sin = rotation_tables(positions, dim, base, xpos_scale_base, xpos_downscale, dtype)
    # Kept as the real and imaginary views of the first half of one complex tensor whose second
    # half is the conjugate: the same values, and the torch backend multiplies by a half as it is
    # (forward: the table, backward: its conjugate) instead of assembling it on every call.
    table = torch.empty((2, *cos.shape), dtype=torch.complex128 if dtype == torch.float64 else torch.complex64)
    table[0] = torch.complex(cos, sin)
    torch.conj_physical(table[0], out=table[1])
    cos, sin = table[0].real, table[0].imag
    # what the torch backend checks: the views' layout, and the version before trusting table[1]
    table._rotary_tables = (cos.shape, cos.stride(), table._version)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES), None), None)  # the oldest (another thread may race)
    _TABLES[key] = (positions.clone(), cos, sin)
    return cos, sin


def _like(x, *_):
    return empty_like(x)


@custom_op("rotary", _like)
def rotary_op(x: Tensor, cos: Tensor, sin: Tensor, backend: str) -> Tensor:
    """-> x rotated by the tables of :func:`rotation_tables`."""
    impl = BACKENDS.select(backend, {"x": x}, device=x.device, dtype=x.dtype)
    return impl.module.rotary_fwd(x, cos, sin, **impl.config)


@custom_op("rotary_bwd", _like)
def rotary_bwd_op(dy: Tensor, cos: Tensor, sin: Tensor, backend: str) -> Tensor:
    """-> dx: the inverse rotation of dy (times the same xPos scale)."""
    impl = BACKENDS.select(backend, {"x": dy}, device=dy.device, dtype=dy.dtype)
    return impl.module.rotary_bwd(dy, cos, sin, **impl.config).to(dy.dtype)


def _setup(ctx, inputs, output):
    x, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend = backend


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rotary_bwd_op(dy, cos, sin, ctx.backend), None, None, None


rotary_op.register_autograd(_backward, setup_context=_setup)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, xpos_scale_base=None, *,
           xpos_downscale: bool = False, backend: str = "auto") -> torch.Tensor:
    """Rotate adjacent feature pairs of ``x`` by their positions (RoPE), optionally with xPos.

    Args:
        x: r(B L H d), d even; float16/bfloat16/float32/float64.
        positions: integer tensor (L,) shared by the batch, or (B, L) per sequence.
        base: RoPE base (upstream ``rope_base``, default 10000).
        xpos_scale_base: None for RoPE; a positive number (LeX uses 512) for xPos.
        xpos_downscale: xPos only; False for queries, True for keys.
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        r(B L H d) in x's dtype.

    Example::

        q = rotary(q, torch.arange(L), xpos_scale_base=512)
        k = rotary(k, torch.arange(L), xpos_scale_base=512, xpos_downscale=True)
    """
    check_tensor("x", x, (None, None, None, None), REAL_DTYPES, dims="(B, L, H, d)")
    B, L, H, d = x.shape
    if d % 2:
        raise ValueError(f"x must have an even last dimension d (pairs of features), got d={d}")
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be an integer torch.Tensor of shape (L,) or (B, L), got {type(positions).__name__}")
    if positions.dim() == 1:
        check_tensor("positions", positions, (L,), INT_DTYPES, device=x.device, dims="(L,)")
    else:
        check_tensor("positions", positions, (B, L), INT_DTYPES, device=x.device, dims="(B, L)")
    base = check_float("base", base, low=0.0, low_open=True)
    if xpos_scale_base is not None:
        xpos_scale_base = check_float("xpos_scale_base", xpos_scale_base, low=0.0, low_open=True)
    if not isinstance(xpos_downscale, bool):
        raise TypeError(f"xpos_downscale must be a bool, got {type(xpos_downscale).__name__}")
    check_backend(backend)
    cos, sin = _tables(positions, d, base, xpos_scale_base, xpos_downscale, acc_dtype(x.dtype))
    return rotary_op(x, cos, sin, backend)
