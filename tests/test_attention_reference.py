"""Finite-difference checks of the attention and dropkey_softmax reference backwards.

The references define the semantics every backend is compared with, so their hand-written
gradients are checked here against central differences of their own forwards (float64).
Masks depend on indices only, never on values, so the forwards are smooth in q, k, v and the
scores and central differences are exact up to O(eps^2).
"""
import numpy as np
import pytest

from megalodon_kernels.reference import attention as ref

EPS = 1e-6


def _fd_directional(f, xs, dirs):
    """(f(x + eps d) - f(x - eps d)) / (2 eps) for all inputs moved together along ``dirs``."""
    plus = f(*[x + EPS * d for x, d in zip(xs, dirs)])
    minus = f(*[x - EPS * d for x, d in zip(xs, dirs)])
    return (plus - minus) / (2 * EPS)


def _fd_elementwise(f, xs, which):
    """Full numerical gradient of scalar f w.r.t. input ``which``."""
    x = xs[which]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        args = [a.copy() for a in xs]
        args[which][idx] += EPS
        up = f(*args)
        args[which][idx] -= 2 * EPS
        g[idx] = (up - f(*args)) / (2 * EPS)
    return g


MODES = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, chunk_size=2),
    dict(causal=True, chunk_size=3, block_causal=True),
    dict(causal=False, chunk_size=2, block_causal=True),
]


@pytest.mark.parametrize("attn_fn", ["softmax", "laplace"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("L, S", [(5, 5), (3, 6), (6, 3)], ids=["L=S", "S>L", "S<L"])
def test_attention_bwd_matches_directional_fd(attn_fn, mode, L, S):
    rng = np.random.default_rng(L * 10 + S)
    B, H, dh, dv = 2, 2, 3, 4
    q, k, v = rng.normal(size=(B, L, H, dh)), rng.normal(size=(B, S, H, dh)), rng.normal(size=(B, S, H, dv))
    keep = rng.random((B, H, L, S)) > 0.25
    do = rng.normal(size=(B, L, H, dv))
    kw = dict(scale=0.8, keep_mask=keep, attn_fn=attn_fn, **mode)

    def loss(q_, k_, v_):
        return float(np.sum(ref.attention(q_, k_, v_, **kw) * do))

    dq, dk, dv_ = ref.attention_bwd(do, q, k, v, **kw)
    for trial in range(3):
        dirs = [rng.normal(size=x.shape) for x in (q, k, v)]
        fd = _fd_directional(loss, (q, k, v), dirs)
        an = sum(float(np.sum(g * d)) for g, d in zip((dq, dk, dv_), dirs))
        print(f"trial {trial}: analytic {an:.10f} fd {fd:.10f}")
        assert abs(an - fd) <= 1e-6 * max(1.0, abs(an))


@pytest.mark.parametrize("attn_fn", ["softmax", "laplace"])
def test_attention_bwd_matches_elementwise_fd(attn_fn):
    rng = np.random.default_rng(7)
    B, L, S, H, dh, dv = 1, 3, 4, 2, 2, 2
    q, k, v = rng.normal(size=(B, L, H, dh)), rng.normal(size=(B, S, H, dh)), rng.normal(size=(B, S, H, dv))
    do = rng.normal(size=(B, L, H, dv))
    kw = dict(scale=1.3, causal=True, chunk_size=2, block_causal=True, attn_fn=attn_fn)

    def loss(q_, k_, v_):
        return float(np.sum(ref.attention(q_, k_, v_, **kw) * do))

    grads = ref.attention_bwd(do, q, k, v, **kw)
    for which, name in enumerate(("dq", "dk", "dv")):
        fd = _fd_elementwise(loss, [q, k, v], which)
        err = np.max(np.abs(grads[which] - fd))
        print(f"{name}: max abs err {err:.2e}")
        assert err <= 1e-7


def test_attention_empty_rows_have_zero_output_and_gradient():
    # S < L causal: the first L - S rows see no key; a keep mask of all False drops everything.
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(1, 5, 1, 2)), rng.normal(size=(1, 2, 1, 2)), rng.normal(size=(1, 2, 1, 3))
    do = rng.normal(size=(1, 5, 1, 3))
    o = ref.attention(q, k, v)
    assert np.all(o[:, :3] == 0) and np.all(np.isfinite(o))
    dq, dk, dv = ref.attention_bwd(do, q, k, v)
    assert np.all(dq[:, :3] == 0) and all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    none = np.zeros((1, 1, 5, 2), dtype=bool)
    assert np.all(ref.attention(q, k, v, keep_mask=none) == 0)
    assert all(np.all(g == 0) for g in ref.attention_bwd(do, q, k, v, keep_mask=none))


def test_visible_mask_examples():
    # Bottom-right causal with a KV cache of 2: query 0 sits at position 2.
    assert ref.visible_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    # Chunks of 2, L = S = 5 (ragged last chunk), causal within a chunk.
    m = ref.visible_mask(5, 5, True, 2).astype(int)
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    # Blockwise causal: a chunk also sees the previous one.
    m = ref.visible_mask(4, 4, False, 2, True).astype(int)
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    # S < L with chunks: positions -2, -1 are in chunk -1 (floor), which has no keys.
    m = ref.visible_mask(4, 2, False, 2).astype(int)
    assert m.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


@pytest.mark.parametrize("shape", [(4, 5), (2, 4, 5), (2, 2, 4, 3)], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_dropkey_softmax_bwd_matches_fd(shape, causal):
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(size=shape)
    keep = rng.random(shape) > 0.3
    dy = rng.normal(size=shape)

    def loss(x_):
        return float(np.sum(ref.dropkey_softmax(x_, causal, keep) * dy))

    fd = _fd_elementwise(loss, [x], 0)
    an = ref.dropkey_softmax_bwd(dy, x, causal, keep)
    err = np.max(np.abs(an - fd))
    print(f"dscores: max abs err {err:.2e}")
    assert err <= 1e-7
    y = ref.dropkey_softmax(x, causal, keep)
    rows_alive = y.sum(-1)
    assert np.all((np.abs(rows_alive - 1) < 1e-12) | (rows_alive == 0))
