"""CEMA, the complex exponential moving average layer of Megalodon (docs/math.md, cema).

    h_t = p x_t + q h_{t-1}  (h_{-1} = hx),   y_t = Re sum_n gamma_n h_t,n + omega x_t,   q = exp(log_q)

computed in parallel over t as y = fftconv(x, k) + b + omega[:, None] x with (k, b) = cema_kernel(...),
and, with ``return_state=True``, the last state h = ema_hidden(x, p, log_q, hx) for streaming:
running the layer on two halves with the first half's h passed as hx equals running it on the whole.

Numerics: the kernel and state use the exact two-level power tables (ops/_vandermonde.py); the
convolution, bias and skip term are summed in float32 (float64 for float64 inputs) and y is
rounded once to x's dtype.

Packed rows (``cu_seqlens``, n documents) run as document rows (``ops/_packing.py``): y comes
from one cema backend call per bucket of rows with every document at the start of its row and
its own initial state hx[d] (the layer is causal, so the padding after a document never reaches
its outputs); the state h from ema_hidden's packed forward (documents at the end of their rows,
plus q**len hx). The kernel k saved for the backward is the longest row's, zero-padded to L:
k[j] does not depend on the row length, so its prefix is every shorter row's kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import REAL_DTYPES, check_coefficients, check_sequence, check_tensor
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, as_dtype, custom_op, empty_like, grad_or_none
from .._packing import check_cu_seqlens, check_per_document, plan
from ..ema_hidden import packed_state, packed_state_grads
from .compose import Needs, Saved, add_optional

__all__ = ["cema"]

BACKENDS = OpBackends("cema", {
    "torch": "megalodon_kernels.ops.cema.torch_impl",
    "cpu": "megalodon_kernels.ops.cema.cpu_impl",
    "triton": "megalodon_kernels.ops.cema.triton_impl",
    "cuda": "megalodon_kernels.ops.cema.cuda_impl",
})

autotune.register(
    "cema",
    key=lambda x, p, log_q, gamma, omega, hx: {"D": x.shape[1], "N": p.shape[1], "L": autotune.pow2_bucket(x.shape[2]),
                                               "hx": hx is not None},
    space=BACKENDS.config_spaces,
)


def _select(x, p, log_q, gamma, omega, hx, backend):
    return BACKENDS.select(backend, {"x": x, "p": p, "log_q": log_q, "gamma": gamma, "omega": omega, "hx": hx},
                           device=x.device, dtype=x.dtype)


def _state_backend(backend):
    """ema_hidden's backend for the packed state: cema's cpu backend runs ema_hidden's torch
    backend (ema_hidden has no compiled CPU kernel)."""
    return "torch" if backend == "cpu" else backend


def _per_document(hx, bucket):
    return None if hx is None else hx.index_select(0, bucket.docs)


def _packed_fwd(x, p, log_q, gamma, omega, hx, cu_seqlens, return_state, weighted, backend):
    """(y r(1 D L), h, k r(D L), V, W) of a packed call, h/V/W c(n D N) or None (see the module
    docstring). One cema backend call per bucket for y, ema_hidden's per bucket for h."""
    L = x.shape[-1]
    y = x.new_empty(x.shape)
    k = p.new_zeros(x.shape[1], L)
    for bucket in plan(cu_seqlens, L).buckets:  # in increasing row length: the last row is the longest
        xr, hr = bucket.rows(x, 2), _per_document(hx, bucket)
        impl = _select(xr, p, log_q, gamma, omega, hr, backend)
        yr, _, saved = impl.module.forward(xr, p, log_q, gamma, omega, hr, False, False, **impl.config)
        bucket.put(yr, y, 2)
        longest = saved.k
    k[:, :longest.shape[-1]] = longest
    h = V = W = None
    if return_state:
        h, V, W = packed_state(x, p, log_q, hx, cu_seqlens, weighted, _state_backend(backend))
    return y, h, k, V, W


def _packed_bwd(dy, dh, x, p, log_q, gamma, omega, hx, k, V, W, needs, cu_seqlens, backend):
    """The gradients of (x, p, log_q, gamma, omega, hx) of a packed call, None where not needed:
    each bucket's through y (its rows, its documents' hx, the first Lb entries of k), summed over
    buckets, plus the state's through ema_hidden's packed backward."""
    needs = needs._replace(hx=needs.hx and hx is not None)
    need_x, need_p, need_lq, need_gamma, need_omega, need_hx = needs
    L = x.shape[-1]
    dx = dp = dlq = dgamma = domega = None
    dhx = torch.zeros_like(hx) if need_hx else None
    for bucket in plan(cu_seqlens, L).buckets:
        dyr, xr, hr = bucket.rows(dy, 2), bucket.rows(x, 2), _per_document(hx, bucket)
        impl = _select(xr, p, log_q, gamma, omega, hr, backend)
        grads = impl.module.backward(dyr, None, xr, p, log_q, gamma, omega, hr,
                                     Saved(k[:, :bucket.size].contiguous(), None, None), needs, **impl.config)
        gx, gp, glq, ggamma, gomega, ghx = grads
        if need_x:
            dx = gx.new_empty(x.shape) if dx is None else dx
            bucket.put(gx, dx, 2)
        dp, dlq, dgamma, domega = (add_optional(a, b) for a, b in zip((dp, dlq, dgamma, domega),
                                                                      (gp, glq, ggamma, gomega)))
        if need_hx:
            dhx.index_add_(0, bucket.docs, ghx.to(dhx.dtype))
    if dh is not None:
        state = packed_state_grads(dh, x, p, log_q, hx, V, W, (need_x, need_p, need_lq, need_hx), cu_seqlens,
                                   _state_backend(backend))
        dx, dp, dlq, dhx = (add_optional(a, b) if need else None
                            for a, b, need in zip((dx, dp, dlq, dhx), state, (need_x, need_p, need_lq, need_hx)))
    return dx, dp, dlq, dgamma, domega, dhx


def _fwd_fake(x, p, log_q, gamma, omega, hx, return_state, weighted, backend, cu_seqlens=None):
    B, D, L = x.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    N = p.shape[1]
    state = log_q.new_empty(n, D, N) if return_state else absent(log_q)
    return (empty_like(x), state, p.new_empty(D, L),
            empty_like(state), empty_like(state) if return_state and weighted else absent(log_q))


@custom_op("cema", _fwd_fake)
def cema_op(x: Tensor, p: Tensor, log_q: Tensor, gamma: Tensor, omega: Tensor, hx: Optional[Tensor],
            return_state: bool, weighted: bool, backend: str,
            cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (y, h or a placeholder, and for the backward k r(D L) in p's dtype, V c(B D N) or a
    placeholder (without return_state), W c(B D N) or a placeholder (unless return_state and
    ``weighted``)); B = n documents with ``cu_seqlens``."""
    weighted = return_state and weighted
    if cu_seqlens is not None:
        y, h, k, V, W = _packed_fwd(x, p, log_q, gamma, omega, hx, cu_seqlens, return_state, weighted, backend)
    else:
        impl = _select(x, p, log_q, gamma, omega, hx, backend)
        y, h, (k, V, W) = impl.module.forward(x, p, log_q, gamma, omega, hx, return_state, weighted, **impl.config)
    if not return_state:
        h = V = absent(log_q)
    return y, h, as_dtype(k, p.dtype), V, (W if weighted else absent(log_q))


def _bwd_fake(dy, dh, x, p, log_q, gamma, omega, hx, k, V, W, weighted, needs, backend, cu_seqlens=None):
    inputs = (x, p, log_q, gamma, omega, hx)
    return tuple(empty_like(t) if t is not None and need else absent(x)
                 for t, need in zip(inputs, needs))


@custom_op("cema_bwd", _bwd_fake)
def cema_bwd_op(dy: Tensor, dh: Optional[Tensor], x: Tensor, p: Tensor, log_q: Tensor, gamma: Tensor, omega: Tensor,
                hx: Optional[Tensor], k: Tensor, V: Tensor, W: Tensor, weighted: bool, needs: list[bool], backend: str,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> the gradients of (x, p, log_q, gamma, omega, hx) in their dtypes, placeholders where not
    needed; ``dh`` is None without return_state; ``W`` is the forward's weighted sums when it ran
    ``weighted`` (and returned its state), else its placeholder."""
    needs = Needs(*needs)
    W = W if weighted else None  # None: the forward ran without a log_q gradient in sight
    if cu_seqlens is not None:
        grads = _packed_bwd(dy, dh, x, p, log_q, gamma, omega, hx, k, V, W, needs, cu_seqlens, backend)
    else:
        impl = _select(x, p, log_q, gamma, omega, hx, backend)
        if dh is None:
            V = W = None
        elif W is None and needs.log_q:  # the forward did not keep W: recompute the sums
            _, _, (_, V, W) = impl.module.forward(x, p, log_q, gamma, omega, hx, True, True, **impl.config)
        grads = impl.module.backward(dy, dh, x, p, log_q, gamma, omega, hx, Saved(k, V, W), needs, **impl.config)
    inputs = (x, p, log_q, gamma, omega, hx)
    return tuple(as_dtype(g, t.dtype) if t is not None and need else absent(x)
                 for g, t, need in zip(grads, inputs, needs))


def _setup(ctx, inputs, output):
    x, p, log_q, gamma, omega, hx, return_state, weighted, backend, cu_seqlens = inputs
    _, _, k, V, W = output
    ctx.save_for_backward(x, p, log_q, gamma, omega, hx, k, V, W, cu_seqlens)
    ctx.return_state, ctx.weighted, ctx.backend = return_state, return_state and weighted, backend
    ctx.mark_non_differentiable(k, V, W)  # residuals: no gradient (fewer outputs for autograd)


def _backward(ctx, dy, dh, _dk, _dV, _dW):
    x, p, log_q, gamma, omega, hx, k, V, W, cu_seqlens = ctx.saved_tensors
    needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:6], (x, p, log_q, gamma, omega, hx))]
    grads = cema_bwd_op(dy, dh if ctx.return_state else None, x, p, log_q, gamma, omega, hx, k, V, W, ctx.weighted,
                        needs, ctx.backend, cu_seqlens)
    return (*(grad_or_none(g, need) for g, need in zip(grads, needs)), None, None, None, None)


cema_op.register_autograd(_backward, setup_context=_setup)


def cema(x: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, gamma: torch.Tensor, omega: torch.Tensor,
         hx: torch.Tensor | None = None, return_state: bool = False, *, backend: str = "auto",
         cu_seqlens: torch.Tensor | None = None):
    """Complex exponential moving average over the last axis of x.

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        p: r(D N) float32 or float64.
        log_q: c(D N), complex64 with float32 p, complex128 with float64 p.
        gamma: c(D N), same dtype as log_q.
        omega: r(D) skip weight, any real dtype.
        hx: c(B D N) previous state, or None; c(n D N) with cu_seqlens.
        return_state: also return the last state h.
        backend: "auto", "torch", "cpu", "triton" or "cuda".
        cu_seqlens: None, or an integer tensor (n + 1,) on x's device delimiting n documents
            packed in one row (0 first, non-decreasing, L last; empty documents allowed), with
            x of batch size 1: the EMA restarts at every document start from that document's
            hx[d] (or 0), exactly as a call on the document alone.

    Returns:
        (y r(B D L) in x's dtype, h c(B D N) in log_q's dtype or None); with cu_seqlens h is
        c(n D N), each document's last state (an empty document's is its hx, or 0). Gradients
        flow to x, p, log_q, gamma, omega and hx (and through h when it is returned).

    Example::

        y1, h = cema(x[..., :L1], p, log_q, gamma, omega, return_state=True)
        y2, _ = cema(x[..., L1:], p, log_q, gamma, omega, hx=h)   # cat(y1, y2) == cema(x, ...)[0]
        # documents of 100, 23 and 900 steps packed into one row x r(1 D 1023):
        cu = torch.tensor([0, 100, 123, 1023], device=x.device)
        y, h = cema(x, p, log_q, gamma, omega, return_state=True, cu_seqlens=cu)   # h c(3 D N)
    """
    B, D, L = check_sequence(x)
    if cu_seqlens is None:
        check_coefficients(p, log_q, gamma, hx, D=D, B=B, device=x.device)
    else:
        n = check_cu_seqlens(cu_seqlens, batch=B, length=L, device=x.device)
        check_coefficients(p, log_q, gamma, hx, D=D, device=x.device)
        check_per_document("hx", hx, n, "(n, D, N)")
    check_tensor("omega", omega, (D,), REAL_DTYPES, device=x.device, dims="(D,)")
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    check_backend(backend)
    weighted = return_state and log_q.requires_grad and torch.is_grad_enabled()
    y, h = cema_op(x, p, log_q, gamma, omega, hx, return_state, weighted, backend, cu_seqlens)[:2]
    return y, (h if return_state else None)
