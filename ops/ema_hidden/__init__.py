"""CEMA last hidden state (docs/math.md, ema_hidden): the state that continues the EMA in the next segment.

    h[b, d, n] = p[d,n] sum_j q[d,n]**(L-1-j) x[b,d,j] + q[d,n]**L hx[b,d,n]

equal to h_{L-1} of h_t = p x_t + q h_{t-1}, h_{-1} = hx (0 if None). Running it on two halves with
the first half's h passed as hx equals running it on the whole sequence (streaming).

Numerical rule: the powers q**(L-1-j) come from the same exact two-level tables as cema_kernel
(``ops/_vandermonde.py``, reverse layout), and q**L from one float64 evaluation; x is read in its
own dtype (fp16/bf16/fp32/fp64) and accumulated in the coefficient dtype.
"""
from __future__ import annotations

import torch

from .._checks import check_coefficients, check_sequence
from ...autotune import registry as autotune
from .._dispatch import OpBackends

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


class EmaHiddenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, log_q, hx, impl):
        ctx.set_materialize_grads(False)
        h, V, W = impl.module.ema_hidden_fwd(x, p, log_q, hx, ctx.needs_input_grad[2], **impl.config)
        ctx.save_for_backward(p, log_q, hx, V, W)
        ctx.length, ctx.x_dtype, ctx.impl = x.shape[-1], x.dtype, impl
        return h

    @staticmethod
    def backward(ctx, dh):
        if dh is None:
            return None, None, None, None, None
        p, log_q, hx, V, W = ctx.saved_tensors
        dx, dp, dlq, dhx = ctx.impl.module.ema_hidden_bwd(
            dh, p, log_q, hx, V, W, ctx.length, ctx.needs_input_grad[:4], **ctx.impl.config)
        return (None if dx is None else dx.to(ctx.x_dtype), dp.to(p.dtype), dlq.to(log_q.dtype),
                None if dhx is None else dhx.to(hx.dtype), None)


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
    impl = BACKENDS.select(backend, {"x": x, "p": p, "log_q": log_q, "hx": hx}, device=x.device, dtype=x.dtype)
    return EmaHiddenFunction.apply(x, p, log_q, hx, impl)
