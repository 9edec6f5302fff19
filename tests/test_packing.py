"""The packed-sequence planner (ops/_packing.py): buckets, gather/scatter, validation, caching."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels.ops import _packing as packing
from megalodon_kernels.ops import document_positions


def cu_of(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (1000, 1024)])
def test_next_pow2(n, want):
    assert packing.next_pow2(n) == want


lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda ls: sum(ls) > 0)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, align=st.sampled_from(["left", "right"]))
def test_every_token_lands_in_exactly_one_row_step(lengths, align):
    L = sum(lengths)
    plan = packing.plan(cu_of(lengths), L, align=align)
    assert plan.n == len(lengths) and plan.lengths.tolist() == list(lengths)
    seen = torch.zeros(L, dtype=torch.int64)
    docs = []
    for b in plan.buckets:
        assert b.size == min(packing.next_pow2(max(b.lengths.tolist())), L)
        assert all(b.size == min(packing.next_pow2(n), L) for n in b.lengths.tolist())
        assert b.valid_src.shape[0] == int(b.valid.sum())
        seen.index_add_(0, b.valid_src, torch.ones(b.valid_src.shape[0], dtype=torch.int64))
        docs += b.docs.tolist()
        # the document occupies the first (left) or last (right) `length` steps of its row
        steps = torch.arange(b.size)
        for row, n in enumerate(b.lengths.tolist()):
            want = steps < n if align == "left" else steps >= b.size - n
            assert torch.equal(b.valid[row], want)
    assert torch.equal(seen, torch.ones(L, dtype=torch.int64))
    assert sorted(docs) == [d for d, n in enumerate(lengths) if n]  # empty documents are in no bucket
    assert len(plan.buckets) <= L.bit_length() + 1


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, dim=st.sampled_from([1, 2]))
def test_rows_then_put_is_the_identity_and_pads_with_zeros(lengths, dim):
    L = sum(lengths)
    plan = packing.plan(cu_of(lengths), L)
    shape = (1, L, 3) if dim == 1 else (1, 3, L)
    x = torch.randn(shape, dtype=torch.float64)
    out = torch.full_like(x, float("nan"))
    for b in plan.buckets:
        rows = b.rows(x, dim)
        assert rows.is_contiguous() and rows.shape[0] == b.docs.shape[0] and rows.shape[dim] == b.size
        invalid = ~b.valid
        padded = rows.movedim(dim, 1)[invalid]
        assert torch.all(padded == 0)
        b.put(rows, out, dim)
    assert torch.equal(out, x)


def test_plan_is_cached_per_tensor_and_version():
    cu = cu_of([3, 5])
    p1 = packing.plan(cu, 8)
    assert packing.plan(cu, 8) is p1
    assert packing.plan(cu.clone(), 8) is not p1  # another tensor with the same values
    assert packing.plan(cu, 8, align="right") is not p1
    cu.add_(0)  # an in-place write bumps the version: the plan is made again
    assert packing.plan(cu, 8) is not p1


@pytest.mark.parametrize("values, match", [
    ([1, 3, 8], "start at 0"),
    ([0, 5, 3, 8], "non-decreasing"),
    ([0, 3, 7], "end at the packed length"),
])
def test_plan_rejects_bad_values(values, match):
    with pytest.raises(ValueError, match=f"cu_seqlens.*{match}|{match}"):
        packing.plan(torch.tensor(values), 8)


def test_check_cu_seqlens_names_the_argument():
    ok = dict(batch=1, length=8, device=torch.device("cpu"))
    assert packing.check_cu_seqlens(cu_of([3, 5]), **ok) == 2
    with pytest.raises(TypeError, match="cu_seqlens"):
        packing.check_cu_seqlens([0, 8], **ok)
    with pytest.raises(TypeError, match="cu_seqlens"):
        packing.check_cu_seqlens(torch.tensor([0.0, 8.0]), **ok)
    with pytest.raises(TypeError, match="cu_seqlens"):
        packing.check_cu_seqlens(torch.tensor([False, True]), **ok)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packing.check_cu_seqlens(torch.tensor([[0, 8]]), **ok)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packing.check_cu_seqlens(torch.tensor([0]), **ok)
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        packing.check_cu_seqlens(torch.tensor([0, 8], device="meta"), **ok)
    with pytest.raises(ValueError, match="x must hold one packed row"):
        packing.check_cu_seqlens(cu_of([3, 5]), batch=2, length=8, device=torch.device("cpu"))


def test_document_positions():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    want = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    assert torch.equal(document_positions(cu), want)
    assert torch.equal(document_positions(cu, 9), want)
    with pytest.raises(TypeError, match="cu_seqlens"):
        document_positions(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_positions(torch.tensor([3]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        document_positions(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        document_positions(torch.tensor([0, 3, 2]))
