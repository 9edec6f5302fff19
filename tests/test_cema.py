"""cema (composed CEMA layer): forward and every gradient (through y and the state h) against the
float64 reference recurrence, in fp32/bf16/fp64, odd sizes, non-contiguous inputs; equality with
the composition of the public stage ops; streaming over two halves; argument validation."""
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.cema import cema
from megalodon_kernels.ops.cema import torch_impl as cema_impl
from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.fftconv import fftconv
from megalodon_kernels.reference import cema as ref
from support import as_input, assert_close, backend_module, knobs as config, to_np, tol
from test_cema_kernel import random_coefficients

# (x dtype, coefficient dtype). y is rounded once to x's dtype; h and the coefficient gradients are
# fp32 computations on the rounded x, so they take the coefficient dtype's tolerance.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64)]
NAMES = ("x", "p", "log_q", "gamma", "omega", "hx")


def _ids(d):
    return str(d).replace("torch.", "")


def _inputs(gen, B, D, N, L, xdtype, cdtype, with_hx, contiguous):
    c = random_coefficients(gen, D, N, B if with_hx else None, cdtype)
    c["x"] = torch.randn(B, D, L, generator=gen, dtype=torch.float64).to(xdtype)
    c["omega"] = (0.5 * torch.randn(D, generator=gen, dtype=torch.float64)).to(cdtype)
    return {n: as_input(c[n], contiguous=contiguous, requires_grad=True) for n in NAMES if c[n] is not None}


def _check(B, D, N, L, xdtype, cdtype, with_hx=True, return_state=True, contiguous=True, seed=0, knobs=None,
           use=("y", "h"), backend="torch"):
    """y, h and every gradient of ``backend`` (run with the knob values ``knobs``) vs the reference
    recurrence; shared with tests/test_triton_cema.py."""
    gen = torch.Generator().manual_seed(seed)
    ins = _inputs(gen, B, D, N, L, xdtype, cdtype, with_hx, contiguous)
    with config(backend_module("cema", backend), **(knobs or {})):
        y, h = cema(*(ins.get(n) for n in NAMES), return_state=return_state, backend=backend)
        assert y.shape == (B, D, L) and y.dtype == xdtype
        npin = {n: to_np(t) for n, t in ins.items()}
        y_ref, h_ref = ref.cema(*(npin.get(n) for n in NAMES), return_state=return_state)
        assert_close("y", y, y_ref, tol(backend, xdtype, "fwd"))
        if return_state:
            assert h.shape == (B, D, N) and h.dtype == ins["log_q"].dtype
            assert_close("h", h, h_ref, tol(backend, cdtype, "fwd"))
        else:
            assert h is None
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(xdtype)
        dh = torch.complex(torch.randn(B, D, N, generator=gen, dtype=torch.float64),
                           torch.randn(B, D, N, generator=gen, dtype=torch.float64)).to(ins["log_q"].dtype)
        outs, cots = [], []
        if "y" in use:
            outs.append(y), cots.append(dy)
        if return_state and "h" in use:
            outs.append(h), cots.append(dh)
        grads = torch.autograd.grad(outs, list(ins.values()), cots, allow_unused=True)
    want = ref.cema_bwd(to_np(dy) * ("y" in use), to_np(dh), *(npin.get(n) for n in NAMES),
                        return_state=return_state and "h" in use)
    want = dict(zip(NAMES, want))
    for name, got in zip(ins, grads):
        dt = xdtype if name == "x" else cdtype
        if float(abs(want[name]).max()) == 0:   # e.g. omega and gamma get nothing through h alone
            assert got is None or torch.all(got == 0), name
            continue
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        assert_close("d" + name, got, want[name], tol(backend, dt, "bwd"))


@pytest.mark.parametrize("xdtype,cdtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
@pytest.mark.parametrize("with_hx,return_state", [(False, False), (True, True)], ids=["plain", "hx_state"])
def test_cema_matches_reference(xdtype, cdtype, L, with_hx, return_state):
    _check(2, 3, 4, L, xdtype, cdtype, with_hx, return_state)


@pytest.mark.parametrize("with_hx,return_state", [(True, False), (False, True)], ids=["hx", "state"])
def test_cema_state_combinations(with_hx, return_state):
    _check(2, 3, 4, 40, torch.float32, torch.float32, with_hx, return_state)


def test_cema_wide_features():
    _check(1, 60, 2, 33, torch.bfloat16, torch.float32, contiguous=False)


@pytest.mark.parametrize("use", [("y",), ("h",)], ids=["y_only", "h_only"])
def test_cema_one_output_used(use):
    _check(2, 3, 4, 40, torch.float64, torch.float64, use=use)


@given(B=st.integers(1, 3), D=st.integers(1, 5), N=st.integers(1, 6), L=st.integers(1, 140),
       dtypes=st.sampled_from(DTYPES), with_hx=st.booleans(), return_state=st.booleans(), contiguous=st.booleans(),
       power_block=st.sampled_from([1, 6, 64]), direct_max_len=st.sampled_from([0, 16, 1000]),
       seed=st.integers(0, 2**31))
def test_cema_property(B, D, N, L, dtypes, with_hx, return_state, contiguous, power_block, direct_max_len, seed):
    _check(B, D, N, L, *dtypes, with_hx, return_state, contiguous, seed,
           knobs={"power_block": power_block, "direct_max_len": direct_max_len})


def test_cema_equals_stage_ops():
    # cema == fftconv(x, k) + b + omega x with k, b from cema_kernel and h from ema_hidden
    gen = torch.Generator().manual_seed(9)
    ins = _inputs(gen, 2, 4, 5, 77, torch.float64, torch.float64, True, True)
    x, p, lq, g, om, hx = (ins[n] for n in NAMES)
    y, h = cema(x, p, lq, g, om, hx, return_state=True)
    k, b = cema_kernel(p, lq, g, 77, hx)
    assert_close("y vs stages", y, to_np(fftconv(x, k) + b + om[:, None] * x), 1e-12)
    assert_close("h vs ema_hidden", h, to_np(ema_hidden(x, p, lq, hx)), 1e-12)


@pytest.mark.parametrize("xdtype,cdtype", [(torch.float32, torch.float32), (torch.float64, torch.float64)],
                         ids=["fp32", "fp64"])
def test_cema_streaming(xdtype, cdtype):
    # two halves with the state carried == the whole sequence, for y and the final state
    gen = torch.Generator().manual_seed(13)
    ins = {n: t.detach() for n, t in _inputs(gen, 2, 3, 4, 200, xdtype, cdtype, True, True).items()}
    x, p, lq, g, om, hx = (ins[n] for n in NAMES)
    y, h = cema(x, p, lq, g, om, hx, return_state=True)
    for L1 in (1, 77, 100, 199):
        y1, h1 = cema(x[..., :L1], p, lq, g, om, hx, return_state=True)
        y2, h2 = cema(x[..., L1:], p, lq, g, om, h1, return_state=True)
        assert_close(f"streamed y (split {L1})", torch.cat((y1, y2), -1), to_np(y), tol("torch", xdtype, "fwd"))
        assert_close(f"streamed h (split {L1})", h2, to_np(h), tol("torch", cdtype, "fwd"))


def test_cema_gradcheck():
    gen = torch.Generator().manual_seed(5)
    ins = _inputs(gen, 2, 2, 3, 6, torch.float64, torch.float64, True, True)
    # fast_mode (random projections of the Jacobian): the full Jacobian takes seconds here
    with config(cema_impl, power_block=4, direct_max_len=0):
        assert torch.autograd.gradcheck(lambda *a: cema(*a, return_state=True), tuple(ins[n] for n in NAMES),
                                        fast_mode=True)


def _good():
    return dict(x=torch.randn(2, 3, 5), p=torch.rand(3, 4), log_q=torch.zeros(3, 4, dtype=torch.complex64),
                gamma=torch.zeros(3, 4, dtype=torch.complex64), omega=torch.randn(3),
                hx=torch.zeros(2, 3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(2, 3)), ValueError, r"x must have rank 3 \(B, D, L\)"),
    (dict(x=torch.randn(2, 3, 0)), ValueError, "x must have length L >= 1"),
    (dict(x=torch.randn(2, 4, 5)), ValueError, r"p must have shape \(D, N\)"),
    (dict(p=torch.rand(3, 4, dtype=torch.float64)), TypeError, "log_q must have dtype"),
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
def test_cema_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        cema(**args, backend=backend)
