"""Triton backend of TimestepNorm: one program per (row, group), time in chunks of T steps.

Forward (one pass over x). A program walks its (b, g) column chunk by chunk. A chunk is a
[T, BLOCK_D] tile of x (padded rows are never read): per step it takes the group mean and
population variance (two-pass inside the row), turns each step into a Welford summary
(n, mu, M2) = (1, gmu, gvar) (identity (0, 0, 0) on padded steps), runs ``tl.associative_scan``
with Chan's merge over the T summaries, and merges the carried summary of all earlier chunks
(the prior (prev_count, prev_mean, prev_count * prev_var) first) into every in-chunk prefix.
The chunk total becomes the new carry. Then y = (x - mu_t) rstd_t scale + bias is written, and
the per-step mu, rstd, gmu ([B, L, G], ~3/Dg of x) are saved for the backward. Statistics are
taken relative to a shift K (per (b, g): the lower median of the finite unpadded row means of
the FIRST chunk, ``tl.sort``) as in the torch backend, which takes the median over all of L
(an extra pass over x); K only changes rounding. Counts are summed exactly in float64; the
merge weights are formed in fp32 (the torch backend also rounds them to fp32).

Backward (one pass over x and dy, in reverse). Chunks are visited from the last to the first,
with the reverse scan (docs/math.md, TimestepNorm) in the torch backend's scaled form: per chunk, the in-chunk
reverse inclusive sums of the V and U increments come from ``tl.cumsum(..., reverse=True)``,
the carries from later chunks are float64 scalars (exact chunk-level Jacobian: each step adds
its term, no rescaling), then dx is written. dscale / dbias: each program sums its features
over time in a float64 carry, writes a [B, D] partial, and the host sums over the rows in
float64 (deterministic, no atomics).

Packed rows (``cu_seqlens``, x of shape (1, L, D) holding n documents): each document is a row
of its own, read in place (no gathers, no padding, one launch for all documents). The ``PACKED``
constexpr makes program (d, g) take its first step and length from cu_seqlens[d] and
cu_seqlens[d + 1] instead of the batch index (b * L, L); every per-step pointer (x, y, dy, dx,
the mask, mu, rstd, gmu) is offset by that start and the per-row state (prior, returned state,
K, dmean / dvar, dprev) is indexed by the document, so a document runs exactly as if alone from
its own prior: its K is the median of its own first chunk, and an empty document (length 0)
returns its prior state and passes dmean / dvar through. The dscale / dbias partials are per
document ([n, D]). The host never reads the bounds: the per-document step counts are a running
count of unpadded steps gathered at cu_seqlens.

Semantics match the torch backend: padded steps output 0, are not counted and leave the state
alone (NaN/inf in a padded x never reach anything); genuine NaN/inf propagate; prev_count = 0
ignores prev_mean / prev_var; a segment with nothing observed returns the prior state and
passes dmean / dvar straight through.
"""
from __future__ import annotations

import torch

from . import Saved
from .._triton_common import (HAVE_TRITON, device_reasons, dtype_reasons, grid_launches, release_reasons, store_rounded,
                              tl, triton)

#: every config this backend may launch with (the tuner chooses among them; each is AOT-compiled
#: in tests); the first values are the default
CONFIG_SPACE: dict = {"block_elems": (4096,), "num_warps": (8,)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}
#: feature-tile widths: a launch takes the smallest >= Dg = D / G
BLOCK_D_TIERS = (16, 64, 256, 1024)
MAX_T = 64
MIN_T = 4


#: the dtype names of the launches in _triton_common.RELEASE_PRUNES
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def not_supported_reasons(x, num_groups=None, packed=False) -> list[str]:
    why = device_reasons(x, op="timestep_norm") + dtype_reasons("x", x)
    if num_groups and x.dim() == 3 and x.shape[2] // num_groups > BLOCK_D_TIERS[-1]:
        why.append(f"group size D / G = {x.shape[2] // num_groups} > {BLOCK_D_TIERS[-1]}; use backend='torch' "
                   "or more groups")
    if not why and x.numel() >= 2**31:
        why.append("x has >= 2**31 elements; use backend='torch'")
    if not why and num_groups and x.dim() == 3:  # the tile width this launch takes
        _, block_d = _tiling(x.shape[2] // num_groups, DEFAULT_CONFIG["block_elems"])
        why += release_reasons("timestep_norm", x.device, dtype=_DTYPE_NAMES[x.dtype], BLOCK_D=block_d,
                               packed=bool(packed))
    return why


def _tiling(Dg, block_elems):
    for bd in BLOCK_D_TIERS:
        if Dg <= bd:
            return max(MIN_T, min(MAX_T, block_elems // bd)), bd
    raise ValueError(f"group size {Dg} > {BLOCK_D_TIERS[-1]}")


if HAVE_TRITON:

    @triton.jit
    def _chan(na, ma, Ma, nb, mb, Mb):
        """Chan's merge of Welford summaries (n, mean, M2): a earlier, b later (fp32 counts)."""
        n = na + nb
        ns = tl.maximum(n, 1.0)
        d = mb - ma
        return n, ma + d * (nb / ns), Ma + Mb + d * d * (na * nb / ns)

    @triton.jit
    def _fwd_chunk(b_x, live, t0, c_n, c_mu, c_M, mu0k, var0, eps, b_scale, b_bias, p_y, p_mu, p_rstd, p_gmu,
                   steps, D, G, Dg, OUT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """One chunk of a row ``steps`` long (pointers at its first step): b_x [BT, BD] = x - K
        (0 on padded rows); returns the carry after it."""
        o_r = tl.arange(0, BLOCK_T)
        o_t = t0 + o_r
        m_t = o_t < steps
        o_f = tl.arange(0, BLOCK_D)
        m_f = o_f < Dg
        m_x = live[:, None] & m_f[None, :]
        b_x = tl.where(m_x, b_x, 0.0)  # masked lanes hold -K
        b_gmu = tl.sum(b_x, axis=1) / Dg
        b_dev = tl.where(m_x, b_x - b_gmu[:, None], 0.0)
        b_gvar = tl.sum(b_dev * b_dev, axis=1) / Dg
        b_gmu = tl.where(live, b_gmu, 0.0)
        b_gvar = tl.where(live, b_gvar, 0.0)
        s_n, s_mu, s_M = tl.associative_scan((live.to(tl.float32), b_gmu, b_gvar), 0, _chan)
        # carry (+) in-chunk prefix: counts summed in float64 (exact past 2**24 steps), the merge
        # weights formed in fp32 (no float64 division: it is a slow subroutine with stack use on GPU)
        n = c_n + s_n.to(tl.float64)
        ns = tl.maximum(n.to(tl.float32), 1.0)
        frac = s_n / ns
        d = s_mu - c_mu
        b_mu = c_mu + d * frac
        b_M = c_M + s_M + d * d * (c_n.to(tl.float32) * frac)
        b_var = tl.where(n > 0, b_M / ns, var0)
        b_rstd = 1.0 / tl.sqrt(b_var + eps)
        b_mu_out = tl.where(n > 0, b_mu, mu0k)  # before any observation: the prior
        b_y = (b_x - b_mu_out[:, None]) * b_rstd[:, None] * b_scale[None, :] + b_bias[None, :]
        b_y = tl.where(live[:, None], b_y, 0.0)
        store_rounded(p_y + o_t[:, None].to(tl.int64) * D + o_f[None, :], b_y, m_t[:, None] & m_f[None, :], OUT_BF16)
        tl.store(p_mu + o_t * G, b_mu_out, mask=m_t)
        tl.store(p_rstd + o_t * G, b_rstd, mask=m_t)
        tl.store(p_gmu + o_t * G, b_gmu, mask=m_t)
        # the last tile row holds the total (rows past the row's end are identities)
        last = o_r == BLOCK_T - 1
        c_n = tl.sum(tl.where(last, n, 0.0), axis=0)
        c_mu = tl.sum(tl.where(last, b_mu, 0.0), axis=0)
        c_M = tl.sum(tl.where(last, b_M, 0.0), axis=0)
        return c_n, c_mu, c_M

    @triton.jit
    def _row_span(cu_ptr, r, L, PACKED: tl.constexpr):
        """(first step, number of steps) of row r: document r of a packed row (from cu_seqlens),
        or batch row r of a [B, L] layout."""
        if PACKED:
            start = tl.load(cu_ptr + r)
            return start, (tl.load(cu_ptr + r + 1) - start).to(tl.int32)
        else:
            return r.to(tl.int64) * L, L

    @triton.jit
    def _timestep_norm_fwd_kernel(
        x_ptr, y_ptr, scale_ptr, bias_ptr, pad_ptr, pc_ptr, pm_ptr, pv_ptr,
        mu_ptr, rstd_ptr, gmu_ptr, k_ptr, mean_ptr, var_ptr, cu_ptr,
        L, D, G, Dg, eps, Y0,
        PACKED: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)  # batch row, or document when PACKED
        g = Y0 + tl.program_id(1)  # group (Y0: grid_launches splits more than 65535 groups)
        start, steps = _row_span(cu_ptr, b, L, PACKED)
        o_f = tl.arange(0, BLOCK_D)
        m_f = o_f < Dg
        o_r = tl.arange(0, BLOCK_T)
        b_scale = tl.load(scale_ptr + g * Dg + o_f, mask=m_f, other=0.0)  # [BD] fp32
        b_bias = tl.load(bias_ptr + g * Dg + o_f, mask=m_f, other=0.0)
        n0 = tl.load(pc_ptr + b).to(tl.float64)
        mu0 = tl.load(pm_ptr + b * G + g)
        var0 = tl.load(pv_ptr + b * G + g)
        p_x = x_ptr + start * D + g * Dg
        p_y = y_ptr + start * D + g * Dg
        p_s = start * G + g  # [B, L, G] saved statistics
        # chunk 0 is loaded once: it also fixes the shift K from its finite unpadded row means
        live = (o_r < steps) & (tl.load(pad_ptr + start + o_r, mask=o_r < steps, other=1) == 0)
        b_x = tl.load(p_x + o_r[:, None].to(tl.int64) * D + o_f[None, :], mask=live[:, None] & m_f[None, :],
                      other=0.0).to(tl.float32)  # [BT, BD]
        raw = tl.sum(b_x, axis=1) / Dg
        ok = live & (raw == raw) & (tl.abs(raw) < float("inf"))
        # lower median of those row means (robust to an outlier step, like torch's nanmedian)
        srt = tl.sort(tl.where(ok, raw, float("inf")), 0)
        cnt = tl.sum(ok.to(tl.int32), axis=0)
        K = tl.sum(tl.where(o_r == (cnt - 1) // 2, srt, 0.0), axis=0)
        K = tl.where(cnt > 0, K, 0.0)  # no finite unpadded step in chunk 0: no shift
        # carry: the prior, relative to K (ignored when prev_count = 0)
        c_n = n0
        c_mu = tl.where(n0 > 0, mu0 - K, 0.0)
        c_M = tl.where(n0 > 0, var0 * n0.to(tl.float32), 0.0)
        c_n, c_mu, c_M = _fwd_chunk(b_x - K, live, 0, c_n, c_mu, c_M, mu0 - K, var0, eps, b_scale, b_bias,
                                    p_y, mu_ptr + p_s, rstd_ptr + p_s, gmu_ptr + p_s, steps, D, G, Dg,
                                    OUT_BF16, BLOCK_T, BLOCK_D)
        for t0 in range(BLOCK_T, steps, BLOCK_T):
            o_t = t0 + o_r
            m_t = o_t < steps
            live = m_t & (tl.load(pad_ptr + start + o_t, mask=m_t, other=1) == 0)
            b_x = tl.load(p_x + o_t[:, None].to(tl.int64) * D + o_f[None, :], mask=live[:, None] & m_f[None, :],
                          other=0.0).to(tl.float32) - K
            c_n, c_mu, c_M = _fwd_chunk(b_x, live, t0, c_n, c_mu, c_M, mu0 - K, var0, eps, b_scale, b_bias,
                                        p_y, mu_ptr + p_s, rstd_ptr + p_s, gmu_ptr + p_s, steps, D, G, Dg,
                                        OUT_BF16, BLOCK_T, BLOCK_D)
        observed = c_n > n0
        tl.store(k_ptr + b * G + g, K)
        tl.store(mean_ptr + b * G + g, tl.where(observed, c_mu + K, mu0))
        tl.store(var_ptr + b * G + g, tl.where(observed, c_M / tl.maximum(c_n, 1.0).to(tl.float32), var0))

    @triton.jit
    def _timestep_norm_bwd_kernel(
        x_ptr, dy_ptr, dx_ptr, scale_ptr, pad_ptr, pc_ptr, nend_ptr, mu_ptr, rstd_ptr, gmu_ptr, mu0_ptr, k_ptr,
        dmean_ptr, dvar_ptr, dscale_ptr, dbias_ptr, dpm_ptr, dpv_ptr, cu_ptr,
        L, D, G, Dg, Y0,
        PACKED: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)  # batch row, or document when PACKED
        g = Y0 + tl.program_id(1)  # group (Y0: grid_launches splits more than 65535 groups)
        start, steps = _row_span(cu_ptr, b, L, PACKED)
        o_f = tl.arange(0, BLOCK_D)
        m_f = o_f < Dg
        o_r = tl.arange(0, BLOCK_T)
        b_scale = tl.load(scale_ptr + g * Dg + o_f, mask=m_f, other=0.0)
        n0 = tl.load(pc_ptr + b).to(tl.float64)
        n_end = tl.load(nend_ptr + b).to(tl.float64)
        K = tl.load(k_ptr + b * G + g)
        mu0 = tl.load(mu0_ptr + b * G + g)
        dmean = tl.load(dmean_ptr + b * G + g)
        dvar = tl.load(dvar_ptr + b * G + g)
        inv_end = 1.0 / tl.maximum(n_end.to(tl.float32), 1.0)  # fp32: no float64 division on GPU
        c_V = (dvar * inv_end).to(tl.float64)  # V carry from later chunks (float64)
        c_U = (dmean * inv_end).to(tl.float64)
        c_after = n_end * 0.0  # live steps in later chunks
        acc_ds = tl.zeros([BLOCK_D], tl.float64)
        acc_db = tl.zeros([BLOCK_D], tl.float64)
        p_x = start * D + g * Dg
        p_s = start * G + g
        n_chunks = tl.cdiv(steps, BLOCK_T)
        for c in range(0, n_chunks):
            t0 = (n_chunks - 1 - c) * BLOCK_T
            o_t = t0 + o_r
            m_t = o_t < steps
            live = m_t & (tl.load(pad_ptr + start + o_t, mask=m_t, other=1) == 0)
            m_x = live[:, None] & m_f[None, :]
            p_tile = p_x + o_t[:, None].to(tl.int64) * D + o_f[None, :]
            b_x = tl.where(m_x, tl.load(x_ptr + p_tile, mask=m_x, other=0.0).to(tl.float32) - K, 0.0)
            b_dy = tl.load(dy_ptr + p_tile, mask=m_x, other=0.0).to(tl.float32)
            b_mu = tl.load(mu_ptr + p_s + o_t * G, mask=live, other=0.0)
            b_r = tl.load(rstd_ptr + p_s + o_t * G, mask=live, other=0.0)
            b_gmu = tl.load(gmu_ptr + p_s + o_t * G, mask=live, other=0.0)
            # mu_{t-1}: the carried mean entering step t (the prior at t = 0)
            b_mup = tl.load(mu_ptr + p_s + (o_t - 1) * G, mask=live & (o_t > 0), other=0.0)
            b_mup = tl.where(o_t == 0, mu0, b_mup)
            # counts: n_t = n_end - (live steps after t)
            w = live.to(tl.float64)
            after = c_after + tl.cumsum(w, 0, reverse=True) - w
            n_t = n_end - after
            n_prev = n_t - w
            inv_n = tl.where(live, 1.0 / tl.maximum(n_t.to(tl.float32), 1.0), 0.0)
            b_xc = tl.where(m_x, b_x - b_mu[:, None], 0.0)
            b_dys = b_dy * b_scale[None, :]
            b_ds = tl.sum(b_dys * b_xc, axis=1)  # [BT]
            b_db = tl.sum(b_dys, axis=1)
            acc_ds += tl.sum(b_dy * b_xc * b_r[:, None], axis=0).to(tl.float64)
            acc_db += tl.sum(b_dy, axis=0).to(tl.float64)
            a_v = tl.where(live, -0.5 * b_r * b_r * b_r * b_ds * inv_n, 0.0)
            b_V = (c_V + tl.cumsum(a_v, 0, reverse=True).to(tl.float64)).to(tl.float32)
            cross = tl.where(n_prev > 0, 2.0 * b_V * (b_gmu - b_mup) * inv_n, 0.0)
            a_u = tl.where(live, b_r * b_db * inv_n + cross, 0.0)
            # U_{t+1} = carry - (reverse sum over s > t)
            b_Un = (c_U - (tl.cumsum(a_u, 0, reverse=True) - a_u).to(tl.float64)).to(tl.float32)
            rest = (b_Un + 2.0 * b_V * (b_gmu - b_mu)) / Dg
            b_dx = rest[:, None] + (b_x - b_gmu[:, None]) * (2.0 / Dg * b_V)[:, None]
            b_dx += (b_dys - (b_db * inv_n / Dg)[:, None]) * b_r[:, None]
            b_dx = tl.where(live[:, None], b_dx, 0.0)
            store_rounded(dx_ptr + p_tile, b_dx, m_t[:, None] & m_f[None, :], OUT_BF16)
            c_V += tl.sum(a_v, axis=0).to(tl.float64)
            c_U -= tl.sum(a_u, axis=0).to(tl.float64)
            c_after += tl.sum(w, axis=0)
        tl.store(dscale_ptr + b * D + g * Dg + o_f, acc_ds.to(tl.float32), mask=m_f)
        tl.store(dbias_ptr + b * D + g * Dg + o_f, acc_db.to(tl.float32), mask=m_f)
        nothing = n_end == n0
        U0 = c_U.to(tl.float32)
        V0 = c_V.to(tl.float32)
        tl.store(dpm_ptr + b * G + g, tl.where(nothing, dmean, tl.where(n0 > 0, (n0 * c_U).to(tl.float32), 0.0)))
        tl.store(dpv_ptr + b * G + g, tl.where(nothing, dvar, tl.where(n0 > 0, (n0 * c_V).to(tl.float32), 0.0)))


def _steps_seen(padding_mask, cu_seqlens):
    """Unpadded steps per row: per batch row, or with cu_seqlens per document (from a running
    count gathered at the document bounds: no host read of cu_seqlens)."""
    live = ~padding_mask
    if cu_seqlens is None:
        return live.sum(1)
    ends = torch.cat((live.new_zeros(1, dtype=torch.int64), live[0].cumsum(0)))[cu_seqlens]
    return ends[1:] - ends[:-1]


def forward(x, scale, bias, prev_count, prev_mean, prev_var, padding_mask, num_groups, eps,
                      cu_seqlens=None, block_elems=4096, num_warps=8):
    """Returns (y, count, mean, var, saved) with ``saved`` the tensors timestep_norm_bwd needs.
    With ``cu_seqlens`` (int64 (n + 1,), values already checked) x is one packed row of n
    documents and the states (prev_*, count, mean, var, K) have one row per document."""
    B, L, D = x.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    G = num_groups
    Dg = D // G
    f32 = torch.float32
    x = x.contiguous()
    dev = x.device
    y = torch.empty_like(x)
    mu = torch.empty(B, L, G, dtype=f32, device=dev)
    rstd = torch.empty(B, L, G, dtype=f32, device=dev)
    gmu = torch.empty(B, L, G, dtype=f32, device=dev)
    K = torch.empty(n, G, dtype=f32, device=dev)
    mean = torch.empty(n, G, dtype=f32, device=dev)
    var = torch.empty(n, G, dtype=f32, device=dev)
    pm = prev_mean.to(f32).contiguous()
    pv = prev_var.to(f32).contiguous()
    pc = prev_count.to(torch.int64).contiguous()
    pad = padding_mask.contiguous().view(torch.uint8)
    T, BD = _tiling(Dg, block_elems)
    sc, bi = scale.to(f32).contiguous(), bias.to(f32).contiguous()
    for grid, y0, _ in grid_launches(n, G):
        _timestep_norm_fwd_kernel[grid[:2]](
            x, y, sc, bi, pad, pc, pm, pv, mu, rstd, gmu, K, mean, var, cu_seqlens, L, D, G, Dg, float(eps), y0,
            PACKED=cu_seqlens is not None, OUT_BF16=x.dtype == torch.bfloat16, BLOCK_T=T, BLOCK_D=BD,
            num_warps=num_warps,
        )
    count = pc + _steps_seen(padding_mask, cu_seqlens)
    saved = Saved(x, scale, mu, rstd, gmu, padding_mask, prev_count, pm - K, K)
    return y, count, mean, var, saved


def backward(dy, dmean, dvar, saved, num_groups, cu_seqlens=None, block_elems=4096, num_warps=8):
    """Returns (dx, dscale, dbias, dprev_mean, dprev_var), all float32; ``cu_seqlens`` as in the
    forward (dmean, dvar and the gradients of the prior state: one row per document)."""
    x, scale, mu, rstd, gmu, padding_mask, prev_count, mu0, K = saved
    B, L, D = x.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    G = num_groups
    Dg = D // G
    f32 = torch.float32
    dev = x.device
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    dscale_p = torch.empty(n, D, dtype=f32, device=dev)
    dbias_p = torch.empty(n, D, dtype=f32, device=dev)
    dpm = torch.empty(n, G, dtype=f32, device=dev)
    dpv = torch.empty(n, G, dtype=f32, device=dev)
    pc = prev_count.to(torch.int64).contiguous()
    n_end = pc + _steps_seen(padding_mask, cu_seqlens)
    dmean = torch.zeros(n, G, dtype=f32, device=dev) if dmean is None else dmean.to(f32).contiguous()
    dvar = torch.zeros(n, G, dtype=f32, device=dev) if dvar is None else dvar.to(f32).contiguous()
    T, BD = _tiling(Dg, block_elems)
    sc, pad, mu0 = scale.to(f32).contiguous(), padding_mask.contiguous().view(torch.uint8), mu0.contiguous()
    for grid, y0, _ in grid_launches(n, G):
        _timestep_norm_bwd_kernel[grid[:2]](
            x, dy, dx, sc, pad, pc, n_end, mu, rstd, gmu, mu0, K, dmean, dvar, dscale_p, dbias_p, dpm, dpv,
            cu_seqlens, L, D, G, Dg, y0,
            PACKED=cu_seqlens is not None, OUT_BF16=x.dtype == torch.bfloat16, BLOCK_T=T, BLOCK_D=BD,
            num_warps=num_warps,
        )
    # deterministic reduction of the per-row (per-document) partials
    dscale = dscale_p.to(torch.float64).sum(0).to(f32)
    dbias = dbias_p.to(torch.float64).sum(0).to(f32)
    return dx, dscale, dbias, dpm, dpv
