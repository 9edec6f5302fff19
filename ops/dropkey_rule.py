"""The ONE DropKey rule of the package: keep/drop of logit (b, h, i, j) as a pure function of the seed.

DropKey (Li et al., CVPR 2023) sets attention logits to -inf *before* the softmax, with no
rescaling. Every backend (torch, Triton, CUDA) and every backward pass regenerates the identical
mask from this rule, so nothing is stored and results do not depend on thread layout (upstream's
curand-based mask did; docs/math.md, DropKey).

The rule, in 32-bit unsigned arithmetic (written so each step is one line of Triton or CUDA)::

    mix32(x) = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15
    s = mix32(lo32(seed) ^ 0x9E3779B9); s = mix32(s ^ hi32(seed))
    s = mix32(s ^ b); s = mix32(s ^ h)            # one stream per (batch, head)
    r = mix32(s ^ i)                              # one per query row
    u = mix32(r ^ j)                              # one per logit
    dropped  <=>  u < floor(p * 2**32)

``mix32`` is a bijective integer hash with full avalanche (constants from Wellons' hash
prospector). Both multipliers are below 2**31, so on int64 tensors the products never
overflow and the torch version needs no unsigned types. i and j are the query and key indices
of the attention call (for ``dropkey_softmax`` on (..., L, S) scores: the last two indices), b
and h the batch and head indices. ``p = 0`` drops nothing; the comparison is on integers, so
the drop probability is exactly floor(p * 2**32) / 2**32.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_M1 = 0x21F0AAAD
MIX_M2 = 0x735A2D97
SEED_SALT = 0x9E3779B9
MAX_SEED = 2**63 - 1


def mix32(x):
    """The 32-bit mixer on Python ints or int64 tensors holding values in [0, 2**32) (the input
    is never modified)."""
    if isinstance(x, torch.Tensor):
        # The same steps, in place on one fresh tensor: a logit-sized mask is hashed with one
        # allocation instead of nine (on the CPU the hash dominates DropKey's cost).
        x = x ^ (x >> 16)
        x.mul_(MIX_M1).bitwise_and_(MASK32)
        x.bitwise_xor_(x >> 15)
        x.mul_(MIX_M2).bitwise_and_(MASK32)
        return x.bitwise_xor_(x >> 15)
    x = x ^ (x >> 16)
    x = (x * MIX_M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_M2) & MASK32
    return x ^ (x >> 15)


def threshold(p: float) -> int:
    """Integer drop threshold for probability p in [0, 1)."""
    return min(int(p * 2**32), MASK32)


def seed_key(seed: int) -> int:
    """Fold a 63-bit seed into the 32-bit stream key (Python int)."""
    s = mix32((seed & MASK32) ^ SEED_SALT)
    return mix32(s ^ (seed >> 32))


def head_keys(seed: int, b_idx: torch.Tensor, h_idx: torch.Tensor) -> torch.Tensor:
    """Per-(b, h) stream keys; ``b_idx``/``h_idx`` broadcast against each other (int64)."""
    s = torch.as_tensor(seed_key(seed), dtype=torch.int64, device=b_idx.device)
    return mix32(mix32(s ^ b_idx) ^ h_idx)


def keep_mask(
    seed: int,
    p: float,
    b_idx: torch.Tensor,
    h_idx: torch.Tensor,
    i_idx: torch.Tensor,
    j_idx: torch.Tensor,
) -> torch.Tensor:
    """Boolean keep-mask for the logits at the broadcast of (b_idx, h_idx, i_idx, j_idx).

    All index tensors are int64 and broadcast together; typical use passes shapes
    (B,1,1,1), (1,H,1,1), (1,1,L,1), (1,1,1,S).
    """
    thr = threshold(p)
    if thr == 0:
        return torch.ones(torch.broadcast_shapes(b_idx.shape, h_idx.shape, i_idx.shape, j_idx.shape),
                          dtype=torch.bool, device=b_idx.device)
    return _ordered_hash(seed, b_idx, h_idx, i_idx, j_idx) >= thr + _INT32_MIN


def drop_mask(
    seed: int,
    p: float,
    b_idx: torch.Tensor,
    h_idx: torch.Tensor,
    i_idx: torch.Tensor,
    j_idx: torch.Tensor,
) -> torch.Tensor:
    """``~keep_mask(...)`` (the dropped logits), without the extra pass of the negation."""
    thr = threshold(p)
    if thr == 0:
        return torch.zeros(torch.broadcast_shapes(b_idx.shape, h_idx.shape, i_idx.shape, j_idx.shape),
                           dtype=torch.bool, device=b_idx.device)
    return _ordered_hash(seed, b_idx, h_idx, i_idx, j_idx) < thr + _INT32_MIN


def _ordered_hash(seed, b_idx, h_idx, i_idx, j_idx) -> torch.Tensor:
    """The per-logit hash u as int32 ordered like the uint32 u: compare it with thr - 2**31."""
    rows = mix32(head_keys(seed, b_idx, h_idx) ^ i_idx)
    # The logit-sized part in int32: half the bytes of int64 per pass.
    # An int32 holds the uint32 hash in two's complement; flipping the sign bit maps unsigned
    # order to signed order, so u >= thr <=> (u ^ 2^31) >= thr - 2^31 as signed.
    u = _mix32_int32(_as_int32(rows) ^ _as_int32(j_idx))
    return u.bitwise_xor_(_INT32_MIN)


_INT32_MIN = -(2**31)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32 with the same 32 bits."""
    return (v - ((v >> 31) << 32)).to(torch.int32)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """mix32 on the int32 image of uint32 values (in place on x). Products wrap modulo 2**32 as
    uint32 ones do; shifts are arithmetic on int32, so each is masked to the logical shift's bits.
    Every step runs in place on x and one scratch tensor: a fresh logit-sized temporary per
    shift and per mask cost more than the pass itself on the CPU (new memory to fault in)."""
    t = torch.empty_like(x)
    for shift, keep_bits, mult in ((16, 0xFFFF, MIX_M1), (15, 0x1FFFF, MIX_M2), (15, 0x1FFFF, None)):
        torch.bitwise_right_shift(x, shift, out=t)
        x.bitwise_xor_(t.bitwise_and_(keep_bits))
        if mult is not None:
            x.mul_(mult)
    return x


def dropkey_mask(seed: int, p: float, batch: int, heads: int, rows: int, cols: int,
                 *, row_offset: int = 0, col_offset: int = 0, device=None) -> torch.Tensor:
    """Full keep-mask of shape (batch, heads, rows, cols) for tests, references and small calls.

    Entry [b, h, i, j] is the rule at query index ``row_offset + i`` and key index
    ``col_offset + j``.
    """
    ar = lambda n, off: torch.arange(off, off + n, dtype=torch.int64, device=device)  # noqa: E731
    return keep_mask(
        seed, p,
        ar(batch, 0).view(-1, 1, 1, 1), ar(heads, 0).view(1, -1, 1, 1),
        ar(rows, row_offset).view(1, 1, -1, 1), ar(cols, col_offset).view(1, 1, 1, -1),
    )


def resolve_seed(seed) -> int:
    """An explicit seed is used as is; None draws one from torch's default CPU generator, so
    ``torch.manual_seed`` makes DropKey reproducible."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
    return seed


#: The ``seed`` a custom op receives when the caller gave none and DropKey is on: the op draws
#: one with :func:`resolve_seed` when it runs (not when it is traced), so a compiled model draws
#: the same seeds from torch's default generator as an eager one.
DRAW_SEED = -1


def seed_tensor(seed: int) -> torch.Tensor:
    """The seed an op used, as the int64 CPU tensor (1,) its backward reads (a CPU read: no sync)."""
    return torch.full((1,), seed, dtype=torch.int64, device="cpu")  # (torch.tensor([seed]) costs twice as much)


def seed_tensor_like() -> torch.Tensor:
    """The fake implementation's :func:`seed_tensor`."""
    return torch.empty(1, dtype=torch.int64, device="cpu")


def seed_value(seed: torch.Tensor) -> int:
    return int(seed.item())  # (int(seed[0]) makes a view first: ~2 us more)
