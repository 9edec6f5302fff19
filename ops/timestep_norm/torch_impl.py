"""PyTorch backend of TimestepNorm: a parallel Welford scan forward, a scaled-carry backward.

Shift. All statistics are taken of x - K with K [B, G] the median of the finite row means of the
segment (see ``_shift``); they are shift-invariant, and only the returned mean adds K back. In
fp32 this keeps x - mu_t at the precision of the data's spread instead of ulp(mean).

Forward. Each unmasked step t of a (batch, group) column is one observation (n=1, mean=gmu_t,
M2=gvar_t) in "per-step" units, so the running population variance is M2/n. Observations are
combined with Chan's pairwise merge, which is associative and never subtracts large sums::

    delta = mu_b - mu_a,  n = n_a + n_b
    mu = mu_a + delta * n_b / n,   M2 = M2_a + M2_b + delta^2 * n_a * n_b / n

(n = 0 is the identity: an empty side returns the other side exactly, no division by zero).
The scan is two-level with chunk length T (``DEFAULT_CONFIG["chunk"]``): a log-depth
Hillis-Steele scan inside each chunk, a Hillis-Steele exclusive scan of the chunk totals with the
prior (prev_count, prev_mean, prev_count * prev_var) merged in front, then one merge of each chunk
prefix into its in-chunk prefixes. Error grows with log(L), not L, and a large common mean or a
wild first step never cancels (cumsum(x) / cumsum(x^2) loses everything in fp32 there).
Counts are exact (float64, so streaming past 2^24 tokens stays exact).

Backward. With n_t the count after step t, w_t = 1 on unmasked steps, r_t = rstd_t and per group
ds_t = sum_i dy_i (x_i - mu_t) scale_i, db_t = sum_i dy_i scale_i, the reverse scan of docs/math.md, TimestepNorm
(carries (u, v) from (dmean, dvar); u <- c1 du - 2 c1 c2 dv (gmu - mu_prev), v <- c1 dv) becomes,
with the carries divided by the running count so that each step ADDS a term instead of
rescaling the carry::

    V_t    = dvar / n_L  - sum_{s >= t} w_s 0.5 r_s^3 ds_s / n_s                     (= dgvar_t)
    U_t    = dmean / n_L - sum_{s >= t} w_s [r_s db_s + 2 V_s (gmu_s - mu_{s-1})] / n_s
    dgmu_t = U_{t+1} - r_t db_t / n_t + 2 V_t (gmu_t - mu_t)
    dx_i   = w_t [dy_i r_t scale_i + dgmu_t / Dg + 2 dgvar_t (x_i - gmu_t) / Dg]
    dprev_mean = n_0 U_0,  dprev_var = n_0 V_0   (n_0 = prev_count; both are (dmean, dvar)
                                                  passed straight through when no step is observed)

(U_t = u_{t-1} / n_{t-1}, V_t = dv_t / n_t in the unscaled carries.) mu_{s-1} is the CARRIED
mean entering step s (as upstream), and (gmu_s - mu_{s-1}) / n_s is used rather than the equal
mu_s - mu_{s-1}, a difference of two rounded running means. The two reverse sums run over all
of L, so they are two-level: a cumsum inside chunks of T in the compute dtype, chunk totals
accumulated in float64, one rounding at the end (the dscale/dbias column sums likewise).
Padded steps enter only through torch.where, so NaN/inf in a padded x (or a 1/0 count before the
first observation) reaches nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import acc_dtype
from .._host_sync import any_or_device
from .._packing import cached
from . import Saved

#: chunk: the time-chunk length T of the two-level scans (forward Welford scan and backward
#: reverse sums). Any T >= 1 gives the same result up to rounding.
CONFIG_SPACE: dict = {"chunk": (64, 16, 32, 128, 256)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(x, num_groups=None, packed=False) -> list[str]:
    return []  # every device and dtype torch supports


# ----------------------------------------------------------------------------------------------
# Welford / Chan merge and the parallel scan
# ----------------------------------------------------------------------------------------------

def _merge(a, b, guard_empty: bool = True):
    """Chan's merge of summaries a = (n, mu, M2) (earlier) and b (later); n is float64 [..., 1].

    With ``guard_empty`` an empty side (n = 0) returns the other side bit-exactly, whatever mean
    it carries (the prior with prev_count = 0). Inside the scans every empty summary is exactly
    (0, 0, 0), for which the plain formula is already exact, so they skip the guard.
    """
    na, ma, Ma = a
    nb, mb, Mb = b
    n = na + nb
    n_safe = n.clamp_min(1.0)
    frac = (nb / n_safe).to(ma.dtype)  # share of b; exact ratio of exact counts, one rounding
    weight = (na * nb / n_safe).to(ma.dtype)
    delta = mb - ma
    mu = torch.addcmul(ma, delta, frac)
    m2 = torch.addcmul(Ma + Mb, delta * delta, weight)
    if guard_empty:
        a_empty, b_empty = na == 0, nb == 0
        mu = torch.where(b_empty, ma, torch.where(a_empty, mb, mu))
        m2 = torch.where(b_empty, Ma, torch.where(a_empty, Mb, m2))
    return n, mu, m2


def _merge_scan(a, b):
    """The merge inside the scans, where every empty summary is exactly (0, 0, 0)."""
    return _merge(a, b, guard_empty=False)


def _merge_segmented(a, b):
    """Merge of flagged summaries (f, n, mu, M2): f = a document starts in the span. A later span
    holding a start does not see the earlier one (associative: the segmented-scan operator)."""
    fa, *sa = a
    fb, *sb = b
    merged = _merge_scan(sa, sb)
    return (fa | fb, *(torch.where(fb, later, m) for later, m in zip(sb, merged)))


def _hillis_steele(s, dim: int, merge=_merge_scan):
    """Inclusive scan of summaries along ``dim`` in ceil(log2(len)) merge rounds."""
    size = s[0].shape[dim]
    step = 1
    while step < size:
        head = [t.narrow(dim, 0, step) for t in s]  # already final after this round
        earlier = [t.narrow(dim, 0, size - step) for t in s]
        later = [t.narrow(dim, step, size - step) for t in s]
        merged = merge(earlier, later)
        s = tuple(torch.cat((h, m), dim=dim) for h, m in zip(head, merged))
        step *= 2
    return s


def _welford_scan(n_obs, gmu, gvar, prior, chunk: int):
    """States after every step: returns (n [B, L, 1] float64, mu [B, L, G], M2 [B, L, G]).

    n_obs [B, L, 1] float64 (1 = observation, 0 = padded), gmu/gvar [B, L, G] (zeros on padded
    steps), prior = (n0 [B, 1], mu0 [B, G], M2_0 [B, G]).
    """
    B, L, G = gmu.shape
    T = max(1, min(chunk, L))
    nc = -(-L // T)
    pad = nc * T - L
    obs = (n_obs, gmu, gvar)
    if pad:
        obs = tuple(F.pad(t, (0, 0, 0, pad)) for t in obs)  # zero summaries = identity
    obs = tuple(t.reshape(B, nc, T, t.shape[-1]) for t in obs)  # [B, nc, T, G]
    local = _hillis_steele(obs, dim=2)  # prefixes inside each chunk
    n0, mu0, m20 = prior
    if nc == 1:  # one chunk (short segments, decoding): its prefix is the prior itself
        carry = (n0[:, None], mu0[:, None], m20[:, None])  # [B, 1, G]
    else:
        totals = tuple(t[:, :, -1] for t in local)  # [B, nc, G]
        incl = _hillis_steele(totals, dim=1)
        # Exclusive prefix of chunk c = prior (+) totals[0..c-1].
        excl = tuple(F.pad(t[:, :-1], (0, 0, 1, 0)) for t in incl)
        carry = _merge((n0[:, None], mu0[:, None], m20[:, None]), excl)  # [B, nc, G]
    out = _merge(tuple(t[:, :, None] for t in carry), local)  # [B, nc, T, G]
    return tuple(t.reshape(B, nc * T, t.shape[-1])[:, :L] for t in out)


def _segmented_welford_scan(starts, n_obs, gmu, gvar, chunk: int):
    """_welford_scan of one packed row whose documents restart the state: ``starts`` [1, L, 1]
    bool marks each document's first step, into which the caller has merged its prior.

    The same two levels, on flagged summaries (_merge_segmented): in-chunk prefixes, a scan of
    the chunk totals, then each chunk's carry merged into its prefixes up to the chunk's first
    document start (a prefix that saw a start keeps its own value)."""
    B, L, G = gmu.shape
    T = max(1, min(chunk, L))
    nc = -(-L // T)
    pad = nc * T - L
    obs = (starts, n_obs, gmu, gvar)
    if pad:
        obs = tuple(F.pad(t, (0, 0, 0, pad)) for t in obs)  # no start, zero summaries = identity
    obs = tuple(t.reshape(B, nc, T, t.shape[-1]) for t in obs)  # [B, nc, T, G]
    local = _hillis_steele(obs, dim=2, merge=_merge_segmented)
    if nc == 1:
        out = local[1:]
    else:
        totals = tuple(t[:, :, -1] for t in local)  # [B, nc, G]
        incl = _hillis_steele(totals, dim=1, merge=_merge_segmented)[1:]
        carry = tuple(F.pad(t[:, :-1], (0, 0, 1, 0))[:, :, None] for t in incl)  # exclusive; identity first
        # unguarded: an empty carry is exactly (0, 0, 0) here (priors arrive folded, unseen ones as zeros)
        merged = _merge_scan(carry, local[1:])
        out = tuple(torch.where(local[0], own, m) for own, m in zip(local[1:], merged))
    return tuple(t.reshape(B, nc * T, t.shape[-1])[:, :L] for t in out)


# ----------------------------------------------------------------------------------------------
# Two-level sums (fp32 inside a chunk, float64 across chunks)
# ----------------------------------------------------------------------------------------------

def _reverse_cumsum(v: torch.Tensor, chunk: int, init: torch.Tensor | None = None) -> torch.Tensor:
    """out[:, t] = init + sum_{s >= t} v[:, s] along dim 1 of v [B, L, G]; init [B, G] float64."""
    B, L, G = v.shape
    T = max(1, min(chunk, L))
    nc = -(-L // T)
    vc = F.pad(v, (0, 0, 0, nc * T - L)).reshape(B, nc, T, G)
    local = vc.flip(2).cumsum(2).flip(2)  # [B, nc, T, G], sums within the chunk
    tot = local[:, :, 0].to(torch.float64)  # [B, nc, G]
    after = tot.flip(1).cumsum(1).flip(1)
    after = F.pad(after[:, 1:], (0, 0, 0, 1))  # sum over later chunks, exclusive
    if init is not None:
        after = after + init[:, None]
    out = (local.to(torch.float64) + after[:, :, None]).to(v.dtype)
    return out.reshape(B, nc * T, G)[:, :L]


def _sum_rows(v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum v [B, L, D] over (B, L): chunks of T rows in v's dtype, the partial sums in float64."""
    B, L, D = v.shape
    T = max(1, min(chunk, L))
    full = (L // T) * T
    out = v[:, :full].reshape(B, L // T, T, D).sum(2).to(torch.float64).sum((0, 1))
    if full < L:
        out = out + v[:, full:].sum(1).to(torch.float64).sum(0)
    return out


# ----------------------------------------------------------------------------------------------
# Rows: what differs between a batch of rows and a packed row of documents
# ----------------------------------------------------------------------------------------------

def _shift(xg, live):
    """A per-(batch, group) value K near the bulk of the data: the median of the finite row means.

    Everything is computed on x - K. Where K/2 <= x <= 2K that subtraction is exact (Sterbenz),
    and the running mean is then stored as a small offset from K: x - mu_t keeps the precision of
    the spread of x instead of ulp(mean) (with |mean| = 1e3 and std 1 in fp32, storing mu_t itself
    costs ~3e-5 relative in y). A median ignores an outlier step; K only changes rounding.
    """
    rough = xg.mean(-1)  # [B, L, G]
    ok = live[..., None] & torch.isfinite(rough)
    K = torch.nanmedian(torch.where(ok, rough, float("nan")), dim=1).values  # [B, G]
    return torch.where(torch.isnan(K), 0.0, K)  # nothing finite observed: no shift


class _Rows:
    """A batch of B independent rows, each starting from its own prior: states are [B, ...]."""

    def __init__(self, padding_mask, chunk):
        self.live, self.chunk = ~padding_mask, chunk
        self.L = padding_mask.shape[1]

    def at_steps(self, state):
        """A per-row state [B, ...] broadcast over the steps: [B, 1, ...]."""
        return state[:, None]

    def shift(self, xg):
        return _shift(xg, self.live)

    def scan(self, n_obs, gmu, gvar, prior):
        return _welford_scan(n_obs, gmu, gvar, prior, self.chunk)

    def observed(self):
        """int64 [B]: the unpadded steps of each row."""
        return self.live.sum(1)

    def running_count(self, prev_count):
        """float64 [B, L]: the count after each step (exact: integers in float64)."""
        return prev_count.to(torch.float64)[:, None] + self.live.to(torch.float64).cumsum(1)

    def last(self, v):
        """v [B, L, ...] at each row's last step."""
        return v[:, -1]

    def first(self, v):
        return v[:, 0]

    def previous(self, v, before):
        """v [B, L, ...] at the step before each step; ``before`` [B, ...] at each row's first step."""
        return torch.cat((before[:, None], v[:, :-1]), dim=1)

    def following(self, v, after):
        """v [B, L, ...] at the step after each step; ``after`` [B, ...] at each row's last step."""
        return torch.cat((v[:, 1:], after[:, None]), dim=1)

    def reverse_sum(self, v, init):
        """init + the sum of v [B, L, G] over the steps >= t of each row; init [B, G] float64."""
        return _reverse_cumsum(v, self.chunk, init=init)


def _document_steps(cu, L):
    """Each step's document (the last one starting at or before it: empty documents share a
    start), and whether it is its document's first / last step; [L] each."""
    t = torch.arange(L, device=cu.device)
    doc = torch.searchsorted(cu[1:], t, right=True)
    return doc, t == cu[:-1][doc], t + 1 == cu[1:][doc]


class _Documents:
    """One packed row (B = 1) of n documents, document d at steps [cu[d], cu[d + 1]), each from
    its own prior: states are [n, ...]. Every per-document quantity is a segmented version of
    _Rows' (scans restart at document starts; sums are differences of float64 prefix sums), all
    on [L, G]-sized tensors: the x-sized passes are those of an unpacked row."""

    def __init__(self, padding_mask, chunk, cu_seqlens):
        self.live, self.chunk = ~padding_mask, chunk
        L = self.L = padding_mask.shape[1]
        self.start, self.end = cu_seqlens[:-1], cu_seqlens[1:]  # [n]
        self.doc, self.is_start, self.is_last = cached(cu_seqlens, ("timestep_norm steps", L),
                                                       lambda: _document_steps(cu_seqlens, L))
        # live steps before each step (and at L): per-document counts are differences
        self.live_before = F.pad(self.live[0].to(torch.int64).cumsum(0), (1, 0))  # [L + 1]

    def _step(self, mask, rank):
        """The bool [L] mask as [1, L, 1...] against a [1, L, ...] tensor of ``rank`` dims."""
        return mask.view(1, -1, *([1] * (rank - 2)))

    def at_steps(self, state):
        return state[self.doc][None]  # [1, L, ...]

    def shift(self, xg):
        """_shift per document: the lower median of its finite live row means, found with ONE
        sort per group of the key (document, value): the document in the high 32 bits, the value's
        order-preserving fp32 bit pattern in the low ones (a value excluded from the median sorts
        as +inf, after every finite one). Ordering fp64 means by their fp32 rounding can only swap
        near-equal values, which moves K by less than an fp32 ulp: K only changes rounding."""
        L = self.L
        rough = xg.mean(-1)[0].t()  # [G, L]
        ok = self.live[0] & torch.isfinite(rough)
        bits = torch.where(ok, rough, float("inf")).float().view(torch.int32).to(torch.int64)
        order_bits = torch.where(bits >= 0, bits + 2**31, -1 - bits)  # in [0, 2^32), monotone in the value
        _, by_key = ((self.doc << 32) | order_bits).sort(dim=-1)
        v = rough.gather(-1, by_key)  # document by document, its finite values first, ascending
        ok_before = F.pad(ok.to(torch.int64).cumsum(-1), (1, 0))  # [G, L + 1]
        n_ok = (ok_before[:, self.end] - ok_before[:, self.start]).t()  # [n, G]
        lower = (self.start[:, None] + (n_ok - 1).clamp_min(0) // 2).clamp(max=max(L - 1, 0))
        K = v.t().gather(0, lower) if L else rough.new_zeros(n_ok.shape)
        return torch.where(n_ok > 0, K, 0.0)

    def scan(self, n_obs, gmu, gvar, prior):
        """The prior of each document is merged into its first step (an unseen prior, n0 = 0, is
        the identity), then a scan that restarts at every start."""
        n0, mu0, m20 = prior
        seen = n0 > 0
        starts = self._step(self.is_start, 3)
        obs = (n_obs, gmu, gvar)
        if any_or_device(seen):  # (training rows start from nothing: no pass over the steps)
            p = tuple(self.at_steps(t) for t in (n0, torch.where(seen, mu0, 0.0), torch.where(seen, m20, 0.0)))
            folded = _merge(p, obs)  # an empty side returns the other exactly
            obs = tuple(torch.where(starts, f, o) for f, o in zip(folded, obs))
        return _segmented_welford_scan(starts, *obs, self.chunk)

    def observed(self):
        return self.live_before[self.end] - self.live_before[self.start]

    def running_count(self, prev_count):
        counts = prev_count.to(torch.int64)[self.doc] + self.live_before[1:] - self.live_before[self.start][self.doc]
        return counts.to(torch.float64)[None]

    def last(self, v):
        """v [1, L, ...] at each document's last step (an empty document's value is arbitrary:
        every caller masks it with ``observed``)."""
        if not self.L:
            return v.new_zeros((self.end.shape[0], *v.shape[2:]))
        return v[0, (self.end - 1).clamp(0, self.L - 1)]

    def first(self, v):
        if not self.L:
            return v.new_zeros((self.end.shape[0], *v.shape[2:]))
        return v[0, self.start.clamp(max=self.L - 1)]

    def previous(self, v, before):
        shifted = torch.cat((v[:, :1], v[:, :-1]), dim=1)
        return torch.where(self._step(self.is_start, v.dim()), self.at_steps(before), shifted)

    def following(self, v, after):
        shifted = torch.cat((v[:, 1:], v[:, -1:]), dim=1)
        return torch.where(self._step(self.is_last, v.dim()), self.at_steps(after), shifted)

    def reverse_sum(self, v, init):
        """In float64 ([L, G] is small): the suffix sum of the whole row minus its value at the
        document's end."""
        R = F.pad(_reverse_cumsum(v.to(torch.float64), self.chunk), (0, 0, 0, 1))  # [1, L + 1, G]
        return (R[:, :-1] - R[:, self.end[self.doc]] + self.at_steps(init)).to(v.dtype)


def _rows(padding_mask, chunk, cu_seqlens):
    return _Rows(padding_mask, chunk) if cu_seqlens is None else _Documents(padding_mask, chunk, cu_seqlens)


# ----------------------------------------------------------------------------------------------
# Forward / backward
# ----------------------------------------------------------------------------------------------

def forward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
                      cu_seqlens=None, chunk=DEFAULT_CONFIG["chunk"]):
    """Returns (y, count, mean, var, saved) with ``saved`` the tensors timestep_norm_bwd needs.
    States are per row, or with ``cu_seqlens`` (x one packed row) per document."""
    B, L, D = x.shape
    G = num_groups
    acc = acc_dtype(x.dtype)
    rows = _rows(padding_mask, chunk, cu_seqlens)
    has_pad = any_or_device(padding_mask)  # without padding, skip the x-sized masking passes
    dead = padding_mask[..., None]  # [B, L, 1]
    mu0 = prev_mean.to(acc)
    var0 = prev_var.to(acc)

    xg = x.to(acc).reshape(B, L, G, D // G)
    K = rows.shift(xg) if L else torch.zeros_like(mu0)  # [rows or documents, G]
    xg = xg - rows.at_steps(K)[..., None]  # [B, L, G, Dg]; every statistic below is relative to K
    # Two-pass moments inside each row: mean first, then squared deviations from it.
    gmu = xg.mean(-1)  # [B, L, G]
    # Every x-sized temporary is a fresh allocation whose pages the kernel faults in again (glibc
    # hands large freed blocks back), so one scratch buffer serves the deviations and then y.
    dev = xg - gmu[..., None]
    gvar = dev.square_().mean(-1)
    if has_pad:  # a padded row's NaN/inf must not enter the scan
        gmu = torch.where(dead, 0.0, gmu)
        gvar = torch.where(dead, 0.0, gvar)
    n_obs = rows.live.to(torch.float64)[..., None]  # [B, L, 1]

    n0 = prev_count.to(torch.float64)[:, None]  # [rows or documents, 1]
    # With no prior observations the prior is ignored entirely (also a non-finite prev_var).
    m20 = torch.where(n0 > 0, var0 * n0.to(acc), 0.0)
    n, mu, m2 = rows.scan(n_obs, gmu, gvar, (n0, mu0 - K, m20))
    # Before the first observation the carried state is the prior itself.
    var = torch.where(n > 0, m2 / n.clamp_min(1.0).to(acc), rows.at_steps(var0))  # [B, L, G]
    rstd = torch.rsqrt(var + eps)

    scale_g = scale.to(acc).reshape(G, D // G)
    bias_g = bias.to(acc).reshape(G, D // G)
    y = torch.sub(xg, mu[..., None], out=dev).mul_(rstd[..., None])  # [B, L, G, Dg]
    y = torch.addcmul(bias_g, y, scale_g, out=y)
    if has_pad:
        y = torch.where(dead[..., None], 0.0, y)
    y = y.reshape(B, L, D).to(x.dtype)

    seen = rows.observed()
    count = prev_count.to(torch.int64) + seen
    if L:
        # A fully padded segment (or an empty document) hands the state back bit-exactly.
        observed = (seen > 0)[:, None]
        mean_out = torch.where(observed, rows.last(mu) + K, mu0)
        var_out = torch.where(observed, rows.last(var), var0)
    else:
        mean_out, var_out = mu0.clone(), var0.clone()
    saved = Saved(x, scale, mu, rstd, gmu, padding_mask, prev_count, mu0 - K, K)
    return y, count, mean_out, var_out, saved


def backward(dy, dmean, dvar, saved, num_groups, cu_seqlens=None, chunk=DEFAULT_CONFIG["chunk"]):
    """Returns (dx, dscale, dbias, dprev_mean, dprev_var), all in the accumulation dtype."""
    # mu, gmu and mu0 are relative to the shift K (see _shift); x is shifted again below.
    x, scale, mu, rstd, gmu, padding_mask, prev_count, mu0, K = saved
    B, L, D = x.shape
    G = num_groups
    Dg = D // G
    acc = mu.dtype
    rows = _rows(padding_mask, chunk, cu_seqlens)
    live = rows.live  # [B, L]
    has_pad = any_or_device(padding_mask)
    dead = padding_mask[..., None]  # [B, L, 1]
    dead4 = dead[..., None]  # [B, L, 1, 1]
    dmean64 = dmean.to(torch.float64)
    dvar64 = dvar.to(torch.float64)

    n0 = prev_count.to(torch.float64)  # [rows or documents]
    n = rows.running_count(prev_count)  # [B, L] count after step t
    n_end = n0 + rows.observed().to(torch.float64)
    inv_n = torch.where(live, 1.0 / n.clamp_min(1.0), 0.0).to(acc)[..., None]  # [B, L, 1], 0 if padded
    inv_n_end = (1.0 / n_end.clamp_min(1.0))[:, None]  # [rows or documents, 1] float64

    xg = x.to(acc).reshape(B, L, G, Dg) - rows.at_steps(K)[..., None]  # [B, L, G, Dg]
    dyg = dy.to(acc).reshape(B, L, G, Dg)
    xc = xg - mu[..., None]  # x - mu_t
    if has_pad:  # zero both factors so padded rows add exact zeros (never 0 * NaN) below
        dyg = torch.where(dead4, 0.0, dyg)
        xc = torch.where(dead4, 0.0, xc)
    scale_g = scale.to(acc).reshape(G, Dg)
    dys = dyg * scale_g  # [B, L, G, Dg]
    # x-sized temporaries reuse buffers (fresh ones cost a page fault per 4 KiB, see the forward).
    dyxc = xc.mul_(dyg)
    scratch = dyxc * scale_g
    ds = scratch.sum(-1)  # [B, L, G]
    db = dys.sum(-1)
    r = rstd
    dscale = _sum_rows(torch.mul(dyxc, r[..., None], out=scratch).reshape(B, L, D), chunk)
    dbias = _sum_rows(dyg.reshape(B, L, D), chunk)

    # V_t = dgvar_t: the variance carry divided by n_t (reverse inclusive sum).
    V = rows.reverse_sum(-0.5 * r * r * r * ds * inv_n, dvar64 * inv_n_end)  # [B, L, G]
    # mu_{t-1}: the carried mean entering step t (the prior mean at a first step).
    mu_prev = rows.previous(mu, mu0)  # [B, L, G]
    n_prev = rows.previous(n, n0)[..., None]  # [B, L, 1]
    # (gmu_t - mu_{t-1}) / n_t equals mu_t - mu_{t-1}, but that difference of two stored running
    # means would lose ulp(mu) * n_t relative; gmu_t - mu_{t-1} is O(spread). The term exists only
    # after an observation (c1 > 0): the guard keeps an arbitrary prior mean with prev_count = 0 out.
    cross = torch.where(n_prev > 0, 2.0 * V * (gmu - mu_prev) * inv_n, 0.0)
    a = torch.where(dead, 0.0, r * db * inv_n + cross)
    U_end = dmean64 * inv_n_end  # [rows or documents, G]
    U = rows.reverse_sum(-a, U_end)  # U_t: mean carry entering t from the right, / n_{t-1}
    U_next = rows.following(U, U_end.to(acc))  # U_{t+1}
    # dgmu_t = U_{t+1} - r_t db_t / n_t + 2 V_t (gmu_t - mu_t); its -r db / n part is kept apart:
    # dx = r (dy scale - db / (n Dg)) + [U_{t+1} + 2 V (gmu - mu)] / Dg + 2 V (x - gmu) / Dg.
    # Subtracting inside the bracket before scaling by r avoids cancelling two O(r |dy|) terms
    # when r is large and n small (var ~ 0, e.g. Dg = 1 at the first step: r = 1/sqrt(eps)).
    rest = (U_next + 2.0 * V * (gmu - mu)) / Dg  # [B, L, G]
    dx = torch.addcmul(rest[..., None], torch.sub(xg, gmu[..., None], out=scratch), (2.0 / Dg * V)[..., None],
                       out=xg)
    dx = dx.addcmul_(dys.sub_((db * inv_n / Dg)[..., None]), r[..., None])
    if has_pad:
        dx = torch.where(dead4, 0.0, dx)
    dx = dx.reshape(B, L, D)

    # Endpoints: the unscaled carries after step 0 are n_0 times the scaled ones. Nothing
    # observed in the segment (also n_L = 0): mean/var ARE prev_mean/prev_var, gradients pass
    # straight through.
    nothing = (rows.observed() == 0)[:, None]
    has_prior = (n0 > 0)[:, None]
    U0 = rows.first(U) if L else U_end.to(acc)
    V0 = rows.first(V) if L else (dvar64 * inv_n_end).to(acc)
    n0c = n0[:, None]  # float64: prev_count may exceed 2^24 in a long stream
    dprev_mean = torch.where(nothing, dmean.to(acc), torch.where(has_prior, (n0c * U0).to(acc), 0.0))
    dprev_var = torch.where(nothing, dvar.to(acc), torch.where(has_prior, (n0c * V0).to(acc), 0.0))
    return dx, dscale.to(acc), dbias.to(acc), dprev_mean, dprev_var
