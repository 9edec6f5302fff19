"""cema (the composed CEMA layer) on every backend against the float64 reference recurrence.

* One table of cases run on each backend that implements it (torch, cpu; CUDA in the emulator: the
  CUDA stage kernels composed; Triton in the interpreter:
  the stage kernels with the bias and skip fused into the convolution, x fp32/bf16, float32
  coefficients): y, h and every gradient (through y and the state h), with and without hx, state
  returned or not, one output used, the direct / FFT (register tile and workspace) convolution
  paths, odd sizes, non-contiguous inputs.
* Equality with the composition of the public stage ops; streaming over two parts; gradcheck.
* The reference's own backward against finite differences, and the stage references composing to
  the recurrence.
* Argument validation and what each backend refuses.
"""
import contextlib
import importlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.cema import cema
from megalodon_kernels.ops.cema import compose, cpu_impl as cema_cpu, torch_impl as cema_torch
from megalodon_kernels.ops.fftconv import cpu_impl as conv_cpu, torch_impl as conv_torch
from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.fftconv import fftconv
from megalodon_kernels.reference import cema as ref
from megalodon_kernels.reference import cema_kernel as kernel_ref
from megalodon_kernels.reference import ema_hidden as hidden_ref
from megalodon_kernels.reference import fftconv as conv_ref
from support import as_input, assert_close, backend_module, cema_coefficients, finite_difference_grad, knobs, \
    on_backends, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
#: the reference's backward vs central differences (support.finite_difference_grad): 1.0e-9 worst
#: measured (truncation + rounding of the step), 3x-4x of it
FD_TOL = 4e-9
NAMES = ("x", "p", "log_q", "gamma", "omega", "hx")

# direct_max_len forcing each convolution path; Triton's workspace path needs L > 2048 whatever the
# knob, and work_bc = 4096 (one column tile per pass) keeps the interpreter fast there.
# chunk = 0 selects the torch backend's convolution forms; "chunked" is its chunked form (torch alone),
# with chunks small enough that the cases below span several of them. The cpu backend runs its
# defaults: the FFT form with the compiled convolution, the recurrence up to RECURRENCE_MAX_LEN steps.
# Triton's "direct" and "fft" paths are its FFT form (chunk = 0); its "chunked" path is its default,
# the chunked kernels (ops/cema/triton_chunked.py, C = 32: the cases up to L = 129 span 1-5 chunks).
PATHS = {"direct": {"torch": dict(chunk=0, direct_max_len=1 << 30), "triton": dict(chunk=0, direct_max_len=64)},
         "fft": {"torch": dict(chunk=0, direct_max_len=0), "triton": dict(chunk=0, direct_max_len=0), "cpu": {},
                 "cuda": {}},
         "chunked": {"torch": dict(chunk=8, chunk_min_len=0), "triton": dict(chunk=32)}}


def _dt(d):
    return str(d).replace("torch.", "")


def _inputs(gen, B, D, N, L, xdtype, cdtype, with_hx, contiguous):
    c = cema_coefficients(gen, D, N, B if with_hx else None, cdtype)._asdict()
    c["x"] = torch.randn(B, D, L, generator=gen, dtype=F64).to(xdtype)
    c["omega"] = (0.5 * torch.randn(D, generator=gen, dtype=F64)).to(cdtype)
    return {n: as_input(c[n], contiguous=contiguous, requires_grad=True) for n in NAMES if c[n] is not None}


# ------------------------------------------------------------------------------------------------
# the case table: y, h and every gradient on every backend
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    B: int
    D: int
    N: int
    L: int
    xdtype: torch.dtype
    cdtype: torch.dtype             # of p and omega; log_q, gamma and hx take the matching complex dtype
    with_hx: bool = True
    return_state: bool = True
    path: str = "fft"
    contiguous: bool = True
    seed: int = 0
    use: tuple = ("y", "h")         # the outputs that get an upstream gradient
    knobs: dict = field(default_factory=dict)   # {backend: knob values}, over the path's
    only: tuple | None = None       # cases for some backends alone (the reason beside each)


def case(B, D, N, L, xdtype, cdtype, id, **kw):
    return pytest.param(Case(B, D, N, L, xdtype, cdtype, **kw), id=id)


# (x dtype, coefficient dtype). y is rounded once to x's dtype; h and the coefficient gradients are
# computed in the coefficient dtype from the rounded x, so they take its tolerance.
DTYPES = [(F32, F32), (BF16, F32), (F64, F64)]
MODES = {"plain": (False, False), "hx_state": (True, True)}

CASES = [
    *(case(2, 3, 4, L, x, c, f"{path}-L{L}-{mode}-x_{_dt(x)}-c_{_dt(c)}", path=path, with_hx=MODES[mode][0],
           return_state=MODES[mode][1])
      for path in PATHS for x, c in DTYPES for L in (1, 31, 33, 63, 129) for mode in MODES),
    case(2, 3, 4, 40, F32, F32, "L40-hx-no_state", with_hx=True, return_state=False),
    case(2, 3, 4, 40, F32, F32, "L40-no_hx-state", with_hx=False, return_state=True),
    *(case(3, 2, 4, 40, F32, F32, f"{path}-L40-no_hx-no_state", path=path, with_hx=False, return_state=False, seed=1)
      for path in PATHS),
    # torch alone: the Triton interpreter takes ~10 s for 60 features
    case(1, 60, 2, 33, BF16, F32, "direct-D60-strided-x_bfloat16", path="direct", contiguous=False, only=("torch",)),
    *(case(2, 3, 4, 40, F64, F64, f"L40-{u}_only-float64", use=(u,)) for u in ("y", "h")),
    *(case(2, 2, 4, 70, BF16, F32, f"L70-{u}_only-x_bfloat16", seed=2, use=(u,)) for u in ("y", "h")),
    case(3, 2, 5, 97, BF16, F32, "L97-strided-odd_batch-x_bfloat16", contiguous=False, seed=3),
    # the chunked form's two-level scan (150 chunks of 2: 3 blocks of 64, the last one partial),
    # and a chunk that does not divide L
    *(case(2, 3, 4, 300, x, c, f"chunked-two_level_scan-x_{_dt(x)}", path="chunked",
           knobs={"torch": dict(chunk=2, chunk_min_len=0)}, seed=5) for x, c in ((F32, F32), (F64, F64))),
    case(2, 3, 4, 150, F32, F32, "chunked-chunk7", path="chunked", knobs={"torch": dict(chunk=7, chunk_min_len=0)},
         seed=6),
    # up to RECURRENCE_MAX_LEN steps the chunked form's forward is the recurrence (decoding)
    *(case(2, 3, 4, L, x, c, f"chunked-recurrence-L{L}-{u}_only-x_{_dt(x)}", path="chunked", use=(u,), seed=7)
      for L in (2, 4) for x, c in DTYPES for u in ("y", "h")),
    # Triton: the three-level convolution (N = 8192) with the fused bias / skip epilogue
    case(3, 1, 4, 2049, F32, F32, "L2049", seed=4, knobs={"triton": dict(chunk=0, work_bc=4096)}),
]


def runs_on(backend, c: Case) -> bool:
    if c.only is not None and backend not in c.only:
        return False
    if backend not in PATHS[c.path]:
        return False
    if backend == "triton":
        return c.xdtype in (F32, BF16) and c.cdtype == F32
    return backend in ("torch", "cpu", "cuda")   # cuda: the CUDA stage kernels composed, in the emulator


def check_cema(backend, B, D, N, L, xdtype, cdtype, with_hx=True, return_state=True, contiguous=True, seed=0,
               config=None, use=("y", "h")):
    """y, h and every gradient of ``backend`` (run with the knob values ``config``) vs the reference."""
    gen = torch.Generator().manual_seed(seed)
    ins = _inputs(gen, B, D, N, L, xdtype, cdtype, with_hx, contiguous)
    with knobs(backend_module("cema", backend), **(config or {})):
        y, h = cema(*(ins.get(n) for n in NAMES), return_state=return_state, backend=backend)
        assert y.shape == (B, D, L) and y.dtype == xdtype
        npin = {n: to_np(t) for n, t in ins.items()}
        y_ref, h_ref = ref.cema(*(npin.get(n) for n in NAMES), return_state=return_state)
        y_terms, h_terms = ref.cema_terms(*(npin.get(n) for n in NAMES), return_state=return_state)
        assert_close("y", y, y_ref, tol(backend, xdtype, "fwd"), y_terms)
        if return_state:
            assert h.shape == (B, D, N) and h.dtype == ins["log_q"].dtype
            assert_close("h", h, h_ref, tol(backend, cdtype, "fwd"), h_terms)
        else:
            assert h is None
        dy = torch.randn(y.shape, generator=gen, dtype=F64).to(xdtype)
        dh = torch.complex(torch.randn(B, D, N, generator=gen, dtype=F64),
                           torch.randn(B, D, N, generator=gen, dtype=F64)).to(ins["log_q"].dtype)
        outs, cots = [], []
        if "y" in use:
            outs.append(y), cots.append(dy)
        if return_state and "h" in use:
            outs.append(h), cots.append(dh)
        grads = torch.autograd.grad(outs, list(ins.values()), cots, allow_unused=True)
    want = ref.cema_bwd(to_np(dy) * ("y" in use), to_np(dh), *(npin.get(n) for n in NAMES),
                        return_state=return_state and "h" in use)
    want = dict(zip(NAMES, want))
    terms = dict(zip(NAMES, ref.cema_bwd_terms(to_np(dy) * ("y" in use), to_np(dh), *(npin.get(n) for n in NAMES),
                                              return_state=return_state and "h" in use)))
    for name, got in zip(ins, grads):
        dt = xdtype if name == "x" else cdtype
        if float(abs(want[name]).max()) == 0:   # e.g. omega and gamma get nothing through h alone
            assert got is None or torch.all(got == 0), name
            continue
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        assert_close("d" + name, got, want[name], tol(backend, dt, "bwd"), terms[name])


@pytest.mark.parametrize("backend, c", on_backends(CASES, runs_on, ("torch", "cpu", "triton", "cuda")))
def test_matches_reference(backend, c):
    config = {**PATHS[c.path][backend], **c.knobs.get(backend, {})}
    check_cema(backend, c.B, c.D, c.N, c.L, c.xdtype, c.cdtype, c.with_hx, c.return_state, c.contiguous, c.seed,
               config, c.use)


@given(B=st.integers(1, 3), D=st.integers(1, 5), N=st.integers(1, 6), L=st.integers(1, 140),
       dtypes=st.sampled_from(DTYPES), with_hx=st.booleans(), return_state=st.booleans(), contiguous=st.booleans(),
       chunk=st.sampled_from([0, 1, 7, 64]), power_block=st.sampled_from([1, 6, 64]),
       direct_max_len=st.sampled_from([0, 16, 1000]), seed=st.integers(0, 2**31))
def test_property_torch(B, D, N, L, dtypes, with_hx, return_state, contiguous, chunk, power_block, direct_max_len,
                        seed):
    check_cema("torch", B, D, N, L, *dtypes, with_hx, return_state, contiguous, seed,
               config={"chunk": chunk, "chunk_min_len": 0, "power_block": power_block,
                       "direct_max_len": direct_max_len})


@given(B=st.integers(1, 3), D=st.integers(1, 4), N=st.integers(1, 6), L=st.integers(1, 140),
       dtypes=st.sampled_from(DTYPES), with_hx=st.booleans(), return_state=st.booleans(), contiguous=st.booleans(),
       seed=st.integers(0, 2**31))
def test_property_cuda(emulated, B, D, N, L, dtypes, with_hx, return_state, contiguous, seed):
    # the CUDA cema and its three CUDA stages in the emulator (a module-scoped fixture: hypothesis
    # runs every example in one test call)
    with contextlib.ExitStack() as stack:
        for op in ("cema", "cema_kernel", "fftconv", "ema_hidden"):
            backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
            stack.enter_context(backends.use("cuda", emulated[op], f"(emulated) {op}"))
        check_cema("cuda", B, D, N, L, *dtypes, with_hx, return_state, contiguous, seed)


# ------------------------------------------------------------------------------------------------
# composition, streaming, gradcheck
# ------------------------------------------------------------------------------------------------

def test_equals_stage_ops():
    # cema == fftconv(x, k) + b + omega x with k, b from cema_kernel and h from ema_hidden
    gen = torch.Generator().manual_seed(9)
    ins = _inputs(gen, 2, 4, 5, 77, F64, F64, True, True)
    x, p, lq, g, om, hx = (ins[n] for n in NAMES)
    y, h = cema(x, p, lq, g, om, hx, return_state=True)
    k, b = cema_kernel(p, lq, g, 77, hx)
    assert_close("y vs stages", y, to_np(fftconv(x, k) + b + om[:, None] * x), tol("torch", F64, "fwd"))
    assert_close("h vs ema_hidden", h, to_np(ema_hidden(x, p, lq, hx)), tol("torch", F64, "fwd"))


@pytest.mark.parametrize("backend, xdtype, cdtype", [("torch", F32, F32), ("torch", F64, F64), ("triton", F32, F32),
                                                    ("cpu", F32, F32), ("cpu", F64, F64), ("cuda", F32, F32),
                                                    ("cuda", F64, F64)],
                         ids=["torch-fp32", "torch-fp64", "triton-fp32", "cpu-fp32", "cpu-fp64", "cuda-fp32",
                              "cuda-fp64"])  # triton: its default, the chunked form
def test_streaming(backend, xdtype, cdtype):
    # two parts with the state carried == the whole sequence, for y and the final state
    gen = torch.Generator().manual_seed(13)
    ins = {n: t.detach() for n, t in _inputs(gen, 2, 3, 4, 200, xdtype, cdtype, True, True).items()}
    x, p, lq, g, om, hx = (ins[n] for n in NAMES)
    y, h = cema(x, p, lq, g, om, hx, return_state=True, backend=backend)
    for L1 in (1, 77, 100, 199):
        y1, h1 = cema(x[..., :L1], p, lq, g, om, hx, return_state=True, backend=backend)
        y2, h2 = cema(x[..., L1:], p, lq, g, om, h1, return_state=True, backend=backend)
        assert_close(f"streamed y (split {L1})", torch.cat((y1, y2), -1), to_np(y), tol(backend, xdtype, "fwd"))
        assert_close(f"streamed h (split {L1})", h2, to_np(h), tol(backend, cdtype, "fwd"))


def _record_forms(monkeypatch) -> list:
    """Record, in call order, each form the composition runs: the chunked pieces, the recurrence,
    and the convolution (torch's "fftconv_fwd/bwd", the compiled kernel's "compiled fftconv_*")."""
    calls = []
    patches = [(compose, name, name) for name in ("chunked_conv_fwd", "chunked_conv_bwd", "recurrence_fwd")]
    patches += [(conv_torch, "forward", "fftconv_fwd"), (conv_torch, "backward", "fftconv_bwd"),
                (conv_cpu, "forward", "compiled fftconv_fwd"), (conv_cpu, "backward", "compiled fftconv_bwd")]
    for module, name, tag in patches:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _tag=tag, **k: calls.append(_tag) or _real(*a, **k))
    return calls


def test_torch_form_follows_chunk_min_len(monkeypatch):
    # the chunked form runs from chunk_min_len steps on (and for the recurrence's few steps), the
    # FFT form below, forward and backward alike; chunk = 0 never runs it
    calls = _record_forms(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    want = {(64, 40, 39): ["fftconv_fwd", "fftconv_bwd"], (64, 40, 40): ["chunked_conv_fwd", "chunked_conv_bwd"],
            (0, 0, 40): ["fftconv_fwd", "fftconv_bwd"], (64, 40, 3): ["recurrence_fwd", "chunked_conv_bwd"]}
    for (chunk, min_len, L), names in want.items():
        ins = _inputs(gen, 2, 3, 4, L, F32, F32, True, True)
        calls.clear()
        with knobs(cema_torch, chunk=chunk, chunk_min_len=min_len):
            y, _ = cema(*(ins[n] for n in NAMES), backend="torch")
            y.sum().backward()
        assert calls == names, (chunk, min_len, L, calls)


def test_cpu_backend_form_and_its_compiled_convolution(monkeypatch):
    # the cpu backend's FFT form runs fftconv's compiled kernel (never the library FFTs), below
    # chunk_min_len and above the recurrence's few steps; the other forms are the torch backend's
    if isinstance(conv_cpu._library(), Exception):
        pytest.skip(f"the cpu fftconv kernel cannot be built here: {conv_cpu._library()}")
    calls = _record_forms(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    limit = cema_cpu.DEFAULT_CONFIG["chunk_min_len"]
    want = {(limit, 40): ["compiled fftconv_fwd", "compiled fftconv_bwd"],
            (40, 40): ["chunked_conv_fwd", "chunked_conv_bwd"], (limit, 3): ["recurrence_fwd", "chunked_conv_bwd"]}
    for (min_len, L), names in want.items():
        ins = _inputs(gen, 2, 3, 4, L, F32, F32, True, True)
        calls.clear()
        with knobs(cema_cpu, chunk_min_len=min_len):
            y, _ = cema(*(ins[n] for n in NAMES), backend="cpu")
            y.sum().backward()
        assert calls == names, (min_len, L, calls)
    # a length the compiled convolution does not take runs the chunked form
    monkeypatch.setattr(conv_cpu, "MAX_LEN", 39)
    ins = _inputs(gen, 2, 3, 4, 40, F32, F32, True, True)
    calls.clear()
    y, _ = cema(*(ins[n] for n in NAMES), backend="cpu")
    y.sum().backward()
    assert calls == ["chunked_conv_fwd", "chunked_conv_bwd"]


@pytest.mark.parametrize("chunk", [0, 2], ids=["fft", "chunked"])
def test_gradcheck_torch(chunk):
    gen = torch.Generator().manual_seed(5)
    ins = _inputs(gen, 2, 2, 3, 6, F64, F64, True, True)
    # fast_mode (random projections of the Jacobian): the full Jacobian takes seconds here
    with knobs(cema_torch, chunk=chunk, chunk_min_len=0, power_block=4, direct_max_len=0):
        assert torch.autograd.gradcheck(lambda *a: cema(*a, return_state=True), tuple(ins[n] for n in NAMES),
                                        fast_mode=True)


# ------------------------------------------------------------------------------------------------
# the references: backward against central finite differences, stages against the recurrence
# ------------------------------------------------------------------------------------------------

def _np_inputs(seed, L, with_hx):
    """Float64 NumPy arguments of reference.cema: B = 2, D = 2, N = 3."""
    gen = torch.Generator().manual_seed(seed)
    p, log_q, gamma, hx = (to_np(t) for t in cema_coefficients(gen, 2, 3, 2, F64))
    x = to_np(torch.randn(2, 2, L, generator=gen, dtype=F64))
    omega = to_np(torch.randn(2, generator=gen, dtype=F64))
    return dict(x=x, p=p, log_q=log_q, gamma=gamma, omega=omega, hx=hx if with_hx else None), gen, hx.shape


@pytest.mark.parametrize("with_hx,return_state", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "hx", "state", "hx_state"])
def test_reference_bwd_matches_finite_differences(with_hx, return_state):
    args, gen, hshape = _np_inputs(4, 6, with_hx)
    dy = to_np(torch.randn(args["x"].shape, generator=gen, dtype=F64))
    dh = to_np(torch.complex(torch.randn(hshape, generator=gen, dtype=F64), torch.randn(hshape, generator=gen,
                                                                                        dtype=F64)))

    def loss(v):
        y, h = ref.cema(**v, return_state=return_state)
        out = np.sum(dy * y)
        return out + (np.sum((np.conj(dh) * h).real) if return_state else 0.0)

    grads = ref.cema_bwd(dy, dh, **args, return_state=return_state)
    names = ["x", "p", "log_q", "gamma", "omega"] + (["hx"] if with_hx else [])
    for name, g in zip(names, grads):
        assert_close(f"{name} vs finite differences", g, finite_difference_grad(loss, args, name), FD_TOL)
    assert (grads[5] is None) == (not with_hx)


@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
def test_stage_references_compose_to_cema(with_hx):
    # The recurrence (reference.cema) must equal fftconv(x, k) + b + omega x with k, b from the
    # kernel reference and h from ema_hidden; and its backward the chain of the stage backwards.
    args, gen, hshape = _np_inputs(5, 11, with_hx)
    x, p, lq, g, om, hx = (args[n] for n in NAMES)
    L = x.shape[-1]
    y, h = ref.cema(x, p, lq, g, om, hx, return_state=True)
    k, b = kernel_ref.cema_kernel(p, lq, g, L, hx)
    y_stages = conv_ref.fftconv(x, k) + (0.0 if b is None else b) + om[:, None] * x
    np.testing.assert_allclose(y, y_stages, rtol=0, atol=1e-12 * np.abs(y).max())
    np.testing.assert_allclose(h, hidden_ref.ema_hidden(x, p, lq, hx), rtol=0, atol=1e-12 * np.abs(h).max())

    dy = to_np(torch.randn(x.shape, generator=gen, dtype=F64))
    dh = to_np(torch.complex(torch.randn(hshape, generator=gen, dtype=F64), torch.randn(hshape, generator=gen,
                                                                                        dtype=F64)))
    dx, dp, dlq, dg, dom, dhx = ref.cema_bwd(dy, dh, x, p, lq, g, om, hx, return_state=True)
    cx, ck = conv_ref.fftconv_bwd(dy, x, k)
    kp, klq, kg, khx = kernel_ref.cema_kernel_bwd(ck, dy if with_hx else None, p, lq, g, L, hx)
    hxg, hp, hlq, hhx = hidden_ref.ema_hidden_bwd(dh, x, p, lq, hx)
    pairs = [("x", dx, cx + om[:, None] * dy + hxg), ("p", dp, kp + hp), ("log_q", dlq, klq + hlq),
             ("gamma", dg, kg), ("omega", dom, np.sum(dy * x, axis=(0, 2)))]
    if with_hx:
        pairs.append(("hx", dhx, khx + hhx))
    for name, got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-11 * np.abs(want).max(), err_msg=name)


# ------------------------------------------------------------------------------------------------
# arguments: validation, and what each backend refuses
# ------------------------------------------------------------------------------------------------

def _good():
    return dict(x=torch.randn(2, 3, 5), p=torch.rand(3, 4), log_q=torch.zeros(3, 4, dtype=torch.complex64),
                gamma=torch.zeros(3, 4, dtype=torch.complex64), omega=torch.randn(3),
                hx=torch.zeros(2, 3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(2, 3)), ValueError, r"x must have rank 3 \(B, D, L\)"),
    (dict(x=torch.randn(2, 3, 0)), ValueError, "x must have length L >= 1"),
    (dict(x=torch.randn(2, 4, 5)), ValueError, r"p must have shape \(D, N\)"),
    (dict(p=torch.rand(3, 4, dtype=F64)), TypeError, "log_q must have dtype"),
    (dict(gamma=torch.zeros(3, 2, dtype=torch.complex64)), ValueError, r"gamma must have shape \(D, N\)"),
    (dict(gamma=torch.zeros(3, 4)), TypeError, "gamma must have dtype"),
    (dict(omega=torch.randn(3, 1)), ValueError, r"omega must have rank 1 \(D,\)"),
    (dict(omega=torch.randn(4)), ValueError, r"omega must have shape \(D,\)"),
    (dict(omega=torch.zeros(3, dtype=torch.complex64)), TypeError, "omega must have dtype"),
    (dict(omega=torch.randn(3, device="meta")), ValueError, "omega is on meta"),
    (dict(hx=torch.zeros(1, 3, 4, dtype=torch.complex64)), ValueError, r"hx must have shape \(B, D, N\)"),
    (dict(return_state=1), TypeError, "return_state must be a bool"),
    (dict(backend="jax"), ValueError, "backend must be one of"),
])
def test_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        cema(**args, backend=backend)


def test_triton_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 33, None, F32)          # N = 33 > the largest n tile
    with pytest.raises(Exception, match="N = 33 > 32"):
        cema(torch.randn(1, 2, 8), p, log_q, gamma, torch.zeros(2), backend="triton")
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 3, None, F32)
    with pytest.raises(Exception, match="x has dtype torch.float16"):
        cema(torch.randn(1, 2, 8, dtype=torch.float16), p, log_q, gamma, torch.zeros(2), backend="triton")
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 3, None, F64)
    with pytest.raises(Exception, match="float32 coefficients"):
        cema(torch.randn(1, 2, 8), p, log_q, gamma, torch.zeros(2, dtype=F64), backend="triton")
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 3, None, F32)
    with pytest.raises(ValueError, match="omega"):
        cema(torch.randn(1, 2, 8), p, log_q, gamma, torch.zeros(3), backend="triton")


def test_cuda_refuses_what_it_cannot_run(use_emulated_cuda):
    # the CUDA cema takes what its three stages take (in the emulator here): not float16 x (its
    # ema_hidden stage), not N above the CUDA n tile, and says so by name
    gen = torch.Generator().manual_seed(0)
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 65, None, F32)          # N = 65 > 64
    with pytest.raises(Exception, match="N = 65 > 64"):
        cema(torch.randn(1, 2, 8), p, log_q, gamma, torch.zeros(2), backend="cuda")
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 3, None, F32)
    with pytest.raises(Exception, match="float16"):
        cema(torch.randn(1, 2, 8, dtype=torch.float16), p, log_q, gamma, torch.zeros(2), backend="cuda")
    # what it takes: float32 x with float64 coefficients runs in float64 (as the torch backend)
    p, log_q, gamma, _ = cema_coefficients(gen, 2, 3, None, F64)
    x, omega = torch.randn(1, 2, 8), torch.randn(2, dtype=F64)
    y, _ = cema(x, p, log_q, gamma, omega, backend="cuda")
    y_ref, _ = ref.cema(*(to_np(t) for t in (x, p, log_q, gamma, omega)), None)
    assert_close("y (float32 x, float64 coefficients)", y, y_ref, tol("cuda", F32, "fwd"))
