"""The CUDA CEMA kernels (cuda/cema.cuh: cema_kernel and ema_hidden, forward and backward), EXECUTED
on the CPU by the SIMT emulator against the float64 NumPy references.

Two levels, as for the other CUDA kernels:
* the tensor API of cuda/kernels.py over the emulator extension, in both fiber orders (a missing
  __syncthreads shows in one of them; shared memory is poisoned per block), every output and
  gradient against reference/cema_kernel.py and reference/ema_hidden.py;
* the ops' autograd Functions end to end (ops.cema_kernel / ops.ema_hidden with backend="cuda"),
  with the backend objects of cuda/backend.py built over the emulator (device_type="cpu").

Shapes cover the awkward cases: L = 1, 31, 33, 129, D = 60, N not a multiple of 16 and N = 64 (all
three n tiles), lengths spanning several tiles and several blocks per feature (the partial-sum
reduction), and one long-L accuracy case with |q| close to 1.

float64 (p float64, log_q/gamma/hx complex128: the kernels' R = double instantiation, every power,
sum and output in double) runs the same cases against the same references (tolerances
tol("cuda", float64)), plus long-L cases against a long-double evaluation of the exact sums: the
double powers (double-double phase, FMA-recovered exponent products) stay ~1e-15 relative there,
where the float64 NumPy reference itself drifts by ~L * 2**-53.
"""
import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels import ops
from megalodon_kernels.reference import cema_kernel as cema_ref
from megalodon_kernels.reference import ema_hidden as hidden_ref
from support import assert_close, noncontiguous, to_np, tol

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")

FWD = tol("cuda", torch.float32, "fwd")
BWD = tol("cuda", torch.float32, "bwd")
REALS = [torch.float32, torch.float64]
CPLX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _tols(real):
    return tol("cuda", real, "fwd"), tol("cuda", real, "bwd")


@pytest.fixture(scope="module")
def K():
    from megalodon_kernels.cuda import kernels

    return kernels


def _coefficients(D, N, B, seed, decay=0.1, dtype=torch.float32):
    """p in (0.05, 0.95), log|q| in (-decay, 0), arg q over the whole circle, gamma ~ 1/sqrt(2N), hx ~ 1.
    float64 draws full 53-bit values (so no product with an exponent is exact by accident)."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(generator=g, dtype=dtype)
    p = torch.rand(D, N, **kw) * 0.9 + 0.05
    log_q = torch.complex(-torch.rand(D, N, **kw) * decay, (2 * torch.rand(D, N, **kw) - 1) * math.pi)
    gamma = torch.complex(torch.randn(D, N, **kw), torch.randn(D, N, **kw)) / math.sqrt(2 * N)
    hx = torch.complex(torch.randn(B, D, N, **kw), torch.randn(B, D, N, **kw))
    return p, log_q, gamma, hx


def _crandn(*shape, generator, dtype=torch.float32):
    return torch.complex(torch.randn(*shape, generator=generator, dtype=dtype),
                         torch.randn(*shape, generator=generator, dtype=dtype))


def _randn(*shape, generator, dtype=torch.float32):
    return torch.randn(*shape, generator=generator, dtype=dtype)


# (B, D, N, L): odd lengths, D = 60, N below / between / at the n tiles (16, 32, 64), and lengths
# over several tiles and several blocks per feature (L = 5000 with D = 2: 5 synthesis / 2 analysis blocks).
SHAPES = [
    (2, 3, 16, 1),
    (2, 3, 16, 31),
    (1, 2, 5, 33),
    (2, 60, 16, 129),
    (1, 2, 40, 129),
    (2, 1, 64, 33),
    (2, 2, 16, 5000),
]
SHAPE_IDS = [f"B{b}-D{d}-N{n}-L{l}" for b, d, n, l in SHAPES]


# ------------------------------------------------------------------------------------------------
# cema_kernel: tensor API in the emulator
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("real", REALS, ids=str)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cema_kernel(ext, K, order, shape, with_hx, real):
    B, D, N, L = shape
    fwd, bwd = _tols(real)
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=L + N, dtype=real)
    hx = hx if with_hx else None
    g = torch.Generator().manual_seed(7)
    k, b = K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx)
    k_ref, b_ref = cema_ref.cema_kernel(to_np(p), to_np(log_q), to_np(gamma), L, None if hx is None else to_np(hx))
    assert k.dtype == real and k.shape == (D, L)
    assert_close("k", k, k_ref, fwd)
    if with_hx:
        assert b.dtype == real and b.shape == (B, D, L)
        assert_close("b", b, b_ref, fwd)
    else:
        assert b is None

    dk = _randn(D, L, generator=g, dtype=real)
    db = _randn(B, D, L, generator=g, dtype=real) if with_hx else None
    got = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    ref = cema_ref.cema_kernel_bwd(to_np(dk), None if db is None else to_np(db), to_np(p), to_np(log_q),
                                   to_np(gamma), L, None if hx is None else to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, ref):
        if r is None:
            assert a is None
            continue
        assert a.dtype == (real if name == "dp" else CPLX[real]) and a.shape == r.shape
        assert_close(name, a, r, bwd)


@pytest.mark.parametrize("real", REALS, ids=str)
@pytest.mark.parametrize("which", ["dk_only", "db_only"])
def test_cema_kernel_bwd_one_gradient(ext, K, order, which, real):
    """One of dk / db absent (autograd passes None for an unused output): its terms vanish, dhx = 0 without db."""
    B, D, N, L = 2, 3, 12, 70
    _, BWD = _tols(real)
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=3, dtype=real)
    g = torch.Generator().manual_seed(11)
    dk = _randn(D, L, generator=g, dtype=real) if which == "dk_only" else None
    db = _randn(B, D, L, generator=g, dtype=real) if which == "db_only" else None
    got = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    ref = cema_ref.cema_kernel_bwd(None if dk is None else to_np(dk), None if db is None else to_np(db), to_np(p),
                                   to_np(log_q), to_np(gamma), L, to_np(hx))
    if which == "db_only":
        assert torch.count_nonzero(got[0]) == 0  # dp depends on dk only
    else:
        assert torch.count_nonzero(got[3]) == 0  # dhx depends on db only
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, ref):
        assert_close(name, a, r, BWD)


@pytest.mark.parametrize("real", REALS, ids=str)
def test_cema_kernel_bwd_without_log_q_gradient(ext, K, real):
    """needs[1] = False skips the exponent-weighted sums: dlog_q is 0, the other gradients unchanged."""
    B, D, N, L = 1, 2, 16, 100
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=5, dtype=real)
    g = torch.Generator().manual_seed(1)
    dk, db = _randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real)
    full = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    part = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx, (True, False, True, True))
    assert torch.count_nonzero(part[1]) == 0 and torch.count_nonzero(full[1]) > 0
    for a, b in zip((full[0], full[2], full[3]), (part[0], part[2], part[3])):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# ema_hidden: tensor API in the emulator
# ------------------------------------------------------------------------------------------------

# (coefficient real type, x dtype): x is read in its own dtype and widened to the real type on load.
HIDDEN_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float64, torch.float64),
                 (torch.float64, torch.float32), (torch.float64, torch.bfloat16)]
HIDDEN_IDS = [f"{str(r)[6:]}-x_{str(x)[6:]}" for r, x in HIDDEN_DTYPES]


@pytest.mark.parametrize("real,dtype", HIDDEN_DTYPES, ids=HIDDEN_IDS)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ema_hidden(ext, K, order, shape, with_hx, real, dtype):
    B, D, N, L = shape
    FWD, BWD = _tols(real)
    p, log_q, _, hx = _coefficients(D, N, B, seed=L + 2 * N, dtype=real)
    hx = hx if with_hx else None
    g = torch.Generator().manual_seed(9)
    x = _randn(B, D, L, generator=g, dtype=real).to(dtype)
    h, V, W = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    # x enters in its own dtype and is accumulated in the real type: against the float64 recurrence
    # on the SAME (rounded) x the error is fp32- (fp64-) level whatever x's dtype.
    h_ref = hidden_ref.ema_hidden(to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    assert h.dtype == CPLX[real] and h.shape == (B, D, N)
    assert_close("h", h, h_ref, FWD)
    # V, W are the saved sums sum_j q**(L-1-j) x_j and sum_j (L-1-j) q**(L-1-j) x_j
    e = (L - 1 - np.arange(L)).astype(np.float64)
    qe = np.exp(e[None, None, :] * to_np(log_q)[:, :, None])          # [D, N, L]
    V_ref = np.einsum("bdl,dnl->bdn", to_np(x), qe)
    W_ref = np.einsum("bdl,dnl->bdn", to_np(x) * e, qe)
    assert_close("V", V, V_ref, FWD)
    assert_close("W", W, W_ref, FWD)

    dh = _crandn(B, D, N, generator=g, dtype=real)
    dx, dp, dlq, dhx = K.ema_hidden_bwd(ext, dh, p, log_q, hx, V, W, L)
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    assert dx.dtype == real and dx.shape == (B, D, L) and dp.dtype == real and dlq.dtype == CPLX[real]
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), (dx, dp, dlq, dhx), ref):
        if r is None:
            assert a is None
            continue
        assert_close(name, a, r, BWD)


@pytest.mark.parametrize("real", REALS, ids=str)
def test_ema_hidden_unweighted_and_partial_needs(ext, K, real):
    """weighted=False leaves W out (the inference path); the backward then computes no dlog_q, and
    need_x / need_p = False skip dx / write dp = 0."""
    B, D, N, L = 2, 3, 16, 77
    _, BWD = _tols(real)
    p, log_q, _, hx = _coefficients(D, N, B, seed=21, dtype=real)
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(2), dtype=real)
    h1, V1, W1 = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    h0, V0, W0 = K.ema_hidden_fwd(ext, x, p, log_q, hx, False)
    assert W0 is None and W1 is not None
    assert torch.equal(h0, h1) and torch.equal(V0, V1)
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(3), dtype=real)
    dx, dp, dlq, dhx = K.ema_hidden_bwd(ext, dh, p, log_q, hx, V0, None, L, (False, False, False, True))
    assert dx is None
    assert torch.count_nonzero(dp) == 0 and torch.count_nonzero(dlq) == 0
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), to_np(hx))
    assert_close("dhx", dhx, ref[3], BWD)
    with pytest.raises(ValueError, match="weighted"):
        K.ema_hidden_bwd(ext, dh, p, log_q, hx, V0, None, L, (False, False, True, True))


@given(D=st.integers(1, 5), N=st.integers(1, 64), B=st.integers(0, 3), L=st.integers(1, 700),
       x_bf16=st.booleans(), fp64=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_property_against_references(ext, K, D, N, B, L, x_bf16, fp64, seed):
    """Random sizes (every n tile, B = 0 without hx, any L up to several tiles), fp32 or fp64
    coefficients: all four ops' outputs and gradients match the float64 references."""
    real = torch.float64 if fp64 else torch.float32
    FWD, BWD = _tols(real)
    p, log_q, gamma, hx = _coefficients(D, N, max(B, 1), seed=seed, dtype=real)
    hx = hx if B > 0 else None
    Bx = max(B, 1)
    g = torch.Generator().manual_seed(seed + 1)
    k, b = K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx)
    ref = cema_ref.cema_kernel(to_np(p), to_np(log_q), to_np(gamma), L, None if hx is None else to_np(hx))
    assert_close("k", k, ref[0], FWD)
    if hx is not None:
        assert_close("b", b, ref[1], FWD)
    dk = _randn(D, L, generator=g, dtype=real)
    db = _randn(B, D, L, generator=g, dtype=real) if hx is not None else None
    got = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    ref = cema_ref.cema_kernel_bwd(to_np(dk), None if db is None else to_np(db), to_np(p), to_np(log_q),
                                   to_np(gamma), L, None if hx is None else to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, ref):
        if r is not None:
            assert_close(name, a, r, BWD)
    x = _randn(Bx, D, L, generator=g, dtype=real).to(torch.bfloat16 if x_bf16 else real)
    h, V, W = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    assert_close("h", h, hidden_ref.ema_hidden(to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx)),
                 FWD)
    dh = _crandn(Bx, D, N, generator=g, dtype=real)
    got = K.ema_hidden_bwd(ext, dh, p, log_q, hx, V, W, L)
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, ref):
        if r is not None:
            assert_close(name, a, r, BWD)


# ------------------------------------------------------------------------------------------------
# Accuracy at long L, determinism
# ------------------------------------------------------------------------------------------------

def _powers(log_q, exponents):
    """q**e in float64 for every coefficient: [D, N, E]."""
    return np.exp(np.asarray(exponents, dtype=np.float64)[None, None, :] * to_np(log_q)[:, :, None])


@pytest.mark.parametrize("L", [1 << 16, 1 << 20], ids=["L=2^16", "L=2^20"])
def test_long_length_accuracy(ext, K, L):
    """|q| close to 1 (log|q| ~ -1e-5, decay length ~1e5 steps) and phases over the whole circle:
    powers up to q**(2**20) stay fp32-accurate (each is exp / sincospi in double, rounded once, times
    one more such table entry). Norm-wise relative error <= 1e-5 vs float64 for k, b and h (and every
    gradient at 2**16)."""
    B, D, N = 1, 2, 4
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=4, decay=2e-5)
    g = torch.Generator().manual_seed(5)
    j = np.arange(L, dtype=np.float64)
    k, b = K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx)
    qj = _powers(log_q, j)                                                    # [D, N, L]
    u = to_np(p) * to_np(gamma)
    k_ref = np.einsum("dn,dnl->dl", u, qj).real
    qj1 = _powers(log_q, j + 1)
    b_ref = np.einsum("bdn,dnl->bdl", to_np(gamma)[None] * to_np(hx), qj1).real
    assert_close("k", k, k_ref, 1e-5)
    assert_close("b", b, b_ref, 1e-5)
    x = torch.randn(B, D, L, generator=g)
    h, V, W = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    qe = qj[..., ::-1]                                                        # q**(L-1-j)
    h_ref = to_np(p) * np.einsum("bdl,dnl->bdn", to_np(x), qe) + _powers(log_q, [L])[..., 0] * to_np(hx)
    assert_close("h", h, h_ref, 1e-5)
    if L > 1 << 16:
        return  # the float64 references of the gradients at 2**20 cost more than the kernels
    dk, db = torch.randn(D, L, generator=g), torch.randn(B, D, L, generator=g)
    got = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    ref = cema_ref.cema_kernel_bwd(to_np(dk), to_np(db), to_np(p), to_np(log_q), to_np(gamma), L, to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, ref):
        assert_close(name, a, r, 1e-5)
    dh = _crandn(B, D, N, generator=g)
    got = K.ema_hidden_bwd(ext, dh, p, log_q, hx, V, W, L)
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), to_np(hx))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, ref):
        assert_close(name, a, r, 1e-5)


def _ld_powers(log_q, exponents):
    """q**e evaluated in x87 long double (64-bit mantissa) from the float64 log_q: [D, N, E]. The
    exact sums for the given float64 inputs to ~1e-16 even at L = 2**16, unlike the float64
    reference, whose exp(e * log_q) drifts by ~e * 2**-53 * |arg q| (2.7e-12 relative at 2**16)."""
    e = np.asarray(exponents, dtype=np.longdouble)
    return np.exp(e[None, None, :] * to_np(log_q).astype(np.clongdouble)[:, :, None])


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs x87 long double for the exact sums")
@pytest.mark.parametrize("L", [4096, 1 << 16], ids=["L=4096", "L=2^16"])
def test_long_length_accuracy_fp64(ext, K, L):
    """float64 at long L, |q| close to 1 (decay length ~5e4 steps), phases over the whole circle:
    every output and gradient of both ops within 1e-12 of the exact sums (max abs error / max |ref|).
    A power rounded through fp32 anywhere would be ~1e-7 off; a double power with its phase e * arg(q)
    formed by one rounded product ~L * 1e-16 (norm-wise 3e-13 at 4096, 5e-12 at 2**16 when tried).
    `pytest -s` prints the measured errors."""
    B, D, N = 1, 2, 4
    real = torch.float64
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=4, decay=2e-5, dtype=real)
    P, G, H = to_np(p).astype(np.longdouble), to_np(gamma).astype(np.clongdouble), to_np(hx).astype(np.clongdouble)
    j = np.arange(L)
    qj, qj1 = _ld_powers(log_q, j), _ld_powers(log_q, j + 1)
    qe, qL = qj[..., ::-1], _ld_powers(log_q, [L])[..., 0]                    # q**(L-1-j), q**L
    g = torch.Generator().manual_seed(5)
    budget = 1e-12

    k, b = K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx)
    assert_close("k", k, np.einsum("dn,dnl->dl", P * G, qj).real, budget)
    assert_close("b", b, np.einsum("bdn,dnl->bdl", G[None] * H, qj1).real, budget)
    dk, db = _randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real)
    DK, DB = to_np(dk).astype(np.longdouble), to_np(db).astype(np.longdouble)
    S, S1 = np.einsum("dl,dnl->dn", DK, qj), np.einsum("dl,dnl->dn", DK * j, qj)
    T, T1 = np.einsum("bdl,dnl->bdn", DB, qj1), np.einsum("bdl,dnl->bdn", DB * (j + 1), qj1)
    ref = ((S * G).real, np.conj(S1 * P * G) + np.conj((T1 * H).sum(0) * G), np.conj(S * P) + np.conj((T * H).sum(0)),
           np.conj(T * G))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx),
                          ref):
        assert_close(name, a, r, budget)

    x = _randn(B, D, L, generator=g, dtype=real)
    X = to_np(x).astype(np.longdouble)
    h, V, W = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    V_ref, W_ref = np.einsum("bdl,dnl->bdn", X, qe), np.einsum("bdl,dnl->bdn", X * (L - 1 - j), qe)
    assert_close("h", h, P * V_ref + qL * H, budget)
    assert_close("V", V, V_ref, budget)
    assert_close("W", W, W_ref, budget)
    dh = _crandn(B, D, N, generator=g, dtype=real)
    DH = to_np(dh).astype(np.clongdouble)
    ref = (np.einsum("bdn,dnl->bdl", np.conj(DH) * P, qe).real, (np.conj(DH) * V_ref).real.sum(0),
           (DH * np.conj(P * W_ref + L * qL * H)).sum(0), DH * np.conj(qL))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), K.ema_hidden_bwd(ext, dh, p, log_q, hx, V, W, L), ref):
        assert_close(name, a, r, budget)


def test_several_tiles_per_block_fp64(ext, K):
    """D = 1025 features leave one block per feature (Y = 1), so each block walks several tiles:
    fp64 at N = 64 has 8-row synthesis tiles (one row per thread) and 16-row analysis tiles, and
    L = 520 gives 3 and 2 of them, in both layouts (cema_kernel forward order, ema_hidden reverse).
    Against the float64 torch backend (its own two-level tables): the q2 / input tiles are rebuilt
    per tile without stale entries."""
    from megalodon_kernels.ops.cema_kernel import torch_impl as cema_torch
    from megalodon_kernels.ops.ema_hidden import torch_impl as hidden_torch

    B, D, N, L = 1, 1025, 64, 520
    real = torch.float64
    FWD, BWD = _tols(real)
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=40, dtype=real)
    g = torch.Generator().manual_seed(41)
    got = K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx)
    for name, a, r in zip("kb", got, cema_torch.cema_kernel_fwd(p, log_q, gamma, L, hx, power_block=64)):
        assert_close(name, a, to_np(r), FWD)
    dk, db = _randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real)
    got = K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx)
    ref = cema_torch.cema_kernel_bwd(dk, db, p, log_q, gamma, L, hx, power_block=64)
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, ref):
        assert_close(name, a, to_np(r), BWD)
    x = _randn(B, D, L, generator=g, dtype=real)
    got = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    ref = hidden_torch.ema_hidden_fwd(x, p, log_q, hx, True, power_block=64)
    for name, a, r in zip(("h", "V", "W"), got, ref):
        assert_close(name, a, to_np(r), FWD)
    dh = _crandn(B, D, N, generator=g, dtype=real)
    got = K.ema_hidden_bwd(ext, dh, p, log_q, hx, got[1], got[2], L)
    ref = hidden_torch.ema_hidden_bwd(dh, p, log_q, hx, ref[1], ref[2], L, power_block=64)
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, ref):
        assert_close(name, a, to_np(r), BWD)


@pytest.mark.parametrize("real", REALS, ids=str)
def test_deterministic_across_runs_and_fiber_orders(ext, K, real):
    """Reductions over j run in a fixed order (per-thread sums, fixed-order block sum, Y partials
    summed in order by one thread; no atomics): bit-identical results in both fiber orders. D = 1
    and L = 40000 spread each feature over many blocks."""
    B, D, N, L = 2, 1, 16, 40000
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=8, dtype=real)
    g = torch.Generator().manual_seed(6)
    dk, db, x = (_randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real),
                 _randn(B, D, L, generator=g, dtype=real))
    runs = []
    for rev in (0, 1, 0):
        ext.emulator_set_reverse(rev)
        runs.append((*K.cema_kernel_bwd(ext, dk, db, p, log_q, gamma, L, hx),
                     *K.ema_hidden_fwd(ext, x, p, log_q, hx, True)))
    ext.emulator_set_reverse(-1)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("real", REALS, ids=str)
def test_strided_conj_and_expanded_inputs(ext, K, real):
    """Strided views of every input, a conj view of dh and an expanded (stride-0) upstream gradient
    (as from k.sum()) give the same bits as contiguous copies."""
    B, D, N, L = 2, 3, 16, 50
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=30, dtype=real)
    views = [noncontiguous(t) for t in (p, log_q, gamma, hx)]
    for a, b in zip(K.cema_kernel_fwd(ext, p, log_q, gamma, L, hx), K.cema_kernel_fwd(ext, *views[:3], L, views[3])):
        assert torch.equal(a, b)
    dk = torch.full((1, 1), 0.5, dtype=real).expand(D, L)
    db = _randn(B, D, L, generator=torch.Generator().manual_seed(1), dtype=real)
    want = K.cema_kernel_bwd(ext, dk.contiguous(), db, p, log_q, gamma, L, hx)
    got = K.cema_kernel_bwd(ext, dk, noncontiguous(db), *views[:3], L, views[3])
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(2), dtype=real)
    want = K.ema_hidden_fwd(ext, x, p, log_q, hx, True)
    got = K.ema_hidden_fwd(ext, noncontiguous(x), views[0], views[1], views[3], True)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(3), dtype=real)
    want = K.ema_hidden_bwd(ext, dh.conj().resolve_conj(), p, log_q, hx, want[1], want[2], L)
    got = K.ema_hidden_bwd(ext, dh.conj(), views[0], views[1], views[3], got[1], got[2], L)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------

def test_bad_inputs(ext, K):
    p, log_q, gamma, hx = _coefficients(2, 16, 1, seed=0)
    with pytest.raises(TypeError, match="float32 or float64 p"):
        K.cema_kernel_fwd(ext, p.half(), log_q, gamma, 10, None)
    # mixed precisions are refused, naming the argument (the op never produces them)
    with pytest.raises(TypeError, match="log_q torch.complex128 with torch.float64 p"):
        K.cema_kernel_fwd(ext, p.double(), log_q, gamma.to(torch.complex128), 10, None)
    with pytest.raises(TypeError, match="gamma torch.complex64 with torch.float32 p"):
        K.cema_kernel_fwd(ext, p, log_q, gamma.to(torch.complex128), 10, None)
    with pytest.raises(TypeError, match="hx torch.complex128"):
        K.cema_kernel_bwd(ext, None, None, p.double(), log_q.to(torch.complex128), gamma.to(torch.complex128), 10,
                          hx)
    with pytest.raises(TypeError, match="dh torch.complex128"):
        K.ema_hidden_bwd(ext, torch.zeros(1, 2, 16, dtype=torch.complex64), p.double(), log_q.to(torch.complex128),
                         None, None, None, 8, (True, False, False, False))
    with pytest.raises(TypeError, match="float32, bfloat16 or float64 x"):
        K.ema_hidden_fwd(ext, torch.zeros(1, 2, 8, dtype=torch.float16), p, log_q, None)
    p65, lq65, g65, _ = _coefficients(1, 65, 1, seed=0)
    with pytest.raises(ValueError, match="N <= 64"):
        K.cema_kernel_fwd(ext, p65, lq65, g65, 10, None)
    with pytest.raises(ValueError, match="N <= 64"):
        K.cema_kernel_fwd(ext, p65.double(), lq65.to(torch.complex128), g65.to(torch.complex128), 10, None)
    with pytest.raises(ValueError, match="length"):
        K.cema_kernel_fwd(ext, p, log_q, gamma, 1 << 24, None)
    with pytest.raises(ValueError, match="length"):
        K.cema_kernel_fwd(ext, p, log_q, gamma, 0, None)
    # the launchers check too (std::invalid_argument -> ValueError), whatever the caller;
    # the first argument is the coefficients' dtype code (0 float32, 4 float64)
    k = torch.empty(1, 4)
    with pytest.raises(ValueError, match="N = 65"):
        ext.cema_kernel_fwd(0, p65.data_ptr(), 0, 0, 0, k.data_ptr(), 0, 0, 1, 65, 4, 0)
    with pytest.raises(ValueError, match="L \\+ 1 < 2\\^24"):
        ext.cema_kernel_fwd(4, p.data_ptr(), 0, 0, 0, k.data_ptr(), 0, 0, 1, 16, (1 << 24) - 1, 0)
    with pytest.raises(ValueError, match="needs hx"):
        ext.cema_kernel_fwd(0, p.data_ptr(), 0, 0, 0, k.data_ptr(), 0, 2, 1, 16, 4, 0)
    with pytest.raises(ValueError, match="coefficient dtype code 1"):  # bf16 coefficients: no kernel
        ext.cema_kernel_fwd(1, p.data_ptr(), log_q.data_ptr(), gamma.data_ptr(), 0, k.data_ptr(), 0, 0, 1, 16, 4, 0)
    with pytest.raises(ValueError, match="float64 x needs float64 coefficients"):  # kernels.py casts it first
        x = torch.zeros(1, 2, 8, dtype=torch.float64)
        out = torch.empty(1, 2, 16, 2)
        ext.ema_hidden_fwd(4, 0, x.data_ptr(), p.data_ptr(), log_q.data_ptr(), 0, out.data_ptr(), out.data_ptr(), 0,
                           out.data_ptr(), 1, 2, 16, 8, 0)


# ------------------------------------------------------------------------------------------------
# The ops' autograd Functions end to end on the emulated CUDA backends
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulated(ext):
    from megalodon_kernels.cuda import backend

    get = lambda: ext  # noqa: E731
    return {"cema_kernel": backend.CemaKernelBackend(get, "cpu"), "ema_hidden": backend.EmaHiddenBackend(get, "cpu")}


@pytest.mark.parametrize("real", REALS, ids=str)
@pytest.mark.parametrize("outputs", ["k_and_b", "k_only", "b_only", "no_hx"])
def test_cema_kernel_op(use_emulated_cuda, outputs, real):
    B, D, N, L = 2, 5, 16, 45
    FWD, BWD = _tols(real)
    p, log_q, gamma, hx = _coefficients(D, N, B, seed=12, dtype=real)
    with_hx = outputs != "no_hx"
    leaves = [t.clone().requires_grad_() for t in (p, log_q, gamma, hx)]
    pl, lql, gl, hl = leaves
    k, b = ops.cema_kernel(pl, lql, gl, L, hl if with_hx else None, backend="cuda")
    k_ref, b_ref = cema_ref.cema_kernel(to_np(p), to_np(log_q), to_np(gamma), L, to_np(hx) if with_hx else None)
    assert k.dtype == real
    assert_close("k", k, k_ref, FWD)
    g = torch.Generator().manual_seed(4)
    dk = _randn(D, L, generator=g, dtype=real) if outputs != "b_only" else None
    db = _randn(B, D, L, generator=g, dtype=real) if outputs in ("k_and_b", "b_only") else None
    if with_hx:
        assert_close("b", b, b_ref, FWD)
    loss = (k * dk).sum() if dk is not None else 0.0
    if db is not None:
        loss = loss + (b * db).sum()
    inputs = leaves if with_hx else leaves[:3]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    ref = cema_ref.cema_kernel_bwd(None if dk is None else to_np(dk), None if db is None else to_np(db), to_np(p),
                                   to_np(log_q), to_np(gamma), L, to_np(hx) if with_hx else None)
    for name, a, r, leaf in zip(("dp", "dlog_q", "dgamma", "dhx"), grads, ref, inputs):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape
        assert_close(name, a, r, BWD)


@pytest.mark.parametrize("real,dtype", HIDDEN_DTYPES + [(torch.float32, torch.float64)],
                         ids=HIDDEN_IDS + ["float32-x_float64"])
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
def test_ema_hidden_op(use_emulated_cuda, real, dtype, with_hx):
    """(real, x dtype) as in test_ema_hidden, plus float64 x with float32 coefficients: computed in
    float32 (x cast first, as the torch backend does), dx returned in x's dtype."""
    B, D, N, L = 2, 4, 16, 63
    FWD, BWD = _tols(real)
    p, log_q, _, hx = _coefficients(D, N, B, seed=13, dtype=real)
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(8), dtype=real).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, p, log_q, hx)]
    xl, pl, lql, hl = leaves
    h = ops.ema_hidden(xl, pl, lql, hl if with_hx else None, backend="cuda")
    h_ref = hidden_ref.ema_hidden(to_np(x), to_np(p), to_np(log_q), to_np(hx) if with_hx else None)
    assert h.dtype == CPLX[real]
    assert_close("h", h, h_ref, FWD)
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(9), dtype=real)
    inputs = leaves if with_hx else leaves[:3]
    grads = torch.autograd.grad(h, inputs, dh)
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), to_np(hx) if with_hx else None)
    for name, a, r, leaf in zip(("dx", "dp", "dlog_q", "dhx"), grads, ref, inputs):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape
        # dx is rounded once to x's dtype by the autograd Function: x's budget for it when x is narrower
        narrow = dtype in (torch.float32, torch.bfloat16)
        assert_close(name, a, r, tol("cuda", dtype, "bwd") if name == "dx" and narrow else BWD)


def test_ema_hidden_op_without_log_q_gradient(use_emulated_cuda):
    """log_q without requires_grad: the forward skips W (inference path), dx and dp still exact."""
    B, D, N, L = 2, 3, 20, 50
    p, log_q, _, _ = _coefficients(D, N, B, seed=15)
    x = torch.randn(B, D, L, generator=torch.Generator().manual_seed(11)).requires_grad_()
    pl = p.clone().requires_grad_()
    h = ops.ema_hidden(x, pl, log_q, backend="cuda")
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(12))
    dx, dp = torch.autograd.grad(h, [x, pl], dh)
    ref = hidden_ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q))
    assert_close("dx", dx, ref[0], BWD)
    assert_close("dp", dp, ref[1], BWD)


def test_ema_hidden_op_streaming(use_emulated_cuda):
    """Two halves with the state carried through hx equal the whole sequence (CUDA backend both times)."""
    B, D, N, L = 2, 3, 16, 90
    p, log_q, _, _ = _coefficients(D, N, B, seed=14)
    x = torch.randn(B, D, L, generator=torch.Generator().manual_seed(10))
    whole = ops.ema_hidden(x, p, log_q, backend="cuda")
    h1 = ops.ema_hidden(x[..., :41], p, log_q, backend="cuda")
    h2 = ops.ema_hidden(x[..., 41:], p, log_q, h1, backend="cuda")
    assert_close("streamed h", h2, to_np(whole), FWD)


def test_reasons_name_the_fix(emulated):
    from megalodon_kernels.cuda import backend

    p, log_q, gamma, hx = _coefficients(2, 80, 1, seed=0)
    why = " ".join(backend.cema_kernel.not_supported_reasons(p=p.half(), log_q=log_q, gamma=gamma,
                                                             length=1 << 24, hx=None))
    assert "_C" in why or "pip install" in why        # the product extension is not built here
    assert "cuda tensors" in why and "float16" in why and "N = 80 > 64" in why and "2**24" in why
    # float64 is supported: with matching complex128 parameters only the size limits remain
    p64, lq64, g64, hx64 = (t.to(torch.float64 if not t.is_complex() else torch.complex128)
                            for t in (p[:, :16], log_q[:, :16], gamma[:, :16], hx[..., :16]))
    emu = emulated["cema_kernel"]
    assert emu.not_supported_reasons(p=p64, log_q=lq64, gamma=g64, length=100, hx=hx64) == []
    why = " ".join(emu.not_supported_reasons(p=p.double(), log_q=log_q.to(torch.complex128), gamma=gamma.to(
        torch.complex128), length=100, hx=None))
    assert "N = 80 > 64" in why and "float64" not in why
    # a mixed precision names the argument
    why = " ".join(emu.not_supported_reasons(p=p64, log_q=lq64, gamma=g64, length=100, hx=hx[..., :16]))
    assert "hx torch.complex128 with torch.float64 p, got torch.complex64" in why and "use backend='torch'" in why
    x = torch.zeros(1, 2, 8, dtype=torch.float16)
    why = " ".join(emulated["ema_hidden"].not_supported_reasons(x=x, p=p[:, :16], log_q=log_q[:, :16], hx=None))
    assert "float16" in why and "use backend='torch'" in why
    assert emulated["ema_hidden"].not_supported_reasons(x=x.float(), p=p[:, :16], log_q=log_q[:, :16], hx=None) == []
    for xdt in (torch.float64, torch.float32, torch.bfloat16):
        assert emulated["ema_hidden"].not_supported_reasons(x=x.to(xdt), p=p64, log_q=lq64, hx=hx64) == []
    why = " ".join(emulated["ema_hidden"].not_supported_reasons(x=x.double(), p=p64, log_q=log_q[:, :16], hx=None))
    assert "log_q torch.complex128 with torch.float64 p" in why
    with pytest.raises(ValueError, match="cuda"):
        ops.cema_kernel(p.double(), log_q.to(torch.complex128), gamma.to(torch.complex128), 8, backend="cuda")
