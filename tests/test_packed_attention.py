"""attention with cu_seqlens (packed documents) on every backend (torch, Triton in the interpreter,
CUDA in the emulator): a packed call equals separate per-document calls (o, dq, dk, dv) for
softmax and Laplace, without and with chunks (documents shorter than, equal to and longer than a
chunk, several chunks, empty documents, one document) and block_causal; nothing crosses a
document boundary; DropKey on a packed row equals the padded batch call with the same seed (the
rule's b is the document index, on the Triton kernels and the CUDA flash and matmul +
dropkey_softmax paths alike); one backend call per packed call (Triton) or per bucket of row lengths
(torch, CUDA); bad input."""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels import ops
from megalodon_kernels.ops.attention import attention
from megalodon_kernels.ops.attention import torch_impl, triton_impl
from megalodon_kernels.reference import attention as attention_ref
from support import assert_close, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
ATTENTION = importlib.import_module("megalodon_kernels.ops.attention")

BACKEND_DTYPES = [("torch", F32), ("torch", BF16), ("torch", F64), ("triton", F32), ("triton", BF16),
                  ("cuda", F32), ("cuda", BF16), ("cuda", F64)]
#: (chunk_size, block_causal); the lengths below are shorter than, equal to and longer than C = 8
MASKS = [(None, False), (8, False), (8, True)]
#: an empty document first and in the middle, 1, < C, == C, several chunks (23 = 8 + 8 + 7), < C
LENGTHS = [0, 1, 5, 0, 8, 23, 3]
H, DH, DV = 2, 8, 4


def packed_inputs(lengths, dtype, seed=0):
    """q, k, v (1, L, H, d) leaves, an upstream gradient do and cu_seqlens for documents of these lengths."""
    L = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    draw = lambda d: torch.randn(1, L, H, d, generator=gen, dtype=F64).to(dtype)  # noqa: E731
    q, k, v = (draw(d).requires_grad_() for d in (DH, DH, DV))
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return q, k, v, draw(DV), cu


def spans(cu):
    return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]


def run(q, k, v, do, **kw):
    o = attention(q, k, v, **kw)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def separate(q, k, v, do, cu, **kw):
    """o, dq, dk, dv from one call per document (batch 1, positions from 0), concatenated."""
    parts = []
    for a, b in spans(cu):
        leaves = [t.detach()[:, a:b].requires_grad_() for t in (q, k, v)]
        parts.append(run(*leaves, do[:, a:b], **kw))
    return [torch.cat(p, dim=1) for p in zip(*parts)]


def padded(t, cu):
    """(n, max length, ...) with document d in row d, zeros after it."""
    docs = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    out = t.new_zeros(len(docs), max(b - a for a, b in docs), *t.shape[2:])
    for d, (a, b) in enumerate(docs):
        out[d, : b - a] = t[0, a:b]
    return out


def unpadded(t, cu):
    docs = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat([t[d, : b - a] for d, (a, b) in enumerate(docs)])[None]


def terms(q, k, v, do, cu, scale=1.0, chunk_size=None, block_causal=False, attn_fn="softmax", **_):
    """The magnitude of the terms (reference.attention's *_terms) of o, dq, dk, dv, document by
    document (no DropKey)."""
    q, k, v, do = (to_np(t) for t in (q, k, v, do))
    out = [np.zeros(t.shape) for t in (do, q, k, v)]
    kw = dict(scale=scale, chunk_size=chunk_size, block_causal=block_causal, attn_fn=attn_fn)
    for a, b in spans(cu):
        doc = [t[:, a:b] for t in (q, k, v)]
        out[0][:, a:b] = attention_ref.attention_terms(*doc, **kw)
        for m, part in zip(out[1:], attention_ref.attention_bwd_terms(do[:, a:b], *doc, **kw)):
            m[:, a:b] = part
    return out


def compare(actual, expected, backend, dtype, magnitudes=(None,) * 4):
    """Packed vs reference: the backend's tolerance (the rows are tiled differently, so the
    accumulation order may differ), against the magnitude of the terms where given."""
    for name, a, e, kind, m in zip(("o", "dq", "dk", "dv"), actual, expected, ("fwd", "bwd", "bwd", "bwd"),
                                   magnitudes):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.isfinite(a.float()).all(), name
        assert_close(name, a, to_np(e), tol(backend, dtype, kind), m)


def fns(backend, dtype):
    """The CUDA backend runs Laplace on its flash kernel only, which has no float64."""
    return ["softmax"] if backend == "cuda" and dtype == F64 else ["softmax", "laplace"]


CASES = [(b, d, fn, C, bc) for b, d in BACKEND_DTYPES for fn in fns(b, d) for C, bc in MASKS
         # the interpreter is slow: Triton takes every mask in float32 and the block-causal one in bf16
         if not (b == "triton" and d == BF16 and not bc)]


@pytest.mark.parametrize("backend, dtype, attn_fn, chunk_size, block_causal", CASES)
def test_packed_equals_separate_documents(backend, dtype, attn_fn, chunk_size, block_causal):
    q, k, v, do, cu = packed_inputs(LENGTHS, dtype)
    kw = dict(scale=DH ** -0.5, chunk_size=chunk_size, block_causal=block_causal, attn_fn=attn_fn, backend=backend)
    compare(run(q, k, v, do, cu_seqlens=cu, **kw), separate(q, k, v, do, cu, **kw), backend, dtype,
            terms(q, k, v, do, cu, **kw))


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 30]), min_size=1, max_size=6),
       mask=st.sampled_from([(None, False), (3, False), (4, False), (4, True), (8, True)]),
       attn_fn=st.sampled_from(["softmax", "laplace"]), seed=st.integers(0, 2**16))
def test_random_documents_torch_float64(lengths, mask, attn_fn, seed):
    q, k, v, do, cu = packed_inputs(lengths, F64, seed)
    kw = dict(chunk_size=mask[0], block_causal=mask[1], attn_fn=attn_fn, backend="torch")
    compare(run(q, k, v, do, cu_seqlens=cu, **kw), separate(q, k, v, do, cu, **kw), "torch", F64,
            terms(q, k, v, do, cu, **kw))


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 4, 8, 9, 17]), min_size=1, max_size=4),
       mask=st.sampled_from([(None, False), (4, False), (4, True)]), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_random_documents_kernels(backend, lengths, mask, seed):
    q, k, v, do, cu = packed_inputs(lengths, F32, seed)
    kw = dict(chunk_size=mask[0], block_causal=mask[1], backend=backend)
    compare(run(q, k, v, do, cu_seqlens=cu, **kw), separate(q, k, v, do, cu, **kw), backend, F32,
            terms(q, k, v, do, cu, **kw))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("chunk_size, block_causal", [(None, False), (8, True)])
def test_nothing_crosses_a_document_boundary(backend, chunk_size, block_causal):
    """Changing document 0 changes nothing in document 1 (outputs bit for bit, and the gradient
    of document 1's outputs reaches no input of document 0), while the same change on an
    unpacked row does reach those positions: the check would see a leak."""
    q, k, v, do, cu = packed_inputs([5, 12], F32)
    kw = dict(chunk_size=chunk_size, block_causal=block_causal, backend=backend)
    bumped = [t.detach().clone() for t in (q, k, v)]
    for t in bumped:
        t[:, :5] = 3.0 * t[:, :5] + 1.0
    o = attention(q, k, v, cu_seqlens=cu, **kw)
    o_bumped = attention(*bumped, cu_seqlens=cu, **kw)
    assert torch.equal(o[:, 5:], o_bumped[:, 5:])
    assert not torch.equal(o[:, :5], o_bumped[:, :5])
    grads = torch.autograd.grad(o[:, 5:], (q, k, v), do[:, 5:])
    for g in grads:
        assert torch.count_nonzero(g[:, :5]) == 0
        assert torch.count_nonzero(g[:, 5:]) > 0
    unpacked = attention(q, k, v, **kw)[:, 5:]
    assert not torch.equal(unpacked, attention(*bumped, **kw)[:, 5:])


DROPKEY_CASES = [("torch", F64), ("torch", BF16), ("triton", F32), ("cuda", F32), ("cuda", BF16), ("cuda", F64)]


@pytest.mark.parametrize("backend, dtype", DROPKEY_CASES)
@pytest.mark.parametrize("chunk_size, block_causal", [(None, False), (8, True)])
def test_dropkey_packed_equals_padded_batch(backend, dtype, chunk_size, block_causal):
    """DropKey on document d of a packed row is the mask batch row d of the padded batch call
    gets (same seed); the dropped logits matter (p = 0.5 changes the outputs)."""
    q, k, v, do, cu = packed_inputs([5, 0, 9, 17, 4], dtype)
    kw = dict(chunk_size=chunk_size, block_causal=block_causal, backend=backend, seed=2024)
    packed = run(q, k, v, do, cu_seqlens=cu, dropkey_p=0.5, **kw)
    leaves = [padded(t.detach(), cu).requires_grad_() for t in (q, k, v)]
    batch = [unpadded(t, cu) for t in run(*leaves, padded(do, cu), dropkey_p=0.5, **kw)]
    compare(packed, batch, backend, dtype)
    no_drop = attention(q, k, v, cu_seqlens=cu, **kw)
    assert (packed[0] - no_drop).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_dropkey_rows_use_their_document_index(backend):
    """Two documents of equal length share a bucket; swapping them in the row swaps their masks
    with them, so each document's output depends on its index, not on its row in the bucket."""
    q, k, v, do, cu = packed_inputs([6, 6], F32)
    kw = dict(dropkey_p=0.5, seed=99, backend=backend)
    o = attention(q, k, v, cu_seqlens=cu, **kw)
    swap = [torch.cat((t[:, 6:], t[:, :6]), dim=1).detach() for t in (q, k, v)]
    o_swap = attention(*swap, cu_seqlens=cu, **kw)
    second_alone = attention(*(t[:, 6:].detach() for t in (q, k, v)), **kw)
    assert_close("o", o_swap[:, :6], to_np(second_alone), tol(backend, F32, "fwd"))  # document 0: b = 0
    assert (o_swap[:, :6] - o[:, 6:]).abs().max() > 0.1  # ... which is not the mask b = 1 gave it


@pytest.mark.parametrize("backend, dtype", [("torch", F64), ("triton", F32), ("cuda", F32)])
def test_one_document_is_the_unpacked_call(backend, dtype):
    q, k, v, do, _ = packed_inputs([21], dtype)
    cu = torch.tensor([0, 21], dtype=torch.int32)
    kw = dict(chunk_size=8, block_causal=True, dropkey_p=0.25, seed=5, backend=backend)
    for a, e in zip(run(q, k, v, do, cu_seqlens=cu, **kw), run(q, k, v, do, **kw)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_launches_scale_with_buckets_not_documents(backend, monkeypatch):
    """45 documents of lengths 0..5: the Triton backend reads the document bounds itself and runs
    the packed row in one call; torch and CUDA run document rows of lengths 1, 2, 4 and 8: four
    forward and four backward calls. Never one per document."""
    module = {"torch": torch_impl, "triton": triton_impl}.get(backend) or ATTENTION.BACKENDS._load("cuda")
    calls = {"forward": [], "backward": []}
    for name, seen in calls.items():
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _inner=inner, _seen=seen, **kw: _seen.append(a[1].shape)
                            or _inner(*a, **kw))
    lengths = [1, 2, 3, 4, 5, 0, 3, 1, 2] * 5
    q, k, v, do, cu = packed_inputs(lengths, F32)
    run(q, k, v, do, cu_seqlens=cu, chunk_size=2, backend=backend)
    want = [(1, sum(lengths))] if backend == "triton" else [(10, 1), (10, 2), (15, 4), (5, 8)]
    assert [s[:2] for s in calls["forward"]] == want
    assert [s[:2] for s in calls["backward"]] == want


def test_empty_row():
    q, k, v, do, cu = packed_inputs([0, 0], F32)
    o, dq, dk, dv = run(q, k, v, do, cu_seqlens=cu, backend="torch")
    assert o.shape == (1, 0, H, DV) and dq.shape == q.shape and dv.shape == v.shape


def test_lse_residual_is_scattered_per_document():
    """The saved lse (1, H, L) is each document's own log-sum-exp (the backward reads it)."""
    q, k, v, _, cu = packed_inputs([3, 6], F64)
    _, lse, _, _ = torch.ops.megalodon_kernels.attention(q, k, v, 1.0, True, None, False, 0.0, 0, "softmax", "torch", cu)
    for a, b in spans(cu):
        _, lse_doc, _, _ = torch.ops.megalodon_kernels.attention(q[:, a:b], k[:, a:b], v[:, a:b], 1.0, True, None, False,
                                                              0.0, 0, "softmax", "torch")
        assert_close("lse", lse[:, :, a:b], to_np(lse_doc), tol("torch", F64, "fwd"))


def bad(q, k, v, **kw):
    return lambda: attention(q, k, v, **kw)


def test_bad_input():
    q, k, v, _, cu = packed_inputs([3, 4], F32)
    qb = q.detach().expand(2, -1, -1, -1)
    cases = [
        (TypeError, "cu_seqlens", bad(q, k, v, cu_seqlens=cu.float())),
        (TypeError, "cu_seqlens", bad(q, k, v, cu_seqlens=cu.bool())),
        (TypeError, "cu_seqlens", bad(q, k, v, cu_seqlens=[0, 3, 7])),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=cu[None])),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=cu[:1])),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=torch.tensor([1, 3, 7]))),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=torch.tensor([0, 5, 3, 7]))),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=torch.tensor([0, 3, 6]))),
        (ValueError, "cu_seqlens", bad(q, k, v, cu_seqlens=cu.to("meta"))),
        (ValueError, "batch size 1", bad(qb, qb, v.detach().expand(2, -1, -1, -1), cu_seqlens=cu)),
        (ValueError, "k has S = 6", bad(q, k[:, :6], v[:, :6], cu_seqlens=cu)),
        (ValueError, "causal-only", bad(q, k, v, cu_seqlens=cu, causal=False)),
    ]
    for error, words, call in cases:
        with pytest.raises(error, match=words):
            call()



@pytest.mark.parametrize("backend, dtype, launcher", [("cuda", F32, "flash"), ("cuda", F64, "matmul")])
def test_cuda_paths_receive_the_document_indices(backend, dtype, launcher, monkeypatch):
    """The packed DropKey reaches the CUDA kernels as their batch index: the flash kernels for
    float32 (emulator) and the matmul + dropkey_softmax path for float64."""
    from megalodon_kernels.ops.attention import cuda_impl

    seen = []
    for name in (f"{launcher}_fwd", f"{launcher}_bwd"):
        inner = getattr(cuda_impl, name)
        monkeypatch.setattr(cuda_impl, name, lambda *a, _inner=inner, _name=name, **kw: seen.append(
            (_name, kw["batch_index"].tolist())) or _inner(*a, **kw))
    q, k, v, do, cu = packed_inputs([3, 9, 2, 12], dtype)
    run(q, k, v, do, cu_seqlens=cu, dropkey_p=0.3, seed=1, backend=backend)
    assert seen == [(f"{launcher}_fwd", [2]), (f"{launcher}_fwd", [0]), (f"{launcher}_fwd", [1, 3]),
                    (f"{launcher}_bwd", [2]), (f"{launcher}_bwd", [0]), (f"{launcher}_bwd", [1, 3])]
