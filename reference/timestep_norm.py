"""Reference TimestepNorm (causal cumulative group norm), forward and backward, float64 NumPy.

The definition of docs/math.md, TimestepNorm: per batch b and group g (Dg = D/G
contiguous features), each unmasked step t is ONE Welford observation carrying the step's group
mean gmu_t and population variance gvar_t. Starting from (prev_count, prev_mean, prev_var)::

    n' = n + 1,  c1 = n / n',  c2 = 1 / n'
    mu'  = c1 mu + c2 gmu_t
    var' = c1 var + c2 gvar_t + c1 c2 (gmu_t - mu)^2
    y_t  = (x_t - mu_t) / sqrt(var_t + eps) * scale + bias      (stats include step t)

A padded step (padding_mask True) outputs y = 0 and leaves (n, mu, var) untouched; whatever its x
holds (NaN included) never reaches anything; genuine inf/NaN inputs propagate (upstream skipped
infinities). The backward is the reverse scan of docs/math.md, TimestepNorm, with the carries
(u, v) started at the gradients of the returned (mean, var), and mu_prev = the CARRIED mean
before step t (the upstream CPU path used cummean[t-1], wrong after a padded step).

Sequential on purpose: one Python loop over time, vectorised only over (batch, group) where the
formula is the same for every element. This is the oracle, not a fast path.
"""
import numpy as np

from .terms import Magnitude


def _as_f64(a):
    return np.asarray(a, dtype=np.float64)


def _defaults(x, num_groups, prev_count, prev_mean, prev_var, padding_mask):
    x = _as_f64(x)
    B, L, D = x.shape
    G = int(num_groups)
    assert D % G == 0, "num_groups must divide D"
    n0 = np.zeros(B, dtype=np.int64) if prev_count is None else np.asarray(prev_count, dtype=np.int64)
    mu0 = np.zeros((B, G)) if prev_mean is None else _as_f64(prev_mean)
    var0 = np.ones((B, G)) if prev_var is None else _as_f64(prev_var)
    pad = np.zeros((B, L), dtype=bool) if padding_mask is None else np.asarray(padding_mask, dtype=bool)
    return x, G, n0, mu0, var0, pad


def _scan(x, G, n0, mu0, var0, pad):
    """Run the Welford recurrence; return every per-step quantity the forward and backward need."""
    B, L, D = x.shape
    xg = x.reshape(B, L, G, D // G)
    n = n0.astype(np.float64).copy()  # [B]
    mu, var = mu0.copy(), var0.copy()  # [B, G]
    out = {
        "gmu": np.zeros((B, L, G)),
        "mu_before": np.zeros((B, L, G)),  # carried mean entering step t
        "mu": np.zeros((B, L, G)),  # state after step t (carried state on padded steps)
        "var": np.zeros((B, L, G)),
        "n": np.zeros((B, L)),  # count after step t
    }
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(L):
            live = ~pad[:, t]  # [B]
            gmu = xg[:, t].mean(axis=-1)  # [B, G]
            gvar = ((xg[:, t] - gmu[..., None]) ** 2).mean(axis=-1)
            n_new = n + 1.0
            c1 = (n / n_new)[:, None]
            c2 = (1.0 / n_new)[:, None]
            mu_new = c1 * mu + c2 * gmu
            var_new = c1 * var + c2 * gvar + c1 * c2 * (gmu - mu) ** 2
            out["gmu"][:, t] = gmu
            out["mu_before"][:, t] = mu
            mu = np.where(live[:, None], mu_new, mu)
            var = np.where(live[:, None], var_new, var)
            n = np.where(live, n_new, n)
            out["mu"][:, t], out["var"][:, t], out["n"][:, t] = mu, var, n
    out["count"], out["mean"], out["final_var"] = n, mu, var
    return out


def timestep_norm(x, scale, bias, num_groups, prev_count=None, prev_mean=None, prev_var=None,
                  padding_mask=None, eps=1e-5):
    """x: (B, L, D); scale, bias: (D,); prev_count (B,) int; prev_mean, prev_var (B, G);
    padding_mask (B, L) bool, True = padded.  Returns (y (B, L, D), count (B,) int64,
    mean (B, G), var (B, G)), all float64 except count."""
    x, G, n0, mu0, var0, pad = _defaults(x, num_groups, prev_count, prev_mean, prev_var, padding_mask)
    B, L, D = x.shape
    s = _scan(x, G, n0, mu0, var0, pad)
    xg = x.reshape(B, L, G, D // G)
    scale_g = _as_f64(scale).reshape(G, D // G)
    bias_g = _as_f64(bias).reshape(G, D // G)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rstd = 1.0 / np.sqrt(s["var"] + eps)  # [B, L, G]
        y = (xg - s["mu"][..., None]) * rstd[..., None] * scale_g + bias_g
    y = np.where(pad[:, :, None, None], 0.0, y).reshape(B, L, D)
    count = n0 + (~pad).sum(axis=1).astype(np.int64)
    return y, count, s["mean"], s["final_var"]


def timestep_norm_bwd(dy, dmean, dvar, x, scale, bias, num_groups, prev_count, prev_mean, prev_var,
                      padding_mask, eps=1e-5):
    """Gradients of sum(dy*y) + sum(dmean*mean) + sum(dvar*var).

    Returns (dx (B, L, D), dscale (D,), dbias (D,), dprev_mean (B, G), dprev_var (B, G)).
    ``dmean``/``dvar`` may be None (zeros)."""
    x, G, n0, mu0, var0, pad = _defaults(x, num_groups, prev_count, prev_mean, prev_var, padding_mask)
    B, L, D = x.shape
    Dg = D // G
    s = _scan(x, G, n0, mu0, var0, pad)
    xg = x.reshape(B, L, G, Dg)
    dyg = _as_f64(dy).reshape(B, L, G, Dg)
    scale_g = _as_f64(scale).reshape(G, Dg)
    u = np.zeros((B, G)) if dmean is None else _as_f64(dmean).copy()  # carry: d/d(mean after t)
    v = np.zeros((B, G)) if dvar is None else _as_f64(dvar).copy()  # carry: d/d(var after t)
    n = s["count"].copy()
    dx = np.zeros((B, L, G, Dg))
    dscale = np.zeros((G, Dg))
    dbias = np.zeros((G, Dg))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(L - 1, -1, -1):
            live = ~pad[:, t]  # [B]
            c1 = ((n - 1.0) / n)[:, None]  # n = count after step t
            c2 = (1.0 / n)[:, None]
            mu_prev = s["mu_before"][:, t]
            mu = s["mu"][:, t]
            gmu = s["gmu"][:, t]
            r = 1.0 / np.sqrt(s["var"][:, t] + eps)  # [B, G]
            xc = xg[:, t] - mu[..., None]  # [B, G, Dg]
            dys = dyg[:, t] * scale_g
            ds = (dys * xc).sum(axis=-1)
            db = dys.sum(axis=-1)
            du = u - r * db  # total gradient w.r.t. mu_t
            dv = v - 0.5 * r ** 3 * ds  # total gradient w.r.t. var_t
            dgmu = c2 * du + 2.0 * c1 * c2 * dv * (gmu - mu_prev)
            dgvar = c2 * dv
            dxt = dys * r[..., None] + dgmu[..., None] / Dg + 2.0 * dgvar[..., None] * (xg[:, t] - gmu[..., None]) / Dg
            dx[:, t] = np.where(live[:, None, None], dxt, 0.0)
            dscale += np.where(live[:, None, None], dyg[:, t] * xc * r[..., None], 0.0).sum(axis=0)
            dbias += np.where(live[:, None, None], dyg[:, t], 0.0).sum(axis=0)
            u = np.where(live[:, None], c1 * du - 2.0 * c1 * c2 * dv * (gmu - mu_prev), u)
            v = np.where(live[:, None], c1 * dv, v)
            n = np.where(live, n - 1.0, n)
    return dx.reshape(B, L, D), dscale.reshape(D), dbias.reshape(D), u, v


# --- the magnitude of the terms (reference.terms.Magnitude) ---------------------------------------

def _scan_terms(x, scale, bias, G, n0, mu0, var0, pad, eps):
    """The forward of :func:`timestep_norm` on Magnitude values: y and the per-step statistics,
    each with the magnitude of its terms."""
    B, L, D = x.shape
    where = Magnitude.where
    X = Magnitude(x.reshape(B, L, G, D // G))
    scale_g, bias_g = Magnitude(_as_f64(scale).reshape(G, D // G)), Magnitude(_as_f64(bias).reshape(G, D // G))
    n = n0.astype(np.float64).copy()
    mu, var = Magnitude(mu0), Magnitude(var0)
    steps = {"X": X, "scale_g": scale_g, "gmu": [], "mu_before": [], "mu": [], "var": [], "y": []}
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(L):
            live = ~pad[:, t]
            xt = X[:, t]
            gmu = xt.mean(axis=-1)
            dev = xt - gmu[..., None]
            gvar = (dev * dev).mean(axis=-1)
            n_new = n + 1.0
            # the weights are exact here: their rounding, like every step's own, accumulates over
            # the scan (a random walk the measured budgets absorb); a worst-case sum growing with
            # the length would hide a drift of one unit per step
            c1, c2 = (n / n_new)[:, None], (1.0 / n_new)[:, None]
            mu_new = c1 * mu + c2 * gmu
            var_new = c1 * var + c2 * gvar + c1 * c2 * (gmu - mu) ** 2
            steps["gmu"].append(gmu)
            steps["mu_before"].append(mu)
            mu = where(live[:, None], mu_new, mu)
            var = where(live[:, None], var_new, var)
            n = np.where(live, n_new, n)
            steps["mu"].append(mu)
            steps["var"].append(var)
            rstd = 1.0 / (var + eps).sqrt()
            y = (xt - mu[..., None]) * rstd[..., None] * scale_g + bias_g
            steps["y"].append(where(pad[:, t, None, None], 0.0, y))
    steps["count"], steps["mean"], steps["final_var"] = n, mu, var
    return steps


def timestep_norm_terms(x, scale, bias, num_groups, prev_count=None, prev_mean=None, prev_var=None,
                        padding_mask=None, eps=1e-5):
    """The magnitude of the terms of (y, mean, var) of :func:`timestep_norm` (reference.terms):
    the normalisation propagated to first order (Magnitude), so that y of inputs far from zero is
    held to the size of x and its running mean, which x - mean cancels."""
    x, G, n0, mu0, var0, pad = _defaults(x, num_groups, prev_count, prev_mean, prev_var, padding_mask)
    B, L, D = x.shape
    s = _scan_terms(x, scale, bias, G, n0, mu0, var0, pad, eps)
    y = np.stack([step.mag for step in s["y"]], axis=1).reshape(B, L, D) if L else np.zeros((B, 0, D))
    return y, s["mean"].mag, s["final_var"].mag


def timestep_norm_bwd_terms(dy, dmean, dvar, x, scale, bias, num_groups, prev_count, prev_mean, prev_var,
                            padding_mask, eps=1e-5):
    """The magnitude of the terms of (dx, dscale, dbias, dprev_mean, dprev_var) of
    :func:`timestep_norm_bwd`: its reverse scan on Magnitude values, over the forward's."""
    x, G, n0, mu0, var0, pad = _defaults(x, num_groups, prev_count, prev_mean, prev_var, padding_mask)
    B, L, D = x.shape
    Dg = D // G
    where = Magnitude.where
    s = _scan_terms(x, scale, bias, G, n0, mu0, var0, pad, eps)
    X, scale_g = s["X"], s["scale_g"]
    DY = Magnitude(_as_f64(dy).reshape(B, L, G, Dg))
    u = Magnitude(np.zeros((B, G)) if dmean is None else _as_f64(dmean))
    v = Magnitude(np.zeros((B, G)) if dvar is None else _as_f64(dvar))
    n = s["count"].copy()
    dx = [None] * L
    dscale, dbias = Magnitude(np.zeros((G, Dg))), Magnitude(np.zeros((G, Dg)))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(L - 1, -1, -1):
            live = ~pad[:, t]
            c1, c2 = ((n - 1.0) / n)[:, None], (1.0 / n)[:, None]
            mu_prev, mu, gmu = s["mu_before"][t], s["mu"][t], s["gmu"][t]
            r = 1.0 / (s["var"][t] + eps).sqrt()
            xc = X[:, t] - mu[..., None]
            dys = DY[:, t] * scale_g
            ds = (dys * xc).sum(axis=-1)
            db = dys.sum(axis=-1)
            du = u - r * db
            dv = v - 0.5 * r ** 3 * ds
            dgmu = c2 * du + 2.0 * c1 * c2 * dv * (gmu - mu_prev)
            dgvar = c2 * dv
            dxt = dys * r[..., None] + dgmu[..., None] / Dg + 2.0 * dgvar[..., None] * (X[:, t] - gmu[..., None]) / Dg
            keep = live[:, None, None]
            dx[t] = where(keep, dxt, 0.0)
            dscale = dscale + where(keep, DY[:, t] * xc * r[..., None], 0.0).sum(axis=0)
            dbias = dbias + where(keep, DY[:, t], 0.0).sum(axis=0)
            u = where(live[:, None], c1 * du - 2.0 * c1 * c2 * dv * (gmu - mu_prev), u)
            v = where(live[:, None], c1 * dv, v)
            n = np.where(live, n - 1.0, n)
    dxm = np.stack([d.mag for d in dx], axis=1).reshape(B, L, D) if L else np.zeros((B, 0, D))
    return dxm, dscale.mag.reshape(D), dbias.mag.reshape(D), u.mag, v.mag
