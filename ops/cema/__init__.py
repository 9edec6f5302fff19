"""CEMA, the complex exponential moving average layer of Megalodon (docs/math.md, cema).

    h_t = p x_t + q h_{t-1}  (h_{-1} = hx),   y_t = Re sum_n gamma_n h_t,n + omega x_t,   q = exp(log_q)

computed in parallel over t as y = fftconv(x, k) + b + omega[:, None] x with (k, b) = cema_kernel(...),
and, with ``return_state=True``, the last state h = ema_hidden(x, p, log_q, hx) for streaming:
running the layer on two halves with the first half's h passed as hx equals running it on the whole.

Numerics: the kernel and state use the exact two-level power tables (ops/_vandermonde.py); the
convolution, bias and skip term are summed in float32 (float64 for float64 inputs) and y is
rounded once to x's dtype.
"""
from __future__ import annotations

import torch

from .._checks import REAL_DTYPES, check_coefficients, check_sequence, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends
from ..cema_kernel import TRITON_SPACE as KERNEL_TRITON_SPACE
from ..fftconv import TRITON_SPACE as CONV_TRITON_SPACE

__all__ = ["cema"]

BACKENDS = OpBackends("cema", {
    "torch": "megalodon_kernels.ops.cema.torch_impl",
    "triton": "megalodon_kernels.ops.cema.triton_impl",
})

autotune.register(
    "cema",
    key=lambda x, p, log_q, gamma, omega, hx: {"D": x.shape[1], "N": p.shape[1], "L": autotune.pow2_bucket(x.shape[2]),
                                               "hx": hx is not None},
    space={"torch": {"power_block": [64, 32, 128], "direct_max_len": [16, 0, 256]},
           # Triton: the stage kernels' knobs (cema_kernel's, and fftconv's with its num_warps as conv_warps)
           "triton": {**KERNEL_TRITON_SPACE,
                      **{("conv_warps" if k == "num_warps" else k): v for k, v in CONV_TRITON_SPACE.items()}}},
)


class CemaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, log_q, gamma, omega, hx, return_state, impl):
        ctx.set_materialize_grads(False)
        weighted = return_state and ctx.needs_input_grad[2]
        y, h, (k, V, W) = impl.module.cema_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted,
                                               **impl.config)
        ctx.save_for_backward(x, p, log_q, gamma, omega, hx, k, V, W)
        ctx.impl = impl
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        x, p, log_q, gamma, omega, hx, k, V, W = ctx.saved_tensors
        if dy is None and dh is None:
            return (None,) * 8
        grads = ctx.impl.module.cema_bwd(dy, dh, x, p, log_q, gamma, omega, hx, (k, V, W),
                                         ctx.needs_input_grad[:6], **ctx.impl.config)
        inputs = (x, p, log_q, gamma, omega, hx)
        out = [None if g is None or not need else g.to(t.dtype)
               for g, t, need in zip(grads, inputs, ctx.needs_input_grad[:6])]
        return (*out, None, None)


def cema(x: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, gamma: torch.Tensor, omega: torch.Tensor,
         hx: torch.Tensor | None = None, return_state: bool = False, *, backend: str = "auto"):
    """Complex exponential moving average over the last axis of x.

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        p: r(D N) float32 or float64.
        log_q: c(D N), complex64 with float32 p, complex128 with float64 p.
        gamma: c(D N), same dtype as log_q.
        omega: r(D) skip weight, any real dtype.
        hx: c(B D N) previous state, or None.
        return_state: also return the last state h.
        backend: "auto", "torch", "triton" or "cuda".

    Returns:
        (y r(B D L) in x's dtype, h c(B D N) in log_q's dtype or None). Gradients flow to x, p,
        log_q, gamma, omega and hx (and through h when it is returned).

    Example::

        y1, h = cema(x[..., :L1], p, log_q, gamma, omega, return_state=True)
        y2, _ = cema(x[..., L1:], p, log_q, gamma, omega, hx=h)   # cat(y1, y2) == cema(x, ...)[0]
    """
    B, D, L = check_sequence(x)
    check_coefficients(p, log_q, gamma, hx, D=D, B=B, device=x.device)
    check_tensor("omega", omega, (D,), REAL_DTYPES, device=x.device, dims="(D,)")
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    impl = BACKENDS.select(backend, {"x": x, "p": p, "log_q": log_q, "gamma": gamma, "omega": omega, "hx": hx},
                           device=x.device, dtype=x.dtype)
    return CemaFunction.apply(x, p, log_q, gamma, omega, hx, return_state, impl)
