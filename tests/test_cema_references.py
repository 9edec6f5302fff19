"""The CEMA-family references checked on their own: every backward against central finite
differences of its forward, and the stage references against the composed one.

Finite differences run in float64 on tiny shapes. Complex inputs are perturbed in their real and
imaginary parts separately and assembled as grad = dL/dRe + i dL/dIm (PyTorch's convention, which
the references promise). Losses are <upstream gradient, output> with random upstream gradients
into every output (k and b; y and h).
"""
import numpy as np
import pytest

from megalodon_kernels.reference import cema as cema_ref
from megalodon_kernels.reference import cema_kernel as kernel_ref
from megalodon_kernels.reference import ema_hidden as hidden_ref
from megalodon_kernels.reference import fftconv as conv_ref

STEP = 1e-6
TOL = 1e-6  # central differences in float64 with O(1) values: ~1e-9 truncation + ~1e-10 rounding


def _inputs(rng, B=2, D=2, N=3, L=7):
    p = rng.uniform(0.1, 0.9, (D, N))
    log_q = np.log(rng.uniform(0.6, 0.97, (D, N))) + 1j * rng.uniform(-np.pi, np.pi, (D, N))
    gamma = (rng.standard_normal((D, N)) + 1j * rng.standard_normal((D, N))) / np.sqrt(N)
    hx = rng.standard_normal((B, D, N)) + 1j * rng.standard_normal((B, D, N))
    x = rng.standard_normal((B, D, L))
    omega = rng.standard_normal(D)
    return dict(x=x, p=p, log_q=log_q, gamma=gamma, hx=hx, omega=omega)


def _fd_grad(loss, args, name):
    """Central-difference gradient of the scalar loss(args) w.r.t. args[name]."""
    base = np.asarray(args[name])
    parts = [1.0, 1j] if np.iscomplexobj(base) else [1.0]
    grad = np.zeros(base.shape, dtype=base.dtype)
    for unit in parts:
        for idx in np.ndindex(base.shape):
            vals = []
            for sign in (1.0, -1.0):
                pert = base.copy()
                pert[idx] += sign * STEP * unit
                vals.append(loss({**args, name: pert}))
            grad[idx] += unit * (vals[0] - vals[1]) / (2 * STEP)
    return grad


def _check(name, analytic, numeric):
    scale = max(np.max(np.abs(numeric)), 1e-30)
    err = np.max(np.abs(np.asarray(analytic) - numeric)) / scale
    print(f"{name}: finite-difference relative error {err:.2e} (tol {TOL:.0e})")
    assert err <= TOL, f"{name}: {err:.2e}"


@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
@pytest.mark.parametrize("L", [1, 7])
def test_cema_kernel_bwd_matches_finite_differences(with_hx, L):
    rng = np.random.default_rng(1)
    a = _inputs(rng, L=L)
    args = dict(p=a["p"], log_q=a["log_q"], gamma=a["gamma"], hx=a["hx"] if with_hx else None)
    D = a["p"].shape[0]
    dk = rng.standard_normal((D, L))
    db = rng.standard_normal((2, D, L))

    def loss(v):
        k, b = kernel_ref.cema_kernel(v["p"], v["log_q"], v["gamma"], L, v["hx"])
        return np.sum(dk * k) + (np.sum(db * b) if b is not None else 0.0)

    grads = kernel_ref.cema_kernel_bwd(dk, db if with_hx else None, args["p"], args["log_q"], args["gamma"], L,
                                       args["hx"])
    names = ["p", "log_q", "gamma"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        _check(name, g, _fd_grad(loss, args, name))
    assert (grads[3] is None) == (not with_hx)


@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
@pytest.mark.parametrize("L", [1, 6])
def test_ema_hidden_bwd_matches_finite_differences(with_hx, L):
    rng = np.random.default_rng(2)
    a = _inputs(rng, L=L)
    args = dict(x=a["x"], p=a["p"], log_q=a["log_q"], hx=a["hx"] if with_hx else None)
    dh = rng.standard_normal(a["hx"].shape) + 1j * rng.standard_normal(a["hx"].shape)

    def loss(v):
        return np.sum((np.conj(dh) * hidden_ref.ema_hidden(v["x"], v["p"], v["log_q"], v["hx"])).real)

    grads = hidden_ref.ema_hidden_bwd(dh, args["x"], args["p"], args["log_q"], args["hx"])
    names = ["x", "p", "log_q"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        _check(name, g, _fd_grad(loss, args, name))


@pytest.mark.parametrize("L", [1, 2, 9])
def test_fftconv_bwd_matches_finite_differences(L):
    rng = np.random.default_rng(3)
    args = dict(x=rng.standard_normal((2, 3, L)), k=rng.standard_normal((3, L)))
    dy = rng.standard_normal((2, 3, L))

    def loss(v):
        return np.sum(dy * conv_ref.fftconv(v["x"], v["k"]))

    dx, dk = conv_ref.fftconv_bwd(dy, args["x"], args["k"])
    _check("x", dx, _fd_grad(loss, args, "x"))
    _check("k", dk, _fd_grad(loss, args, "k"))


@pytest.mark.parametrize("with_hx,return_state", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "hx", "state", "hx_state"])
def test_cema_bwd_matches_finite_differences(with_hx, return_state):
    rng = np.random.default_rng(4)
    a = _inputs(rng, L=6)
    args = dict(x=a["x"], p=a["p"], log_q=a["log_q"], gamma=a["gamma"], omega=a["omega"],
                hx=a["hx"] if with_hx else None)
    dy = rng.standard_normal(a["x"].shape)
    dh = rng.standard_normal(a["hx"].shape) + 1j * rng.standard_normal(a["hx"].shape)

    def loss(v):
        y, h = cema_ref.cema(**v, return_state=return_state)
        out = np.sum(dy * y)
        return out + (np.sum((np.conj(dh) * h).real) if return_state else 0.0)

    grads = cema_ref.cema_bwd(dy, dh, **args, return_state=return_state)
    names = ["x", "p", "log_q", "gamma", "omega"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        _check(name, g, _fd_grad(loss, args, name))
    assert (grads[5] is None) == (not with_hx)


@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
def test_stage_references_compose_to_cema(with_hx):
    # The recurrence (reference.cema) must equal fftconv(x, k) + b + omega x with k, b from the
    # kernel reference and h from ema_hidden; and its backward the chain of the stage backwards.
    rng = np.random.default_rng(5)
    a = _inputs(rng, L=11)
    hx = a["hx"] if with_hx else None
    x, p, lq, g, om = a["x"], a["p"], a["log_q"], a["gamma"], a["omega"]
    L = x.shape[-1]
    y, h = cema_ref.cema(x, p, lq, g, om, hx, return_state=True)
    k, b = kernel_ref.cema_kernel(p, lq, g, L, hx)
    y_stages = conv_ref.fftconv(x, k) + (0.0 if b is None else b) + om[:, None] * x
    np.testing.assert_allclose(y, y_stages, rtol=0, atol=1e-12 * np.abs(y).max())
    np.testing.assert_allclose(h, hidden_ref.ema_hidden(x, p, lq, hx), rtol=0, atol=1e-12 * np.abs(h).max())

    dy = rng.standard_normal(x.shape)
    dh = rng.standard_normal(h.shape) + 1j * rng.standard_normal(h.shape)
    dx, dp, dlq, dg, dom, dhx = cema_ref.cema_bwd(dy, dh, x, p, lq, g, om, hx, return_state=True)
    cx, ck = conv_ref.fftconv_bwd(dy, x, k)
    kp, klq, kg, khx = kernel_ref.cema_kernel_bwd(ck, dy if with_hx else None, p, lq, g, L, hx)
    hxg, hp, hlq, hhx = hidden_ref.ema_hidden_bwd(dh, x, p, lq, hx)
    pairs = [("x", dx, cx + om[:, None] * dy + hxg), ("p", dp, kp + hp), ("log_q", dlq, klq + hlq),
             ("gamma", dg, kg), ("omega", dom, np.sum(dy * x, axis=(0, 2)))]
    if with_hx:
        pairs.append(("hx", dhx, khx + hhx))
    for name, got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-11 * np.abs(want).max(), err_msg=name)
