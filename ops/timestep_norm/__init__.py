"""TimestepNorm: causal cumulative group normalisation (Megalodon), streamable.

For each batch element b and group g of Dg = D / G contiguous features, step t is normalised by
the pooled mean and population variance of every unmasked step <= t (the current step included),
on top of a prior worth ``prev_count`` steps::

    y[b, t, i] = (x[b, t, i] - mu_t) / sqrt(var_t + eps) * scale[i] + bias[i]

where (n_t, mu_t, var_t) follow the Welford merge (docs/math.md, TimestepNorm), one observation
per step (its group mean and population variance). A padded step (``padding_mask`` True) outputs 0,
is not counted and leaves the state alone; NaN/inf in a padded x never reach anything, while
genuine NaN/inf inputs propagate (upstream silently drops infinities). The returned (count, mean,
var) are the streaming state: feeding them back as (prev_count, prev_mean, prev_var) for the next
segment gives the same outputs as one call on the whole sequence, and gradients flow back through
them.

Numerics: the backends never form cumsum(x) and cumsum(x^2); statistics come from an
associative (Chan) Welford merge in fp32 (fp64 for fp64 inputs) - see ``torch_impl``.

Packed rows (``cu_seqlens``): the backends read the document bounds themselves (the scans restart
at every document start, each from the document's own prior), so a packed call is one backend
call, forward and backward, over the packed row: no gathered rows, no padding (docs/math.md,
TimestepNorm, Packed sequences).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._checks import INT_DTYPES, REAL_DTYPES, acc_dtype, check_float, check_int, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import as_dtype, custom_op, empty_like, fill_place, filled, is_filled
from .._host_sync import check_on_device
from .._packing import check_cu_seqlens, check_per_document, document_bounds

__all__ = ["timestep_norm"]

BACKENDS = OpBackends("timestep_norm", {
    "cpu": "megalodon_kernels.ops.timestep_norm.cpu_impl",
    "cuda": "megalodon_kernels.ops.timestep_norm.cuda_impl",
    "torch": "megalodon_kernels.ops.timestep_norm.torch_impl",
    "triton": "megalodon_kernels.ops.timestep_norm.triton_impl",
})

autotune.register(
    "timestep_norm",
    key=lambda x, num_groups, packed=False: {"D": x.shape[2], "G": num_groups, "L": autotune.pow2_bucket(x.shape[1])},
    space=BACKENDS.config_spaces,
)


def _select(x, num_groups, backend, cu_seqlens):
    """The backend for this call; ``packed`` is an input of the choice because a backend's packed
    kernels may differ in what a device runs (Triton 3.6's packed tiles on sm_90)."""
    return BACKENDS.select(backend, {"x": x, "num_groups": num_groups, "packed": cu_seqlens is not None},
                           device=x.device, dtype=x.dtype)


class Saved(NamedTuple):
    """What the torch, Triton and cpu forwards hand their backward."""

    x: Tensor
    scale: Tensor
    mu: Tensor             # r(B L G) running mean per step, relative to the shift K
    rstd: Tensor           # r(B L G) running reciprocal std per step
    gmu: Tensor            # r(B L G) each step's group mean, relative to K
    padding_mask: Tensor
    prev_count: Tensor
    mu0: Tensor            # r(n G) the prior mean relative to K
    K: Tensor              # r(n G) the per-group shift


class CudaSaved(NamedTuple):
    """What the CUDA forward hands its backward: its statistics and the shift they are relative to."""

    x: Tensor
    scale: Tensor
    prev_count: Tensor
    prev_mean: Tensor
    padding_mask: Tensor
    cummean: Tensor        # r(B L G) running mean per step, relative to the shift
    cumrstd: Tensor        # r(B L G) running reciprocal std per step
    kstep: Tensor          # r(B L G) the shift at every step (the op's gmu residual)
    kshift: Tensor         # r(n G) the shift of every state row (the op's K residual)


def _residuals(impl, saved, mean, acc):
    """A backend's saved tensors as the op's residuals (mu, rstd, gmu, K) in the accumulation dtype."""
    if impl.name == "cuda":  # its shift rides in the gmu and K slots (same shapes and dtype)
        mu, rstd, gmu, K = saved.cummean, saved.cumrstd, saved.kstep, saved.kshift
    else:
        mu, rstd, gmu, K = saved.mu, saved.rstd, saved.gmu, saved.K
    return as_dtype(mu, acc), as_dtype(rstd, acc), as_dtype(gmu, acc), as_dtype(K, acc)


def _saved(impl, x, scale, prev_count, prev_mean, padding_mask, mu, rstd, gmu, K, acc):
    """The op's residuals back as what the backend ``impl``'s backward takes."""
    if impl.name == "cuda":
        return CudaSaved(x.contiguous(), as_dtype(scale, acc).contiguous(),
                         as_dtype(prev_count, torch.int64).contiguous(), as_dtype(prev_mean, acc).contiguous(),
                         padding_mask.contiguous(), mu, rstd, gmu, K)
    xs = x.contiguous() if impl.name == "triton" else x  # Triton's kernels read the contiguous copy of x
    return Saved(xs, scale, mu, rstd, gmu, padding_mask, prev_count, as_dtype(prev_mean, acc) - K, K)


def _fwd_fake(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, backend,
              cu_seqlens=None):
    B, L, D = x.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # states: one per row, or per document
    acc = acc_dtype(x.dtype)
    stats = x.new_empty(B, L, num_groups, dtype=acc)
    state = x.new_empty(n, num_groups, dtype=acc)
    return (empty_like(x), x.new_empty(n, dtype=torch.int64),
            state, empty_like(state), stats, empty_like(stats), empty_like(stats),
            empty_like(state))


@custom_op("timestep_norm", _fwd_fake)
def timestep_norm_op(x: Tensor, scale: Tensor, bias: Tensor, prev_count: Tensor, prev_mean: Tensor, prev_var: Tensor,
                     padding_mask: Tensor, num_groups: int, eps: float, backend: str,
                     cu_seqlens: Optional[Tensor] = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (y, count, mean, var, and for the backward mu, rstd, gmu r(B L G) and K in the
    accumulation dtype): the running mean and reciprocal std per step, each step's group mean
    and the per-group shift they are relative to (the CUDA backend saves no group means: its gmu
    is the shift at every step, which its backward reads with K). count, mean, var and K have one
    row per batch element, or with ``cu_seqlens`` one per document."""
    if not is_filled(prev_count):  # the public function's default (zeros) needs no check
        check_on_device(prev_count >= 0, "prev_count must be >= 0 (a number of steps already seen)")
    impl = _select(x, num_groups, backend, cu_seqlens)
    y, count, mean, var, saved = impl.module.forward(
        x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
        **_packed(cu_seqlens, x), **impl.config)
    acc = acc_dtype(x.dtype)
    return (y, as_dtype(count, torch.int64), as_dtype(mean, acc), as_dtype(var, acc), *_residuals(impl, saved, mean, acc))


def _packed(cu_seqlens, x) -> dict:
    """The backends' packed-row argument: the document bounds, checked, as int64 (none unpacked)."""
    return {} if cu_seqlens is None else {"cu_seqlens": document_bounds(cu_seqlens, x.shape[1])}


def _bwd_fake(dy, dmean, dvar, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, mu, rstd, gmu, K,
              num_groups, backend, cu_seqlens=None):
    return tuple(empty_like(t)
                 for t in (x, scale, bias, prev_mean, prev_var))


@custom_op("timestep_norm_bwd", _bwd_fake)
def timestep_norm_bwd_op(dy: Tensor, dmean: Tensor, dvar: Tensor, x: Tensor, scale: Tensor, bias: Tensor,
                         prev_count: Tensor, prev_mean: Tensor, prev_var: Tensor, padding_mask: Tensor, mu: Tensor,
                         rstd: Tensor, gmu: Tensor, K: Tensor, num_groups: int, backend: str,
                         cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> the gradients of (x, scale, bias, prev_mean, prev_var), each in its input's dtype."""
    acc = acc_dtype(x.dtype)
    impl = _select(x, num_groups, backend, cu_seqlens)  # the forward's choice (cached)
    saved = _saved(impl, x, scale, prev_count, prev_mean, padding_mask, mu, rstd, gmu, K, acc)
    grads = impl.module.backward(dy, dmean, dvar, saved, num_groups, **_packed(cu_seqlens, x), **impl.config)
    return tuple(as_dtype(g, t.dtype) for g, t in zip(grads, (x, scale, bias, prev_mean, prev_var)))


def _setup(ctx, inputs, output):
    x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, backend, cu_seqlens = inputs
    ctx.save_for_backward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, cu_seqlens, *output[4:])
    ctx.num_groups, ctx.backend = num_groups, backend
    # count is an integer; mu, rstd, gmu, K are residuals: no gradient (fewer outputs for autograd)
    ctx.mark_non_differentiable(output[1], *output[4:])
    ctx.set_materialize_grads(False)  # the backward makes only the zeros it reads (none for the residuals)


def _backward(ctx, dy, _dcount, dmean, dvar, *_stats):
    x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, cu_seqlens, mu, rstd, gmu, K = ctx.saved_tensors
    # an output whose gradient nobody gave: zeros like it (y like x; mean and var r(n G) in the
    # accumulation dtype, like K)
    dy = torch.zeros_like(x, memory_format=torch.contiguous_format) if dy is None else dy
    dmean = torch.zeros_like(K) if dmean is None else dmean
    dvar = torch.zeros_like(K) if dvar is None else dvar
    dx, dscale, dbias, dpm, dpv = timestep_norm_bwd_op(dy, dmean, dvar, x, scale, bias, prev_count, prev_mean,
                                                       prev_var, padding_mask, mu, rstd, gmu, K, ctx.num_groups,
                                                       ctx.backend, cu_seqlens)
    return dx, dscale, dbias, None, dpm, dpv, None, None, None, None, None


timestep_norm_op.register_autograd(_backward, setup_context=_setup)


def _check_state(name, state, shape, dtypes, device, cu_seqlens):
    """An initial state: (B, ...) unpacked; with cu_seqlens one row per document (n, ...)."""
    if cu_seqlens is None:
        check_tensor(name, state, shape, dtypes, device=device, dims="(B,)" if len(shape) == 1 else "(B, G)")
    else:
        dims = "(n,)" if len(shape) == 1 else "(n, G)"
        check_tensor(name, state, (None, *shape[1:]), dtypes, device=device, dims=dims)
        check_per_document(name, state, shape[0], dims)


def timestep_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, num_groups: int,
                  prev_count: torch.Tensor | None = None, prev_mean: torch.Tensor | None = None,
                  prev_var: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                  eps: float = 1e-5, *, cu_seqlens: torch.Tensor | None = None, backend: str = "auto"):
    """Causal cumulative group norm over time with a carried (count, mean, var) state.

    Args:
        x: r(B L D), float16/bfloat16/float32/float64.
        scale: r(D), any float dtype: the gamma actually applied (a model layer adds its +1).
        bias: r(D), any float dtype.
        num_groups: G >= 1 dividing D; groups are contiguous blocks of Dg = D / G features.
        prev_count: integer (B,), >= 0, prior steps already seen (default zeros).
        prev_mean: r(B G), any float dtype (default zeros).
        prev_var: r(B G), any float dtype, population variance (default ones). With
            prev_count = 0 the prior mean and variance are ignored.
        padding_mask: bool (B L), True = padded step (default: nothing padded).
        eps: > 0, added to the running variance inside the square root.
        cu_seqlens: integer (n + 1,) on x's device, or None: x is one packed row (B = 1) of n
            documents, document d at steps [cu_seqlens[d], cu_seqlens[d + 1]) (0 first,
            non-decreasing, L last; empty documents allowed). Each document is normalised on
            its own, from its own initial state: prev_count (n,), prev_mean / prev_var r(n G).
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        y: r(B L D) in x's dtype (0 on padded steps);
        count: int64 (B,) = prev_count + number of unmasked steps;
        mean, var: r(B G), float32 (float64 for float64 x), the state after the last step
        (prev_mean / prev_var when nothing was observed). mean and var are differentiable.
        With cu_seqlens: count (n,) and mean, var r(n G), each document's state after its last
        step (an empty document returns its initial state).

    Gradients flow to x, scale, bias, prev_mean and prev_var (each in its own dtype), from y and
    from mean/var; prev_count, padding_mask and cu_seqlens get none.

    Example::

        y1, n, m, v = timestep_norm(x[:, :1024], scale, bias, num_groups=32)
        y2, n, m, v = timestep_norm(x[:, 1024:], scale, bias, 32, n, m, v)
        # torch.cat((y1, y2), 1) equals timestep_norm(x, scale, bias, 32)[0]

        # three documents of 5, 0 and 3 steps packed in one row x r(1 8 D)
        cu = torch.tensor([0, 5, 5, 8])
        y, n, m, v = timestep_norm(x, scale, bias, 32, cu_seqlens=cu)  # n, m, v: one per document
        # y[:, 5:] equals timestep_norm(x[:, 5:], scale, bias, 32)[0]; n[1] = 0
    """
    check_tensor("x", x, (None, None, None), REAL_DTYPES, dims="(B, L, D)")
    B, L, D = x.shape
    dev = x.device
    # states: one per batch element, or with cu_seqlens one per document
    n = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, batch=B, length=L, device=dev)
    num_groups = check_int("num_groups", num_groups, minimum=1)
    if D % num_groups:
        raise ValueError(f"num_groups must divide D (the last dimension of x), got num_groups={num_groups}, D={D}")
    G = num_groups
    check_tensor("scale", scale, (D,), REAL_DTYPES, device=dev, dims="(D,)")
    check_tensor("bias", bias, (D,), REAL_DTYPES, device=dev, dims="(D,)")
    acc = acc_dtype(x.dtype)
    # where the defaults come from (kept tensors in plain eager mode: see filled), asked once
    place = (fill_place(dev) if prev_count is None or prev_mean is None or prev_var is None or padding_mask is None
             else None)
    if prev_count is None:
        prev_count = filled((n,), 0, torch.int64, dev, place)
    else:
        _check_state("prev_count", prev_count, (n,), INT_DTYPES, dev, cu_seqlens)
        # its values (>= 0) are checked inside the op, where reading them traces nothing
    if prev_mean is None:
        prev_mean = filled((n, G), 0.0, acc, dev, place)
    else:
        _check_state("prev_mean", prev_mean, (n, G), REAL_DTYPES, dev, cu_seqlens)
    if prev_var is None:
        prev_var = filled((n, G), 1.0, acc, dev, place)
    else:
        _check_state("prev_var", prev_var, (n, G), REAL_DTYPES, dev, cu_seqlens)
    if padding_mask is None:
        padding_mask = filled((B, L), False, torch.bool, dev, place)
    else:
        check_tensor("padding_mask", padding_mask, (B, L), (torch.bool,), device=dev, dims="(B, L)")
    eps = check_float("eps", eps, low=0.0, low_open=True)
    check_backend(backend)
    return timestep_norm_op(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, G, eps, backend,
                            cu_seqlens)[:4]
