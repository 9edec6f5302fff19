"""rotary on a packed row: ops.rotary(x, ops.document_positions(cu_seqlens)) equals rotary on each
document with positions from 0 (RoPE and xPos, forward and dx, every backend), documents far away
(positions near 1e9 and 2^31, a reference position per document) score as near 0, and
document_positions' values and bad input."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels import ops
from megalodon_kernels.reference import rotary as ref
from support import assert_close, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64

BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
]]
#: an empty document first and in the middle, 1 token, longer ones
LENGTHS = [0, 5, 1, 0, 17, 9]


def cumulative(lengths, dtype=torch.int64):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(dtype)


def packed_x(lengths, dtype, seed=0, H=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, sum(lengths), H, d, generator=gen, dtype=F64).to(dtype).requires_grad_()
    dy = torch.randn(x.shape, generator=gen, dtype=F64).to(dtype)
    return x, dy


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("xpos, downscale", [(None, False), (512.0, False), (512.0, True)],
                         ids=["rope", "xpos-q", "xpos-k"])
def test_packed_rotary_equals_each_document_from_position_0(backend, dtype, xpos, downscale):
    x, dy = packed_x(LENGTHS, dtype)
    cu = cumulative(LENGTHS)
    # one xPos reference position for the row and each document alone (the default, the middle of
    # each call's positions, differs between them; q.k would not: test_packed_xpos_far_away)
    kw = dict(xpos_scale_base=xpos, xpos_downscale=downscale, backend=backend,
              xpos_reference=None if xpos is None else 0)
    y = ops.rotary(x, ops.document_positions(cu), **kw)
    (dx,) = torch.autograd.grad(y, x, dy)
    ys, dxs = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b == a:
            continue
        xd = x.detach()[:, a:b].requires_grad_()
        yd = ops.rotary(xd, torch.arange(b - a), **kw)
        ys.append(yd)
        dxs.append(torch.autograd.grad(yd, xd, dy[:, a:b])[0])
    budget = 1e-10 if dtype == F64 else None
    assert_close("y", y, to_np(torch.cat(ys, dim=1)), budget or tol(backend, dtype, "fwd"))
    assert_close("dx", dx, to_np(torch.cat(dxs, dim=1)), budget or tol(backend, dtype, "bwd"))
    # the restart matters: positions running on across documents rotate them differently
    y_running = ops.rotary(x, torch.arange(x.shape[1]), **kw)
    assert (y_running - y).abs().max() > 0.1


def scores(q, k):
    return torch.einsum("blhd,bmhd->bhlm", q.double(), k.double())


@pytest.mark.parametrize("backend, dtype", [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("triton", F32), ("cuda", F32), ("cuda", BF16)]])
def test_packed_xpos_far_away(backend, dtype):
    # Documents that continue streams far away (positions = their start + document_positions, up
    # to 2^31 - 1), each with its own reference position (a per-token tensor): every document's
    # q.k equal those of the document alone at positions from 0 (its default reference), and the
    # outputs equal the long-double reference. The row's default reference cannot serve all of
    # them (they span 2^31): refused.
    lengths = [5, 0, 17, 1, 9]
    starts = [10**9, 7, 2**31 - 17, 45_000, 123_456_789]
    cu = cumulative(lengths)
    doc_start = torch.repeat_interleave(torch.tensor(starts), torch.tensor(lengths))
    pos = doc_start + ops.document_positions(cu)
    reference = doc_start + 3
    gen = torch.Generator().manual_seed(3)
    q0 = torch.randn(1, sum(lengths), 2, 16, generator=gen).to(dtype)
    k0 = torch.randn(1, sum(lengths), 2, 16, generator=gen).to(dtype)
    kw = dict(xpos_scale_base=512.0, backend=backend)
    q = ops.rotary(q0, pos, xpos_reference=reference, **kw)
    k = ops.rotary(k0, pos, xpos_downscale=True, xpos_reference=reference, **kw)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    assert_close("q", q, ref.rotary(to_np(q0), pos.numpy(), 10000.0, 512.0, False, reference.numpy()),
                 tol(backend, dtype, "fwd"))
    assert_close("k", k, ref.rotary(to_np(k0), pos.numpy(), 10000.0, 512.0, True, reference.numpy()),
                 tol(backend, dtype, "fwd"))
    score_tol = {F32: 6e-7, BF16: 2e-2}[dtype]  # as tests/test_rotary.py's SCORE_TOL
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b == a:
            continue
        near = torch.arange(b - a)
        want = scores(ops.rotary(q0[:, a:b], near, **kw), ops.rotary(k0[:, a:b], near, xpos_downscale=True, **kw))
        assert_close(f"scores of document [{a}, {b})", scores(q[:, a:b], k[:, a:b]), to_np(want), score_tol)
    with pytest.raises(ValueError, match="xpos_reference"):
        ops.rotary(q0, pos, **kw)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8), dtype=st.sampled_from([torch.int32, torch.int64]),
       give_length=st.booleans())
def test_document_positions_restart_at_every_document(lengths, dtype, give_length):
    cu = cumulative(lengths, dtype)
    pos = ops.document_positions(cu, sum(lengths) if give_length else None)
    expected = [t for n in lengths for t in range(n)]
    assert pos.dtype == torch.int64 and pos.tolist() == expected


def test_document_positions_bad_input():
    cases = [
        (TypeError, lambda: ops.document_positions([0, 3, 5])),
        (TypeError, lambda: ops.document_positions(torch.tensor([0.0, 3.0, 5.0]))),
        (TypeError, lambda: ops.document_positions(torch.tensor([False, True]))),
        (ValueError, lambda: ops.document_positions(torch.tensor([[0, 3, 5]]))),
        (ValueError, lambda: ops.document_positions(torch.tensor([0]))),
    ]
    for error, call in cases:
        with pytest.raises(error, match="cu_seqlens"):
            call()
