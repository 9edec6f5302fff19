"""DropKey softmax over an existing score tensor (upstream's ``attention_softmax``; docs/math.md, DropKey).

For callers that build scores themselves (extra biases, custom score functions): the same
bottom-right causal mask and the same DropKey rule as :func:`ops.attention.attention`, so
``dropkey_softmax(scale * q k^T, causal, p, seed) @ v`` equals ``attention(q, k, v, ...)``
with the same seed. The backward uses the saved output only: dropped and masked entries have
y = 0 and get zero gradient, so no mask replay is needed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, _dtype_names, check_float
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import as_dtype, custom_op, empty_like
from ..dropkey_rule import DRAW_SEED, resolve_seed, seed_tensor, seed_tensor_like, seed_value

__all__ = ["dropkey_softmax"]

BACKENDS = OpBackends("dropkey_softmax", {
    "cuda": "megalodon_kernels.ops.dropkey_softmax.cuda_impl",
    "torch": "megalodon_kernels.ops.dropkey_softmax.torch_impl",
    "triton": "megalodon_kernels.ops.dropkey_softmax.triton_impl",
})

autotune.register(
    "dropkey_softmax",
    key=lambda scores: {"L": autotune.pow2_bucket(scores.shape[-2]), "S": autotune.pow2_bucket(scores.shape[-1])},
    space=BACKENDS.config_spaces,  # each backend module's CONFIG_SPACE, read on first use
)


def _fwd_fake(scores, causal, dropkey_p, seed, backend):
    return empty_like(scores), seed_tensor_like()


@custom_op("dropkey_softmax", _fwd_fake, tags=(torch.Tag.nondeterministic_seeded,))
def dropkey_softmax_op(scores: Tensor, causal: bool, dropkey_p: float, seed: int,
                       backend: str) -> tuple[Tensor, Tensor]:
    """-> (y, the seed used as an int64 CPU tensor (1,)); ``seed`` = DRAW_SEED draws one here."""
    impl = BACKENDS.select(backend, {"scores": scores}, device=scores.device, dtype=scores.dtype)
    seed = resolve_seed(None) if seed == DRAW_SEED else seed
    y = impl.module.forward(scores, causal=causal, dropkey_p=dropkey_p, seed=seed, **impl.config)
    return y, seed_tensor(seed)


@custom_op("dropkey_softmax_bwd",
           lambda dy, y, seed, causal, dropkey_p, backend: empty_like(y))
def dropkey_softmax_bwd_op(dy: Tensor, y: Tensor, seed: Tensor, causal: bool, dropkey_p: float,
                           backend: str) -> Tensor:
    """-> dscores from the saved output alone (dropped and masked entries have y = 0)."""
    impl = BACKENDS.select(backend, {"scores": y}, device=y.device, dtype=y.dtype)
    return as_dtype(impl.module.backward(dy, y, causal=causal, dropkey_p=dropkey_p, seed=seed_value(seed),
                                         **impl.config), y.dtype)


class _Options(NamedTuple):
    """The forward's non-tensor arguments the backward op takes, in its order."""

    causal: bool
    dropkey_p: float
    backend: str


def _setup(ctx, inputs, output):
    _scores, causal, dropkey_p, _seed, backend = inputs
    y, seed_t = output
    ctx.save_for_backward(y, seed_t)
    ctx.options = _Options(causal, dropkey_p, backend)
    ctx.mark_non_differentiable(seed_t)  # the seed used, for the backward
    ctx.set_materialize_grads(False)  # y is the one differentiable output: no zeros for the others


def _backward(ctx, dy, _dseed):
    if dy is None:  # an undefined gradient of y (grads are not zero-filled, see _setup): none for the inputs
        return (None,) * len(ctx.needs_input_grad)
    y, seed_t = ctx.saved_tensors
    return dropkey_softmax_bwd_op(dy, y, seed_t, *ctx.options), *(None,) * (len(ctx.needs_input_grad) - 1)


dropkey_softmax_op.register_autograd(_backward, setup_context=_setup)


def dropkey_softmax(scores: torch.Tensor, causal: bool = True, dropkey_p: float = 0.0, seed=None, *,
                    backend: str = "auto") -> torch.Tensor:
    """Softmax over the last axis with the bottom-right causal mask and DropKey.

    Args:
        scores: r(..., L, S), at least 2-D; float16/bfloat16/float32/float64.
        causal: row i sees keys j <= i + (S - L) only (bottom-right alignment, as in attention).
        dropkey_p: DropKey drop probability in [0, 1); 0 disables it.
        seed: int in [0, 2**63 - 1] or None; with dropkey_p > 0, None draws one from torch's
            default generator.
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        r(..., L, S) probabilities, same shape and dtype as scores (computed in fp32, fp64 for
        fp64, rounded once).

    DropKey indices: i and j are the last two indices of scores; h is the index along dim -3
    (0 if scores is 2-D); b is the flat (row-major) index over the dims before -3 (0 if scores
    has at most 3 dims). Entry (b, h, i, j) is dropped unless
    ``ops.dropkey_rule.keep_mask(seed, dropkey_p, b, h, i, j)``; a dropped score becomes -inf
    before the softmax, nothing is rescaled, and a row with no visible kept entry is all 0.
    For scores r(B H L S) = scale * q k^T per head, ``dropkey_softmax(scores, causal, p, seed) @ v``
    equals ``attention(q, k, v, scale=scale, causal=causal, dropkey_p=p, seed=seed)`` (up to
    layout).

    Example::

        scores = torch.einsum("blhd,bshd->bhls", q, k) + bias  # (B, H, L, S)
        p = dropkey_softmax(scores, causal=True, dropkey_p=0.1, seed=step)
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor of shape (..., L, S), got {type(scores).__name__}")
    if scores.dtype not in REAL_DTYPES:
        raise TypeError(f"scores must have dtype in [{_dtype_names(REAL_DTYPES)}], got {scores.dtype}")
    if scores.dim() < 2:
        raise ValueError(f"scores must have rank >= 2 (..., L, S), got shape {tuple(scores.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    dropkey_p = check_float("dropkey_p", dropkey_p, low=0.0, high=1.0, high_open=True)
    seed = resolve_seed(seed) if seed is not None else (DRAW_SEED if dropkey_p > 0.0 else 0)
    check_backend(backend)
    return dropkey_softmax_op(scores, causal, dropkey_p, seed, backend)[0]
