"""cema_kernel (k and bias b) on every backend against the float64 reference.

* One table of cases run on each backend that implements it (torch; Triton in the interpreter,
  float32, N <= 32; CUDA in the emulator, float32/float64, N <= 64): k, b and every gradient with
  random upstream gradients into k and b (or one of them).
* The fp32 accuracy contract at L = 2**18 with |q| = 1 - gap against an exact float64 oracle;
  streaming (prefix / carried-state) properties; gradcheck.
* The reference's own backward against finite differences.
* The CUDA kernels' launch description (ops/cema_kernel/cuda_impl.py over cuda/cema.cuh) in the emulator, in both fiber
  orders: shapes over every n tile and several blocks per feature, partial gradients, long L in
  fp32 and fp64, determinism, strided inputs, what the launchers refuse.
* Argument validation and what each backend refuses, naming the fix.
"""
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels import ops
from megalodon_kernels.cuda.launch import EmulatorLauncher as emu  # the launch descriptions in the emulator
from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda
from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.cema_kernel import torch_impl as kernel_torch
from megalodon_kernels.ops.cema_kernel import triton_impl as kernel_triton
from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.reference import cema_kernel as ref
from support import (as_input, assert_close, backend_module, cema_coefficients, cema_powers, finite_difference_grad,
                     knobs, noncontiguous, on_backends, to_np, tol)

F32, F64 = torch.float32, torch.float64
#: the reference's backward vs central differences (support.finite_difference_grad): 3.3e-10 worst
#: measured (truncation + rounding of the step), 3x-4x of it
FD_TOL = 1.5e-9
CPLX = {F32: torch.complex64, F64: torch.complex128}


@pytest.fixture(scope="module")
def emulated(ext):
    """The CUDA backends over the emulator (conftest.use_emulated_cuda plugs them in); ema_hidden for
    the streaming state."""
    from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda

    get = lambda launcher=emu(ext): launcher  # noqa: E731
    return {"cema_kernel": cema_cuda.CemaKernelBackend(get, "cpu"),
            "ema_hidden": hidden_cuda.EmaHiddenBackend(get, "cpu")}


# ------------------------------------------------------------------------------------------------
# the case table: forward and every gradient on every backend
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    D: int
    N: int
    B: int | None                   # None: no hx, so no b
    L: int
    dtype: torch.dtype              # of p; log_q, gamma and hx take the matching complex dtype
    contiguous: bool = True
    use: tuple = ("k", "b")         # the outputs that get an upstream gradient
    knobs: dict = field(default_factory=dict)   # {backend: knob values}
    only: tuple | None = None       # a sweep of one backend's knob runs on that backend alone


def case(D, N, B, L, dtype, id, **kw):
    return pytest.param(Case(D, N, B, L, dtype, **kw), id=id)


def _dt(dtype):
    return str(dtype).replace("torch.", "")


USES = {"k_and_b": ("k", "b"), "k_only": ("k",), "b_only": ("b",)}

CASES = [
    *(case(3, 4, B, L, dt, f"L{L}-{'hx' if B else 'no_hx'}-{_dt(dt)}")
      for dt in (F32, F64) for B in (None, 2) for L in (1, 31, 33, 63, 129)),
    case(60, 2, 1, 33, F32, "D60-strided", contiguous=False),
    # N = 19 pads to Triton's 32-wide n tile; L = 333 with 16 x 16 Triton tiles spans two row blocks and a partial tile
    case(2, 19, 2, 333, F32, "N19-L333-strided-tiles16", contiguous=False,
         knobs={"triton": dict(block_m=16, block_r=16)}),
    # one output unused (autograd passes None for its gradient): its terms vanish, dhx = 0 without db
    *(case(2, 3, 2, 40, dt, f"L40-{u}-{_dt(dt)}", use=USES[u]) for u in ("k_only", "b_only") for dt in (F32, F64)),
    # the CUDA n tile 16, every combination of outputs
    *(case(5, 16, 2, 45, dt, f"N16-L45-{u}-{_dt(dt)}", use=USES[u]) for u in USES for dt in (F32, F64)),
    *(case(5, 16, None, 45, dt, f"N16-L45-no_hx-{_dt(dt)}") for dt in (F32, F64)),
    # N = 20 (CUDA n tile 32) over a longer length, float64
    *(case(5, 20, B, 300, F64, f"N20-L300-{'hx' if B else 'no_hx'}-float64") for B in (2, None)),
    # every power-table block size of the torch backend: T = 1 makes every power a Q2 entry, T >= L
    # every power a Q1 entry; 3 and 8 leave a partial last block (L = 50), so the padding of both
    # layouts is exercised
    *(case(2, 3, 2, 50, F32, f"power_block{T}", knobs={"torch": dict(power_block=T)}, only=("torch",))
      for T in (1, 3, 8, 64, 1000)),
]


def runs_on(backend, c: Case) -> bool:
    if c.only is not None and backend not in c.only:
        return False
    if backend == "triton":
        return c.dtype == F32 and c.N <= 32
    if backend == "cuda":
        return c.N <= 64
    return True


def check_cema_kernel(backend, D, N, B, L, dtype, contiguous=True, seed=0, use=("k", "b"), **config):
    """k, b and every gradient of ``backend`` (run with the knob values ``config``) vs the reference."""
    gen = torch.Generator().manual_seed(seed)
    c = cema_coefficients(gen, D, N, B, dtype)._asdict()
    names = ["p", "log_q", "gamma"] + (["hx"] if B is not None else [])
    ins = {n: as_input(c[n], contiguous=contiguous, requires_grad=True) for n in names}
    with knobs(backend_module("cema_kernel", backend), **config):
        k, b = cema_kernel(ins["p"], ins["log_q"], ins["gamma"], L, ins.get("hx"), backend=backend)
        assert k.shape == (D, L) and k.dtype == dtype
        assert (b is None) == (B is None)
        npin = {n: to_np(t) for n, t in ins.items()}
        k_ref, b_ref = ref.cema_kernel(npin["p"], npin["log_q"], npin["gamma"], L, npin.get("hx"))
        k_terms, b_terms = ref.cema_kernel_terms(npin["p"], npin["log_q"], npin["gamma"], L, npin.get("hx"))
        assert_close("k", k, k_ref, tol(backend, dtype, "fwd"), k_terms)
        if B is not None:
            assert b.shape == (B, D, L) and b.dtype == dtype
            assert_close("b", b, b_ref, tol(backend, dtype, "fwd"), b_terms)
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
    terms = ref.cema_kernel_bwd_terms(to_np(dk) if "k" in use else None, None if db is None else to_np(db),
                                      npin["p"], npin["log_q"], npin["gamma"], L, npin.get("hx"))
    for name, got, exp, m in zip(names, grads, want, terms):
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        if np.max(np.abs(exp)) == 0:  # dp without dk, dhx without db
            assert torch.all(got == 0), name
            continue
        assert_close("d" + name, got, exp, tol(backend, dtype, "bwd"), m)


@pytest.mark.parametrize("backend, c", on_backends(CASES, runs_on))
def test_matches_reference(backend, c):
    check_cema_kernel(backend, c.D, c.N, c.B, c.L, c.dtype, c.contiguous, use=c.use, **c.knobs.get(backend, {}))


@given(D=st.integers(1, 6), N=st.integers(1, 8), B=st.sampled_from([None, 1, 3]), L=st.integers(1, 200),
       dtype=st.sampled_from([F32, F64]), contiguous=st.booleans(),
       power_block=st.sampled_from([None, 1, 5, 16, 33]), seed=st.integers(0, 2**31))
def test_property_torch(D, N, B, L, dtype, contiguous, power_block, seed):
    check_cema_kernel("torch", D, N, B, L, dtype, contiguous, seed,
                      **({} if power_block is None else {"power_block": power_block}))


# ------------------------------------------------------------------------------------------------
# accuracy at long L, streaming, gradcheck
# ------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("count, step, first", [(1, 1, 0), (16, 1, 0), (17, 1, 0), (65, 1, 0), (4097, 1, 0),
                                                 (300, 64, 64), (33, 4096, 0)])
def test_progression_powers_match_exact_powers(count, step, first):
    # The power tables' doubling construction (float64 products of exact factors, rounded once)
    # against one exact evaluation per entry: complex128 bit for bit (it is exact_powers there);
    # complex64 equal except where the float64 value sits within ~1e-15 of a rounding boundary,
    # and there within one unit in the last place.
    from megalodon_kernels.ops._vandermonde import exact_powers, progression_powers

    gen = torch.Generator().manual_seed(count)
    lq = torch.complex(-torch.rand(24, 8, generator=gen) * torch.logspace(-6, 0, 8),
                       (torch.rand(24, 8, generator=gen) - 0.5) * 2 * math.pi)
    exps = torch.arange(count) * step + first
    for dtype in (torch.complex64, torch.complex128):
        got, want = progression_powers(lq.to(dtype), count, step, first), exact_powers(lq.to(dtype), exps)
        assert got.dtype == dtype and got.shape == (24, 8, count)
        differ = got != want
        print(f"{dtype}: {int(differ.sum())} of {differ.numel()} entries differ")
        if dtype == torch.complex128:
            assert not differ.any()
        else:
            assert differ.float().mean() <= 1e-4
            ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
            assert ((got - want).abs() <= ulp).all()
    with pytest.raises(ValueError, match="count"):
        progression_powers(lq, 0)


@pytest.mark.parametrize("backend, gap, config", [
    ("torch", 1e-5, {}),
    ("torch", 1e-6, {}),
    # two programs per kernel (D = 2) with 256 x 256 tiles, each looping over the whole length
    ("triton", 1e-5, dict(block_m=256, block_r=256)),
    ("cuda", 1e-5, {}),
], ids=["torch-gap1e-5", "torch-gap1e-6", "triton-gap1e-5", "cuda-gap1e-5"])
def test_fp32_accuracy_at_long_length(backend, gap, config):
    # The numerical contract: fp32 powers up to j = 2**18 with |q| = 1 - gap stay within the op's
    # fp32 budget (norm-wise, ~7e-7 measured: tests/support.py) of float64, forward and backward,
    # also on the second half (no loss of precision with j; bench/accuracy_cema.py goes to 2**20).
    # A power built by repeated multiplication or from j*arg(q) in fp32 fails this.
    L, D, N, B = 1 << 18, 2, 4, 1
    gen = torch.Generator().manual_seed(7)
    ins = [t.requires_grad_() for t in cema_coefficients(gen, D, N, B, F32, min_gap=gap, max_gap=gap)]
    with knobs(backend_module("cema_kernel", backend), **config):
        k, b = cema_kernel(*ins[:3], L, ins[3], backend=backend)
        dk = torch.randn(k.shape, generator=gen)
        db = torch.randn(b.shape, generator=gen)
        grads = torch.autograd.grad((k, b), ins, (dk, db))
    k_ref, b_ref, grads_ref = _oracle_long(*ins, L, dk, db)
    assert_close("k", k, k_ref, tol(backend, F32, "fwd"))
    assert_close("b", b, b_ref, tol(backend, F32, "fwd"))
    assert_close("k[L/2:]", k[:, L // 2:], k_ref[:, L // 2:], tol(backend, F32, "fwd"))
    for name, got, want in zip(("dp", "dlog_q", "dgamma", "dhx"), grads, grads_ref):
        assert_close(name, got, want, tol(backend, F32, "bwd"))


@pytest.mark.parametrize("backend, dtype", [
    ("torch", F32), ("torch", F64), ("triton", F32),
    ("cuda", F32), ("cuda", F64),
], ids=["torch-float32", "torch-float64", "triton-float32", "cuda-float32", "cuda-float64"])
def test_streaming(backend, dtype):
    # k of a shorter length is a prefix of k; b over [L1, L) with state hx equals b over L - L1
    # steps from the state carried through L1 zero inputs, q**L1 hx = ema_hidden(0, ..., hx).
    p, log_q, gamma, hx = cema_coefficients(3, 4, 5, 2, dtype)
    L, L1 = 150, 61
    k, b = cema_kernel(p, log_q, gamma, L, hx, backend=backend)
    k2, _ = cema_kernel(p, log_q, gamma, L - L1, backend=backend)
    h1 = ema_hidden(torch.zeros(2, 4, L1, dtype=dtype), p, log_q, hx, backend=backend)
    _, b2 = cema_kernel(p, log_q, gamma, L - L1, h1, backend=backend)
    assert_close("k prefix", k2, to_np(k[:, : L - L1]), tol(backend, dtype, "fwd"))
    assert_close("b second half", b2, to_np(b[..., L1:]), tol(backend, dtype, "fwd"))


def test_gradcheck_torch():
    ins = tuple(t.requires_grad_() for t in cema_coefficients(5, 2, 3, 2, F64))
    with knobs(kernel_torch, power_block=3):
        assert torch.autograd.gradcheck(lambda p, lq, g, hx: cema_kernel(p, lq, g, 7, hx), ins)


# ------------------------------------------------------------------------------------------------
# the reference's backward against central finite differences (float64, tiny shapes)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
@pytest.mark.parametrize("L", [1, 7])
def test_reference_bwd_matches_finite_differences(with_hx, L):
    gen = torch.Generator().manual_seed(1)
    p, log_q, gamma, hx = (to_np(t) for t in cema_coefficients(gen, 2, 3, 2, F64))
    args = dict(p=p, log_q=log_q, gamma=gamma, hx=hx if with_hx else None)
    dk = to_np(torch.randn(2, L, generator=gen, dtype=F64))
    db = to_np(torch.randn(2, 2, L, generator=gen, dtype=F64))

    def loss(v):
        k, b = ref.cema_kernel(v["p"], v["log_q"], v["gamma"], L, v["hx"])
        return np.sum(dk * k) + (np.sum(db * b) if b is not None else 0.0)

    grads = ref.cema_kernel_bwd(dk, db if with_hx else None, p, log_q, gamma, L, args["hx"])
    names = ["p", "log_q", "gamma"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        assert_close(f"{name} vs finite differences", g, finite_difference_grad(loss, args, name), FD_TOL)
    assert (grads[3] is None) == (not with_hx)


# ------------------------------------------------------------------------------------------------
# CUDA: the kernels' tensor API in the emulator
# ------------------------------------------------------------------------------------------------

# (B, D, N, L): odd lengths, D = 60, N below / between / at the n tiles (16, 32, 64), and lengths
# over several tiles and several blocks per feature (L = 5000 with D = 2: 5 synthesis / 2 analysis blocks).
SHAPES = [(2, 3, 16, 1), (2, 3, 16, 31), (1, 2, 5, 33), (2, 60, 16, 129), (1, 2, 40, 129), (2, 1, 64, 33),
          (2, 2, 16, 5000)]
SHAPE_IDS = [f"B{b}-D{d}-N{n}-L{l}" for b, d, n, l in SHAPES]


def _randn(*shape, generator, dtype=F32):
    return torch.randn(*shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_kernels(ext, order, shape, with_hx, real):
    B, D, N, L = shape
    fwd, bwd = tol("cuda", real, "fwd"), tol("cuda", real, "bwd")
    p, log_q, gamma, hx = cema_coefficients(L + N, D, N, B, real)
    hx = hx if with_hx else None
    g = torch.Generator().manual_seed(7)
    k, b = cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx)
    k_ref, b_ref = ref.cema_kernel(to_np(p), to_np(log_q), to_np(gamma), L, None if hx is None else to_np(hx))
    assert k.dtype == real and k.shape == (D, L)
    assert_close("k", k, k_ref, fwd)
    if with_hx:
        assert b.dtype == real and b.shape == (B, D, L)
        assert_close("b", b, b_ref, fwd)
    else:
        assert b is None
    dk = _randn(D, L, generator=g, dtype=real)
    db = _randn(B, D, L, generator=g, dtype=real) if with_hx else None
    got = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    want = ref.cema_kernel_bwd(to_np(dk), None if db is None else to_np(db), to_np(p), to_np(log_q),
                               to_np(gamma), L, None if hx is None else to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, want):
        if r is None:
            assert a is None
            continue
        assert a.dtype == (real if name == "dp" else CPLX[real]) and a.shape == r.shape
        assert_close(name, a, r, bwd)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
@pytest.mark.parametrize("which", ["dk_only", "db_only"])
def test_cuda_kernels_bwd_one_gradient(ext, order, which, real):
    """One of dk / db absent (autograd passes None for an unused output): its terms vanish, dhx = 0 without db."""
    B, D, N, L = 2, 3, 12, 70
    p, log_q, gamma, hx = cema_coefficients(3, D, N, B, real)
    g = torch.Generator().manual_seed(11)
    dk = _randn(D, L, generator=g, dtype=real) if which == "dk_only" else None
    db = _randn(B, D, L, generator=g, dtype=real) if which == "db_only" else None
    got = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    want = ref.cema_kernel_bwd(None if dk is None else to_np(dk), None if db is None else to_np(db), to_np(p),
                               to_np(log_q), to_np(gamma), L, to_np(hx))
    if which == "db_only":
        assert torch.count_nonzero(got[0]) == 0  # dp depends on dk only
    else:
        assert torch.count_nonzero(got[3]) == 0  # dhx depends on db only
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, want):
        assert_close(name, a, r, tol("cuda", real, "bwd"))


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_bwd_without_log_q_gradient(ext, real):
    """needs[1] = False skips the exponent-weighted sums: dlog_q is 0, the other gradients unchanged."""
    B, D, N, L = 1, 2, 16, 100
    p, log_q, gamma, hx = cema_coefficients(5, D, N, B, real)
    g = torch.Generator().manual_seed(1)
    dk, db = _randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real)
    full = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    part = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx, (True, False, True, True))
    assert torch.count_nonzero(part[1]) == 0 and torch.count_nonzero(full[1]) > 0
    for a, b in zip((full[0], full[2], full[3]), (part[0], part[2], part[3])):
        assert torch.equal(a, b)


@given(D=st.integers(1, 5), N=st.integers(1, 64), B=st.integers(0, 3), L=st.integers(1, 700),
       fp64=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_cuda_kernels_property(ext, D, N, B, L, fp64, seed):
    """Random sizes (every n tile, B = 0 without hx, any L up to several tiles), fp32 or fp64
    coefficients: k, b and every gradient match the float64 reference."""
    real = F64 if fp64 else F32
    fwd, bwd = tol("cuda", real, "fwd"), tol("cuda", real, "bwd")
    p, log_q, gamma, hx = cema_coefficients(seed, D, N, max(B, 1), real)
    hx = hx if B > 0 else None
    g = torch.Generator().manual_seed(seed + 1)
    k, b = cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx)
    want = ref.cema_kernel(to_np(p), to_np(log_q), to_np(gamma), L, None if hx is None else to_np(hx))
    assert_close("k", k, want[0], fwd)
    if hx is not None:
        assert_close("b", b, want[1], fwd)
    dk = _randn(D, L, generator=g, dtype=real)
    db = _randn(B, D, L, generator=g, dtype=real) if hx is not None else None
    got = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    want = ref.cema_kernel_bwd(to_np(dk), None if db is None else to_np(db), to_np(p), to_np(log_q),
                               to_np(gamma), L, None if hx is None else to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, want):
        if r is not None:
            assert_close(name, a, r, bwd)


@pytest.mark.parametrize("L", [1 << 16, 1 << 20], ids=["L=2^16", "L=2^20"])
def test_cuda_kernels_long_length_accuracy(ext, L):
    """|q| close to 1 (1 - |q| ~ 1e-6 .. 2e-5, decay length ~1e5 steps) and phases over the whole circle:
    powers up to q**(2**20) stay fp32-accurate (each is exp / sincospi in double, rounded once, times
    one more such table entry). Norm-wise relative error within the CUDA fp32 budget vs float64 for k and b (and every
    gradient at 2**16)."""
    B, D, N = 1, 2, 4
    p, log_q, gamma, hx = cema_coefficients(4, D, N, B, F32, min_gap=1e-6, max_gap=2e-5)
    g = torch.Generator().manual_seed(5)
    j = np.arange(L, dtype=np.float64)
    k, b = cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx)
    qj, qj1 = cema_powers(log_q, j), cema_powers(log_q, j + 1)                # [D, N, L]
    assert_close("k", k, np.einsum("dn,dnl->dl", to_np(p) * to_np(gamma), qj).real, tol("cuda", F32, "fwd"))
    assert_close("b", b, np.einsum("bdn,dnl->bdl", to_np(gamma)[None] * to_np(hx), qj1).real, tol("cuda", F32, "fwd"))
    if L > 1 << 16:
        return  # the float64 references of the gradients at 2**20 cost more than the kernels
    dk, db = torch.randn(D, L, generator=g), torch.randn(B, D, L, generator=g)
    got = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    want = ref.cema_kernel_bwd(to_np(dk), to_np(db), to_np(p), to_np(log_q), to_np(gamma), L, to_np(hx))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, want):
        assert_close(name, a, r, tol("cuda", F32, "bwd"))


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs x87 long double for the exact sums")
@pytest.mark.parametrize("L", [4096, 1 << 16], ids=["L=4096", "L=2^16"])
def test_cuda_kernels_long_length_accuracy_fp64(ext, L):
    """float64 at long L, |q| close to 1 (decay length ~5e4 steps), phases over the whole circle: k, b
    and every gradient within 1.5e-14 (4.1e-15 measured) of the exact sums (max abs error / max
    |ref|), where the float64 NumPy reference itself drifts by ~L * 2**-53. A power rounded through
    fp32 anywhere would be ~1e-7 off; a double power with its phase e * arg(q) formed by one rounded
    product ~L * 1e-16 (norm-wise 3e-13 at 4096, 5e-12 at 2**16 when tried). `pytest -s` prints the
    measured errors."""
    B, D, N = 1, 2, 4
    p, log_q, gamma, hx = cema_coefficients(4, D, N, B, F64, min_gap=1e-6, max_gap=2e-5)
    P, G, H = to_np(p).astype(np.longdouble), to_np(gamma).astype(np.clongdouble), to_np(hx).astype(np.clongdouble)
    j = np.arange(L)
    qj, qj1 = cema_powers(log_q, j, exact=True), cema_powers(log_q, j + 1, exact=True)
    g = torch.Generator().manual_seed(5)
    budget = 1.5e-14
    k, b = cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx)
    assert_close("k", k, np.einsum("dn,dnl->dl", P * G, qj).real, budget)
    assert_close("b", b, np.einsum("bdn,dnl->bdl", G[None] * H, qj1).real, budget)
    dk, db = _randn(D, L, generator=g, dtype=F64), _randn(B, D, L, generator=g, dtype=F64)
    DK, DB = to_np(dk).astype(np.longdouble), to_np(db).astype(np.longdouble)
    S, S1 = np.einsum("dl,dnl->dn", DK, qj), np.einsum("dl,dnl->dn", DK * j, qj)
    T, T1 = np.einsum("bdl,dnl->bdn", DB, qj1), np.einsum("bdl,dnl->bdn", DB * (j + 1), qj1)
    want = ((S * G).real, np.conj(S1 * P * G) + np.conj((T1 * H).sum(0) * G), np.conj(S * P) + np.conj((T * H).sum(0)),
            np.conj(T * G))
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"),
                          cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx), want):
        assert_close(name, a, r, budget)


def test_cuda_kernels_several_tiles_per_block_fp64(ext):
    """D = 1025 features leave one block per feature (Y = 1), so each block walks several tiles: fp64
    at N = 64 has 8-row synthesis tiles (one row per thread) and 16-row analysis tiles, and L = 520
    gives 3 and 2 of them. Against the float64 torch backend (its own two-level tables): the q2 /
    input tiles are rebuilt per tile without stale entries."""
    B, D, N, L = 1, 1025, 64, 520
    fwd, bwd = tol("cuda", F64, "fwd"), tol("cuda", F64, "bwd")
    p, log_q, gamma, hx = cema_coefficients(40, D, N, B, F64)
    g = torch.Generator().manual_seed(41)
    got = cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx)
    for name, a, r in zip("kb", got, kernel_torch.forward(p, log_q, gamma, L, hx, power_block=64)):
        assert_close(name, a, to_np(r), fwd)
    dk, db = _randn(D, L, generator=g, dtype=F64), _randn(B, D, L, generator=g, dtype=F64)
    got = cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx)
    want = kernel_torch.backward(dk, db, p, log_q, gamma, L, hx, power_block=64)
    for name, a, r in zip(("dp", "dlog_q", "dgamma", "dhx"), got, want):
        assert_close(name, a, to_np(r), bwd)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_deterministic_across_runs_and_fiber_orders(ext, real):
    """Reductions over j run in a fixed order (per-thread sums, fixed-order block sum, Y partials
    summed in order by one thread; no atomics): bit-identical results in both fiber orders. D = 1
    and L = 40000 spread each feature over many blocks."""
    B, D, N, L = 2, 1, 16, 40000
    p, log_q, gamma, hx = cema_coefficients(8, D, N, B, real)
    g = torch.Generator().manual_seed(6)
    dk, db = _randn(D, L, generator=g, dtype=real), _randn(B, D, L, generator=g, dtype=real)
    runs = []
    for rev in (0, 1, 0):
        ext.emulator_set_reverse(rev)
        runs.append(cema_cuda.launch_bwd(emu(ext), dk, db, p, log_q, gamma, L, hx))
    ext.emulator_set_reverse(-1)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_strided_and_expanded_inputs(ext, real):
    """Strided views of every input and an expanded (stride-0) upstream gradient (as from k.sum())
    give the same bits as contiguous copies."""
    B, D, N, L = 2, 3, 16, 50
    p, log_q, gamma, hx = cema_coefficients(30, D, N, B, real)
    views = [noncontiguous(t) for t in (p, log_q, gamma, hx)]
    for a, b in zip(cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, L, hx),
                    cema_cuda.launch_fwd(emu(ext), *views[:3], L, views[3])):
        assert torch.equal(a, b)
    dk = torch.full((1, 1), 0.5, dtype=real).expand(D, L)
    db = _randn(B, D, L, generator=torch.Generator().manual_seed(1), dtype=real)
    want = cema_cuda.launch_bwd(emu(ext), dk.contiguous(), db, p, log_q, gamma, L, hx)
    got = cema_cuda.launch_bwd(emu(ext), dk, noncontiguous(db), *views[:3], L, views[3])
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_cuda_kernels_bad_inputs(ext):
    p, log_q, gamma, hx = cema_coefficients(0, 2, 16, 1)
    with pytest.raises(TypeError, match="float32 or float64 p"):
        cema_cuda.launch_fwd(emu(ext), p.half(), log_q, gamma, 10, None)
    # mixed precisions are refused, naming the argument (the op never produces them)
    with pytest.raises(TypeError, match="log_q torch.complex128 with torch.float64 p"):
        cema_cuda.launch_fwd(emu(ext), p.double(), log_q, gamma.to(torch.complex128), 10, None)
    with pytest.raises(TypeError, match="gamma torch.complex64 with torch.float32 p"):
        cema_cuda.launch_fwd(emu(ext), p, log_q, gamma.to(torch.complex128), 10, None)
    with pytest.raises(TypeError, match="hx torch.complex128"):
        cema_cuda.launch_bwd(emu(ext), None, None, p.double(), log_q.to(torch.complex128),
                             gamma.to(torch.complex128), 10, hx)
    p65, lq65, g65, _ = cema_coefficients(0, 1, 65, 1)
    with pytest.raises(ValueError, match="N <= 64"):
        cema_cuda.launch_fwd(emu(ext), p65, lq65, g65, 10, None)
    with pytest.raises(ValueError, match="N <= 64"):
        cema_cuda.launch_fwd(emu(ext), p65.double(), lq65.to(torch.complex128), g65.to(torch.complex128), 10, None)
    with pytest.raises(ValueError, match="length"):
        cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, 1 << 24, None)
    with pytest.raises(ValueError, match="length"):
        cema_cuda.launch_fwd(emu(ext), p, log_q, gamma, 0, None)


# ------------------------------------------------------------------------------------------------
# arguments: validation, and what each backend refuses
# ------------------------------------------------------------------------------------------------

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
def test_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        cema_kernel(**args, backend=backend)


def test_device_mismatch():
    args = _good()
    args["gamma"] = args["gamma"].to("meta")
    with pytest.raises(ValueError, match="gamma is on meta"):
        cema_kernel(**args)


def test_triton_refuses_float64():
    p, log_q, gamma, _ = cema_coefficients(0, 2, 3, None, F64)
    with pytest.raises(Exception, match="float32 coefficients"):
        cema_kernel(p, log_q, gamma, 8, backend="triton")


def test_triton_phase_fraction_is_exact_mod_one():
    # F / 2**64 == arg(q) / (2 pi) mod 1 to float64 precision, and e * F wraps exactly
    lq = torch.complex(torch.zeros(5), torch.tensor([-3.1, -1e-7, 0.0, 0.5, 3.14159]))
    f = kernel_triton.phase_fraction(lq)
    turns = (f.double() / 2.0 ** 64) % 1.0
    want = (lq.imag.double() / (2 * math.pi)) % 1.0
    assert torch.allclose(turns, want, atol=1e-15, rtol=0)


def test_cuda_reasons_name_the_fix(emulated):
    p, log_q, gamma, hx = cema_coefficients(0, 2, 80, 1)
    why = " ".join(cema_cuda.not_supported_reasons(p=p.half(), log_q=log_q, gamma=gamma,
                                                             length=1 << 24, hx=None))
    assert "unavailable" in why                       # no GPU runtime here (the reason says which part)
    assert "cuda tensors" not in why  # the unavailable runtime is the one reason about where it runs
    assert "float16" in why and "N = 80 > 64" in why and "2**24" in why
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
    with pytest.raises(ValueError, match="cuda"):
        ops.cema_kernel(p.double(), log_q.to(torch.complex128), gamma.to(torch.complex128), 8, backend="cuda")
