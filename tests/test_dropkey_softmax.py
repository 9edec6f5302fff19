"""dropkey_softmax (torch backend) against the float64 reference: forward and dscores for every
rank, the (b, h, i, j) index mapping, DropKey properties, empty rows and bad inputs."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.dropkey_rule import dropkey_mask, resolve_seed
from megalodon_kernels.ops.dropkey_softmax import dropkey_softmax
from megalodon_kernels.ops.dropkey_softmax import torch_impl
from megalodon_kernels.reference import attention as ref
from support import knobs as support_knobs
from support import as_input, assert_close, to_np, tol

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def knobs(**config):
    return support_knobs(torch_impl, **config)


def keep_for(shape, seed, p):
    """The op's keep mask for scores of ``shape``: b = flat index over dims before -3, h = dim -3."""
    L, S = shape[-2:]
    H = shape[-3] if len(shape) >= 3 else 1
    B = math.prod(shape[:-3])
    return dropkey_mask(seed, p, B, H, L, S).reshape(shape).numpy()


def run_case(shape, dtype=torch.float32, causal=True, p=0.0, seed=99, contiguous=True, data_seed=0):
    gen = torch.Generator().manual_seed(data_seed)
    x = as_input(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    y = dropkey_softmax(x, causal, p, seed, backend="torch")
    assert y.dtype == dtype and y.shape == x.shape
    keep = keep_for(shape, seed, p) if p > 0 else None
    xn = to_np(x)
    assert_close("y", y, ref.dropkey_softmax(xn, causal, keep), tol("torch", dtype, "fwd"))
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close("dscores", dx, ref.dropkey_softmax_bwd(to_np(dy), xn, causal, keep), tol("torch", dtype, "bwd"))
    return y, dx


SHAPES = [(5, 7), (3, 31, 33), (2, 3, 33, 17), (2, 3, 1, 129), (2, 2, 2, 17, 31), (1, 2, 63, 63)]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropkey_softmax_matches_reference(dtype, shape, causal, p):
    run_case(shape, dtype, causal, p)


def test_dropkey_softmax_float16_and_noncontiguous():
    run_case((2, 3, 33, 40), torch.float16, True, 0.2)
    run_case((2, 3, 33, 40), torch.float32, True, 0.2, contiguous=False)
    run_case((3, 17, 9), torch.float32, False, 0.2, contiguous=False)


@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), L=st.integers(1, 70), S=st.integers(1, 70),
    causal=st.booleans(), p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    contiguous=st.booleans(), block_q=st.sampled_from([1, 4, 32, 256]), data_seed=st.integers(0, 2**31),
)
def test_dropkey_softmax_property(lead, L, S, causal, p, seed, contiguous, block_q, data_seed):
    with knobs(block_q=block_q):
        run_case((*lead, L, S), torch.float32, causal, p, seed, contiguous, data_seed)


def test_dropkey_softmax_knobs_agree():
    shape = (2, 3, 45, 50)
    outs = []
    for cfg in [dict(block_q=1), dict(block_q=7), dict(block_q=256), dict(block_q=256, max_block_elems=1)]:
        with knobs(**cfg):
            outs.append(run_case(shape, torch.float32, True, 0.4))
    for y, dx in outs[1:]:
        # Not bitwise: a causal block reduces over keys up to its own last row, a different length.
        assert_close("y vs block_q=1", y, to_np(outs[0][0]), 1e-6)
        assert_close("dscores vs block_q=1", dx, to_np(outs[0][1]), 1e-6)


def test_dropkey_softmax_index_mapping():
    # A rank-5 call equals the rank-4 call on the flattened leading dims (b is their flat index),
    # and a rank-3 call equals batch 0 of the rank-4 call (b = 0).
    x = torch.randn(2, 3, 4, 9, 11, dtype=torch.float64)
    y5 = dropkey_softmax(x, True, 0.5, 3)
    y4 = dropkey_softmax(x.reshape(6, 4, 9, 11), True, 0.5, 3)
    assert torch.equal(y5.reshape(6, 4, 9, 11), y4)
    y3 = dropkey_softmax(x[0, 0], True, 0.5, 3)
    assert torch.equal(y3, y4[0])
    y2 = dropkey_softmax(x[0, 0, 0], True, 0.5, 3)
    assert torch.equal(y2, y4[0, 0])


# ---------------------------------------------------------------------------------------------
# DropKey properties


def test_mix32_tensor_path_equals_the_integer_rule_and_leaves_its_input():
    # the in-place tensor path of mix32 against the Python-int path (the rule's definition), on
    # edge values and random words; the caller's tensor is not modified
    from megalodon_kernels.ops.dropkey_rule import MASK32, mix32
    words = [0, 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, MASK32 - 1, MASK32]
    words += torch.randint(0, 2**32, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    x = torch.tensor(words, dtype=torch.int64)
    before = x.clone()
    assert mix32(x).tolist() == [mix32(w) for w in words]
    assert torch.equal(x, before)
    assert mix32(x[::2]).tolist() == [mix32(w) for w in words[::2]]  # strided views too


def test_dropkey_softmax_reproducible_and_seed_sensitive():
    x = torch.randn(2, 3, 20, 24, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 20, 24, dtype=torch.float64)
    y1 = dropkey_softmax(x, True, 0.3, 8)
    y2 = dropkey_softmax(x, True, 0.3, 8)
    y3 = dropkey_softmax(x, True, 0.3, 9)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    (g1,) = torch.autograd.grad(y1, x, dy)
    (g2,) = torch.autograd.grad(y2, x, dy)
    assert torch.equal(g1, g2)


def test_dropkey_softmax_seed_none_uses_torch_generator():
    x = torch.randn(2, 3, 20, 24, dtype=torch.float64)
    torch.manual_seed(4)
    drawn = resolve_seed(None)
    torch.manual_seed(4)
    y = dropkey_softmax(x, True, 0.3)
    assert_close("y", y, ref.dropkey_softmax(to_np(x), True, keep_for(x.shape, drawn, 0.3)), 1e-12)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.95])
def test_dropkey_softmax_drop_fraction_is_binomial(p):
    x = torch.zeros(3, 4, 64, 128, dtype=torch.float64)
    y = dropkey_softmax(x, False, p, 321)
    kept = y > 0
    assert np.array_equal(kept.numpy(), keep_for(x.shape, 321, p))
    n = kept.numel()
    frac = 1.0 - kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    print(f"p={p}: dropped fraction {frac:.5f}, {abs(frac - p) / sigma:.2f} sigma over n={n}")
    assert abs(frac - p) <= 5 * sigma


def test_dropkey_softmax_p0_is_plain_softmax():
    x = torch.randn(2, 3, 20, 24)
    state = torch.get_rng_state()
    y = dropkey_softmax(x, True)
    assert torch.equal(torch.get_rng_state(), state)  # p = 0 draws no seed
    mask = torch.ones(20, 24, dtype=torch.bool).tril(diagonal=4)  # bottom-right: S - L = 4
    assert_close("y vs torch.softmax", y, to_np(torch.softmax(x.masked_fill(~mask, -math.inf), -1)), 1e-6)
    assert torch.equal(dropkey_softmax(x, False, 0.0, 5), torch.softmax(x, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropkey_softmax_empty_rows_zero_and_finite_grads(dtype):
    # L > S causal: the first rows see no key; p = 0.9 with S = 3 drops whole rows too.
    for shape, p in [((2, 9, 4), 0.0), ((2, 2, 12, 3), 0.9)]:
        y, dx = run_case(shape, dtype, True, p)
        allowed = np.broadcast_to(ref.visible_mask(shape[-2], shape[-1]), shape)
        if p > 0:
            allowed = allowed & keep_for(shape, 99, p)
        empty = ~allowed.any(-1)
        assert empty.any()
        assert np.all(to_np(y)[empty] == 0) and np.all(np.isfinite(to_np(y)))
        assert np.all(np.isfinite(to_np(dx))) and np.all(to_np(dx)[empty] == 0)


# ---------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize("bad, exc, match", [
    (dict(scores=torch.randn(5)), ValueError, r"scores must have rank >= 2 \(\.\.\., L, S\)"),
    (dict(scores=torch.ones(3, 4, dtype=torch.int32)), TypeError, "scores must have dtype"),
    (dict(scores=np.zeros((3, 4))), TypeError, "scores must be a torch.Tensor"),
    (dict(causal=None), TypeError, "causal must be a bool"),
    (dict(dropkey_p=1.5), ValueError, "dropkey_p must be < 1"),
    (dict(dropkey_p=-1e-3), ValueError, "dropkey_p must be >= 0"),
    (dict(dropkey_p=0.2, seed=2**63), ValueError, "seed must be in"),
    (dict(seed="7"), TypeError, "seed must be an int"),
    (dict(backend="cuDNN"), ValueError, "backend must be one of"),
])
def test_dropkey_softmax_bad_inputs(bad, exc, match):
    args = dict(scores=torch.randn(2, 3, 4))
    args.update(bad)
    with pytest.raises(exc, match=match):
        dropkey_softmax(**args)
