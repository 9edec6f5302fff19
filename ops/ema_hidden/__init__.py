"""CEMA last hidden state (docs/math.md, ema_hidden): the state that continues the EMA in the next segment.

    h[b, d, n] = p[d,n] sum_j q[d,n]**(L-1-j) x[b,d,j] + q[d,n]**L hx[b,d,n]

equal to h_{L-1} of h_t = p x_t + q h_{t-1}, h_{-1} = hx (0 if None). Running it on two halves with
the first half's h passed as hx equals running it on the whole sequence (streaming).

Numerical rule: the powers q**(L-1-j) come from the same exact two-level tables as cema_kernel
(``ops/_vandermonde.py``, reverse layout), and q**L from one float64 evaluation; x is read in its
own dtype (fp16/bf16/fp32/fp64) and accumulated in the coefficient dtype.

Packed rows (``cu_seqlens``, n documents) run as document rows (``ops/_packing.py``) with every
document at the END of its row: the zeros in front add nothing to sum_j q**(len-1-j) x_j, so the
backends' ordinary forward without hx gives each document's p V (and V, W) exactly, one call per
bucket. The initial states' term q**len hx (and its gradients) is added per document here, with
q**len evaluated once in float64 from the lengths (``exact_powers``). An empty document has h = hx.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_coefficients, check_sequence
from ...autotune import registry as autotune
from .._dispatch import OpBackends, check_backend
from .._library import absent, as_dtype, custom_op, empty_like, grad_or_none
from .._packing import check_cu_seqlens, check_per_document, plan
from .._vandermonde import exact_powers

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
    space=BACKENDS.config_spaces,
)


def _select(x, p, log_q, hx, backend):
    return BACKENDS.select(backend, {"x": x, "p": p, "log_q": log_q, "hx": hx}, device=x.device, dtype=x.dtype)


def _document_rows(cu_seqlens, L):
    """The buckets of a packed row with every document at the end of its row."""
    return plan(cu_seqlens, L, align="right").buckets


def _decay(log_q, lengths):
    """q**len c(n D N) for every document, each entry evaluated once in float64."""
    return exact_powers(log_q, lengths).movedim(-1, 0)


def packed_state(x, p, log_q, hx, cu_seqlens, weighted, backend):
    """The last state of every document of the packed row x r(1 D L): (h c(n D N), V c(n D N),
    W c(n D N) or None), V and W each document's sums sum_j q**e_j x_j and sum_j e_j q**e_j x_j
    (e_j = len-1-j; 0 for an empty document). One ema_hidden backend call per bucket; cema
    returns its state through this too."""
    n, D, N = cu_seqlens.shape[0] - 1, x.shape[1], p.shape[1]
    cplx = log_q.dtype
    h = log_q.new_zeros(n, D, N)
    V = log_q.new_zeros(n, D, N)
    W = log_q.new_zeros(n, D, N) if weighted else None
    for bucket in _document_rows(cu_seqlens, x.shape[-1]):
        xr = bucket.rows(x, 2)
        impl = _select(xr, p, log_q, None, backend)
        hr, Vr, Wr = impl.module.forward(xr, p, log_q, None, weighted, **impl.config)
        h.index_copy_(0, bucket.docs, hr.to(cplx))
        V.index_copy_(0, bucket.docs, Vr.to(cplx))
        if weighted:
            W.index_copy_(0, bucket.docs, Wr.to(cplx))
    if hx is not None:
        h = h + _decay(log_q, plan(cu_seqlens, x.shape[-1], align="right").lengths) * hx
    return h, V, W


def packed_state_grads(dh, x, p, log_q, hx, V, W, needs, cu_seqlens, backend):
    """(dx r(1 D L) in p's dtype or None, dp r(D N), dlog_q c(D N), dhx c(n D N) or None) of
    :func:`packed_state` from its saved V and W (None: recomputed here when log_q needs a
    gradient). dx comes from one backend call per bucket; the coefficient gradients are those
    of the documents summed, the hx terms added per document."""
    need_x, need_p, need_lq, need_hx = needs
    L = x.shape[-1]
    if need_lq and W is None:
        _, V, W = packed_state(x, p, log_q, None, cu_seqlens, True, backend)
    dx = x.new_empty(x.shape, dtype=p.dtype) if need_x else None
    dp, dlq = torch.zeros_like(p), torch.zeros_like(log_q)
    if need_x or need_p or need_lq:
        for bucket in _document_rows(cu_seqlens, L):
            dhr, Vr = dh.index_select(0, bucket.docs), V.index_select(0, bucket.docs)
            Wr = W.index_select(0, bucket.docs) if need_lq else None
            xr = bucket.rows(x, 2)
            impl = _select(xr, p, log_q, None, backend)
            dxr, dpr, dlqr, _ = impl.module.backward(dhr, p, log_q, None, Vr, Wr, bucket.size,
                                                     (need_x, need_p, need_lq, False), **impl.config)
            if need_x:
                bucket.put(dxr, dx, 2)
            if need_p:
                dp += dpr
            if need_lq:
                dlq += dlqr
    dhx = None
    if hx is not None:
        lengths = plan(cu_seqlens, L, align="right").lengths
        qlen = _decay(log_q, lengths)
        if need_lq:  # d(q**len hx) / dlog_q = len q**len hx
            dlq += (dh * (lengths.to(p.dtype)[:, None, None] * qlen * hx).conj()).sum(0)
        if need_hx:
            dhx = dh * qlen.conj()
    return dx, dp, dlq, dhx


def _fwd_fake(x, p, log_q, hx, weighted, backend, cu_seqlens=None):
    B, D, N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1, x.shape[1], p.shape[1]
    h = log_q.new_empty(B, D, N)
    return h, empty_like(h), empty_like(h) if weighted else absent(log_q)


@custom_op("ema_hidden", _fwd_fake)
def ema_hidden_op(x: Tensor, p: Tensor, log_q: Tensor, hx: Optional[Tensor], weighted: bool,
                  backend: str, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (h c(B D N), and for the backward V c(B D N) and W c(B D N) (an empty placeholder unless
    ``weighted``: W is needed for the gradient of log_q only)); B = n documents with
    ``cu_seqlens``."""
    if cu_seqlens is not None:
        h, V, W = packed_state(x, p, log_q, hx, cu_seqlens, weighted, backend)
        return h, V, (W if weighted else absent(log_q))
    impl = _select(x, p, log_q, hx, backend)
    h, V, W = impl.module.forward(x, p, log_q, hx, weighted, **impl.config)
    return h, V, (W if weighted else absent(log_q))


def _bwd_fake(dh, x, p, log_q, hx, V, W, weighted, needs, backend, cu_seqlens=None):
    return (empty_like(x) if needs[0] else absent(x), empty_like(p), empty_like(log_q),
            empty_like(hx) if hx is not None and needs[3] else absent(log_q))


@custom_op("ema_hidden_bwd", _bwd_fake)
def ema_hidden_bwd_op(dh: Tensor, x: Tensor, p: Tensor, log_q: Tensor, hx: Optional[Tensor], V: Tensor,
                      W: Tensor, weighted: bool, needs: list[bool], backend: str,
                      cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx or a placeholder, dp, dlog_q, dhx or a placeholder) in the inputs' dtypes. ``W`` is
    the forward's weighted sums when it ran ``weighted``, else its placeholder."""
    W = W if weighted else None  # None: the forward ran without log_q needing a gradient
    if cu_seqlens is not None:
        dx, dp, dlq, dhx = packed_state_grads(dh, x, p, log_q, hx, V, W, tuple(needs), cu_seqlens, backend)
    else:
        impl = _select(x, p, log_q, hx, backend)
        if W is None and needs[2]:  # a caller that asked for the gradient anyway: compute the weighted sums now
            _, V, W = impl.module.forward(x, p, log_q, hx, True, **impl.config)
        dx, dp, dlq, dhx = impl.module.backward(dh, p, log_q, hx, V, W, x.shape[-1], tuple(needs), **impl.config)
    return (as_dtype(dx, x.dtype) if needs[0] else absent(x), as_dtype(dp, p.dtype), as_dtype(dlq, log_q.dtype),
            as_dtype(dhx, hx.dtype) if hx is not None and needs[3] else absent(log_q))


def _setup(ctx, inputs, output):
    x, p, log_q, hx, weighted, backend, cu_seqlens = inputs
    h, V, W = output
    ctx.save_for_backward(x, p, log_q, hx, V, W, cu_seqlens)
    ctx.weighted, ctx.backend = weighted, backend
    ctx.mark_non_differentiable(V, W)  # residuals: no gradient (fewer outputs for autograd)
    ctx.set_materialize_grads(False)  # h is the one differentiable output: no zeros for the others


def _backward(ctx, dh, _dV, _dW):
    if dh is None:  # an undefined gradient of h (grads are not zero-filled, see _setup): none for the inputs
        return (None,) * len(ctx.needs_input_grad)
    x, p, log_q, hx, V, W, cu_seqlens = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    dx, dp, dlq, dhx = ema_hidden_bwd_op(dh, x, p, log_q, hx, V, W, ctx.weighted, needs, ctx.backend, cu_seqlens)
    return (grad_or_none(dx, needs[0]), grad_or_none(dp, needs[1]), grad_or_none(dlq, needs[2]),
            grad_or_none(dhx, needs[3] and hx is not None), None, None, None)


ema_hidden_op.register_autograd(_backward, setup_context=_setup)


def ema_hidden(x: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, hx: torch.Tensor | None = None, *,
               backend: str = "auto", cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden state of the CEMA recurrence over x.

    Args:
        x: r(B D L), float16/bfloat16/float32/float64.
        p: r(D N) float32 or float64.
        log_q: c(D N), complex64 with float32 p, complex128 with float64 p.
        hx: c(B D N) previous state, or None (zero state); c(n D N) with cu_seqlens.
        backend: "auto", "torch", "triton" or "cuda".
        cu_seqlens: None, or an integer tensor (n + 1,) on x's device delimiting n documents
            packed in one row (0 first, non-decreasing, L last; empty documents allowed), with
            x of batch size 1: returns each document's last state, from its own hx[d] (or 0).

    Returns:
        h c(B D N) in log_q's dtype (c(n D N) with cu_seqlens; an empty document's is its hx,
        or 0). Gradients flow to x (in x's dtype), p, log_q and hx.

    Example::

        h1 = ema_hidden(x[..., :512], p, log_q)
        h = ema_hidden(x[..., 512:], p, log_q, h1)      # == ema_hidden(x, p, log_q)
        # documents of 100, 23 and 900 steps packed into one row x r(1 D 1023), hx c(3 D N):
        h = ema_hidden(x, p, log_q, hx, cu_seqlens=torch.tensor([0, 100, 123, 1023]))
    """
    B, D, L = check_sequence(x)
    if cu_seqlens is None:
        check_coefficients(p, log_q, None, hx, D=D, B=B, device=x.device)
    else:
        n = check_cu_seqlens(cu_seqlens, batch=B, length=L, device=x.device)
        check_coefficients(p, log_q, None, hx, D=D, device=x.device)
        check_per_document("hx", hx, n, "(n, D, N)")
    check_backend(backend)
    weighted = log_q.requires_grad and torch.is_grad_enabled()
    return ema_hidden_op(x, p, log_q, hx, weighted, backend, cu_seqlens)[0]

