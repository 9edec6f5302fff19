"""Exact powers q**j of complex CEMA coefficients, and the Vandermonde sums built from them.

Every CEMA op (kernel, bias, last state, and all their gradients) is a sum over a sequence index j
of a real weight times q**e(j), with e(j) an integer exponent up to ~2**20. Two things must hold
for fp32 to keep ~1e-7 relative accuracy at such exponents:

* no power is built by repeated multiplication (rounding errors would grow with j), and
* the phase j*arg(q) is never formed in fp32 (its absolute error would be ~j * 2**-24 rad).

The two-level table. Split the exponent as e = e2[m] + e1[r] with j = m*T + r (T = the
``power_block`` tuning knob, m < M = ceil(L/T), r < T), so that q**e = Q2[m] * Q1[r] with

    Q1[d, n, r] = q**e1[r]   (T entries per coefficient)
    Q2[d, n, m] = q**e2[m]   (M entries per coefficient).

Each table entry is a power of an arithmetic progression of exponents, from
:func:`progression_powers`: for fp32 coefficients, a float64 product of at most ~log2(L) factors
each evaluated by :func:`exact_powers` (the exponent e*log_q formed in float64, exact since
e < 2**29 times a 24-bit fp32 mantissa fits in 53 bits; the phase reduced mod 2*pi in float64,
fmod being exact; exp/cos/sin in float64), so ~1e-15 relative from exact, then rounded ONCE to
complex64; for fp64 coefficients each entry is exact_powers' own, rounded once to complex128. A
power is then at most two such roundings and one complex product away from exact, whatever j is.

The sums become batched REAL matmuls (the product of two complex numbers' real part is a 2-term
dot product, so stacking real and imaginary parts turns N complex terms into 2N real ones):

* synthesis  out[..., d, m*T + r] = Re sum_n coef[..., d, n] Q2[d, n, m] Q1[d, n, r]
    = [..., D, M, 2N] @ [D, 2N, T] with rows [Re A, -Im A] (A = coef*Q2) and columns [Re Q1; Im Q1];
* analysis   S[..., d, n]  = sum_j w[..., d, j] q**e(j)
             S1[..., d, n] = sum_j w[..., d, j] e(j) q**e(j)   (the d/dlog_q weight: no 1/q anywhere)
    = [..., D, M, T] @ [D, T, 4N] giving P[m] = sum_r w[m, r] Q1[r] and P1[m] = sum_r w e1[r] Q1[r],
    then S = sum_m Q2[m] P[m] and S1 = sum_m Q2[m] (e2[m] P[m] + P1[m]), an O(D N M) reduction.

Nothing of size D*N*L is materialised beyond the [D, L/T, 2N] matmul operand.

Three layouts of the sequence index, all served by ONE evaluated table (Q1 holds q**0..q**T):

* forward, e(j) = j, positions padded at the END up to M*T (the kernel k);
* shifted, e(j) = j + 1 (the bias b uses q**(t+1)): Q1 is the view q**1..q**T of the same table;
* reverse, e(j) = L-1-j (ema_hidden and its gradients), positions padded at the FRONT up to M*T,
  so that e = (M-1-m)*T + (T-1-r): both tables flipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PowerTable", "exact_powers", "progression_powers", "power_table", "shifted", "reversed_table",
           "synthesize", "analyze"]

_TWO_PI = 2.0 * math.pi


def exact_powers(log_q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """q**e = exp(e * log_q) for every entry of log_q and every integer exponent e.

    Args:
        log_q: c(...) complex64 or complex128.
        exponents: integer or float tensor (E,) of integers with |e| < 2**29.

    Returns:
        c(..., E) in log_q's dtype, each entry rounded once from a float64 evaluation.
    """
    lq = log_q.to(torch.complex128)
    e = exponents.to(device=log_q.device, dtype=torch.float64)
    # Both products are exact for fp32 log_q (24-bit mantissa times a <=29-bit integer).
    real = log_q.real.dtype
    # exp underflows (to 0) on a slow path of the CPU's libm; below the floor the power
    # rounds to 0 in the output dtype anyway (fp32: exp(-110) < half the least subnormal)
    floor = -746.0 if real == torch.float64 else -110.0
    magnitude = torch.exp((lq.real.unsqueeze(-1) * e).clamp_min(floor))
    phase = torch.fmod(lq.imag.unsqueeze(-1) * e, _TWO_PI)
    # = torch.polar(magnitude, phase).to(log_q.dtype), the same float64 products rounded once;
    # polar is not vectorised on the CPU (slower than these real ops)
    return torch.complex((magnitude * torch.cos(phase)).to(real), (magnitude * torch.sin(phase)).to(real))


#: Up to this many powers progression_powers evaluates each one (exact_powers): doubling's
#: per-level calls cost more than it saves there.
_PROGRESSION_MIN = 16


def progression_powers(log_q: torch.Tensor, count: int, step: int = 1, first: int = 0) -> torch.Tensor:
    """q**(first + step*j) for j < count: :func:`exact_powers` of an arithmetic progression of
    exponents, with ~log2(count) exact evaluations per coefficient instead of count.

    For complex64 outputs (complex128 ones, and up to ``_PROGRESSION_MIN`` powers, are
    exact_powers' own) by doubling, in complex128: with P[j] = q**(first + step*j) known for j < m,
    P[m + j] = P[j] * q**(m*step), each factor q**E evaluated by :func:`exact_powers` (exponent
    formed and phase reduced in float64). Entry j is then a product of at most
    ceil(log2(count)) + 1 factors, each within ~1 float64 rounding of exact, so it is ~1e-15
    relative from exact before the single rounding to the output dtype: the fp32 result is
    exact_powers' up to a rare last-bit difference where the float64 value lies within ~1e-15 of
    a rounding boundary. (Powers that underflow float64 are below fp32's least subnormal by far
    and round to 0 either way.) The O(count) work is one complex multiply per entry instead of
    exact_powers' exp, cos, sin and fmod, several times faster on the CPU.

    Args:
        log_q: c(...) complex64 or complex128.
        count: number of powers, >= 1.
        step, first: integers with |first + step*j| < 2**29 for every j < count.

    Returns:
        c(..., count) in log_q's dtype.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    dev = log_q.device
    if log_q.dtype == torch.complex128 or count <= _PROGRESSION_MIN:
        # float64 outputs keep exact_powers' single rounding; few powers gain nothing by doubling
        return exact_powers(log_q, torch.arange(count, device=dev) * step + first)
    doublings = (count - 1).bit_length()                            # factors q**(step 2**i), i < doublings
    exps = torch.tensor([first] + [step << i for i in range(doublings)], device=dev)
    factors = exact_powers(log_q.to(torch.complex128), exps)        # [..., 1 + doublings] complex128
    out = torch.empty(*log_q.shape, count, dtype=torch.complex128, device=dev)
    out[..., :1] = factors[..., :1]
    m = 1
    for i in range(doublings):                                      # m = 2**i entries known
        w = min(m, count - m)
        torch.mul(out[..., :w], factors[..., 1 + i:2 + i], out=out[..., m:m + w])
        m += w
    return out.to(log_q.dtype)


@dataclass(frozen=True)
class PowerTable:
    """q**e(j) = Q2[..., m] * Q1[..., r] for positions j = m*T + r of a padded length M*T."""

    q1: torch.Tensor  # c[D, N, T]
    q2: torch.Tensor  # c[D, N, M]
    e1: torch.Tensor  # r[T]   exponent of each Q1 column (compute dtype)
    e2: torch.Tensor  # r[M]   exponent of each Q2 column
    length: int       # L, the number of real positions
    reverse: bool     # padding at the front (reverse) or at the end (forward)
    q1_ext: torch.Tensor | None = None  # c[D, N, T+1] = q**0..q**T (forward table only)

    @property
    def block(self) -> int:
        return self.q1.shape[-1]

    @property
    def blocks(self) -> int:
        return self.q2.shape[-1]

    @property
    def pad(self) -> int:
        return self.blocks * self.block - self.length


def power_table(log_q: torch.Tensor, length: int, block: int) -> PowerTable:
    """The forward table, e(j) = j, for sequence length ``length`` with block size ``block``.

    Args:
        log_q: c(D N).
        length: L >= 1.
        block: T, the ``power_block`` knob; clamped to L so tiny lengths do no wasted work.

    Returns:
        A :class:`PowerTable`; :func:`shifted` and :func:`reversed_table` derive the other two
        layouts from it without evaluating any new power.

    Example::

        table = power_table(log_q, 4096, 64)       # q**j, j < 4096
        k = synthesize(p * gamma, table)           # r(D 4096)
    """
    if block < 1:
        raise ValueError(f"power_block must be >= 1, got {block}")
    T = min(block, length)
    M = -(-length // T)
    real = torch.float64 if log_q.dtype == torch.complex128 else torch.float32
    dev = log_q.device
    e1 = torch.arange(T + 1, device=dev, dtype=torch.int64)   # one extra power, q**T, for shifted()
    e2 = torch.arange(M, device=dev, dtype=torch.int64) * T
    q1_ext = progression_powers(log_q, T + 1)
    return PowerTable(q1_ext[..., :T], progression_powers(log_q, M, step=T), e1[:T].to(real), e2.to(real),
                      length, False, q1_ext)


def shifted(table: PowerTable) -> PowerTable:
    """The forward table with every exponent increased by one, e(j) = j + 1 (the bias's q**(t+1))."""
    if table.q1_ext is None:
        raise ValueError("shifted() needs a forward table from power_table()")
    return PowerTable(table.q1_ext[..., 1:], table.q2, table.e1 + 1, table.e2, table.length, False)


def reversed_table(table: PowerTable) -> PowerTable:
    """The reverse layout e(j) = L-1-j: with the front padding, (M-1-m)*T + (T-1-r) is the forward
    exponent of the mirrored block and column, so both tables are simply flipped."""
    if table.reverse:
        raise ValueError("reversed_table() needs a forward table from power_table()")
    return PowerTable(table.q1.flip(-1), table.q2.flip(-1), table.e1.flip(0), table.e2.flip(0), table.length, True)


def _real_rows(a: torch.Tensor) -> torch.Tensor:
    # [..., 2N]: Re(a * z) = [Re a, -Im a] . [Re z, Im z]
    return torch.cat((a.real, -a.imag), dim=-1)


def synthesize(coef: torch.Tensor, table: PowerTable) -> torch.Tensor:
    """out[..., d, j] = Re sum_n coef[..., d, n] * q[d, n]**e(j).

    Args:
        coef: c(... D N), any leading batch dims.
        table: from :func:`power_table` for the same log_q.

    Returns:
        r(... D L) in the table's real dtype.
    """
    a = coef.unsqueeze(-2) * table.q2.transpose(-1, -2)             # [..., D, M, N]
    q1 = table.q1
    cols = torch.cat((q1.real, q1.imag), dim=-2)                    # [D, 2N, T]
    out = torch.matmul(_real_rows(a), cols)                          # [..., D, M, T]
    out = out.flatten(-2)                                            # [..., D, M*T]
    if table.pad == 0:
        return out
    return out[..., table.pad:] if table.reverse else out[..., : table.length]


def analyze(w: torch.Tensor, table: PowerTable, weighted: bool):
    """S = sum_j w[..., d, j] q**e(j) and, if ``weighted``, S1 = sum_j w[..., d, j] e(j) q**e(j).

    Args:
        w: r(... D L) in the table's real dtype.
        table: from :func:`power_table`.
        weighted: also return S1 (the log_q-derivative sum); otherwise S1 is None.

    Returns:
        (S c(... D N), S1 c(... D N) or None).
    """
    T, M, N = table.block, table.blocks, table.q1.shape[-2]
    if table.pad:
        w = F.pad(w, (table.pad, 0) if table.reverse else (0, table.pad))
    # contiguous: an upstream gradient may be an expanded (stride-0) tensor, e.g. from .sum(),
    # which sends CPU bmm to a per-matrix fallback, far slower than one batched call.
    w = w.contiguous().view(*w.shape[:-1], M, T)                     # [..., D, M, T]
    q1 = table.q1
    parts = [q1.real, q1.imag]
    if weighted:
        parts += [q1.real * table.e1, q1.imag * table.e1]
    cols = torch.cat(parts, dim=-2).transpose(-1, -2)                # [D, T, 2N or 4N]
    res = torch.matmul(w, cols)                                      # [..., D, M, 2N or 4N]
    q2 = table.q2.transpose(-1, -2)                                  # [D, M, N]
    P = torch.complex(res[..., :N], res[..., N:2 * N])               # [..., D, M, N]
    S = (P * q2).sum(-2)
    if not weighted:
        return S, None
    P1 = torch.complex(res[..., 2 * N:3 * N], res[..., 3 * N:])
    S1 = ((P * table.e2.unsqueeze(-1) + P1) * q2).sum(-2)
    return S, S1
