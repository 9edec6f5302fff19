"""cema, backend "triton" (interpreter): the Triton stage kernels composed with the bias and skip fused
into the convolution; y, h and every gradient (through y and h) against the float64 reference
recurrence, fp32 and bf16 x, direct / register-tile / workspace convolution paths, with and without
hx, state not returned, one output used, non-contiguous inputs; inputs the backend must refuse."""
import pytest
import torch

from megalodon_kernels.ops.cema import cema
from test_cema import _check as check_backend
from test_cema_kernel import random_coefficients

PATHS = {"direct": dict(direct_max_len=64), "fft": dict(direct_max_len=0)}


def _ids(d):
    return str(d).replace("torch.", "")


def _check(B, D, N, L, xdtype, knobs, with_hx=True, return_state=True, contiguous=True, seed=0, use=("y", "h")):
    check_backend(B, D, N, L, xdtype, torch.float32, with_hx, return_state, contiguous, seed, knobs, use,
                  backend="triton")


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
