"""CEMA kernel and bias: the Vandermonde sums of the complex EMA (docs/math.md, CEMA kernel).

For coefficients p r(D N), q = exp(log_q) c(D N), gamma c(D N) and an optional initial state
hx c(B D N)::

    k[d, j]    = Re sum_n p[d,n] gamma[d,n] q[d,n]**j               j < L
    b[b, d, t] = Re sum_n gamma[d,n] hx[b,d,n] q[d,n]**(t+1)        t < L

k is the impulse response and b the free response of h_t = p x_t + q h_{t-1}, y_t = Re sum gamma h_t,
so y = causal_conv(x, k) + b. The coefficients come in as log_q (not q) so that |q| close to 1 keeps
its decay in fp32, and gradients flow to log_q directly (d q**j / d log_q = j q**j: no 1/q).

Numerical rule (``ops/_vandermonde.py``): every power is Q1[j mod T] * Q2[j div T], each table entry
evaluated on its own with a float64 exponent and phase reduced mod 2 pi in float64, rounded once;
never repeated multiplication, never j*arg(q) in fp32. fp32 error vs float64 stays ~1e-7 relative
(norm-wise) up to L = 2**20 (bench/accuracy_cema.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_coefficients, check_int
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, as_dtype, custom_op, empty_like, grad_or_none

__all__ = ["cema_kernel"]

BACKENDS = OpBackends("cema_kernel", {
    "cuda": "megalodon_kernels.ops.cema_kernel.cuda_impl",
    "torch": "megalodon_kernels.ops.cema_kernel.torch_impl",
    "triton": "megalodon_kernels.ops.cema_kernel.triton_impl",
})

autotune.register(
    "cema_kernel",
    key=lambda p, log_q, gamma, length, hx: {"D": p.shape[0], "N": p.shape[1], "L": autotune.pow2_bucket(length),
                                             "hx": hx is not None},
    space=BACKENDS.config_spaces,
)

def _select(p, log_q, gamma, length, hx, backend):
    return BACKENDS.select(backend, {"p": p, "log_q": log_q, "gamma": gamma, "length": length, "hx": hx},
                           device=p.device, dtype=p.dtype)


def _fwd_fake(p, log_q, gamma, length, hx, backend):
    D = p.shape[0]
    b = p.new_empty(hx.shape[0], D, length) if hx is not None else absent(p)
    return p.new_empty(D, length), b


@custom_op("cema_kernel", _fwd_fake)
def cema_kernel_op(p: Tensor, log_q: Tensor, gamma: Tensor, length: int, hx: Optional[Tensor],
                   backend: str) -> tuple[Tensor, Tensor]:
    """-> (k r(D L), b r(B D L), or an empty placeholder without hx), in p's dtype."""
    impl = _select(p, log_q, gamma, length, hx, backend)
    k, b = impl.module.forward(p, log_q, gamma, length, hx, **impl.config)
    return as_dtype(k, p.dtype), (as_dtype(b, p.dtype) if hx is not None else absent(p))


def _bwd_fake(dk, db, p, log_q, gamma, length, hx, needs, backend):
    return (empty_like(p), empty_like(log_q), empty_like(gamma),
            empty_like(hx) if hx is not None and needs[3] else absent(p, log_q.dtype))


@custom_op("cema_kernel_bwd", _bwd_fake)
def cema_kernel_bwd_op(dk: Tensor, db: Optional[Tensor], p: Tensor, log_q: Tensor, gamma: Tensor, length: int,
                       hx: Optional[Tensor], needs: list[bool], backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dp, dlog_q, dgamma, dhx or an empty placeholder) in the inputs' dtypes."""
    impl = _select(p, log_q, gamma, length, hx, backend)
    dp, dlq, dgamma, dhx = impl.module.backward(dk, db, p, log_q, gamma, length, hx, tuple(needs), **impl.config)
    return (as_dtype(dp, p.dtype), as_dtype(dlq, log_q.dtype), as_dtype(dgamma, gamma.dtype),
            as_dtype(dhx, hx.dtype) if hx is not None and needs[3] else absent(p, log_q.dtype))


def _setup(ctx, inputs, output):
    p, log_q, gamma, length, hx, backend = inputs
    ctx.save_for_backward(p, log_q, gamma, hx)
    ctx.length, ctx.backend = length, backend
    if hx is None:  # b is a placeholder: no gradient (one output fewer for autograd)
        ctx.mark_non_differentiable(output[1])


def _backward(ctx, dk, db):
    p, log_q, gamma, hx = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3]) + [ctx.needs_input_grad[4]]
    dp, dlq, dgamma, dhx = cema_kernel_bwd_op(dk, db if hx is not None else None, p, log_q, gamma, ctx.length, hx,
                                              needs, ctx.backend)
    return (grad_or_none(dp, needs[0]), grad_or_none(dlq, needs[1]), grad_or_none(dgamma, needs[2]), None,
            grad_or_none(dhx, needs[3] and hx is not None), None)


cema_kernel_op.register_autograd(_backward, setup_context=_setup)


def cema_kernel(p: torch.Tensor, log_q: torch.Tensor, gamma: torch.Tensor, length: int,
                hx: torch.Tensor | None = None, *, backend: str = "auto"):
    """CEMA convolution kernel k and initial-state bias b.

    Args:
        p: r(D N) float32 or float64 (upstream sigmoid(alpha)).
        log_q: c(D N), complex64 with float32 p, complex128 with float64 p.
        gamma: c(D N), same dtype as log_q (already scaled by sqrt(1/N)).
        length: L >= 1.
        hx: c(B D N) previous hidden state, or None.
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        (k r(D L), b r(B D L) or None), in p's dtype. Gradients flow to p, log_q, gamma, hx.

    Example::

        k, b = cema_kernel(p, log_q, gamma, 4096, hx)   # y = fftconv(x, k) + b + omega[:, None] * x
    """
    check_coefficients(p, log_q, gamma, hx)
    length = check_int("length", length, minimum=1)
    check_backend(backend)
    k, b = cema_kernel_op(p, log_q, gamma, length, hx, backend)
    return k, (b if hx is not None else None)
