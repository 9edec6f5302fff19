"""Rotary position embedding (RoPE) and its length-extrapolatable xPos variant (LeX Transformer).

Pairs are ADJACENT features (x[..., 2j], x[..., 2j+1]) read as the complex number
x[2j] + i x[2j+1], the layout of upstream Megalodon (docs/math.md, rotary) and of torchscale's xPos.
For position t and pair j, with theta_j = base**(-2j/d)::

    out_j = zeta_j**(s * (t - r) / xpos_scale_base) * exp(i * t * theta_j) * x_j

where zeta_j = (2j + 0.4 d) / (1.4 d), s = +1 for queries and -1 for keys
(``xpos_downscale=True``), r is the reference position (``xpos_reference``), and the zeta factor
is 1 when ``xpos_scale_base`` is None (plain RoPE). With xPos, q_t . k_u then depends on t - u
only, decaying with the distance, whatever r is, as long as q and k share it.

Any position (docs/math.md, rotary). The angle t * theta_j is formed exactly for |t| < 2^31:
theta_j (float64) is split into a high part of 22 significant bits, whose product with t is exact
in float64, and a small remainder; cos and sin of the sum come from those of the two parts (angle
addition), then are rounded once to the table dtype. So a rotation at position 2^31 - 1 is as
accurate as one at 0 (the plain float64 product would be off by up to 2.4e-7 rad there). The xPos
scale is measured from r, never from 0: zeta_0 = 2/7, so zeta**(t / 512) alone leaves float32 at
t ~ 36k; zeta**((t - r) / b) stays within float range while |t - r| <= :func:`xpos_limit` (26770
positions for b = 512 in float32/bfloat16), and the op refuses positions further than that
from their reference (ValueError on the CPU, a device-side assert elsewhere). Accuracy
(tests/test_rotary.py): q.k at positions ending at 45k, 1e6, 1e9 or 2^31 - 1 equal the same
vectors' scores at positions from 0 to 1.5e-7 relative to the largest score in float32 (6.5e-3 in
bfloat16, its output rounding), on every backend; float64 tables are within 3e-14 at 2^31 - 1.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .._checks import INT_DTYPES, REAL_DTYPES, acc_dtype, check_float, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._host_sync import check_on_device
from .._library import as_dtype, cuda_stream_place, custom_op, empty_like, plain_eager, plain_tensor
from . import table_cache
from .table_cache import TABLES as _TABLES

__all__ = ["rotary", "rotation_tables", "xpos_limit"]

BACKENDS = OpBackends("rotary", {
    "cuda": "megalodon_kernels.ops.rotary.cuda_impl",
    "torch": "megalodon_kernels.ops.rotary.torch_impl",
    "triton": "megalodon_kernels.ops.rotary.triton_impl",
})

autotune.register(
    "rotary",
    key=lambda x: {"H": x.shape[2], "d": x.shape[3], "L": autotune.pow2_bucket(x.shape[1])},
    space=BACKENDS.config_spaces,  # each backend module's CONFIG_SPACE, read on first use
)


#: theta_j is split as theta_hi + theta_lo with theta_hi a multiple of 2^-22 below 1 (22
#: significant bits): t * theta_hi is exact in float64 for |t| < 2^31 (31 + 22 <= 53 bits)
_THETA_SPLIT = 2.0 ** 22
#: ln(1 / zeta_0) = ln(3.5): the fastest-changing xPos scale (pair 0)
_LN_INV_ZETA0 = math.log(3.5)


def xpos_limit(dtype: torch.dtype, xpos_scale_base: float) -> int:
    """The largest distance |t - r| between a position and its xPos reference that ``rotary``
    accepts for x of ``dtype``: the scales zeta_j**(+-(t - r) / xpos_scale_base) then lie within
    tiny**(+-3/4) (tiny = the dtype's smallest normal number), so x times a scale neither overflows
    nor loses precision to subnormals for |x| between tiny**(1/4) and max * tiny**(3/4). float32 and
    bfloat16: 52.3 * xpos_scale_base (26770 at 512); float16: 5.8 * xpos_scale_base (2974);
    float64: 424 * xpos_scale_base (217139)."""
    exponent = -0.75 * math.log(torch.finfo(dtype).tiny)
    return int(exponent * xpos_scale_base / _LN_INV_ZETA0)


def _xpos_offsets(pos: torch.Tensor, reference) -> torch.Tensor:
    """t - r (int64, exact) for positions pos (P, L) int64: reference None = the middle of each row
    (min + (max - min) // 2, shared by every call given the same positions), an int, or an integer
    tensor broadcastable to pos."""
    if reference is None:
        if pos.shape[-1] == 0:
            return pos
        lo, hi = pos.amin(dim=-1, keepdim=True), pos.amax(dim=-1, keepdim=True)
        return pos - (lo + torch.div(hi - lo, 2, rounding_mode="floor"))
    if isinstance(reference, torch.Tensor):
        return pos - reference.to(torch.int64)
    return pos - int(reference)


def _theta_split(dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequencies theta_j = base^(-2j/dim) split as hi + lo (hi with few mantissa bits, so that
    position * hi is exact), as float64 tensors on ``device``.

    theta_j comes from Python's (C library) pow, so the NumPy reference has the same float64 values.
    The tensors are built from host lists, a host-to-device copy. In plain eager mode on a CUDA device
    they are kept per (dim, base, device), so that a call inside CUDA-graph capture (where such a copy
    is refused) finds them made by its eager warm-up call; traced, faked or CPU calls build them anew
    (a cached tensor must never be a fake or traced one)."""
    if device.type == "cuda" and plain_eager(profiler_ok=True):
        return _theta_split_cached(dim, base, device)
    return _theta_split_tensors(dim, base, device)


def _theta_split_tensors(dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    theta = [base ** (-2.0 * j / dim) for j in range(dim // 2)]
    theta_hi = [math.floor(t * _THETA_SPLIT) / _THETA_SPLIT for t in theta]
    hi = torch.tensor(theta_hi, dtype=torch.float64, device=device)
    lo = torch.tensor([t - h for t, h in zip(theta, theta_hi)], dtype=torch.float64, device=device)
    return hi, lo


@functools.lru_cache(maxsize=64)  # a few hundred bytes each; covers any model's (dim, base) pairs
def _theta_split_cached(dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):  # normal tensors even when first made under inference_mode
        return _theta_split_tensors(dim, base, device)


def rotation_tables(positions: torch.Tensor, dim: int, base: float, xpos_scale_base, xpos_downscale: bool,
                    dtype: torch.dtype, reference=None, limit_dtype: torch.dtype | None = None):
    """(cos, sin) of shape (P, L, 1, dim/2) with the xPos scale folded in; P = 1 or B.

    ``reference``: the xPos reference position (see :func:`rotary`). ``limit_dtype``: x's dtype,
    whose :func:`xpos_limit` the positions' distances to the reference are checked against
    (default ``dtype``)."""
    pos_i = positions.to(torch.int64)
    if pos_i.dim() == 1:
        pos_i = pos_i.unsqueeze(0)
    pos = pos_i.to(torch.float64)  # exact: |t| < 2^53
    hi, lo = _theta_split(dim, float(base), positions.device)
    a_hi = pos[..., None] * hi  # [P, L, d/2], exact for |t| < 2^31
    a_lo = pos[..., None] * lo  # |a_lo| < 2^9 rad: rounding below 6e-14 rad
    c_hi, s_hi, c_lo, s_lo = torch.cos(a_hi), torch.sin(a_hi), torch.cos(a_lo), torch.sin(a_lo)
    cos = c_hi * c_lo - s_hi * s_lo
    sin = s_hi * c_lo + c_hi * s_lo
    if xpos_scale_base is not None:
        offsets = _xpos_offsets(pos_i, reference)  # [P', L], P' = P or B (a per-sequence reference)
        limit = xpos_limit(limit_dtype or dtype, xpos_scale_base)
        if not torch.compiler.is_compiling():  # a traced value check would break the graph
            check_on_device(
                offsets.abs() <= limit,
                f"rotary: with xPos every position must lie within {limit} of its reference position "
                f"(for {limit_dtype or dtype} and xpos_scale_base={xpos_scale_base:g}: the scales "
                f"zeta^(+-(t - r)/xpos_scale_base) must stay finite and normal); pass xpos_reference near "
                f"the positions (the same for the queries and keys that attend to each other, e.g. the "
                f"middle of each attention window), or use float64")
        j = torch.arange(0, dim // 2, dtype=torch.float64, device=positions.device)
        log_zeta = torch.log((2.0 * j + 0.4 * dim) / (1.4 * dim))
        sign = -1.0 if xpos_downscale else 1.0
        scale = torch.exp(log_zeta * (sign * offsets.to(torch.float64)[..., None] / xpos_scale_base))
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def _tables(positions, dim, base, xpos_scale_base, xpos_downscale, dtype, reference=None, limit_dtype=None):
    """rotation_tables, answered from the table cache (ops/rotary/table_cache.py) in plain eager mode:
    CPU positions equal to cached ones, or on a GPU the same positions tensor, unchanged, on the same
    stream (the cache's doc says why and when not)."""
    args = (positions, dim, base, xpos_scale_base, xpos_downscale, dtype, reference, limit_dtype)
    ref_is_tensor = isinstance(reference, torch.Tensor)
    if (not plain_eager(profiler_ok=True) or not plain_tensor(positions)
            or (ref_is_tensor and (reference.device != positions.device or not plain_tensor(reference)))):
        return rotation_tables(*args)
    place = _identity_place(positions)
    if place is None:  # CPU: compared by value; elsewhere (a graph being captured, IDENTITY off): built anew
        if not positions.is_cpu or torch.is_inference_mode_enabled():
            return rotation_tables(*args)
    elif positions.is_inference() or (ref_is_tensor and reference.is_inference()):
        return rotation_tables(*args)  # no version counter: an in-place write would go unseen
    identity = place is not None
    ref_key = (reference.dtype, reference.shape) if ref_is_tensor else reference
    key = (positions.dtype, positions.shape, dim, base, xpos_scale_base, xpos_downscale, dtype, limit_dtype, ref_key,
           place)
    entry = _TABLES.get(key, positions, reference, identity)
    if entry is None:
        with torch.inference_mode(False):  # normal tensors (a version counter) even under inference_mode
            entry = _TABLES.put(key, positions, reference, *rotation_tables(*args), identity=identity)
    return entry.cos, entry.sin


def _identity_place(positions: torch.Tensor):
    """(device, stream) under which a GPU call's tables are cached by the positions tensor's identity
    (ops/rotary/table_cache.py); None for CPU positions (compared by value), while the current stream
    captures a CUDA graph (the graph must compute its tables at every replay), for positions on a
    device other than the current one (see cuda_stream_place) or with the identity entries turned
    off (table_cache.IDENTITY). Tests fake a place here to run the GPU road on the CPU."""
    if positions.is_cpu or not table_cache.IDENTITY:
        return None
    return cuda_stream_place(positions.device)


def _like(x, *_):
    return empty_like(x)


@custom_op("rotary", _like)
def rotary_op(x: Tensor, cos: Tensor, sin: Tensor, backend: str) -> Tensor:
    """-> x rotated by the tables of :func:`rotation_tables`."""
    impl = BACKENDS.select(backend, {"x": x}, device=x.device, dtype=x.dtype)
    return impl.module.forward(x, cos, sin, **impl.config)


@custom_op("rotary_bwd", _like)
def rotary_bwd_op(dy: Tensor, cos: Tensor, sin: Tensor, backend: str) -> Tensor:
    """-> dx: the inverse rotation of dy (times the same xPos scale)."""
    impl = BACKENDS.select(backend, {"x": dy}, device=dy.device, dtype=dy.dtype)
    return as_dtype(impl.module.backward(dy, cos, sin, **impl.config), dy.dtype)


def _setup(ctx, inputs, output):
    _x, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend = backend


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rotary_bwd_op(dy, cos, sin, ctx.backend), None, None, None  # cos, sin: tables, no gradient


rotary_op.register_autograd(_backward, setup_context=_setup)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, xpos_scale_base=None, *,
           xpos_downscale: bool = False, xpos_reference=None, backend: str = "auto") -> torch.Tensor:
    """Rotate adjacent feature pairs of ``x`` by their positions (RoPE), optionally with xPos.

    Args:
        x: r(B L H d), d even; float16/bfloat16/float32/float64.
        positions: integer tensor (L,) shared by the batch, or (B, L) per sequence. Any values;
            the rotation is exact to the table dtype's rounding for |t| < 2^31.
        base: RoPE base (upstream ``rope_base``, default 10000).
        xpos_scale_base: None for RoPE; a positive number (LeX uses 512) for xPos.
        xpos_downscale: xPos only; False for queries, True for keys.
        xpos_reference: xPos only: the position r the scale zeta**(+-(t - r) / xpos_scale_base)
            is measured from. q_t . k_u does not depend on r as long as q and k share it, so pass
            the SAME reference for queries and the keys they attend to. None (default): the middle
            of each row of ``positions`` (min + (max - min) // 2, torchscale's centring): right
            whenever q and k are rotated with the same positions (training, prefill, packed rows
            with ``document_positions``). A KV cache, whose keys were rotated in earlier calls,
            needs an explicit one: an int, or an integer tensor broadcastable to the positions
            ((B, 1) per sequence, (L,) or (B, L) per token, e.g. the middle of each attention
            chunk). Every position must lie within :func:`xpos_limit` (x's dtype) of its reference
            (float32/bfloat16 at 512: 26770 positions), else ValueError (a device-side assert on
            a GPU).
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        r(B L H d) in x's dtype.

    Example::

        q = rotary(q, torch.arange(L), xpos_scale_base=512)
        k = rotary(k, torch.arange(L), xpos_scale_base=512, xpos_downscale=True)
        # decoding position t against keys cached with the reference r0
        q_t = rotary(q_t, torch.tensor([t]), xpos_scale_base=512, xpos_reference=r0)
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
    _check_reference(xpos_reference, xpos_scale_base, B, L, x.device)
    check_backend(backend)
    cos, sin = _tables(positions, d, base, xpos_scale_base, xpos_downscale, acc_dtype(x.dtype),
                       xpos_reference, x.dtype)
    return rotary_op(x, cos, sin, backend)


def _check_reference(reference, xpos_scale_base, B, L, device):
    if reference is None:
        return
    if xpos_scale_base is None:
        raise ValueError("xpos_reference is an xPos argument: pass xpos_scale_base too (or no reference for RoPE)")
    if isinstance(reference, torch.Tensor):
        if reference.dtype not in INT_DTYPES:
            raise TypeError(f"xpos_reference must be an int or an integer tensor, got dtype {reference.dtype}")
        if reference.device != device:
            raise ValueError(f"xpos_reference must be on x's device {device}, got {reference.device}")
        try:
            shape = torch.broadcast_shapes(reference.shape, (1, L))
        except RuntimeError:
            shape = None
        if shape is None or len(shape) != 2 or shape[0] not in (1, B) or shape[1] != L:
            raise ValueError(f"xpos_reference must broadcast to the positions' (B, L) = ({B}, {L}): shape (), "
                             f"(B, 1), (L,) or (B, L), got {tuple(reference.shape)}")
    elif isinstance(reference, bool) or not isinstance(reference, int):
        raise TypeError(f"xpos_reference must be None, an int or an integer tensor, got {type(reference).__name__}")
