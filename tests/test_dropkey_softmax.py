"""dropkey_softmax on every backend against the float64 reference: forward and dscores for one
table of cases (torch, Triton in the interpreter, CUDA in the emulator) with the DropKey keep set
bit-identical to the package rule, empty rows, the torch tiling knobs, the (b, h, i, j) index
mapping, DropKey properties, the CUDA kernels in both fiber orders, the reference's own backward
and bad inputs."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.cuda.launch import EmulatorLauncher
from megalodon_kernels.ops.dropkey_rule import dropkey_mask, resolve_seed
from megalodon_kernels.ops.dropkey_softmax import dropkey_softmax
from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dk_cuda, torch_impl, triton_impl
from megalodon_kernels.reference import attention as ref
from support import knobs as support_knobs
from support import as_input, assert_close, to_np, tol

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN lanes the Triton kernel masks away

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

#: (backend, dtype) pairs every case runs on; float16 runs on the FP16_CASES only
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
]]


def case(shape, causal, p, *, seed=99, contiguous=True, id=None):
    name = id or f"{'x'.join(map(str, shape))}-{'causal' if causal else 'full'}-p{p}"
    return pytest.param(dict(shape=shape, causal=causal, p=p, seed=seed, contiguous=contiguous), id=name)


# Rank 2 to 5, S > L (KV cache), S < L (leading rows see no key), one query row, L = S.
SHAPES = [(5, 7), (3, 31, 33), (2, 3, 33, 17), (2, 3, 1, 129), (2, 2, 2, 17, 31), (1, 2, 63, 63), (2, 1, 5, 129)]
CASES = [
    *(case(shape, causal, p) for shape in SHAPES for causal in (True, False) for p in (0.0, 0.3)),
    case((2, 3, 33, 40), True, 0.2, id="S40-L33-p0.2"),
    case((2, 3, 33, 40), True, 0.2, contiguous=False, id="strided-S40-L33-p0.2"),
    case((3, 17, 9), False, 0.2, contiguous=False, id="strided-rank3-full-p0.2"),
    case((1, 2, 11, 300), True, 0.4, contiguous=False, id="strided-S300-p0.4"),  # Triton's middle tier
    # S above Triton's widest key window (4096): an online (max, sum) sweep, then a writing sweep
    case((1, 1, 3, 4099), True, 0.2, seed=2**40 + 3, id="long-rows-S4099"),
    case((2, 3, 9, 12), True, 0.2, seed=77, id="S12-L9-p0.2"),
    case((2, 3, 9, 12), False, 0.0, seed=77, id="S12-L9-full"),
]
FP16_CASES = [c for c in CASES if c.id in ("S40-L33-p0.2", "long-rows-S4099")]


def knobs(**config):
    return support_knobs(torch_impl, **config)


def keep_for(shape, seed, p):
    """The op's keep mask for scores of ``shape``: b = flat index over dims before -3, h = dim -3."""
    L, S = shape[-2:]
    H = shape[-3] if len(shape) >= 3 else 1
    B = math.prod(shape[:-3])
    return dropkey_mask(seed, p, B, H, L, S).reshape(shape).numpy()


def check(shape, dtype=F32, causal=True, p=0.0, seed=99, contiguous=True, data_seed=0, backend="torch"):
    """Forward and dscores of ``backend`` against the reference; the non-zero probabilities are
    exactly the visible, kept entries. Returns (y, dscores)."""
    gen = torch.Generator().manual_seed(data_seed)
    x = as_input(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    y = dropkey_softmax(x, causal, p, seed, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    keep = keep_for(shape, seed, p) if p > 0 else None
    xn = to_np(x)
    y_ref = ref.dropkey_softmax(xn, causal, keep)
    assert_close("y", y, y_ref, tol(backend, dtype, "fwd"), ref.dropkey_softmax_terms(xn, causal, keep))
    allowed = np.broadcast_to(ref.visible_mask(shape[-2], shape[-1], causal), shape)
    if keep is not None:
        allowed = allowed & keep
    if dtype != F16:  # fp16 underflows tiny probabilities to 0
        assert np.array_equal(to_np(y) > 0, allowed & (y_ref > 0))
    assert np.all(to_np(y)[~allowed] == 0)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close("dscores", dx, ref.dropkey_softmax_bwd(to_np(dy), xn, causal, keep), tol(backend, dtype, "bwd"),
                 ref.dropkey_softmax_bwd_terms(to_np(dy), xn, causal, keep))
    return y, dx


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("c", CASES)
def test_dropkey_softmax_matches_reference(c, backend, dtype):
    check(dtype=dtype, backend=backend, **c)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("c", FP16_CASES)
def test_dropkey_softmax_float16(c, backend):
    check(dtype=F16, backend=backend, **c)


@pytest.mark.parametrize("backend, dtype", [p for p in BACKEND_DTYPES if p.values[1] in (F32, BF16)])
def test_empty_rows_output_zero_with_finite_gradients(backend, dtype):
    # L > S causal: the first rows see no key; p = 0.9 with S = 3 drops whole rows too.
    for shape, p in [((2, 9, 4), 0.0), ((2, 2, 12, 3), 0.9)]:
        y, dx = check(shape, dtype, True, p, backend=backend)
        allowed = np.broadcast_to(ref.visible_mask(shape[-2], shape[-1]), shape)
        if p > 0:
            allowed = allowed & keep_for(shape, 99, p)
        empty = ~allowed.any(-1)
        assert empty.any()
        assert np.all(to_np(y)[empty] == 0) and np.all(np.isfinite(to_np(y)))
        assert np.all(np.isfinite(to_np(dx))) and np.all(to_np(dx)[empty] == 0)


@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), L=st.integers(1, 70), S=st.integers(1, 70),
    causal=st.booleans(), p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    contiguous=st.booleans(), block_q=st.sampled_from([1, 4, 32, 256]), data_seed=st.integers(0, 2**31),
)
def test_dropkey_softmax_property(lead, L, S, causal, p, seed, contiguous, block_q, data_seed):
    with knobs(block_q=block_q):
        check((*lead, L, S), F32, causal, p, seed, contiguous, data_seed)


# ---------------------------------------------------------------------------------------------
# Tiling


def test_torch_knobs_agree():
    shape = (2, 3, 45, 50)
    outs = []
    for cfg in [dict(block_q=1), dict(block_q=7), dict(block_q=256), dict(block_q=256, max_block_elems=1)]:
        with knobs(**cfg):
            outs.append(check(shape, F32, True, 0.4))
    for y, dx in outs[1:]:
        # Not bitwise: a causal block reduces over keys up to its own last row, a different length.
        assert_close("y vs block_q=1", y, to_np(outs[0][0]), tol("torch", F32, "fwd"))
        assert_close("dscores vs block_q=1", dx, to_np(outs[0][1]), tol("torch", F32, "bwd"))


def test_triton_tiling():
    assert triton_impl._tiling(1, 4096) == (64, 64, True)
    assert triton_impl._tiling(513, 4096) == (1, 4096, True)
    assert triton_impl._tiling(4097, 4096) == (1, 4096, False)


def test_index_mapping():
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


@pytest.mark.parametrize("p", [0.1, 0.5, 0.97, 1 - 2**-33], ids=str)
def test_keep_mask_equals_the_integer_rule(p):
    # keep_mask hashes the logit-sized part in int32; against the rule on Python ints, with
    # indices whose hash words cover both halves of the uint32 range
    from megalodon_kernels.ops.dropkey_rule import head_keys, keep_mask, mix32, threshold
    seed, thr = 2**40 + 7, threshold(p)
    b, h = torch.tensor([0, 3]).view(-1, 1, 1, 1), torch.tensor([1, 2**31 + 5]).view(1, -1, 1, 1)
    i = torch.tensor([0, 1, 2**20, 2**31 - 1, 2**32 - 1]).view(1, 1, -1, 1)
    j = torch.cat((torch.arange(40), torch.tensor([2**31, 2**32 - 1]))).view(1, 1, 1, -1)
    got = keep_mask(seed, p, b, h, i, j)
    keys = head_keys(seed, b, h)
    want = [[[[mix32(mix32(int(keys[bb, hh, 0, 0]) ^ int(ii)) ^ int(jj)) >= thr for jj in j.flatten()]
              for ii in i.flatten()] for hh in range(2)] for bb in range(2)]
    assert got.tolist() == want


def test_reproducible_and_seed_sensitive():
    x = torch.randn(2, 3, 20, 24, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 20, 24, dtype=torch.float64)
    y1 = dropkey_softmax(x, True, 0.3, 8)
    y2 = dropkey_softmax(x, True, 0.3, 8)
    y3 = dropkey_softmax(x, True, 0.3, 9)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    (g1,) = torch.autograd.grad(y1, x, dy)
    (g2,) = torch.autograd.grad(y2, x, dy)
    assert torch.equal(g1, g2)


def test_seed_none_uses_torch_generator():
    x = torch.randn(2, 3, 20, 24, dtype=torch.float64)
    torch.manual_seed(4)
    drawn = resolve_seed(None)
    torch.manual_seed(4)
    y = dropkey_softmax(x, True, 0.3)
    assert_close("y", y, ref.dropkey_softmax(to_np(x), True, keep_for(x.shape, drawn, 0.3)), tol("torch", F64, "fwd"))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.95])
def test_drop_fraction_is_binomial(p):
    x = torch.zeros(3, 4, 64, 128, dtype=torch.float64)
    y = dropkey_softmax(x, False, p, 321)
    kept = y > 0
    assert np.array_equal(kept.numpy(), keep_for(x.shape, 321, p))
    n = kept.numel()
    frac = 1.0 - kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    print(f"p={p}: dropped fraction {frac:.5f}, {abs(frac - p) / sigma:.2f} sigma over n={n}")
    assert abs(frac - p) <= 5 * sigma


def test_p0_is_plain_softmax():
    x = torch.randn(2, 3, 20, 24)
    state = torch.get_rng_state()
    y = dropkey_softmax(x, True)
    assert torch.equal(torch.get_rng_state(), state)  # p = 0 draws no seed
    mask = torch.ones(20, 24, dtype=torch.bool).tril(diagonal=4)  # bottom-right: S - L = 4
    assert_close("y vs torch.softmax", y, to_np(torch.softmax(x.masked_fill(~mask, -math.inf), -1)),
                 tol("torch", F32, "fwd"))
    assert torch.equal(dropkey_softmax(x, False, 0.0, 5), torch.softmax(x, -1))


def test_triton_keep_mask_equals_torch_backend_bitwise():
    x = torch.randn(2, 3, 40, 50)
    for seed in (0, 7, 2**33 + 5, 2**63 - 1):
        a = dropkey_softmax(x, True, 0.5, seed, backend="triton")
        b = dropkey_softmax(x, True, 0.5, seed, backend="torch")
        assert torch.equal(a != 0, b != 0)
        assert_close("y vs torch", a, to_np(b), tol("triton", F32, "fwd"))


# ---------------------------------------------------------------------------------------------
# The CUDA kernels themselves (the launch description over the emulator), in both fiber orders


@pytest.fixture
def launcher(ext):
    return EmulatorLauncher(ext)


def _kernel_reference(x, causal, p, seed):
    Bf, Hf, L, S = x.shape
    allowed = ref.visible_mask(L, S, causal=causal)[None, None]
    if p > 0:
        allowed = allowed & dropkey_mask(seed, p, Bf, Hf, L, S).numpy()
    return ref._masked_softmax(to_np(x), allowed), allowed


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("shape,causal,p", [
    ((2, 3, 5, 7), True, 0.0),        # S > L: KV-cache alignment
    ((1, 2, 33, 33), True, 0.3),
    ((1, 1, 9, 6), True, 0.5),        # S < L: leading rows fully masked -> 0
    ((2, 1, 4, 300), False, 0.2),     # several items per thread
    ((1, 1, 2, 4500), True, 0.1),     # beyond the register cache (8 x 512): streamed pass
], ids=["kvcache", "square", "short_S", "wide", "streamed"])
def test_cuda_kernels(launcher, order, dtype, shape, causal, p):
    seed = 2**40 + 12345
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    y = dk_cuda.softmax_fwd(launcher, x, causal=causal, dropkey_p=p, seed=seed)
    want, allowed = _kernel_reference(x, causal, p, seed)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close("y", y, want, tol("cuda", dtype, "fwd"))
    # the keep/drop decisions are bit-identical: exactly the allowed entries are non-zero
    np.testing.assert_array_equal(to_np(y) != 0, (want != 0) & allowed)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    dx = dk_cuda.softmax_bwd(launcher, dy, y, causal=causal)
    yr, dyr = to_np(y), to_np(dy)
    assert_close("dx", dx, yr * (dyr - (yr * dyr).sum(-1, keepdims=True)), tol("cuda", dtype, "bwd"))


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32 + 7, 2**63 - 1])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.999])
def test_cuda_kernel_keep_mask_is_the_package_rule(launcher, seed, p):
    # zero scores, no causal mask: y > 0 exactly where the rule keeps the logit
    Bf, Hf, L, S = 2, 3, 4, 70
    y = dk_cuda.softmax_fwd(launcher, torch.zeros(Bf, Hf, L, S), causal=False, dropkey_p=p, seed=seed)
    keep = dropkey_mask(seed, p, Bf, Hf, L, S)
    np.testing.assert_array_equal((y > 0).numpy(), keep.numpy())


def test_cuda_kernel_p0_is_plain_softmax(launcher):
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    y = dk_cuda.softmax_fwd(launcher, x, causal=False, dropkey_p=0.0, seed=5)
    assert_close("y", y, torch.softmax(x.double(), -1), tol("cuda", F32, "fwd"))


def test_cuda_kernel_rank_2_and_5(launcher):
    for shape in [(5, 8), (2, 2, 2, 3, 4)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
        y = dk_cuda.softmax_fwd(launcher, x, causal=True, dropkey_p=0.25, seed=9)
        flat = x.reshape(-1, shape[-3] if len(shape) >= 3 else 1, *shape[-2:])
        want, _ = _kernel_reference(flat, True, 0.25, 9)
        assert_close("y", y.reshape(flat.shape), want, tol("cuda", F32, "fwd"))


# ---------------------------------------------------------------------------------------------
# The reference and bad inputs


@pytest.mark.parametrize("shape", [(4, 5), (2, 4, 5), (2, 2, 4, 3)], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_matches_finite_differences(shape, causal):
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(size=shape)
    keep = rng.random(shape) > 0.3
    dy = rng.normal(size=shape)
    eps = 1e-6

    def loss(x_):
        return float(np.sum(ref.dropkey_softmax(x_, causal, keep) * dy))

    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        fd[idx] = (loss(xp) - loss(xm)) / (2 * eps)
    an = ref.dropkey_softmax_bwd(dy, x, causal, keep)
    err = np.max(np.abs(an - fd))
    print(f"dscores: max abs err {err:.2e}")
    assert err <= 1e-7
    y = ref.dropkey_softmax(x, causal, keep)
    rows_alive = y.sum(-1)
    assert np.all((np.abs(rows_alive - 1) < 1e-12) | (rows_alive == 0))


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
def test_bad_inputs(bad, exc, match):
    args = dict(scores=torch.randn(2, 3, 4))
    args.update(bad)
    with pytest.raises(exc, match=match):
        dropkey_softmax(**args)
