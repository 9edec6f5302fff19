"""rotary on a packed row: ops.rotary(x, ops.document_positions(cu_seqlens)) equals rotary on each
document with positions from 0 (RoPE and xPos, forward and dx, every backend), and
document_positions' values and bad input."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels import ops
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
    kw = dict(xpos_scale_base=xpos, xpos_downscale=downscale, backend=backend)
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
