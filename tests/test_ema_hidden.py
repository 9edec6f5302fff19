"""ema_hidden (the last CEMA state) on every backend against the float64 reference, whose forward is
the step-by-step recurrence.

* One table of cases run on each backend that implements it (torch; Triton in the interpreter,
  float32 coefficients, N <= 32, x not float64; CUDA in the emulator, N <= 64, x not float16): h
  and every gradient in every (x, coefficient) dtype pair, odd sizes, non-contiguous inputs, every
  power-table block size, log_q without a gradient (the inference path).
* The fp32 accuracy at L = 2**18 with 1 - |q| = 1e-5 against an exact float64 oracle; streaming
  over two parts; gradcheck.
* The reference's own backward against finite differences.
* The CUDA kernels' launch description (ops/ema_hidden/cuda_impl.py over cuda/cema.cuh) in the emulator, in both fiber
  orders: every n tile, several blocks per feature, the saved sums V and W, partial gradients, long
  L in fp32 and fp64, determinism, strided and conj inputs, what the launchers refuse.
* Argument validation and what each backend refuses, naming the fix.
"""
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.cuda.launch import EmulatorLauncher as emu  # the launch descriptions in the emulator
from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda
from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.ema_hidden import torch_impl as hidden_torch
from megalodon_kernels.reference import ema_hidden as ref
from support import (as_input, assert_close, backend_module, cema_coefficients, cema_powers, finite_difference_grad,
                     knobs, noncontiguous, on_backends, to_np, tol)

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
#: the reference's backward vs central differences (support.finite_difference_grad): 3.4e-10 worst
#: measured (truncation + rounding of the step), 3x-4x of it
FD_TOL = 1.5e-9
CPLX = {F32: torch.complex64, F64: torch.complex128}


@pytest.fixture(scope="module")
def emulated(ext):
    """The CUDA backend over the emulator (conftest.use_emulated_cuda plugs it in)."""
    return {"ema_hidden": hidden_cuda.EmaHiddenBackend(lambda launcher=emu(ext): launcher, "cpu")}


def _dt(dtype):
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------
# the case table: h and every gradient on every backend
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    B: int
    D: int
    N: int
    L: int
    xdtype: torch.dtype
    cdtype: torch.dtype             # of p; log_q and hx take the matching complex dtype
    with_hx: bool = True
    contiguous: bool = True
    log_q_grad: bool = True         # False: the inference path (no exponent-weighted sums W)
    knobs: dict = field(default_factory=dict)   # {backend: knob values}
    only: tuple | None = None       # a sweep of one backend's knob runs on that backend alone


def case(B, D, N, L, xdtype, cdtype, id, **kw):
    return pytest.param(Case(B, D, N, L, xdtype, cdtype, **kw), id=id)


def _hx(with_hx):
    return "hx" if with_hx else "no_hx"


# (x dtype, coefficient dtype). x is read in its own dtype and accumulated in the coefficient
# dtype: h and the coefficient gradients are computed from the rounded x and meet the coefficient
# dtype's error; dx is rounded once to x's dtype.
DTYPES = [(F32, F32), (BF16, F32), (F16, F32), (F64, F64)]
MIXED = [(F32, F64), (BF16, F64), (F64, F32)]

CASES = [
    *(case(2, 3, 4, L, x, c, f"L{L}-{_hx(h)}-x_{_dt(x)}-c_{_dt(c)}", with_hx=h)
      for x, c in DTYPES for L in (1, 31, 33, 63, 129) for h in (False, True)),
    case(1, 60, 2, 33, BF16, F32, "D60-strided-x_bfloat16", contiguous=False),
    # N = 19 pads to Triton's 32-wide n tile; L = 333 with 16 x 16 Triton tiles: front padding, two row blocks
    case(2, 2, 19, 333, BF16, F32, "N19-L333-strided-tiles16-x_bfloat16", contiguous=False,
         knobs={"triton": dict(block_m=16, block_r=16)}),
    # the CUDA n tile 16 in every dtype pair the CUDA kernels take
    *(case(2, 4, 16, 63, x, c, f"N16-L63-{_hx(h)}-x_{_dt(x)}-c_{_dt(c)}", with_hx=h)
      for x, c in [(F32, F32), (BF16, F32), (F64, F64)] + MIXED for h in (True, False)),
    *(case(2, 4, 16, 150, x, F64, f"N16-L150-{_hx(h)}-x_{_dt(x)}-c_float64", with_hx=h)
      for x in (F64, F32) for h in (True, False)),
    # log_q without requires_grad: the forward skips W, dx and dp still exact
    case(2, 3, 20, 50, F32, F32, "N20-L50-no_log_q_grad-float32", with_hx=False, log_q_grad=False),
    case(2, 3, 24, 90, F64, F64, "N24-L90-no_log_q_grad-float64", with_hx=False, log_q_grad=False),
    # ... and in the other (x, coefficient) pairs the CUDA kernels take (each its own instantiation)
    *(case(2, 3, 20, 50, x, c, f"N20-L50-no_log_q_grad-x_{_dt(x)}-c_{_dt(c)}", with_hx=False, log_q_grad=False)
      for x, c in [(BF16, F32), (BF16, F64), (F32, F64)]),
    # every power-table block size of the torch backend: the reverse layout pads at the front, so
    # L = 50 leaves a partial first block for T = 3 and 8
    *(case(2, 2, 3, 50, F32, F32, f"power_block{T}", knobs={"torch": dict(power_block=T)}, only=("torch",))
      for T in (1, 3, 8, 1000)),
]


def runs_on(backend, c: Case) -> bool:
    if c.only is not None and backend not in c.only:
        return False
    if backend == "triton":
        return c.cdtype == F32 and c.xdtype != F64 and c.N <= 32
    if backend == "cuda":
        return c.xdtype != F16 and c.N <= 64
    return True


def _coarser(a, b):
    return a if torch.finfo(a).eps > torch.finfo(b).eps else b


def check_ema_hidden(backend, B, D, N, L, xdtype, cdtype, with_hx=True, contiguous=True, seed=0, log_q_grad=True,
                     **config):
    """h and every gradient of ``backend`` (run with the knob values ``config``) vs the reference."""
    gen = torch.Generator().manual_seed(seed)
    c = cema_coefficients(gen, D, N, B if with_hx else None, cdtype)._asdict()
    x0 = torch.randn(B, D, L, generator=gen, dtype=torch.float64)
    ins = {"x": as_input(x0, xdtype, contiguous, requires_grad=True)}
    for n in ("p", "log_q") + (("hx",) if with_hx else ()):
        ins[n] = as_input(c[n], contiguous=contiguous, requires_grad=n != "log_q" or log_q_grad)
    with knobs(backend_module("ema_hidden", backend), **config):
        h = ema_hidden(ins["x"], ins["p"], ins["log_q"], ins.get("hx"), backend=backend)
        assert h.shape == (B, D, N) and h.dtype == c["log_q"].dtype
        npin = {n: to_np(t) for n, t in ins.items()}
        # h is computed from the rounded x in the coefficient dtype
        assert_close("h", h, ref.ema_hidden(npin["x"], npin["p"], npin["log_q"], npin.get("hx")),
                     tol(backend, cdtype, "fwd"), ref.ema_hidden_terms(npin["x"], npin["p"], npin["log_q"], npin.get("hx")))
        dh = torch.complex(torch.randn(h.shape, generator=gen, dtype=torch.float64),
                           torch.randn(h.shape, generator=gen, dtype=torch.float64)).to(h.dtype)
        leaves = {n: t for n, t in ins.items() if t.requires_grad}
        grads = torch.autograd.grad(h, list(leaves.values()), dh)
    want = dict(zip(("x", "p", "log_q", "hx"),
                    ref.ema_hidden_bwd(to_np(dh), npin["x"], npin["p"], npin["log_q"], npin.get("hx"))))
    terms = dict(zip(("x", "p", "log_q", "hx"),
                     ref.ema_hidden_bwd_terms(to_np(dh), npin["x"], npin["p"], npin["log_q"], npin.get("hx"))))
    for name, got in zip(leaves, grads):
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        # dx: computed in the coefficient dtype and rounded to x's, so the coarser budget of the two
        dt = _coarser(xdtype, cdtype) if name == "x" else cdtype
        assert_close("d" + name, got, want[name], tol(backend, dt, "bwd"), terms[name])


@pytest.mark.parametrize("backend, c", on_backends(CASES, runs_on))
def test_matches_reference(backend, c):
    check_ema_hidden(backend, c.B, c.D, c.N, c.L, c.xdtype, c.cdtype, c.with_hx, c.contiguous,
                     log_q_grad=c.log_q_grad, **c.knobs.get(backend, {}))


@given(B=st.integers(1, 3), D=st.integers(1, 5), N=st.integers(1, 8), L=st.integers(1, 150),
       dtypes=st.sampled_from(DTYPES), with_hx=st.booleans(), contiguous=st.booleans(),
       power_block=st.sampled_from([None, 1, 7, 32]), seed=st.integers(0, 2**31))
def test_property_torch(B, D, N, L, dtypes, with_hx, contiguous, power_block, seed):
    check_ema_hidden("torch", B, D, N, L, *dtypes, with_hx, contiguous, seed,
                     **({} if power_block is None else {"power_block": power_block}))


# ------------------------------------------------------------------------------------------------
# accuracy at long L, streaming, gradcheck
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, config", [
    ("torch", {}),
    # one program per d for the forward, 256 x 256 tiles (few, large programs)
    ("triton", dict(block_m=256, block_r=256)),
    ("cuda", {}),
], ids=["torch", "triton", "cuda"])
def test_fp32_accuracy_at_long_length(backend, config):
    # h and its gradients at L = 2**18, 1-|q| = 1e-5, within the op's fp32 budget of float64 (exact
    # powers, chunked), also dx on its first half (the largest exponents)
    gap, L, D, N, B = 1e-5, 1 << 18, 2, 4, 1
    gen = torch.Generator().manual_seed(7)
    p, log_q, _, hx = cema_coefficients(gen, D, N, B, F32, min_gap=gap, max_gap=gap)
    x = torch.randn(B, D, L, generator=gen)
    ins = [x.requires_grad_(), p.requires_grad_(), log_q.requires_grad_(), hx.requires_grad_()]
    with knobs(backend_module("ema_hidden", backend), **config):
        h = ema_hidden(*ins, backend=backend)
        dh = torch.complex(torch.randn(h.shape, generator=gen), torch.randn(h.shape, generator=gen))
        grads = torch.autograd.grad(h, ins, dh)
    # float64 oracle: every power a direct exp of an exact float64 exponent
    lq = log_q.detach().to(torch.complex128)
    pd, hxd, xd = p.detach().double(), hx.detach().to(torch.complex128), x.detach().double()
    e = torch.arange(L - 1, -1, -1, dtype=torch.float64)
    qe = torch.exp(lq[..., None] * e)                                   # [D, N, L]
    qL = torch.exp(lq * L)
    V = torch.einsum("bdl,dnl->bdn", xd.to(qe.dtype), qe)
    W = torch.einsum("bdl,dnl->bdn", (xd * e).to(qe.dtype), qe)
    dhd = dh.to(torch.complex128)
    want_h = pd * V + qL * hxd
    want = (torch.einsum("bdn,dnl->bdl", dhd.conj() * pd, qe).real, (dhd.conj() * V).real.sum(0),
            (dhd * (pd * W + L * qL * hxd).conj()).sum(0), dhd * qL.conj())
    assert_close("h", h, want_h, tol(backend, F32, "fwd"))
    for name, got, exp in zip(("dx", "dp", "dlog_q", "dhx"), grads, want):
        assert_close(name, got, exp, tol(backend, F32, "bwd"))
    assert_close("dx[:L/2]", grads[0][..., : L // 2], want[0][..., : L // 2], tol(backend, F32, "bwd"))


@pytest.mark.parametrize("backend, xdtype, cdtype", [
    ("torch", F32, F32), ("torch", F64, F64), ("triton", F32, F32),
    ("cuda", F32, F32), ("cuda", F64, F64),
], ids=["torch-fp32", "torch-fp64", "triton-fp32", "cuda-fp32", "cuda-fp64"])
@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
def test_streaming(backend, xdtype, cdtype, with_hx):
    # h over [0, L) == h over [L1, L) started from h over [0, L1): the state the model caches.
    gen = torch.Generator().manual_seed(11)
    p, log_q, _, hx = cema_coefficients(gen, 3, 4, 2 if with_hx else None, cdtype)
    x = torch.randn(2, 3, 300, generator=gen, dtype=torch.float64).to(xdtype)
    whole = ema_hidden(x, p, log_q, hx, backend=backend)
    for L1 in (1, 41, 97, 150, 299):
        h1 = ema_hidden(x[..., :L1], p, log_q, hx, backend=backend)
        h2 = ema_hidden(x[..., L1:], p, log_q, h1, backend=backend)
        assert_close(f"streamed h (split {L1})", h2, to_np(whole), tol(backend, cdtype, "fwd"))


def test_gradcheck_torch():
    gen = torch.Generator().manual_seed(5)
    p, log_q, _, hx = cema_coefficients(gen, 2, 3, 2, F64)
    x = torch.randn(2, 2, 7, generator=gen, dtype=F64).requires_grad_()
    ins = (x, p.requires_grad_(), log_q.requires_grad_(), hx.requires_grad_())
    with knobs(hidden_torch, power_block=3):
        assert torch.autograd.gradcheck(lambda *a: ema_hidden(*a), ins)


# ------------------------------------------------------------------------------------------------
# the reference's backward against central finite differences (float64, tiny shapes)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
@pytest.mark.parametrize("L", [1, 6])
def test_reference_bwd_matches_finite_differences(with_hx, L):
    gen = torch.Generator().manual_seed(2)
    p, log_q, _, hx = (None if t is None else to_np(t) for t in cema_coefficients(gen, 2, 3, 2, F64))
    x = to_np(torch.randn(2, 2, L, generator=gen, dtype=F64))
    args = dict(x=x, p=p, log_q=log_q, hx=hx if with_hx else None)
    dh = to_np(torch.complex(torch.randn(hx.shape, generator=gen, dtype=F64),
                             torch.randn(hx.shape, generator=gen, dtype=F64)))

    def loss(v):
        return np.sum((np.conj(dh) * ref.ema_hidden(v["x"], v["p"], v["log_q"], v["hx"])).real)

    grads = ref.ema_hidden_bwd(dh, x, p, log_q, args["hx"])
    names = ["x", "p", "log_q"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        assert_close(f"{name} vs finite differences", g, finite_difference_grad(loss, args, name), FD_TOL)


# ------------------------------------------------------------------------------------------------
# CUDA: the kernels' tensor API in the emulator
# ------------------------------------------------------------------------------------------------

# (B, D, N, L): odd lengths, D = 60, N below / between / at the n tiles (16, 32, 64), and lengths
# over several tiles and several blocks per feature (L = 5000 with D = 2: 5 synthesis / 2 analysis blocks).
SHAPES = [(2, 3, 16, 1), (2, 3, 16, 31), (1, 2, 5, 33), (2, 60, 16, 129), (1, 2, 40, 129), (2, 1, 64, 33),
          (2, 2, 16, 5000)]
SHAPE_IDS = [f"B{b}-D{d}-N{n}-L{l}" for b, d, n, l in SHAPES]
# (coefficient real type, x dtype): x is read in its own dtype and widened to the real type on load.
KERNEL_DTYPES = [(F32, F32), (F32, BF16), (F64, F64), (F64, F32), (F64, BF16)]
KERNEL_DTYPE_IDS = [f"{_dt(r)}-x_{_dt(x)}" for r, x in KERNEL_DTYPES]


def _randn(*shape, generator, dtype=F32):
    return torch.randn(*shape, generator=generator, dtype=dtype)


def _crandn(*shape, generator, dtype=F32):
    return torch.complex(_randn(*shape, generator=generator, dtype=dtype), _randn(*shape, generator=generator,
                                                                                   dtype=dtype))


@pytest.mark.parametrize("real,dtype", KERNEL_DTYPES, ids=KERNEL_DTYPE_IDS)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_kernels(ext, order, shape, with_hx, real, dtype):
    B, D, N, L = shape
    fwd, bwd = tol("cuda", real, "fwd"), tol("cuda", real, "bwd")
    p, log_q, _, hx = cema_coefficients(L + 2 * N, D, N, B, real)
    hx = hx if with_hx else None
    g = torch.Generator().manual_seed(9)
    x = _randn(B, D, L, generator=g, dtype=real).to(dtype)
    h, V, W = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    # x enters in its own dtype and is accumulated in the real type: against the float64 recurrence
    # on the SAME (rounded) x the error is fp32- (fp64-) level whatever x's dtype.
    h_ref = ref.ema_hidden(to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    assert h.dtype == CPLX[real] and h.shape == (B, D, N)
    assert_close("h", h, h_ref, fwd)
    # V, W are the saved sums sum_j q**(L-1-j) x_j and sum_j (L-1-j) q**(L-1-j) x_j
    e = (L - 1 - np.arange(L)).astype(np.float64)
    qe = cema_powers(log_q, e)                                                # [D, N, L]
    assert_close("V", V, np.einsum("bdl,dnl->bdn", to_np(x), qe), fwd)
    assert_close("W", W, np.einsum("bdl,dnl->bdn", to_np(x) * e, qe), fwd)

    dh = _crandn(B, D, N, generator=g, dtype=real)
    dx, dp, dlq, dhx = hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V, W, L)
    want = ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    assert dx.dtype == real and dx.shape == (B, D, L) and dp.dtype == real and dlq.dtype == CPLX[real]
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), (dx, dp, dlq, dhx), want):
        if r is None:
            assert a is None
            continue
        assert_close(name, a, r, bwd)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_unweighted_and_partial_needs(ext, real):
    """weighted=False leaves W out (the inference path); the backward then computes no dlog_q, and
    need_x / need_p = False skip dx / write dp = 0."""
    B, D, N, L = 2, 3, 16, 77
    p, log_q, _, hx = cema_coefficients(21, D, N, B, real)
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(2), dtype=real)
    h1, V1, W1 = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    h0, V0, W0 = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, False)
    assert W0 is None and W1 is not None
    assert torch.equal(h0, h1) and torch.equal(V0, V1)
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(3), dtype=real)
    dx, dp, dlq, dhx = hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V0, None, L, (False, False, False, True))
    assert dx is None
    assert torch.count_nonzero(dp) == 0 and torch.count_nonzero(dlq) == 0
    want = ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), to_np(hx))
    assert_close("dhx", dhx, want[3], tol("cuda", real, "bwd"))
    with pytest.raises(ValueError, match="weighted"):
        hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V0, None, L, (False, False, True, True))


@given(D=st.integers(1, 5), N=st.integers(1, 64), B=st.integers(0, 3), L=st.integers(1, 700),
       x_bf16=st.booleans(), fp64=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_cuda_kernels_property(ext, D, N, B, L, x_bf16, fp64, seed):
    """Random sizes (every n tile, B = 0 without hx, any L up to several tiles), fp32 or fp64
    coefficients, fp32/fp64 or bf16 x: h and every gradient match the float64 reference."""
    real = F64 if fp64 else F32
    fwd, bwd = tol("cuda", real, "fwd"), tol("cuda", real, "bwd")
    p, log_q, _, hx = cema_coefficients(seed, D, N, max(B, 1), real)
    hx = hx if B > 0 else None
    g = torch.Generator().manual_seed(seed + 1)
    x = _randn(max(B, 1), D, L, generator=g, dtype=real).to(BF16 if x_bf16 else real)
    h, V, W = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    assert_close("h", h, ref.ema_hidden(to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx)), fwd)
    dh = _crandn(max(B, 1), D, N, generator=g, dtype=real)
    got = hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V, W, L)
    want = ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), None if hx is None else to_np(hx))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, want):
        if r is not None:
            assert_close(name, a, r, bwd)


@pytest.mark.parametrize("L", [1 << 16, 1 << 20], ids=["L=2^16", "L=2^20"])
def test_cuda_kernels_long_length_accuracy(ext, L):
    """|q| close to 1 (1 - |q| ~ 1e-6 .. 2e-5, decay length ~1e5 steps) and phases over the whole circle:
    powers up to q**(2**20) stay fp32-accurate. Norm-wise relative error within the CUDA fp32 budget vs float64 for h
    (and every gradient at 2**16)."""
    B, D, N = 1, 2, 4
    p, log_q, _, hx = cema_coefficients(4, D, N, B, F32, min_gap=1e-6, max_gap=2e-5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, D, L, generator=g)
    h, V, W = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    qe = cema_powers(log_q, np.arange(L - 1, -1, -1, dtype=np.float64))      # q**(L-1-j)
    h_ref = to_np(p) * np.einsum("bdl,dnl->bdn", to_np(x), qe) + cema_powers(log_q, [L])[..., 0] * to_np(hx)
    assert_close("h", h, h_ref, tol("cuda", F32, "fwd"))
    if L > 1 << 16:
        return  # the float64 references of the gradients at 2**20 cost more than the kernels
    dh = _crandn(B, D, N, generator=g)
    got = hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V, W, L)
    want = ref.ema_hidden_bwd(to_np(dh), to_np(x), to_np(p), to_np(log_q), to_np(hx))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, want):
        assert_close(name, a, r, tol("cuda", F32, "bwd"))


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs x87 long double for the exact sums")
@pytest.mark.parametrize("L", [4096, 1 << 16], ids=["L=4096", "L=2^16"])
def test_cuda_kernels_long_length_accuracy_fp64(ext, L):
    """float64 at long L, |q| close to 1 (decay length ~5e4 steps), phases over the whole circle: h,
    V, W and every gradient within 1.5e-14 (3.6e-15 measured) of the exact sums (max abs error /
    max |ref|), where the float64 NumPy reference itself drifts by ~L * 2**-53. `pytest -s` prints
    the measured errors."""
    B, D, N = 1, 2, 4
    p, log_q, _, hx = cema_coefficients(4, D, N, B, F64, min_gap=1e-6, max_gap=2e-5)
    P, H = to_np(p).astype(np.longdouble), to_np(hx).astype(np.clongdouble)
    j = np.arange(L)
    qe, qL = cema_powers(log_q, L - 1 - j, exact=True), cema_powers(log_q, [L], exact=True)[..., 0]
    g = torch.Generator().manual_seed(5)
    budget = 1.5e-14
    x = _randn(B, D, L, generator=g, dtype=F64)
    X = to_np(x).astype(np.longdouble)
    h, V, W = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    V_ref, W_ref = np.einsum("bdl,dnl->bdn", X, qe), np.einsum("bdl,dnl->bdn", X * (L - 1 - j), qe)
    assert_close("h", h, P * V_ref + qL * H, budget)
    assert_close("V", V, V_ref, budget)
    assert_close("W", W, W_ref, budget)
    dh = _crandn(B, D, N, generator=g, dtype=F64)
    DH = to_np(dh).astype(np.clongdouble)
    want = (np.einsum("bdn,dnl->bdl", np.conj(DH) * P, qe).real, (np.conj(DH) * V_ref).real.sum(0),
            (DH * np.conj(P * W_ref + L * qL * H)).sum(0), DH * np.conj(qL))
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, V, W, L),
                          want):
        assert_close(name, a, r, budget)


def test_cuda_kernels_several_tiles_per_block_fp64(ext):
    """D = 1025 features leave one block per feature (Y = 1), so each block walks several tiles: fp64
    at N = 64 has 8-row synthesis tiles (one row per thread) and 16-row analysis tiles, and L = 520
    gives 3 and 2 of them, in the reverse layout. Against the float64 torch backend (its own two-level
    tables): the q2 / input tiles are rebuilt per tile without stale entries."""
    B, D, N, L = 1, 1025, 64, 520
    fwd, bwd = tol("cuda", F64, "fwd"), tol("cuda", F64, "bwd")
    p, log_q, _, hx = cema_coefficients(40, D, N, B, F64)
    g = torch.Generator().manual_seed(41)
    x = _randn(B, D, L, generator=g, dtype=F64)
    got = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    want = hidden_torch.forward(x, p, log_q, hx, True, power_block=64)
    for name, a, r in zip(("h", "V", "W"), got, want):
        assert_close(name, a, to_np(r), fwd)
    dh = _crandn(B, D, N, generator=g, dtype=F64)
    got = hidden_cuda.launch_bwd(emu(ext), dh, p, log_q, hx, got[1], got[2], L)
    want = hidden_torch.backward(dh, p, log_q, hx, want[1], want[2], L, power_block=64)
    for name, a, r in zip(("dx", "dp", "dlog_q", "dhx"), got, want):
        assert_close(name, a, to_np(r), bwd)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_deterministic_across_runs_and_fiber_orders(ext, real):
    """Reductions over j run in a fixed order (per-thread sums, fixed-order block sum, Y partials
    summed in order by one thread; no atomics): bit-identical results in both fiber orders. D = 1
    and L = 40000 spread each feature over many blocks."""
    B, D, N, L = 2, 1, 16, 40000
    p, log_q, _, hx = cema_coefficients(8, D, N, B, real)
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(6), dtype=real)
    runs = []
    for rev in (0, 1, 0):
        ext.emulator_set_reverse(rev)
        runs.append(hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True))
    ext.emulator_set_reverse(-1)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("real", [F32, F64], ids=str)
def test_cuda_kernels_strided_and_conj_inputs(ext, real):
    """Strided views of every input and a conj view of dh give the same bits as contiguous copies."""
    B, D, N, L = 2, 3, 16, 50
    p, log_q, _, hx = cema_coefficients(30, D, N, B, real)
    views = [noncontiguous(t) for t in (p, log_q, hx)]
    x = _randn(B, D, L, generator=torch.Generator().manual_seed(2), dtype=real)
    want = hidden_cuda.launch_fwd(emu(ext), x, p, log_q, hx, True)
    got = hidden_cuda.launch_fwd(emu(ext), noncontiguous(x), *views, True)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    dh = _crandn(B, D, N, generator=torch.Generator().manual_seed(3), dtype=real)
    want = hidden_cuda.launch_bwd(emu(ext), dh.conj().resolve_conj(), p, log_q, hx, want[1], want[2], L)
    got = hidden_cuda.launch_bwd(emu(ext), dh.conj(), *views, got[1], got[2], L)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_cuda_kernels_bad_inputs(ext):
    p, log_q, _, _ = cema_coefficients(0, 2, 16, 1)
    with pytest.raises(TypeError, match="dh torch.complex128"):
        hidden_cuda.launch_bwd(emu(ext), torch.zeros(1, 2, 16, dtype=torch.complex64), p.double(),
                               log_q.to(torch.complex128), None, None, None, 8, (True, False, False, False))
    with pytest.raises(TypeError, match="float32, bfloat16 or float64 x"):
        hidden_cuda.launch_fwd(emu(ext), torch.zeros(1, 2, 8, dtype=F16), p, log_q, None)
    # float64 x with float32 coefficients is cast to float32 first (as the torch backend computes
    # x in p's dtype): no such instantiation exists, and the result is the float32 x one
    assert not any("kAnalysisHidden, double, float," in k.name for k in hidden_cuda.KERNELS)
    x = torch.randn(1, 2, 8, dtype=F64)
    for a, b in zip(hidden_cuda.launch_fwd(emu(ext), x, p, log_q, None, True),
                    hidden_cuda.launch_fwd(emu(ext), x.float(), p, log_q, None, True)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# arguments: validation, and what each backend refuses
# ------------------------------------------------------------------------------------------------

def _good():
    return dict(x=torch.randn(2, 3, 5), p=torch.rand(3, 4), log_q=torch.zeros(3, 4, dtype=torch.complex64),
                hx=torch.zeros(2, 3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(3, 5)), ValueError, r"x must have rank 3 \(B, D, L\)"),
    (dict(x=torch.randn(2, 3, 0)), ValueError, "x must have length L >= 1"),
    (dict(x=torch.zeros(2, 3, 5, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=[[[1.0]]]), TypeError, "x must be a torch.Tensor"),
    (dict(p=torch.rand(4, 4)), ValueError, r"p must have shape \(D, N\)"),
    (dict(p=torch.rand(3, 4, dtype=BF16)), TypeError, "p must have dtype"),
    (dict(log_q=torch.zeros(3, 3, dtype=torch.complex64)), ValueError, r"log_q must have shape \(D, N\)"),
    (dict(log_q=torch.zeros(3, 4, dtype=torch.complex128)), TypeError, "log_q must have dtype"),
    (dict(hx=torch.zeros(3, 3, 4, dtype=torch.complex64)), ValueError, r"hx must have shape \(B, D, N\)"),
    (dict(hx=torch.zeros(2, 3, 4, 1, dtype=torch.complex64)), ValueError, "hx must have rank 3"),
    (dict(hx=torch.zeros(2, 3, 4, dtype=torch.complex128)), TypeError, "hx must have dtype"),
    (dict(backend="cuda-please"), ValueError, "backend must be one of"),
])
def test_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        ema_hidden(**args, backend=backend)


def test_device_mismatch():
    args = _good()
    args["p"] = args["p"].to("meta")
    with pytest.raises(ValueError, match="p is on meta"):
        ema_hidden(**args)


def test_triton_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    p, log_q, _, _ = cema_coefficients(gen, 2, 33, None, F32)          # N = 33 > the largest n tile
    with pytest.raises(Exception, match="N = 33 > 32"):
        ema_hidden(torch.randn(1, 2, 8), p, log_q, backend="triton")
    p, log_q, _, _ = cema_coefficients(gen, 2, 3, None, F64)
    with pytest.raises(Exception, match="float32 coefficients"):
        ema_hidden(torch.randn(1, 2, 8, dtype=F64), p, log_q, backend="triton")


def test_cuda_reasons_name_the_fix(emulated):
    p, log_q, _, hx = cema_coefficients(0, 2, 80, 1)
    p64, lq64, hx64 = p[:, :16].double(), log_q[:, :16].to(torch.complex128), hx[..., :16].to(torch.complex128)
    emu = emulated["ema_hidden"]
    x = torch.zeros(1, 2, 8, dtype=F16)
    why = " ".join(emu.not_supported_reasons(x=x, p=p[:, :16], log_q=log_q[:, :16], hx=None))
    assert "float16" in why and "use backend='torch'" in why
    assert emu.not_supported_reasons(x=x.float(), p=p[:, :16], log_q=log_q[:, :16], hx=None) == []
    for xdt in (F64, F32, BF16):
        assert emu.not_supported_reasons(x=x.to(xdt), p=p64, log_q=lq64, hx=hx64) == []
    why = " ".join(emu.not_supported_reasons(x=x.double(), p=p64, log_q=log_q[:, :16], hx=None))
    assert "log_q torch.complex128 with torch.float64 p" in why
