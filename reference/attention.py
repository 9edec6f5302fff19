"""Reference attention and DropKey softmax (see ops/attention and ops/dropkey_softmax), fwd + bwd.

Float64 NumPy, full score matrices, masks built by explicit comparison of index grids: the
definitions every backend is tested against. DropKey randomness is NOT generated here: the
caller passes the boolean ``keep_mask`` (True = keep), which the tests build with
``ops.dropkey_rule.dropkey_mask`` from the same seed the op used.

Layouts: q (B, L, H, dh), k (B, S, H, dh), v (B, S, H, dv), o (B, L, H, dv); scores and
probabilities (B, H, L, S); keep_mask (B, H, L, S) for attention, the scores' shape for
dropkey_softmax.
"""
import numpy as np

# Mega's Laplace attention function. A reference imports NumPy and the standard library only, so
# these are a copy of ops/attention/laplace.py's, pinned to them by tests/test_attention_layouts.py.
LAPLACE_MU = np.sqrt(0.5)
LAPLACE_SIGMA = np.sqrt(1.0 / (4.0 * np.pi))


def _erfc(x):
    """Elementwise erfc in float64 (math.erfc; NumPy has no erf of its own)."""
    from math import erfc

    return np.vectorize(erfc, otypes=[np.float64])(x)


def visible_mask(L, S, causal=True, chunk_size=None, block_causal=False):
    """Bool (L, S): may query i see key j?

    Query i sits at key position pos_i = i + (S - L) (bottom-right alignment). Visible iff
    (not causal or j <= pos_i) and, with chunk size C, chunk(j) == chunk(pos_i), or with
    block_causal chunk(j) in {chunk(pos_i) - 1, chunk(pos_i)}; chunk(t) = floor(t / C).
    """
    vis = np.zeros((L, S), dtype=bool)
    for i in range(L):
        pos = i + (S - L)
        for j in range(S):
            ok = (not causal) or j <= pos
            if chunk_size is not None:
                cj, cp = j // chunk_size, pos // chunk_size  # Python floor division: floor for pos < 0
                ok = ok and (cj == cp or (block_causal and cj == cp - 1))
            vis[i, j] = ok
    return vis


def laplace(x):
    """Mega's Laplace attention function 0.5 * (1 + erf((x - mu) / (sigma * sqrt 2))).

    Evaluated as 0.5 * erfc(-z), the same value without 1 + erf(z) cancelling for z << 0.
    """
    return 0.5 * _erfc(-(x - LAPLACE_MU) / (LAPLACE_SIGMA * np.sqrt(2.0)))


def laplace_grad(x):
    """d laplace / dx: the Gaussian density with mean mu and std sigma."""
    return np.exp(-((x - LAPLACE_MU) ** 2) / (2.0 * LAPLACE_SIGMA**2)) / (LAPLACE_SIGMA * np.sqrt(2.0 * np.pi))


def _masked_softmax(s, allowed):
    """Softmax along the last axis over ``allowed`` entries; a row with none allowed is all 0."""
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(s - m), 0.0)
    z = np.sum(e, axis=-1, keepdims=True)
    return np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)


def _scores_and_mask(q, k, scale, causal, chunk_size, block_causal, keep_mask):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    B, L, H, _ = q.shape
    S = k.shape[1]
    s = scale * np.einsum("blhd,bshd->bhls", q, k)  # [B, H, L, S]
    allowed = np.broadcast_to(visible_mask(L, S, causal, chunk_size, block_causal), (B, H, L, S))
    if keep_mask is not None:
        allowed = allowed & np.broadcast_to(np.asarray(keep_mask, dtype=bool), (B, H, L, S))
    return s, allowed


def attention_probs(q, k, scale=1.0, causal=True, chunk_size=None, block_causal=False, keep_mask=None,
                    attn_fn="softmax"):
    """The probability matrix P (B, H, L, S) of :func:`attention`, with the scores s and mask."""
    s, allowed = _scores_and_mask(q, k, scale, causal, chunk_size, block_causal, keep_mask)
    if attn_fn == "softmax":
        p = _masked_softmax(s, allowed)
    elif attn_fn == "laplace":
        p = np.where(allowed, laplace(s), 0.0)
    else:
        raise ValueError(f"attn_fn must be 'softmax' or 'laplace', got {attn_fn!r}")
    return p, s, allowed


def attention(q, k, v, scale=1.0, causal=True, chunk_size=None, block_causal=False, keep_mask=None,
              attn_fn="softmax"):
    """o (B, L, H, dv) = P v with P from :func:`attention_probs`; float64."""
    p, _, _ = attention_probs(q, k, scale, causal, chunk_size, block_causal, keep_mask, attn_fn)
    return np.einsum("bhls,bshd->blhd", p, np.asarray(v, dtype=np.float64))


def attention_bwd(do, q, k, v, scale=1.0, causal=True, chunk_size=None, block_causal=False, keep_mask=None,
                  attn_fn="softmax"):
    """(dq, dk, dv) for upstream gradient ``do`` (B, L, H, dv).

    dV = P^T dO; dP = dO V^T; softmax: dS = P (dP - rowsum(P dP)); laplace: dS = dP laplace'(s)
    on allowed entries; dQ = scale dS K; dK = scale dS^T Q.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    do = np.asarray(do, dtype=np.float64)
    p, s, allowed = attention_probs(q, k, scale, causal, chunk_size, block_causal, keep_mask, attn_fn)
    dv = np.einsum("bhls,blhd->bshd", p, do)
    dp = np.einsum("blhd,bshd->bhls", do, v)  # [B, H, L, S]
    if attn_fn == "softmax":
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    else:
        ds = np.where(allowed, dp * laplace_grad(s), 0.0)
    dq = scale * np.einsum("bhls,bshd->blhd", ds, k)
    dk = scale * np.einsum("bhls,blhd->bshd", ds, q)
    return dq, dk, dv


def _row_mask(shape, causal, keep_mask):
    L, S = shape[-2], shape[-1]
    allowed = np.broadcast_to(visible_mask(L, S, causal), shape)
    if keep_mask is not None:
        allowed = allowed & np.broadcast_to(np.asarray(keep_mask, dtype=bool), shape)
    return allowed


def dropkey_softmax(scores, causal=True, keep_mask=None):
    """Softmax over the last axis of scores (..., L, S) with the bottom-right causal mask and
    the keep mask (scores' shape, True = keep); rows with nothing allowed are 0."""
    scores = np.asarray(scores, dtype=np.float64)
    return _masked_softmax(scores, _row_mask(scores.shape, causal, keep_mask))


def dropkey_softmax_bwd(dy, scores, causal=True, keep_mask=None):
    """dscores = y (dy - sum_j y dy), y = dropkey_softmax(scores, causal, keep_mask)."""
    y = dropkey_softmax(scores, causal, keep_mask)
    dy = np.asarray(dy, dtype=np.float64)
    return y * (dy - np.sum(y * dy, axis=-1, keepdims=True))


# --- the magnitude of the terms (reference/terms.py) ----------------------------------------------
# Scores are sums of products (magnitude scale |q| |k|); a weight moves with its score to first
# order: softmax: dp_j = p_j (ds_j - sum_i p_i ds_i), Laplace: dp = laplace'(s) ds; each value
# also carries its own rounding (its size). The outputs and gradients are then sums of products of
# these, whose magnitudes add as in reference.terms.Magnitude.

def _weight_terms(p, s, s_terms, allowed, attn_fn):
    """(M_p, g, M_g): the magnitude of the weights' terms and, for the backward, laplace'(s) with
    its own (None for softmax)."""
    if attn_fn == "softmax":
        spread = s_terms + np.sum(p * s_terms, axis=-1, keepdims=True)
        return np.where(allowed, p * (1.0 + spread), 0.0), None, None
    g = laplace_grad(s)
    curvature = np.abs(g * (s - LAPLACE_MU)) / LAPLACE_SIGMA**2   # |laplace''(s)|
    m_p = np.where(allowed, p + g * s_terms, 0.0)
    return m_p, np.where(allowed, g, 0.0), np.where(allowed, g + curvature * s_terms, 0.0)


def _softmax_bwd_terms(p, m_p, dp, m_dp):
    """(ds, its magnitude) of the softmax backward ds = p (dp - sum_j p dp), from the weights p,
    the upstream dp and their magnitudes."""
    r = np.sum(p * dp, axis=-1, keepdims=True)
    m_r = np.sum(m_p * np.abs(dp) + p * m_dp, axis=-1, keepdims=True)
    ds = p * (dp - r)
    return ds, m_p * np.abs(dp - r) + p * (m_dp + m_r) + np.abs(ds)


def attention_terms(q, k, v, scale=1.0, causal=True, chunk_size=None, block_causal=False, keep_mask=None,
                    attn_fn="softmax"):
    """The magnitude of the terms of o (B, L, H, dv) of :func:`attention`."""
    p, s, allowed = attention_probs(q, k, scale, causal, chunk_size, block_causal, keep_mask, attn_fn)
    s_terms = abs(scale) * np.einsum("blhd,bshd->bhls", np.abs(q), np.abs(k))
    m_p, _, _ = _weight_terms(p, s, s_terms, allowed, attn_fn)
    return np.einsum("bhls,bshd->blhd", m_p + p, np.abs(np.asarray(v, dtype=np.float64)))


def attention_bwd_terms(do, q, k, v, scale=1.0, causal=True, chunk_size=None, block_causal=False, keep_mask=None,
                        attn_fn="softmax"):
    """The magnitude of the terms of (dq, dk, dv) of :func:`attention_bwd`."""
    q, k, v, do = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do))
    p, s, allowed = attention_probs(q, k, scale, causal, chunk_size, block_causal, keep_mask, attn_fn)
    s_terms = abs(scale) * np.einsum("blhd,bshd->bhls", np.abs(q), np.abs(k))
    m_p, g, m_g = _weight_terms(p, s, s_terms, allowed, attn_fn)
    m_dv = np.einsum("bhls,blhd->bshd", m_p + p, np.abs(do))
    dp = np.einsum("blhd,bshd->bhls", do, v)
    m_dp = np.einsum("blhd,bshd->bhls", np.abs(do), np.abs(v))
    if attn_fn == "softmax":
        _, m_ds = _softmax_bwd_terms(p, m_p, dp, m_dp)
    else:
        m_ds = np.where(allowed, m_dp * g + np.abs(dp) * m_g, 0.0) + np.abs(dp * g)
    m_dq = abs(scale) * np.einsum("bhls,bshd->blhd", m_ds, np.abs(k))
    m_dk = abs(scale) * np.einsum("bhls,blhd->bshd", m_ds, np.abs(q))
    return m_dq, m_dk, m_dv


def dropkey_softmax_terms(scores, causal=True, keep_mask=None):
    """The magnitude of the terms of y of :func:`dropkey_softmax` (the scores are inputs: |s|)."""
    scores = np.asarray(scores, dtype=np.float64)
    y = dropkey_softmax(scores, causal, keep_mask)
    allowed = _row_mask(scores.shape, causal, keep_mask)
    return _weight_terms(y, scores, np.abs(scores), allowed, "softmax")[0]


def dropkey_softmax_bwd_terms(dy, scores, causal=True, keep_mask=None):
    """The magnitude of the terms of dscores of :func:`dropkey_softmax_bwd`."""
    scores, dy = np.asarray(scores, dtype=np.float64), np.asarray(dy, dtype=np.float64)
    y = dropkey_softmax(scores, causal, keep_mask)
    allowed = _row_mask(scores.shape, causal, keep_mask)
    m_y = _weight_terms(y, scores, np.abs(scores), allowed, "softmax")[0]
    return _softmax_bwd_terms(y, m_y, dy, np.abs(dy))[1]
