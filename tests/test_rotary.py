"""rotary (RoPE / xPos) on every backend against the float64 reference: forward and dx for one
table of cases (torch, Triton in the interpreter, CUDA in the emulator), the CUDA kernels in both
fiber orders, the reference's own backward, the relative-position property, positions anywhere
below 2^31 (xPos reference positions, a KV cache far away, the xPos limit) and bad inputs."""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels import ops
from megalodon_kernels.reference import rotary as ref
from support import as_input, assert_close, to_np, tol

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

#: (backend, dtype) pairs each case runs on
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16), ("triton", F16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
]]


def case(L, xpos, *, B=2, H=3, d=8, downscale=False, offset=0, per_batch=False, contiguous=True, id):
    return pytest.param(dict(B=B, L=L, H=H, d=d, xpos=xpos, downscale=downscale, offset=offset,
                             per_batch=per_batch, contiguous=contiguous), id=id)


CASES = [
    *(case(L, None, id=f"rope-L{L}") for L in (1, 31, 33, 129)),
    *(case(L, 512.0, id=f"xpos-L{L}") for L in (1, 31, 33, 129)),
    # positions from 7 (a KV cache), a strided x, shared or per-batch positions, q or k scaling
    *(case(33, 512.0, offset=7, per_batch=pb, downscale=ds, contiguous=False,
           id=f"xpos-L33-from7-strided-{'per_batch' if pb else 'shared'}-{'k' if ds else 'q'}")
      for pb in (False, True) for ds in (False, True)),
    case(17, 512.0, H=2, offset=3, id="xpos-L17-H2-from3"),
]


def check(B, L, H, d, dtype, xpos, downscale, offset, per_batch, contiguous, seed=0, backend="torch"):
    """Forward and dx of ``backend`` against the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, L, H, d, dtype=torch.float64, generator=gen)
    # xPos scales grow like zeta**(t / scale_base): keep t / scale_base moderate so the
    # norm-wise error compares numbers of similar size (torchscale centres positions for this).
    max_pos = 100_000 if xpos is None else int(4 * xpos)
    offset = min(offset, max_pos)
    if per_batch:
        pos = torch.randint(0, max_pos + 1, (B, L), generator=gen)
    else:
        pos = torch.arange(offset, offset + L)
    x = as_input(x0, dtype, contiguous, requires_grad=True)
    y = ops.rotary(x, pos, xpos_scale_base=xpos, xpos_downscale=downscale, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    xr = to_np(x.detach())  # the reference sees the rounded input
    assert_close("y", y, ref.rotary(xr, pos.numpy(), 10000.0, xpos, downscale), tol(backend, dtype, "fwd"),
                 ref.rotary_terms(xr, pos.numpy(), 10000.0, xpos, downscale))
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close("dx", dx, ref.rotary_bwd(to_np(dy), pos.numpy(), 10000.0, xpos, downscale),
                 tol(backend, dtype, "bwd"), ref.rotary_bwd_terms(to_np(dy), pos.numpy(), 10000.0, xpos, downscale))


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("c", CASES)
def test_rotary_matches_reference(c, backend, dtype):
    check(dtype=dtype, backend=backend, **c)


@given(
    B=st.integers(1, 3), L=st.integers(1, 70), H=st.integers(1, 3), half=st.integers(1, 8),
    xpos=st.sampled_from([None, 64.0, 512.0]), downscale=st.booleans(),
    offset=st.integers(0, 100_000), per_batch=st.booleans(), contiguous=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_rotary_property(B, L, H, half, xpos, downscale, offset, per_batch, contiguous, seed):
    check(B, L, H, 2 * half, F32, xpos, downscale, offset, per_batch, contiguous, seed)


def test_triton_equals_torch_bitwise_in_fp32():
    x = torch.randn(2, 17, 2, 16)
    pos = torch.arange(17) * 1000
    a = ops.rotary(x, pos, backend="triton")
    b = ops.rotary(x, pos, backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared", "per-batch"])
def test_cached_tables_equal_fresh_tables(H, per_batch):
    # rotary() keeps the tables of recent positions (and, for several heads, the torch backend
    # keeps them repeated over the heads); a call that hits those caches must give what fresh
    # tables give, forward and backward, also after the cached tables were written to (the
    # version check then rebuilds what derives from them). Equal up to the last bit of a complex
    # product: a multiply broadcasting a table over the heads may run torch's scalar inner loop
    # and the repeated table its vectorised one, which round differently.
    from megalodon_kernels.ops.rotary import rotary_op, rotation_tables
    from megalodon_kernels.ops.rotary.table_cache import TABLES

    B, L, d = 2, 37, 8
    gen = torch.Generator().manual_seed(H)
    x = torch.randn(B, L, H, d, generator=gen, requires_grad=True)
    dy = torch.randn(B, L, H, d, generator=gen)
    pos = torch.randint(0, 50, (B, L) if per_batch else (L,), generator=gen) + 1000 * H  # a key of its own

    def fresh(cos, sin):
        y = rotary_op(x, cos.clone(), sin.clone(), "torch")  # clones: not the cache's marked views
        return (y, *torch.autograd.grad(y, x, dy))

    for _ in range(3):  # a miss, then hits
        y = ops.rotary(x, pos, backend="torch")
        got = (y, *torch.autograd.grad(y, x, dy))
        want = fresh(*rotation_tables(pos, d, 10000.0, None, False, F32))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=4e-7, atol=4e-7)
    entry, = [e for e in TABLES.entries() if torch.equal(e.positions, pos)]
    cos, sin = entry.cos, entry.sin
    with torch.no_grad():
        cos.mul_(0.5)  # bumps the shared version: the conjugate half and repeated tables are stale
    y = ops.rotary(x, pos, backend="torch")
    got = (y, *torch.autograd.grad(y, x, dy))
    want = fresh(cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=4e-7, atol=4e-7)
    stale = fresh(*rotation_tables(pos, d, 10000.0, None, False, F32))
    assert (got[0] - stale[0]).abs().max() > 0.1 and (got[1] - stale[1]).abs().max() > 0.1
    TABLES.clear()


def test_table_cache_is_bounded_and_marks_no_tensor(monkeypatch):
    """The cache keeps at most SIZE entries (the oldest go first), its hits reach the torch
    backend's complex tables forward and backward, and no tensor gets an attribute."""
    from megalodon_kernels.ops.rotary import rotation_tables, table_cache

    cache = table_cache.TableCache(3)
    monkeypatch.setattr(table_cache, "TABLES", cache)
    monkeypatch.setattr(importlib.import_module("megalodon_kernels.ops.rotary"), "_TABLES", cache)
    monkeypatch.setattr(importlib.import_module("megalodon_kernels.ops.rotary.torch_impl"), "TABLES", cache)
    x = torch.randn(1, 5, 2, 4, requires_grad=True)
    for base in range(5):  # five keys
        ops.rotary(x, torch.arange(5), 100.0 + base, backend="torch")
    assert [e.cos.shape for e in cache.entries()] == [(1, 5, 1, 2)] * 3
    fresh = rotation_tables(torch.arange(5), 4, 102.0, None, False, torch.float32)
    assert torch.equal(cache.entries()[0].cos, fresh[0])  # the oldest kept is base 102
    used = []
    real = table_cache.Entry.complex_table
    monkeypatch.setattr(table_cache.Entry, "complex_table", lambda self, *a: used.append(a) or real(self, *a))
    y = ops.rotary(x, torch.arange(5), 104.0, backend="torch")
    y.sum().backward()
    assert used == [(False, 2), (True, 2)]
    for e in cache.entries():
        assert not any(vars(t) for t in (e.cos, e.sin, e.table, x, y)), "an attribute on a tensor"


@pytest.fixture
def identity_tables(monkeypatch):
    """The GPU road of the table cache on CPU tensors: a faked (device, stream) place, a cache of
    its own, and a count of the tables built."""
    rotary_module = importlib.import_module("megalodon_kernels.ops.rotary")
    from megalodon_kernels.ops.rotary import table_cache

    cache = table_cache.TableCache(4)
    stream = ["stream-1"]
    monkeypatch.setattr(table_cache, "TABLES", cache)
    monkeypatch.setattr(rotary_module, "_TABLES", cache)
    monkeypatch.setattr(importlib.import_module("megalodon_kernels.ops.rotary.torch_impl"), "TABLES", cache)
    monkeypatch.setattr(rotary_module, "_identity_place", lambda positions: ("faked-gpu", stream[0]))
    built = []
    real = rotary_module.rotation_tables
    monkeypatch.setattr(rotary_module, "rotation_tables", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    return cache, built, stream, real


@pytest.mark.parametrize("xpos", [None, 512.0], ids=["rope", "xpos"])
def test_identity_cache_rebuilds_on_any_change(identity_tables, xpos):
    # the GPU road (faked on the CPU): q and k of every layer share one build per positions
    # tensor; an in-place write (also through a view), a new tensor with the same values, a
    # tensor reference written to, another stream or an inference tensor build again; results and
    # gradients equal those of fresh tables throughout
    from megalodon_kernels.ops.rotary import rotary_op

    cache, built, stream, rotation_tables = identity_tables
    gen = torch.Generator().manual_seed(5)
    B, L, H, d = 2, 7, 2, 8
    x = torch.randn(B, L, H, d, generator=gen, requires_grad=True)
    dy = torch.randn(B, L, H, d, generator=gen)
    pos = torch.arange(L) + 40
    ref_pos = torch.tensor([[41], [43]])

    def check(positions, reference=None, downscale=False):
        kw = dict(xpos_scale_base=xpos, xpos_downscale=downscale, xpos_reference=reference if xpos else None)
        y = ops.rotary(x, positions, **kw, backend="torch")
        got = (y, *torch.autograd.grad(y, x, dy))
        cos, sin = rotation_tables(positions, d, 10000.0, xpos, downscale, F32, kw["xpos_reference"], F32)
        y0 = rotary_op(x, cos.clone(), sin.clone(), "torch")
        for a, b in zip(got, (y0, *torch.autograd.grad(y0, x, dy))):
            torch.testing.assert_close(a, b, rtol=4e-7, atol=4e-7)

    for _ in range(3):  # "q and k of three layers": one build
        check(pos)
    assert len(built) == 1
    pos.add_(5)  # in place
    check(pos)
    assert len(built) == 2
    pos[3:].fill_(2)  # through a view
    check(pos)
    check(pos)
    assert len(built) == 3
    check(pos.clone())  # equal values, another tensor (it takes the key's entry)
    assert len(built) == 4
    check(pos)
    stream[0] = "stream-2"  # another stream: an entry of its own
    check(pos)
    stream[0] = "stream-1"
    check(pos)
    stream[0] = "stream-2"
    check(pos)
    assert len(built) == 6
    if xpos:
        check(pos, ref_pos)
        check(pos, ref_pos)
        ref_pos.add_(1)
        check(pos, ref_pos)
        assert len(built) == 8
    with torch.inference_mode():
        frozen = torch.arange(L)
    n = len(built)
    check(frozen)
    check(frozen)  # an inference tensor has no version counter: never cached
    assert len(built) == n + 2
    assert all(e.stamp is not None for e in cache.entries())


def test_identity_cache_off_builds_every_call(identity_tables, monkeypatch):
    from megalodon_kernels.ops.rotary import table_cache

    cache, built, _, _ = identity_tables
    rotary_module = importlib.import_module("megalodon_kernels.ops.rotary")
    monkeypatch.setattr(rotary_module, "_identity_place", lambda positions: None)  # e.g. capturing a graph
    monkeypatch.setattr(rotary_module, "plain_tensor", lambda t: False)  # and no value cache either
    pos = torch.arange(5)
    x = torch.randn(1, 5, 1, 4)
    ops.rotary(x, pos, backend="torch")
    ops.rotary(x, pos, backend="torch")
    assert len(built) == 2 and not cache.entries()
    assert table_cache.IDENTITY


def test_xpos_scores_depend_on_distance_only():
    # q_t . k_u must equal q_{t+s} . k_{u+s}: the defining property of RoPE and xPos (one call per
    # position, so the reference position is passed: the same for q and k)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(t, u, r, xpos=512.0):
        qt = ops.rotary(q, torch.tensor([t]), xpos_scale_base=xpos, xpos_reference=r)
        ku = ops.rotary(k, torch.tensor([u]), xpos_scale_base=xpos, xpos_downscale=True, xpos_reference=r)
        return float((qt * ku).sum())

    want = score(710, 10, 0)
    for t, r in [(1710, 1000), (1710, 5), (10**9 + 710, 10**9 - 7000), (2**31 - 1, 2**31 - 20)]:
        assert abs(score(t, t - 700, r) - want) < 1e-9 * abs(want) + 1e-12
    # and it decays with the distance: not the plain RoPE score
    assert abs(want - score(710, 10, None, None)) > 0.1 * abs(want)


# ---------------------------------------------------------------------------------------------
# Any position below 2^31: angles formed exactly, xPos scales from a reference position


def scores(q, k):
    """q_t . k_u for every pair: (B, L, H, d) x (B, M, H, d) -> (B, H, L, M), float64."""
    return torch.einsum("blhd,bmhd->bhlm", q.double(), k.double())


#: the last position of each window: near 0, where the scale alone left float32 (~36k... 45k), far
FAR_ENDS = [40, 45_000, 10**6, 10**9, 2**31 - 1]
#: q.k at far positions vs the same at positions near 0, relative to the largest score: measured
#: (max over the cases of test_xpos_at_any_position) fp32 1.5e-7, bf16 6.5e-3 (bf16 rounding of the
#: two outputs); docs/math.md, rotary
SCORE_TOL = {F32: 6e-7, BF16: 2e-2}


@pytest.mark.parametrize("backend, dtype", [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("triton", F32), ("triton", BF16), ("cuda", F32), ("cuda", BF16)]])
@pytest.mark.parametrize("xpos", [None, 512.0], ids=["rope", "xpos"])
@pytest.mark.parametrize("end", FAR_ENDS, ids=lambda e: f"to{e}")
def test_xpos_at_any_position(end, xpos, backend, dtype):
    # One window of positions ending at `end` (int32 positions at 2^31 - 1), the default reference
    # (the middle of the positions, shared by q and k): finite, equal to the long-double reference,
    # and the scores equal those of the same vectors at positions 0..L-1.
    B, L, H, d = 2, 24, 2, 16
    gen = torch.Generator().manual_seed(end % 1000)
    q0 = torch.randn(B, L, H, d, generator=gen).to(dtype)
    k0 = torch.randn(B, L, H, d, generator=gen).to(dtype)
    pos = torch.arange(end - L + 1, end + 1)
    if end == 2**31 - 1:
        pos = pos.to(torch.int32)
    kw = dict(xpos_scale_base=xpos, backend=backend)
    q = ops.rotary(q0, pos, **kw)
    k = ops.rotary(k0, pos, xpos_downscale=True, **kw)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    assert_close("q", q, ref.rotary(to_np(q0), pos.numpy(), 10000.0, xpos, False), tol(backend, dtype, "fwd"))
    assert_close("k", k, ref.rotary(to_np(k0), pos.numpy(), 10000.0, xpos, True), tol(backend, dtype, "fwd"))
    near = torch.arange(L)
    s0 = scores(ops.rotary(q0, near, **kw), ops.rotary(k0, near, xpos_downscale=True, **kw))
    assert_close("scores far vs near", scores(q, k), to_np(s0), SCORE_TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_xpos_kv_cache_far_away(backend):
    # A stream at position 1e9: the keys rotated as they come (a prefill of 25, then one per
    # decoding step) and every query with the same reference position; the scores of all pairs
    # equal those of one call over positions 0..N-1. Whatever reference, as long as it is shared.
    B, H, d, N, start = 2, 2, 16, 40, 10**9
    gen = torch.Generator().manual_seed(1)
    q0, k0 = torch.randn(B, N, H, d, generator=gen), torch.randn(B, N, H, d, generator=gen)
    near = torch.arange(N)
    want = to_np(scores(ops.rotary(q0, near, xpos_scale_base=512.0, backend=backend),
                        ops.rotary(k0, near, xpos_scale_base=512.0, xpos_downscale=True, backend=backend)))
    pieces = [(0, 25)] + [(t, t + 1) for t in range(25, N)]
    references = {"int": start + 20, "per-sequence": torch.tensor([[start], [start + 5000]]),
                  "behind": start - 20_000}
    for name, r in references.items():
        kw = dict(xpos_scale_base=512.0, xpos_reference=r, backend=backend)
        qs, ks = [], []
        for a, b in pieces:
            pos = torch.arange(start + a, start + b)
            qs.append(ops.rotary(q0[:, a:b], pos, **kw))
            ks.append(ops.rotary(k0[:, a:b], pos, xpos_downscale=True, **kw))
        got = scores(torch.cat(qs, 1), torch.cat(ks, 1))
        assert torch.isfinite(got).all(), name
        assert_close(f"scores ({name} reference)", got, want, SCORE_TOL[F32])


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
def test_xpos_limit(dtype):
    # Positions up to xpos_limit from their reference: finite outputs of full precision (the
    # reference's relative error); one position further: refused, with the way out in the message.
    from megalodon_kernels.ops.rotary import xpos_limit

    limit = xpos_limit(dtype, 64.0)
    x = torch.randn(1, 3, 1, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    pos = torch.tensor([1000 - limit, 1000, 1000 + limit])  # the default reference: 1000
    for down in (False, True):
        y = ops.rotary(x, pos, xpos_scale_base=64.0, xpos_downscale=down, backend="torch")
        assert torch.isfinite(y).all()
        want = ref.rotary(to_np(x), pos.numpy(), 10000.0, 64.0, down)
        # per position: each row's size differs by up to e^(+-2 * 52) in float32
        for t in range(3):
            assert_close(f"y[{t}]", y[:, t], want[:, t], tol("torch", dtype, "fwd"))
    with pytest.raises(ValueError, match=f"within {limit} of its reference.*xpos_reference"):
        ops.rotary(x, pos + torch.tensor([0, 0, 2]), xpos_scale_base=64.0, backend="torch")
    with pytest.raises(ValueError, match="within"):
        ops.rotary(x, pos, xpos_scale_base=64.0, xpos_reference=1001, backend="torch")


def test_angles_exact_at_2_31():
    # float64 tables at the largest int32 positions equal the long-double reference to 6e-14 (the
    # float64 rounding of t * theta_lo, |t * theta_lo| < 2^9; measured 2.8e-14): the angle
    # t * theta is formed exactly otherwise (the plain float64 product is off by up to 2.4e-7 rad here)
    from megalodon_kernels.ops.rotary import rotation_tables

    pos = torch.arange(2**31 - 64, 2**31, dtype=torch.int64)
    cos, sin = rotation_tables(pos, 64, 10000.0, None, False, F64)
    f = ref._factors(pos.numpy(), 64, 10000.0, None, False)
    assert_close("cos", cos, f.real, 1e-13)
    assert_close("sin", sin, f.imag, 1e-13)
    naive = torch.cos(pos.double()[:, None] * torch.tensor([10000.0 ** (-2.0 * j / 64) for j in range(32)],
                                                          dtype=F64))
    assert (naive - cos[0, :, 0]).abs().max() > 1e-9  # what the exact split avoids


# ---------------------------------------------------------------------------------------------
# The CUDA kernels themselves (the launch description of cuda_impl.py in the emulator), in both fiber orders


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("xpos,per_batch", [(None, False), (512.0, False), (None, True)],
                         ids=["rope", "xpos", "per_batch"])
def test_cuda_kernels(ext, order, dtype, xpos, per_batch):
    from megalodon_kernels.cuda.launch import EmulatorLauncher
    from megalodon_kernels.ops.rotary import cuda_impl as rotary_cuda, rotation_tables

    launcher = EmulatorLauncher(ext)
    B, L, H, d = 2, 33, 3, 8
    x = torch.randn(B, L, H, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    pos = (torch.randint(0, 1000, (B, L), generator=torch.Generator().manual_seed(6)) if per_batch
           else torch.arange(7, 7 + L))
    # fp32 tables for fp32/bf16 x; float64 x gets float64 tables (fp32 ones would cap it at ~1e-7)
    tables = F64 if dtype == F64 else F32
    for downscale in (False, True):
        cos, sin = rotation_tables(pos, d, 10000.0, xpos, downscale, tables)
        y = rotary_cuda.rotary(launcher, x, cos, sin, False)
        assert y.dtype == dtype
        assert_close("y", y, ref.rotary(to_np(x), pos.numpy(), 10000.0, xpos, downscale), tol("cuda", dtype, "fwd"))
        dx = rotary_cuda.rotary(launcher, x, cos, sin, True)
        assert_close("dx", dx, ref.rotary_bwd(to_np(x), pos.numpy(), 10000.0, xpos, downscale),
                     tol("cuda", dtype, "bwd"))


# ---------------------------------------------------------------------------------------------
# The reference and bad inputs


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 2, 6))
    dy = rng.standard_normal(x.shape)
    pos = np.array([5, 70, 300])
    dx = ref.rotary_bwd(dy, pos, 100.0, 128.0, True)
    fd = np.zeros_like(x)
    eps = 1e-6
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        diff = ref.rotary(xp, pos, 100.0, 128.0, True) - ref.rotary(xm, pos, 100.0, 128.0, True)
        fd[idx] = (diff * dy).sum() / (2 * eps)
    assert_close("reference dx vs finite differences", dx, fd, 1e-8)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(2, 3, 4)), ValueError, "x must have rank 4"),
    (dict(x=torch.randn(1, 3, 2, 5)), ValueError, "even"),
    (dict(x=torch.randn(1, 3, 2, 4, dtype=torch.complex64)), TypeError, "x must have dtype"),
    (dict(positions=torch.arange(4)), ValueError, "positions must have shape"),
    (dict(positions=torch.arange(3.0)), TypeError, "positions must have dtype"),
    (dict(positions=[0, 1, 2]), TypeError, "positions must be"),
    (dict(base=-1.0), ValueError, "base must be >"),
    (dict(xpos_scale_base=0.0), ValueError, "xpos_scale_base"),
    (dict(xpos_reference=3), ValueError, "xpos_reference is an xPos argument"),
    (dict(xpos_scale_base=512.0, xpos_reference=3.0), TypeError, "xpos_reference must be None, an int"),
    (dict(xpos_scale_base=512.0, xpos_reference=torch.tensor([1.0])), TypeError, "xpos_reference must be an int"),
    (dict(xpos_scale_base=512.0, xpos_reference=torch.zeros(2, 3, dtype=torch.int64)), ValueError,
     "xpos_reference must broadcast"),
    (dict(xpos_scale_base=512.0, xpos_reference=torch.zeros(4, dtype=torch.int64)), ValueError,
     "xpos_reference must broadcast"),
    (dict(xpos_scale_base=512.0, positions=torch.tensor([0, 1, 60_000])), ValueError, "within 26770"),
    (dict(backend="cuDNN"), ValueError, "backend must be one of"),
])
def test_rotary_bad_inputs(bad, exc, match):
    args = dict(x=torch.randn(1, 3, 2, 4), positions=torch.arange(3))
    args.update(bad)
    with pytest.raises(exc, match=match):
        ops.rotary(**args)
