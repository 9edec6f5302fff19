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
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import INT_DTYPES, REAL_DTYPES, acc_dtype, check_float, check_int, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import custom_op, empty_like
from .._host_sync import check_on_device

__all__ = ["timestep_norm"]

BACKENDS = OpBackends("timestep_norm", {
    "cuda": "megalodon_kernels.ops.timestep_norm.cuda_impl",
    "torch": "megalodon_kernels.ops.timestep_norm.torch_impl",
    "triton": "megalodon_kernels.ops.timestep_norm.triton_impl",
})

autotune.register(
    "timestep_norm",
    key=lambda x, num_groups: {"D": x.shape[2], "G": num_groups, "L": autotune.pow2_bucket(x.shape[1])},
    space={"cuda": {}, "torch": {"chunk": [64, 16, 32, 128, 256]},
           "triton": {"block_elems": [4096], "num_warps": [8]}},
)


def _select(x, num_groups, backend):
    return BACKENDS.select(backend, {"x": x, "num_groups": num_groups}, device=x.device, dtype=x.dtype)


def _fwd_fake(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, backend):
    B, L, D = x.shape
    acc = acc_dtype(x.dtype)
    stats = x.new_empty(B, L, num_groups, dtype=acc)
    state = x.new_empty(B, num_groups, dtype=acc)
    return (empty_like(x), x.new_empty(B, dtype=torch.int64),
            state, empty_like(state), stats, empty_like(stats), empty_like(stats),
            empty_like(state))


@custom_op("timestep_norm", _fwd_fake)
def timestep_norm_op(x: Tensor, scale: Tensor, bias: Tensor, prev_count: Tensor, prev_mean: Tensor, prev_var: Tensor,
                     padding_mask: Tensor, num_groups: int, eps: float,
                     backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (y, count, mean, var, and for the backward mu, rstd, gmu r(B L G) and K r(B G) in the
    accumulation dtype): the running mean and reciprocal std per step, each step's group mean
    and the per-group shift they are relative to (the CUDA backend's statistics are absolute:
    gmu and K are zeros there)."""
    check_on_device(prev_count >= 0, "prev_count must be >= 0 (a number of steps already seen)")
    impl = _select(x, num_groups, backend)
    y, count, mean, var, saved = impl.module.timestep_norm_fwd(
        x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, **impl.config)
    acc = acc_dtype(x.dtype)
    if impl.name == "cuda":  # saved = (x, scale, count, mean, mask, cummean, cumrstd)
        mu, rstd = saved[5], saved[6]
        gmu, K = torch.zeros_like(mu), mean.new_zeros(mean.shape)
    else:  # saved = (x, scale, mu, rstd, gmu, mask, count, mu0 - K, K)
        mu, rstd, gmu, K = saved[2], saved[3], saved[4], saved[8]
    return (y, count.to(torch.int64), mean.to(acc), var.to(acc), mu.to(acc), rstd.to(acc), gmu.to(acc),
            K.to(acc))


def _bwd_fake(dy, dmean, dvar, x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, mu, rstd, gmu, K,
              num_groups, backend):
    return tuple(empty_like(t)
                 for t in (x, scale, bias, prev_mean, prev_var))


@custom_op("timestep_norm_bwd", _bwd_fake)
def timestep_norm_bwd_op(dy: Tensor, dmean: Tensor, dvar: Tensor, x: Tensor, scale: Tensor, bias: Tensor,
                         prev_count: Tensor, prev_mean: Tensor, prev_var: Tensor, padding_mask: Tensor, mu: Tensor,
                         rstd: Tensor, gmu: Tensor, K: Tensor, num_groups: int,
                         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> the gradients of (x, scale, bias, prev_mean, prev_var), each in its input's dtype."""
    impl = _select(x, num_groups, backend)
    acc = acc_dtype(x.dtype)
    if impl.name == "cuda":
        saved = (x.contiguous(), scale.to(acc).contiguous(), prev_count.to(torch.int64).contiguous(),
                 prev_mean.to(acc).contiguous(), padding_mask.contiguous(), mu, rstd)
    else:  # Triton's kernels read the contiguous copy of x its forward saved
        xs = x.contiguous() if impl.name == "triton" else x
        saved = (xs, scale, mu, rstd, gmu, padding_mask, prev_count, prev_mean.to(acc) - K, K)
    grads = impl.module.timestep_norm_bwd(dy, dmean, dvar, saved, num_groups, **impl.config)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (x, scale, bias, prev_mean, prev_var)))


def _setup(ctx, inputs, output):
    x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, backend = inputs
    ctx.save_for_backward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, *output[4:])
    ctx.num_groups, ctx.backend = num_groups, backend
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _dcount, dmean, dvar, *_stats):
    x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, mu, rstd, gmu, K = ctx.saved_tensors
    dx, dscale, dbias, dpm, dpv = timestep_norm_bwd_op(dy, dmean, dvar, x, scale, bias, prev_count, prev_mean,
                                                       prev_var, padding_mask, mu, rstd, gmu, K, ctx.num_groups,
                                                       ctx.backend)
    return dx, dscale, dbias, None, dpm, dpv, None, None, None, None


timestep_norm_op.register_autograd(_backward, setup_context=_setup)


def timestep_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, num_groups: int,
                  prev_count: torch.Tensor | None = None, prev_mean: torch.Tensor | None = None,
                  prev_var: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                  eps: float = 1e-5, *, backend: str = "auto"):
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
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        y: r(B L D) in x's dtype (0 on padded steps);
        count: int64 (B,) = prev_count + number of unmasked steps;
        mean, var: r(B G), float32 (float64 for float64 x), the state after the last step
        (prev_mean / prev_var when nothing was observed). mean and var are differentiable.

    Gradients flow to x, scale, bias, prev_mean and prev_var (each in its own dtype), from y and
    from mean/var; prev_count and padding_mask get none.

    Example::

        y1, n, m, v = timestep_norm(x[:, :1024], scale, bias, num_groups=32)
        y2, n, m, v = timestep_norm(x[:, 1024:], scale, bias, 32, n, m, v)
        # torch.cat((y1, y2), 1) equals timestep_norm(x, scale, bias, 32)[0]
    """
    check_tensor("x", x, (None, None, None), REAL_DTYPES, dims="(B, L, D)")
    B, L, D = x.shape
    dev = x.device
    num_groups = check_int("num_groups", num_groups, minimum=1)
    if D % num_groups:
        raise ValueError(f"num_groups must divide D (the last dimension of x), got num_groups={num_groups}, D={D}")
    G = num_groups
    check_tensor("scale", scale, (D,), REAL_DTYPES, device=dev, dims="(D,)")
    check_tensor("bias", bias, (D,), REAL_DTYPES, device=dev, dims="(D,)")
    acc = acc_dtype(x.dtype)
    if prev_count is None:
        prev_count = torch.zeros(B, dtype=torch.int64, device=dev)
    else:
        check_tensor("prev_count", prev_count, (B,), INT_DTYPES, device=dev, dims="(B,)")
        # its values (>= 0) are checked inside the op, where reading them traces nothing
    if prev_mean is None:
        prev_mean = torch.zeros(B, G, dtype=acc, device=dev)
    else:
        check_tensor("prev_mean", prev_mean, (B, G), REAL_DTYPES, device=dev, dims="(B, G)")
    if prev_var is None:
        prev_var = torch.ones(B, G, dtype=acc, device=dev)
    else:
        check_tensor("prev_var", prev_var, (B, G), REAL_DTYPES, device=dev, dims="(B, G)")
    if padding_mask is None:
        padding_mask = torch.zeros(B, L, dtype=torch.bool, device=dev)
    else:
        check_tensor("padding_mask", padding_mask, (B, L), (torch.bool,), device=dev, dims="(B, L)")
    eps = check_float("eps", eps, low=0.0, low_open=True)
    check_backend(backend)
    return timestep_norm_op(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, G, eps, backend)[:4]
