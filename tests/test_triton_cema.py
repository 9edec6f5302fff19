"""cema, backend "triton" (interpreter): the Triton stage kernels composed with the bias and skip fused
into the convolution; y, h and every gradient (through y and h) against the float64 reference
recurrence, fp32 and bf16 x, direct / register-tile / workspace convolution paths, with and without
hx, state not returned, one output used, non-contiguous inputs; inputs the backend must refuse."""
import numpy as np
import pytest
import torch

from megalodon_kernels.ops.cema import cema
from megalodon_kernels.ops.cema import triton_impl as cema_impl
from megalodon_kernels.reference import cema as ref
from support import as_input, assert_close, knobs as config, to_np, tol
from test_cema_kernel import random_coefficients

NAMES = ("x", "p", "log_q", "gamma", "omega", "hx")
PATHS = {"direct": dict(direct_max_len=64), "fft": dict(direct_max_len=0)}


def _ids(d):
    return str(d).replace("torch.", "")


def _check(B, D, N, L, xdtype, knobs, with_hx=True, return_state=True, contiguous=True, seed=0, use=("y", "h")):
    cdtype = torch.float32
    gen = torch.Generator().manual_seed(seed)
    c = random_coefficients(gen, D, N, B if with_hx else None, cdtype)
    c["x"] = torch.randn(B, D, L, generator=gen, dtype=torch.float64).to(xdtype)
    c["omega"] = (0.5 * torch.randn(D, generator=gen, dtype=torch.float64)).to(cdtype)
    ins = {n: as_input(c[n], contiguous=contiguous, requires_grad=True) for n in NAMES if c[n] is not None}
    with config(cema_impl, **knobs):
        y, h = cema(*(ins.get(n) for n in NAMES), return_state=return_state, backend="triton")
        assert y.shape == (B, D, L) and y.dtype == xdtype
        npin = {n: to_np(t) for n, t in ins.items()}
        y_ref, h_ref = ref.cema(*(npin.get(n) for n in NAMES), return_state=return_state)
        assert_close("y", y, y_ref, tol("triton", xdtype, "fwd"))
        if return_state:
            assert h.shape == (B, D, N) and h.dtype == ins["log_q"].dtype
            assert_close("h", h, h_ref, tol("triton", cdtype, "fwd"))
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
    for (name, t), got in zip(ins.items(), grads):
        exp = want[name]
        if np.max(np.abs(exp)) == 0:       # e.g. domega with only h used
            assert got is None or torch.all(got == 0), name
            continue
        assert got.dtype == t.dtype and got.shape == t.shape, name
        # dx is rounded to x's dtype; the others are fp32 computations on the rounded x
        assert_close("d" + name, got, exp, tol("triton", xdtype if name == "x" else cdtype, "bwd"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
def test_triton_cema_matches_reference(path, xdtype, L):
    _check(2, 3, 4, L, xdtype, PATHS[path])


@pytest.mark.parametrize("path", list(PATHS))
def test_triton_cema_no_hx_no_state(path):
    _check(3, 2, 4, 40, torch.float32, PATHS[path], with_hx=False, return_state=False, seed=1)


@pytest.mark.parametrize("use", [("y",), ("h",)], ids=["y_only", "h_only"])
def test_triton_cema_one_output_used(use):
    _check(2, 2, 4, 70, torch.bfloat16, PATHS["fft"], seed=2, use=use)


def test_triton_cema_noncontiguous_odd_batch():
    _check(3, 2, 5, 97, torch.bfloat16, PATHS["fft"], contiguous=False, seed=3)


def test_triton_cema_workspace_path():
    # L = 2049: the three-level convolution (N = 8192) with the fused bias / skip epilogue
    _check(3, 1, 4, 2049, torch.float32, dict(direct_max_len=0, work_bc=4096), seed=4)


def test_triton_cema_rejects_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    c = random_coefficients(gen, 2, 33, None, torch.float32)          # N = 33 > the largest n tile
    with pytest.raises(Exception, match="N = 33 > 32"):
        cema(torch.randn(1, 2, 8), c["p"], c["log_q"], c["gamma"], torch.zeros(2), backend="triton")
    c = random_coefficients(gen, 2, 3, None, torch.float32)
    with pytest.raises(Exception, match="x has dtype torch.float16"):
        cema(torch.randn(1, 2, 8, dtype=torch.float16), c["p"], c["log_q"], c["gamma"], torch.zeros(2),
             backend="triton")
    c = random_coefficients(gen, 2, 3, None, torch.float64)
    with pytest.raises(Exception, match="float32 coefficients"):
        cema(torch.randn(1, 2, 8), c["p"], c["log_q"], c["gamma"], torch.zeros(2, dtype=torch.float64),
             backend="triton")
    with pytest.raises(ValueError, match="omega"):
        c = random_coefficients(gen, 2, 3, None, torch.float32)
        cema(torch.randn(1, 2, 8), c["p"], c["log_q"], c["gamma"], torch.zeros(3), backend="triton")
