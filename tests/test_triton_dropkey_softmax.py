"""dropkey_softmax, Triton backend (interpreter) against the float64 reference: forward and dscores,
fp32 and bf16, causal/non-causal, DropKey bit-identical to the package rule, one-pass and
multi-pass tilings, empty rows."""
import math

import numpy as np
import pytest
import torch

from megalodon_kernels.ops.dropkey_rule import dropkey_mask
from megalodon_kernels.ops.dropkey_softmax import dropkey_softmax
from megalodon_kernels.ops.dropkey_softmax import triton_impl
from megalodon_kernels.reference import attention as ref
from support import as_input, assert_close, to_np, tol

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN lanes the kernel masks away


def keep_for(shape, seed, p):
    L, S = shape[-2:]
    H = shape[-3] if len(shape) >= 3 else 1
    return dropkey_mask(seed, p, math.prod(shape[:-3]), H, L, S).reshape(shape).numpy()


def run_case(shape, dtype=torch.float32, causal=True, p=0.0, seed=99, contiguous=True):
    gen = torch.Generator().manual_seed(0)
    x = as_input(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    y = dropkey_softmax(x, causal, p, seed, backend="triton")
    assert y.dtype == dtype and y.shape == x.shape
    keep = keep_for(shape, seed, p) if p > 0 else None
    xn = to_np(x)
    y_ref = ref.dropkey_softmax(xn, causal, keep)
    assert_close("y", y, y_ref, tol("triton", dtype, "fwd"))
    # DropKey regenerated in Triton uint32 arithmetic: exactly the rule's kept set
    allowed = np.broadcast_to(ref.visible_mask(shape[-2], shape[-1], causal), shape)
    if keep is not None:
        allowed = allowed & keep
    if dtype != torch.float16:  # fp16 underflows tiny probabilities to 0
        assert np.array_equal(to_np(y) > 0, allowed & (y_ref > 0))
    assert np.all(to_np(y)[~allowed] == 0)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close("dscores", dx, ref.dropkey_softmax_bwd(to_np(dy), xn, causal, keep), tol("triton", dtype, "bwd"))
    return y, dx


# few programs per launch: BLOCK_M = 4096 / BLOCK_S rows each
SHAPES = [(5, 7), (3, 31, 33), (2, 3, 33, 17), (2, 2, 2, 17, 31), (1, 2, 63, 63), (2, 1, 5, 129)]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_dropkey_softmax_matches_reference(dtype, shape, causal, p):
    run_case(shape, dtype, causal, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_dropkey_softmax_multipass_long_rows(dtype):
    # S > widest key window (4096): online (max, sum) sweep, then a writing sweep
    run_case((1, 1, 3, 4099), dtype, True, 0.2, seed=2**40 + 3)


def test_triton_dropkey_softmax_middle_tier_and_noncontiguous():
    run_case((1, 2, 11, 300), torch.float32, True, 0.4, contiguous=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_dropkey_softmax_empty_rows(dtype):
    for shape, p in [((2, 9, 4), 0.0), ((2, 2, 12, 3), 0.9)]:
        y, dx = run_case(shape, dtype, True, p)
        assert torch.isfinite(y).all() and torch.isfinite(dx).all()


def test_triton_dropkey_softmax_equals_torch_backend_mask_bitwise():
    x = torch.randn(2, 3, 40, 50)
    for seed in (0, 7, 2**33 + 5, 2**63 - 1):
        a = dropkey_softmax(x, True, 0.5, seed, backend="triton")
        b = dropkey_softmax(x, True, 0.5, seed, backend="torch")
        assert torch.equal(a != 0, b != 0)
        assert_close("y vs torch", a, to_np(b), 1e-6)


def test_triton_dropkey_softmax_tiling():
    assert triton_impl._tiling(1, 4096) == (64, 64, True)
    assert triton_impl._tiling(513, 4096) == (1, 4096, True)
    assert triton_impl._tiling(4097, 4096) == (1, 4096, False)
