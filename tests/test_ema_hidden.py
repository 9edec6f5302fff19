"""ema_hidden (last CEMA state): forward and every gradient against the float64 reference (whose
forward is the step-by-step recurrence), in every x dtype, odd sizes, non-contiguous inputs, every
power-table block size; streaming over two halves; argument validation."""
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.ema_hidden import torch_impl as hidden_impl
from megalodon_kernels.reference import ema_hidden as ref
from support import as_input, assert_close, backend_module, knobs, to_np, tol
from test_cema_kernel import random_coefficients

# (x dtype, coefficient dtype). With bf16/fp16 x the output h and every coefficient gradient are
# complex64/fp32 computed from the rounded x, so they meet fp32-level error; only dx is rounded.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
          (torch.float64, torch.float64)]


def check_ema_hidden(B, D, N, L, xdtype, cdtype, with_hx=True, contiguous=True, seed=0, backend="torch", **config):
    """Forward and every gradient of one backend (run with the knob values ``config``) vs the
    reference; shared with tests/test_triton_ema_hidden.py and the CUDA tests."""
    gen = torch.Generator().manual_seed(seed)
    c = random_coefficients(gen, D, N, B if with_hx else None, cdtype)
    x0 = torch.randn(B, D, L, generator=gen, dtype=torch.float64)
    ins = {"x": as_input(x0, xdtype, contiguous, requires_grad=True)}
    for n in ("p", "log_q") + (("hx",) if with_hx else ()):
        ins[n] = as_input(c[n], contiguous=contiguous, requires_grad=True)
    with knobs(backend_module("ema_hidden", backend), **config):
        h = ema_hidden(ins["x"], ins["p"], ins["log_q"], ins.get("hx"), backend=backend)
        assert h.shape == (B, D, N) and h.dtype == c["log_q"].dtype
        npin = {n: to_np(t) for n, t in ins.items()}
        # the forward tolerance follows the coefficient dtype: h is computed from the rounded x
        assert_close("h", h, ref.ema_hidden(npin["x"], npin["p"], npin["log_q"], npin.get("hx")),
                     tol(backend, cdtype, "fwd"))
        dh = torch.complex(torch.randn(h.shape, generator=gen, dtype=torch.float64),
                           torch.randn(h.shape, generator=gen, dtype=torch.float64)).to(h.dtype)
        grads = torch.autograd.grad(h, list(ins.values()), dh)
    want = ref.ema_hidden_bwd(to_np(dh), npin["x"], npin["p"], npin["log_q"], npin.get("hx"))
    for name, got, exp in zip(ins, grads, want):
        assert got.dtype == ins[name].dtype and got.shape == ins[name].shape
        dt = xdtype if name == "x" else cdtype
        assert_close("d" + name, got, exp, tol(backend, dt, "bwd"))


@pytest.mark.parametrize("xdtype,cdtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
def test_ema_hidden_matches_reference(xdtype, cdtype, L, with_hx):
    check_ema_hidden(2, 3, 4, L, xdtype, cdtype, with_hx)


def test_ema_hidden_wide_features():
    check_ema_hidden(1, 60, 2, 33, torch.bfloat16, torch.float32, contiguous=False)


@pytest.mark.parametrize("power_block", [1, 3, 8, 1000])
def test_ema_hidden_every_power_block(power_block):
    # the reverse layout pads at the front: L = 50 leaves a partial first block for T = 3 and 8
    check_ema_hidden(2, 2, 3, 50, torch.float32, torch.float32, power_block=power_block)


@given(B=st.integers(1, 3), D=st.integers(1, 5), N=st.integers(1, 8), L=st.integers(1, 150),
       dtypes=st.sampled_from(DTYPES), with_hx=st.booleans(), contiguous=st.booleans(),
       power_block=st.sampled_from([None, 1, 7, 32]), seed=st.integers(0, 2**31))
def test_ema_hidden_property(B, D, N, L, dtypes, with_hx, contiguous, power_block, seed):
    check_ema_hidden(B, D, N, L, *dtypes, with_hx, contiguous, seed,
                     **({} if power_block is None else {"power_block": power_block}))


@pytest.mark.parametrize("xdtype,cdtype", [(torch.float32, torch.float32), (torch.float64, torch.float64)],
                         ids=["fp32", "fp64"])
@pytest.mark.parametrize("with_hx", [False, True], ids=["no_hx", "hx"])
def test_ema_hidden_streaming(xdtype, cdtype, with_hx):
    # h over [0, L) == h over [L1, L) started from h over [0, L1): the state the model caches.
    gen = torch.Generator().manual_seed(11)
    c = random_coefficients(gen, 3, 4, 2 if with_hx else None, cdtype)
    x = torch.randn(2, 3, 300, generator=gen, dtype=torch.float64).to(xdtype)
    for L1 in (1, 97, 150, 299):
        whole = ema_hidden(x, c["p"], c["log_q"], c["hx"])
        h1 = ema_hidden(x[..., :L1], c["p"], c["log_q"], c["hx"])
        h2 = ema_hidden(x[..., L1:], c["p"], c["log_q"], h1)
        assert_close(f"streamed h (split {L1})", h2, to_np(whole), tol("torch", cdtype, "fwd"))


def test_ema_hidden_gradcheck():
    gen = torch.Generator().manual_seed(5)
    c = random_coefficients(gen, 2, 3, 2, torch.float64)
    x = torch.randn(2, 2, 7, generator=gen, dtype=torch.float64).requires_grad_()
    ins = (x, c["p"].requires_grad_(), c["log_q"].requires_grad_(), c["hx"].requires_grad_())
    with knobs(hidden_impl, power_block=3):
        assert torch.autograd.gradcheck(lambda *a: ema_hidden(*a), ins)


def _good():
    return dict(x=torch.randn(2, 3, 5), p=torch.rand(3, 4), log_q=torch.zeros(3, 4, dtype=torch.complex64),
                hx=torch.zeros(2, 3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(3, 5)), ValueError, r"x must have rank 3 \(B, D, L\)"),
    (dict(x=torch.randn(2, 3, 0)), ValueError, "x must have length L >= 1"),
    (dict(x=torch.zeros(2, 3, 5, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=[[[1.0]]]), TypeError, "x must be a torch.Tensor"),
    (dict(p=torch.rand(4, 4)), ValueError, r"p must have shape \(D, N\)"),
    (dict(p=torch.rand(3, 4, dtype=torch.bfloat16)), TypeError, "p must have dtype"),
    (dict(log_q=torch.zeros(3, 3, dtype=torch.complex64)), ValueError, r"log_q must have shape \(D, N\)"),
    (dict(log_q=torch.zeros(3, 4, dtype=torch.complex128)), TypeError, "log_q must have dtype"),
    (dict(hx=torch.zeros(3, 3, 4, dtype=torch.complex64)), ValueError, r"hx must have shape \(B, D, N\)"),
    (dict(hx=torch.zeros(2, 3, 4, 1, dtype=torch.complex64)), ValueError, "hx must have rank 3"),
    (dict(hx=torch.zeros(2, 3, 4, dtype=torch.complex128)), TypeError, "hx must have dtype"),
    (dict(backend="cuda-please"), ValueError, "backend must be one of"),
])
def test_ema_hidden_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        ema_hidden(**args, backend=backend)


def test_ema_hidden_device_mismatch():
    args = _good()
    args["p"] = args["p"].to("meta")
    with pytest.raises(ValueError, match="p is on meta"):
        ema_hidden(**args)
