"""PyTorch backend of cema_kernel: two-level exact power tables + batched real matmuls.

k = synthesize(p*gamma, Q(j)) and b = synthesize(gamma*hx, Q(j+1)) (see ``ops/_vandermonde.py``);
the backward is the analysis of dk and db against the same tables:

    S  = sum_j dk_j q**j,       S1 = sum_j dk_j j q**j
    dp = Re(S gamma),  dgamma = conj(S p),  dlog_q = conj(S1 p gamma)
    Tb = sum_t db_t q**(t+1),   T1b = sum_t db_t (t+1) q**(t+1)       (per batch b)
    dhx = conj(Tb gamma),  dgamma += sum_b conj(Tb hx_b),  dlog_q += sum_b conj(T1b gamma hx_b)

Nothing is saved between forward and backward but the inputs: the tables cost O(D N (T + L/T))
float64 exps, far less than the O(D N L) matmuls they feed.
"""
from __future__ import annotations

import torch

from .._vandermonde import analyze, power_table, shifted, synthesize

#: power_block = T, the inner table size of q**j = Q1[j mod T] Q2[j div T]; it trades the table
#: size D N (T + L/T) and the [D, L/T, 2N] operand against the matmul shape. Tunable per length bucket.
CONFIG_SPACE: dict = {"power_block": (64, 16, 32, 128, 256)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(**inputs) -> list[str]:
    return []  # every device and dtype torch supports


def forward(p, log_q, gamma, length, hx, *, power_block, table=None):
    """-> (k r(D L), b r(B D L) or None) in p's dtype. ``table``: a prebuilt power_table to share."""
    table = table if table is not None else power_table(log_q, length, power_block)
    k = synthesize(p * gamma, table)                                   # [D, L]
    b = None
    if hx is not None:
        b = synthesize(gamma * hx, shifted(table))                     # [B, D, L]
    return k, b


def backward(dk, db, p, log_q, gamma, length, hx, needs=(True, True, True, True), *, power_block,
                    table=None):
    """-> (dp r(D N), dlog_q c(D N), dgamma c(D N), dhx c(B D N) or None); dk/db may be None."""
    real = p.dtype
    need_lq = needs[1]
    table = table if table is not None else power_table(log_q, length, power_block)
    dp = torch.zeros_like(p)
    dlq = torch.zeros_like(log_q)
    dgamma = torch.zeros_like(gamma)
    dhx = None if hx is None else torch.zeros_like(hx)
    if dk is not None:
        S, S1 = analyze(dk.to(real), table, weighted=need_lq)         # [D, N]
        dp = (S * gamma).real
        dgamma = (S * p).conj_physical()
        if need_lq:
            dlq = (S1 * (p * gamma)).conj_physical()
    if db is not None and hx is not None:
        T, T1 = analyze(db.to(real), shifted(table), weighted=need_lq)  # [B, D, N]
        dhx = (T * gamma).conj_physical()
        dgamma = dgamma + (T * hx).sum(0).conj_physical()
        if need_lq:
            dlq = dlq + ((T1 * hx).sum(0) * gamma).conj_physical()
    return dp, dlq, dgamma, dhx
