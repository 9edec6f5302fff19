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
from torch.autograd.function import once_differentiable

from .._checks import INT_DTYPES, REAL_DTYPES, acc_dtype, check_float, check_int, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends
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


class TimestepNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, bias, prev_mean, prev_var, prev_count, padding_mask, num_groups, eps, impl):
        y, count, mean, var, saved = impl.module.timestep_norm_fwd(
            x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps, **impl.config
        )
        ctx.save_for_backward(*saved)
        ctx.num_groups = num_groups
        ctx.impl = impl
        ctx.dtypes = (x.dtype, scale.dtype, bias.dtype, prev_mean.dtype, prev_var.dtype)
        ctx.mark_non_differentiable(count)
        return y, count, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _dcount, dmean, dvar):
        grads = ctx.impl.module.timestep_norm_bwd(dy, dmean, dvar, ctx.saved_tensors, ctx.num_groups,
                                                  **ctx.impl.config)
        dx, dscale, dbias, dprev_mean, dprev_var = (g.to(dt) for g, dt in zip(grads, ctx.dtypes))
        return dx, dscale, dbias, dprev_mean, dprev_var, None, None, None, None, None


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
        check_on_device(prev_count >= 0, "prev_count must be >= 0 (a number of steps already seen)")
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
    impl = BACKENDS.select(backend, {"x": x, "num_groups": num_groups}, device=dev, dtype=x.dtype)
    return TimestepNormFunction.apply(x, scale, bias, prev_mean, prev_var, prev_count, padding_mask, G, eps, impl)
