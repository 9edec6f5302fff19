"""CEMA last hidden state (docs/math.md, ema_hidden): the state that continues the EMA in the next segment.

    h[b, d, n] = p[d,n] sum_j q[d,n]**(L-1-j) x[b,d,j] + q[d,n]**L hx[b,d,n]

equal to h_{L-1} of h_t = p x_t + q h_{t-1}, h_{-1} = hx (0 if None). Running it on two halves with
the first half's h passed as hx equals running it on the whole sequence (streaming).

Numerical rule: the powers q**(L-1-j) come from the same exact two-level tables as cema_kernel
(``ops/_vandermonde.py``, reverse layout), and q**L from one float64 evaluation; x is read in its
own dtype (fp16/bf16/fp32/fp64) and accumulated in the coefficient dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_coefficients, check_sequence
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, custom_op, empty_like, grad_or_none

__all__ = ["ema_hidden"]

BACKENDS = OpBackends("ema_hidden", {
    "cuda": "megalodon_kernels.ops.ema_hidden.cuda_impl",
    "torch": "megalodon_kernels.ops.ema_hidden.torch_impl",
    "triton": "megalodon_kernels.ops.ema_hidden.triton_impl",
})

autotune.register(
    "ema_hidden",
    key=lambda x, p, log_q, hx: {"D": x.shape[1], "N": p.shape[1], "L": autotune.pow2_bucket(x.shape[2]),
                                 "hx": hx is not None},
    space={"cuda": {}, "torch": {"power_block": [64, 16, 32, 128, 256]},
           "triton": {"block_m": [32], "block_r": [32], "num_warps": [4], "analysis_warps": [8]}},
)


def _select(x, p, log_q, hx, backend):
    return BACKENDS.select(backend, {"x": x, "p": p, "log_q": log_q, "hx": hx}, device=x.device, dtype=x.dtype)


def _fwd_fake(x, p, log_q, hx, weighted, backend):
    B, D, N = x.shape[0], x.shape[1], p.shape[1]
    h = log_q.new_empty(B, D, N)
    return h, empty_like(h), empty_like(h) if weighted else absent(log_q)


@custom_op("ema_hidden", _fwd_fake)
def ema_hidden_op(x: Tensor, p: Tensor, log_q: Tensor, hx: Optional[Tensor], weighted: bool,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (h c(B D N), and for the backward V c(B D N) and W c(B D N) (an empty placeholder unless
    ``weighted``: W is needed for the gradient of log_q only))."""
    impl = _select(x, p, log_q, hx, backend)
    h, V, W = impl.module.ema_hidden_fwd(x, p, log_q, hx, weighted, **impl.config)
    return h, V, (W if weighted else absent(log_q))


def _bwd_fake(dh, x, p, log_q, hx, V, W, needs, backend):
    return (empty_like(x) if needs[0] else absent(x), empty_like(p), empty_like(log_q),
            empty_like(hx) if hx is not None and needs[3] else absent(log_q))


@custom_op("ema_hidden_bwd", _bwd_fake)
def ema_hidden_bwd_op(dh: Tensor, x: Tensor, p: Tensor, log_q: Tensor, hx: Optional[Tensor], V: Tensor,
                      W: Tensor, needs: list[bool], backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx or a placeholder, dp, dlog_q, dhx or a placeholder) in the inputs' dtypes."""
    impl = _select(x, p, log_q, hx, backend)
    if W.dim() != 3:  # the placeholder: the forward ran without log_q needing a gradient
        W = None
        if needs[2]:  # a caller that asked for the gradient anyway: compute the weighted sums now
            _, V, W = impl.module.ema_hidden_fwd(x, p, log_q, hx, True, **impl.config)
    dx, dp, dlq, dhx = impl.module.ema_hidden_bwd(dh, p, log_q, hx, V, W, x.shape[-1], tuple(needs), **impl.config)
    return (dx.to(x.dtype) if needs[0] else absent(x), dp.to(p.dtype), dlq.to(log_q.dtype),
            dhx.to(hx.dtype) if hx is not None and needs[3] else absent(log_q))


def _setup(ctx, inputs, output):
    x, p, log_q, hx, weighted, backend = inputs
    h, V, W = output
    ctx.save_for_backward(x, p, log_q, hx, V, W)
    ctx.backend = backend


def _backward(ctx, dh, _dV, _dW):
    x, p, log_q, hx, V, W = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    dx, dp, dlq, dhx = ema_hidden_bwd_op(dh, x, p, log_q, hx, V, W, needs, ctx.backend)
    return (grad_or_none(dx, needs[0]), grad_or_none(dp, needs[1]), grad_or_none(dlq, needs[2]),
            grad_or_none(dhx, needs[3] and hx is not None), None, None)


ema_hidden_op.register_autograd(_backward, setup_context=_setup)


def ema_hidden(x: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, hx: torch.Tensor | None = None, *,
               backend: str = "auto") -> torch.Tensor:
    """Last hidden state of the CEMA recurrence over x.

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        p: r(D N) float32 or float64.
        log_q: c(D N), complex64 with float32 p, complex128 with float64 p.
        hx: c(B D N) previous state, or None (zero state).
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        h c(B D N) in log_q's dtype. Gradients flow to x (in x's dtype), p, log_q and hx.

    Example::

        h1 = ema_hidden(x[..., :512], p, log_q)
        h = ema_hidden(x[..., 512:], p, log_q, h1)      # == ema_hidden(x, p, log_q)
    """
    B, D, L = check_sequence(x)
    check_coefficients(p, log_q, None, hx, D=D, B=B, device=x.device)
    check_backend(backend)
    weighted = log_q.requires_grad and torch.is_grad_enabled()
    return ema_hidden_op(x, p, log_q, hx, weighted, backend)[0]
