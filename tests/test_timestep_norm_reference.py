"""The TimestepNorm reference checked on its own: backward vs central finite differences, forward vs
the closed form (pooled mean / population variance of every element seen so far), step 0 vs
GroupNorm, and the streaming property. Everything here is float64 NumPy (plus torch's group_norm)."""
import numpy as np
import pytest
import torch

from megalodon_kernels.reference import timestep_norm as ref


def _problem(seed, B=2, L=7, D=6, G=3, prior=True, pad=True):
    rng = np.random.default_rng(seed)
    x = 1.0 + 2.0 * rng.normal(size=(B, L, D))
    p = dict(x=x, scale=rng.normal(size=D), bias=rng.normal(size=D), num_groups=G)
    if prior:
        p.update(prev_count=rng.integers(0, 4, size=B), prev_mean=rng.normal(size=(B, G)),
                 prev_var=rng.uniform(0.5, 2.0, size=(B, G)))
        p["prev_count"][0] = 0
    if pad:
        m = np.zeros((B, L), dtype=bool)
        m[0, :2] = True  # leading padding with prev_count = 0
        m[0, 4] = True  # a hole: the next step must use the CARRIED mean (spec 8.2)
        m[-1, -1] = True
        x[m] = np.nan  # never read
        p["padding_mask"] = m
    return p, rng


@pytest.mark.parametrize("prior", [False, True], ids=["no_prior", "prior"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("G", [1, 3, 6])
def test_reference_backward_matches_finite_differences(prior, pad, G):
    p, rng = _problem(G, G=G, prior=prior, pad=pad)
    y, _, m, v = ref.timestep_norm(**p)
    dy, dm, dv = rng.normal(size=y.shape), rng.normal(size=m.shape), rng.normal(size=v.shape)
    names = ["x", "scale", "bias"] + (["prev_mean", "prev_var"] if prior else [])

    def loss(q):
        yy, _, mm, vv = ref.timestep_norm(**q)
        return float((dy * yy).sum() + (dm * mm).sum() + (dv * vv).sum())

    grads = ref.timestep_norm_bwd(dy, dm, dv, p["x"], p["scale"], p["bias"], G, p.get("prev_count"),
                                  p.get("prev_mean"), p.get("prev_var"), p.get("padding_mask"))
    h = 1e-6
    for name, g in zip(names, grads):
        fd = np.zeros_like(p[name])
        for idx in np.ndindex(fd.shape):
            if np.isnan(p[name][idx]):
                continue  # padded x: its gradient is 0 by construction (checked below)
            plus = {**p, name: p[name].copy()}
            minus = {**p, name: p[name].copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            fd[idx] = (loss(plus) - loss(minus)) / (2 * h)
        err = np.max(np.abs(g - fd)) / max(np.max(np.abs(fd)), 1e-30)
        print(f"d{name}: finite-difference relative error {err:.2e}")
        assert err < 1e-7, name
    if pad:
        assert np.all(grads[0][p["padding_mask"]] == 0)


def test_reference_forward_is_pooled_moments():
    # Without a prior, (mu_t, var_t) are the mean and population variance of ALL elements of the
    # group in unmasked steps <= t; with a prior, it counts as prev_count steps of that moment.
    p, _ = _problem(1, B=2, L=9, D=8, G=2, prior=True, pad=True)
    y, count, mean, var = ref.timestep_norm(**p)
    s = ref._scan(p["x"], 2, p["prev_count"], p["prev_mean"], p["prev_var"], p["padding_mask"])
    x, m = p["x"], p["padding_mask"]
    for b in range(2):
        for g in range(2):
            seen = []
            for t in range(9):
                if not m[b, t]:
                    seen.append(x[b, t, 4 * g:4 * g + 4])
                if not seen:
                    continue
                data = np.concatenate(seen)
                k = len(seen)
                n0 = p["prev_count"][b]
                # pooled: prior (n0 steps with mean m0, var v0) + the observed elements
                tot = n0 + k
                mu = (n0 * p["prev_mean"][b, g] + k * data.mean()) / tot
                ex2 = (n0 * (p["prev_var"][b, g] + p["prev_mean"][b, g] ** 2) + k * np.mean(data ** 2)) / tot
                np.testing.assert_allclose(s["mu"][b, t, g], mu, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(s["var"][b, t, g], ex2 - mu ** 2, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(count, p["prev_count"] + (~m).sum(1))


def test_reference_first_step_is_group_norm():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 12))
    scale, bias = rng.normal(size=12), rng.normal(size=12)
    y = ref.timestep_norm(x, scale, bias, 4)[0]
    gn = torch.nn.functional.group_norm(torch.from_numpy(x[:, 0]), 4, torch.from_numpy(scale),
                                        torch.from_numpy(bias), eps=1e-5)
    np.testing.assert_allclose(y[:, 0], gn.numpy(), rtol=1e-12, atol=1e-12)


def test_reference_streaming():
    p, _ = _problem(2, B=2, L=11, D=6, G=3, prior=True, pad=True)
    whole = ref.timestep_norm(**p)
    first = ref.timestep_norm(**{**p, "x": p["x"][:, :5], "padding_mask": p["padding_mask"][:, :5]})
    second = ref.timestep_norm(p["x"][:, 5:], p["scale"], p["bias"], 3, first[1], first[2], first[3],
                               p["padding_mask"][:, 5:])
    np.testing.assert_allclose(np.concatenate((first[0], second[0]), 1), whole[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(second[1], whole[1])
    np.testing.assert_allclose(second[2], whole[2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(second[3], whole[3], rtol=1e-12, atol=1e-12)
