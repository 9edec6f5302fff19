"""PyTorch backend of ema_hidden: reverse-layout exact power tables + batched real matmuls.

With e_j = L-1-j, the forward is an analysis sum over the (front-padded) sequence
(``ops/_vandermonde.py``): V = sum_j q**e_j x_j and, when log_q needs a gradient, W = sum_j e_j q**e_j x_j
in the same matmul (4N instead of 2N columns), then h = p V + q**L hx. V and W are c(B D N): saving
them instead of x keeps the backward free of any pass over x except the synthesis of dx:

    dx_j   = Re sum_n conj(g) p q**e_j            (synthesis with coefficient conj(g) p)
    dp     = sum_b Re(conj(g) V)
    dlog_q = sum_b g conj(p W + L q**L hx)
    dhx    = g conj(q**L)
"""
from __future__ import annotations

import torch

from .._vandermonde import analyze, exact_powers, power_table, reversed_table, synthesize

#: power_block = T of the two-level table q**e = Q1[.] Q2[.] (see cema_kernel).
CONFIG_SPACE: dict = {"power_block": (64, 16, 32, 128, 256)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(**inputs) -> list[str]:
    return []  # every device and dtype torch supports


def power_L(log_q, length):
    """q**L c(D N), evaluated exactly like a table entry."""
    return exact_powers(log_q, torch.tensor([length]))[..., 0]


def forward(x, p, log_q, hx, weighted=False, *, power_block, table=None):
    """-> (h c(B D N), V c(B D N), W c(B D N) or None); x is computed in p's dtype.
    ``table``: a prebuilt forward power_table to share (it is reversed here)."""
    L = x.shape[-1]
    table = reversed_table(table if table is not None else power_table(log_q, L, power_block))
    V, W = analyze(x.to(p.dtype), table, weighted=weighted)            # [B, D, N]
    h = p * V
    if hx is not None:
        h = h + power_L(log_q, L) * hx
    return h, V, W


def backward(dh, p, log_q, hx, V, W, length, needs=(True, True, True, True), *, power_block,
                   table=None):
    """-> (dx r(B D L) in p's dtype or None, dp r(D N), dlog_q c(D N), dhx c(B D N) or None)."""
    need_x, need_p, need_lq, need_hx = needs
    dx = None
    if need_x:
        table = reversed_table(table if table is not None else power_table(log_q, length, power_block))
        dx = synthesize(dh.conj() * p, table)                          # [B, D, L]
    return (dx, *coefficient_grads(dh, p, log_q, hx, V, W, length, need_p, need_lq))


def coefficient_grads(dh, p, log_q, hx, V, W, length, need_p, need_lq):
    """(dp, dlog_q, dhx or None) from the saved sums V = sum_j q**(L-1-j) x_j and its
    exponent-weighted twin W: O(B D N) products shared by every backend of ema_hidden."""
    gc = dh.conj()
    dp = (gc * V).real.sum(0) if need_p else torch.zeros_like(p)
    qL = power_L(log_q, length) if hx is not None else None
    if need_lq:
        dq = p * W
        if hx is not None:
            dq = dq + (length * qL) * hx
        dlq = (dh * dq.conj()).sum(0)
    else:
        dlq = torch.zeros_like(log_q)
    dhx = dh * qL.conj() if hx is not None else None
    return dp, dlq, dhx
