"""cema_kernel (k and bias b): forward and every gradient against the float64 reference, the
two-level power table at every block size, long-L fp32 accuracy against an exact float64 oracle,
streaming (prefix / carried-state) properties and argument validation."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.cema_kernel import torch_impl as kernel_impl
from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.reference import cema_kernel as ref
from support import as_input, assert_close, backend_module, knobs, to_np, tol

COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def random_coefficients(gen, D, N, B=None, dtype=torch.float32, min_gap=1e-3):
    """CEMA coefficients as the model makes them: p in (0, 1), |q| = 1 - gap with gap log-uniform
    in [min_gap, 0.5], phase uniform in (-pi, pi], gamma ~ CN(0, 1/N), hx ~ CN(0, 1)."""
    f64 = torch.float64

    def cnormal(*shape):
        return torch.complex(torch.randn(*shape, generator=gen, dtype=f64), torch.randn(*shape, generator=gen, dtype=f64))

    p = 0.05 + 0.9 * torch.rand(D, N, generator=gen, dtype=f64)
    u = torch.rand(D, N, generator=gen, dtype=f64)
    gap = torch.exp(math.log(min_gap) + (math.log(0.5) - math.log(min_gap)) * u)
    theta = (2 * torch.rand(D, N, generator=gen, dtype=f64) - 1) * math.pi
    log_q = torch.complex(torch.log1p(-gap), theta)
    gamma = cnormal(D, N) / math.sqrt(2 * N)
    out = dict(p=p.to(dtype), log_q=log_q.to(COMPLEX[dtype]), gamma=gamma.to(COMPLEX[dtype]), hx=None)
    if B is not None:
        out["hx"] = cnormal(B, D, N).to(COMPLEX[dtype])
    return out


def check_cema_kernel(D, N, B, L, dtype, contiguous=True, seed=0, use=("k", "b"), backend="torch", **config):
    """Forward and every gradient of one backend (run with the knob values ``config``) vs the reference;
    shared with tests/test_triton_cema_kernel.py and the CUDA tests."""
    gen = torch.Generator().manual_seed(seed)
    c = random_coefficients(gen, D, N, B, dtype)
    names = ["p", "log_q", "gamma"] + (["hx"] if B is not None else [])
    ins = {n: as_input(c[n], contiguous=contiguous, requires_grad=True) for n in names}
    with knobs(backend_module("cema_kernel", backend), **config):
        k, b = cema_kernel(ins["p"], ins["log_q"], ins["gamma"], L, ins.get("hx"), backend=backend)
        assert k.shape == (D, L) and k.dtype == dtype
        assert (b is None) == (B is None)
        npin = {n: to_np(t) for n, t in ins.items()}
        k_ref, b_ref = ref.cema_kernel(npin["p"], npin["log_q"], npin["gamma"], L, npin.get("hx"))
        assert_close("k", k, k_ref, tol(backend, dtype, "fwd"))
        if B is not None:
            assert b.shape == (B, D, L) and b.dtype == dtype
            assert_close("b", b, b_ref, tol(backend, dtype, "fwd"))
        dk = torch.randn(k.shape, generator=gen, dtype=torch.float64).to(dtype)
        outs, cots = [], []
        if "k" in use:
            outs.append(k), cots.append(dk)
        db = None
        if B is not None and "b" in use:
            db = torch.randn(b.shape, generator=gen, dtype=torch.float64).to(dtype)
            outs.append(b), cots.append(db)
        grads = torch.autograd.grad(outs, list(ins.values()), cots, allow_unused=True)
    want = ref.cema_kernel_bwd(to_np(dk) if "k" in use else None, None if db is None else to_np(db),
                               npin["p"], npin["log_q"], npin["gamma"], L, npin.get("hx"))
    for name, got, exp in zip(names, grads, want):
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        if np.max(np.abs(exp)) == 0:  # e.g. hx gets no gradient when b is unused
            assert torch.all(got == 0), name
            continue
        assert_close("d" + name, got, exp, tol(backend, dtype, "bwd"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
@pytest.mark.parametrize("B", [None, 2], ids=["no_hx", "hx"])
def test_cema_kernel_matches_reference(dtype, L, B):
    check_cema_kernel(3, 4, B, L, dtype)


def test_cema_kernel_wide_features():
    check_cema_kernel(60, 2, 1, 33, torch.float32, contiguous=False)


@pytest.mark.parametrize("power_block", [1, 3, 8, 64, 1000])
def test_cema_kernel_every_power_block(power_block):
    # T = 1 makes every power a Q2 entry, T >= L every power a Q1 entry; 3 and 8 leave a partial
    # last block (L = 50), so the padding of both layouts is exercised.
    check_cema_kernel(2, 3, 2, 50, torch.float32, power_block=power_block)


@pytest.mark.parametrize("use", [("k",), ("b",)], ids=["k_only", "b_only"])
def test_cema_kernel_one_output_used(use):
    check_cema_kernel(2, 3, 2, 40, torch.float64, use=use)


@given(D=st.integers(1, 6), N=st.integers(1, 8), B=st.sampled_from([None, 1, 3]), L=st.integers(1, 200),
       dtype=st.sampled_from([torch.float32, torch.float64]), contiguous=st.booleans(),
       power_block=st.sampled_from([None, 1, 5, 16, 33]), seed=st.integers(0, 2**31))
def test_cema_kernel_property(D, N, B, L, dtype, contiguous, power_block, seed):
    check_cema_kernel(D, N, B, L, dtype, contiguous, seed, **({} if power_block is None else {"power_block": power_block}))


def _oracle_long(p, log_q, gamma, hx, L, dk, db, chunk=1 << 16):
    """float64 k, b and gradients for long L: every power a direct exp of a float64 exponent
    (exact for fp32 log_q), chunked over j; vectorised, so it scales to L = 2**18 in about a second."""
    p, lq, g, hx = (t.detach().to(torch.complex128 if t.is_complex() else torch.float64) for t in (p, log_q, gamma, hx))
    dk, db = dk.double(), db.double()
    u = p * g
    k, b = torch.zeros(dk.shape, dtype=torch.float64), torch.zeros(db.shape, dtype=torch.float64)
    S = S1 = T = T1 = 0
    for j0 in range(0, L, chunk):
        j = torch.arange(j0, min(j0 + chunk, L), dtype=torch.float64)
        qj = torch.exp(lq[..., None] * j)                    # [D, N, C]
        qj1 = torch.exp(lq[..., None] * (j + 1))
        sl = slice(j0, j0 + len(j))
        k[:, sl] = torch.einsum("dn,dnc->dc", u, qj).real
        b[..., sl] = torch.einsum("bdn,dnc->bdc", g * hx, qj1).real
        S = S + torch.einsum("dc,dnc->dn", dk[:, sl].to(qj.dtype), qj)
        S1 = S1 + torch.einsum("dc,dnc->dn", (dk[:, sl] * j).to(qj.dtype), qj)
        T = T + torch.einsum("bdc,dnc->bdn", db[..., sl].to(qj.dtype), qj1)
        T1 = T1 + torch.einsum("bdc,dnc->bdn", (db[..., sl] * (j + 1)).to(qj.dtype), qj1)
    grads = ((S * g).real, (S1 * u + (T1 * hx).sum(0) * g).conj_physical(), (S * p + (T * hx).sum(0)).conj_physical(),
             (T * g).conj_physical())
    return k, b, grads


@pytest.mark.parametrize("gap", [1e-5, 1e-6])
def test_cema_kernel_fp32_accuracy_at_long_length(gap):
    # The numerical contract: fp32 powers up to j = 2**18 with |q| = 1 - gap stay within 1e-5
    # (norm-wise) of float64, forward and backward (bench/accuracy_cema.py measures ~3e-7, and
    # goes to 2**20). A power built by repeated multiplication or from j*arg(q) in fp32 fails this.
    L, D, N, B = 1 << 18, 2, 4, 1
    gen = torch.Generator().manual_seed(7)
    c = random_coefficients(gen, D, N, B, torch.float32)
    c["log_q"] = torch.complex(torch.full((D, N), math.log1p(-gap), dtype=torch.float64),
                               c["log_q"].imag.double()).to(torch.complex64)
    ins = [c[n].requires_grad_() for n in ("p", "log_q", "gamma", "hx")]
    k, b = cema_kernel(*ins[:3], L, ins[3], backend="torch")
    dk = torch.randn(k.shape, generator=gen)
    db = torch.randn(b.shape, generator=gen)
    grads = torch.autograd.grad((k, b), ins, (dk, db))
    k_ref, b_ref, grads_ref = _oracle_long(*ins, L, dk, db)
    assert_close("k", k, k_ref, 1e-5)
    assert_close("b", b, b_ref, 1e-5)
    assert_close("k[L/2:]", k[:, L // 2:], k_ref[:, L // 2:], 1e-5)  # no loss of precision with j
    for name, got, want in zip(("dp", "dlog_q", "dgamma", "dhx"), grads, grads_ref):
        assert_close(name, got, want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cema_kernel_streaming(dtype):
    # k of a shorter length is a prefix of k; b over [L1, L) with state hx equals b over L - L1
    # steps from the state carried through L1 zero inputs, q**L1 hx = ema_hidden(0, ..., hx).
    gen = torch.Generator().manual_seed(3)
    c = random_coefficients(gen, 4, 5, 2, dtype)
    L, L1 = 150, 61
    k, b = cema_kernel(c["p"], c["log_q"], c["gamma"], L, c["hx"])
    k2, _ = cema_kernel(c["p"], c["log_q"], c["gamma"], L - L1)
    h1 = ema_hidden(torch.zeros(2, 4, L1, dtype=dtype), c["p"], c["log_q"], c["hx"])
    _, b2 = cema_kernel(c["p"], c["log_q"], c["gamma"], L - L1, h1)
    assert_close("k prefix", k2, to_np(k[:, : L - L1]), tol("torch", dtype, "fwd"))
    assert_close("b second half", b2, to_np(b[..., L1:]), tol("torch", dtype, "fwd"))


def test_cema_kernel_gradcheck():
    gen = torch.Generator().manual_seed(5)
    c = random_coefficients(gen, 2, 3, 2, torch.float64)
    ins = tuple(c[n].requires_grad_() for n in ("p", "log_q", "gamma", "hx"))
    with knobs(kernel_impl, power_block=3):
        assert torch.autograd.gradcheck(lambda p, lq, g, hx: cema_kernel(p, lq, g, 7, hx), ins)


def _good():
    return dict(p=torch.rand(3, 4), log_q=torch.zeros(3, 4, dtype=torch.complex64),
                gamma=torch.zeros(3, 4, dtype=torch.complex64), length=5,
                hx=torch.zeros(2, 3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(p=torch.rand(3, 4, 1)), ValueError, r"p must have rank 2 \(D, N\)"),
    (dict(p=torch.rand(3, 4, dtype=torch.float16)), TypeError, "p must have dtype"),
    (dict(p=torch.rand(3, 4).numpy()), TypeError, "p must be a torch.Tensor"),
    (dict(log_q=torch.zeros(3, 5, dtype=torch.complex64)), ValueError, r"log_q must have shape \(D, N\)"),
    (dict(log_q=torch.zeros(3, 4)), TypeError, "log_q must have dtype in \\[complex64\\]"),
    (dict(log_q=torch.zeros(3, 4, dtype=torch.complex128)), TypeError, "log_q must have dtype"),
    (dict(gamma=torch.zeros(4, 4, dtype=torch.complex64)), ValueError, r"gamma must have shape \(D, N\)"),
    (dict(gamma=torch.zeros(3, 4, dtype=torch.complex128)), TypeError, "gamma must have dtype"),
    (dict(hx=torch.zeros(3, 4, dtype=torch.complex64)), ValueError, r"hx must have rank 3 \(B, D, N\)"),
    (dict(hx=torch.zeros(2, 3, 5, dtype=torch.complex64)), ValueError, r"hx must have shape \(B, D, N\)"),
    (dict(hx=torch.zeros(2, 3, 4)), TypeError, "hx must have dtype"),
    (dict(length=0), ValueError, "length must be >= 1"),
    (dict(length=5.0), TypeError, "length must be an int"),
    (dict(length=True), TypeError, "length must be an int"),
    (dict(backend="cuDNN"), ValueError, "backend must be one of"),
])
def test_cema_kernel_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        cema_kernel(**args, backend=backend)


def test_cema_kernel_device_mismatch():
    args = _good()
    args["gamma"] = args["gamma"].to("meta")
    with pytest.raises(ValueError, match="gamma is on meta"):
        cema_kernel(**args)
