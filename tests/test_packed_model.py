"""The model on packed rows (docs/design.md, Packed sequences): ``model(tokens, cu_seqlens=cu)``
and ``model(tokens, segment_ids=s)`` against each document run through the model on its own
(logits and every parameter gradient), ``model.pack``, and the refusals of bad input.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megalodon_kernels.model import Megalodon, MegalodonConfig, pack, segment_ids_to_cu_seqlens
from support import assert_close, tol

CHUNK = 8
VOCAB = 37


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def make_model(dtype=torch.float64, backend="torch", **kw):
    cfg = dict(num_layers=2, model_dim=24, z_dim=16, value_dim=20, num_heads=2, ffn_hidden_dim=40, cema_ndim=4,
               chunk_size=CHUNK, norm_num_groups=4, vocab_size=VOCAB, backend=backend)
    cfg.update(kw)
    torch.manual_seed(0)
    model = Megalodon(MegalodonConfig(**cfg)).to(dtype)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # move the zero-initialised norm weights, gamma/beta, priors off zero
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return model.eval()


def documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def run(model, fn, weights):
    """Logits from fn(), and every parameter's gradient of sum(logits * weights)."""
    model.zero_grad(set_to_none=True)
    logits = fn()
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def per_document(model, docs, weights):
    """Each non-empty document through ``model`` on its own: logits concatenated (1, T, V), the
    gradient of the summed loss summed over documents."""
    logits, grads, start = [], {}, 0
    for doc in docs:
        if doc.numel() == 0:
            continue
        stop = start + doc.numel()
        lg, gr = run(model, lambda: model(doc[None]), weights[:, start:stop])
        logits.append(lg)
        for n, g in gr.items():
            grads[n] = grads[n] + g if n in grads else g
        start = stop
    return torch.cat(logits, dim=1), grads


def check_packed(model, docs, backend="torch", reference=None):
    """model(packed row) == each document alone through ``reference`` (default: the same model)."""
    dtype = next(model.parameters()).dtype
    tokens, cu = pack(docs)
    g = torch.Generator().manual_seed(7)
    weights = torch.randn(1, tokens.shape[1], VOCAB, generator=g, dtype=torch.float64).to(dtype)
    logits, grads = run(model, lambda: model(tokens, cu_seqlens=cu), weights)
    ref_logits, ref_grads = per_document(model if reference is None else reference, docs, weights)
    assert logits.shape == (1, tokens.shape[1], VOCAB)
    if sum(doc.numel() > 0 for doc in docs) > 1:  # the comparison can fail: the row unpacked differs
        with torch.no_grad():
            assert (model(tokens) - ref_logits).abs().max() > 1e-3 * ref_logits.abs().max()
    assert_close("logits", logits, ref_logits, tol(backend, dtype, "fwd"))
    assert set(grads) == set(ref_grads)
    # packed vs separate in float64 is held to the forward budget for gradients too
    grad_tol = tol(backend, dtype, "fwd" if dtype == torch.float64 else "bwd")
    for n, g in ref_grads.items():
        assert_close(f"grad {n}", grads[n], g, grad_tol)


# lengths: 1, shorter / equal / longer than a chunk, several chunks, empty documents
CASES = {
    "mixed": [5, 0, 8, 17, 1, 23, 3],
    "one_document": [29],
    "empty_ends": [0, 9, 16, 0],
    "many_short": [1, 2, 1, 3, 1, 1, 2, 4, 1],
}


@pytest.mark.parametrize("lengths", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_packed_equals_each_document_alone(lengths, dtype):
    check_packed(make_model(dtype), documents(lengths))


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(0, 3 * CHUNK + 3), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
       st.integers(0, 2 ** 16))
def test_packed_equals_each_document_alone_random_lengths(lengths, seed):
    check_packed(make_model(), documents(lengths, seed))


def test_packed_with_prior_count_swiglu_and_checkpointing():
    """Learnable TimestepNorm priors (every document starts from them), the other FFN and
    layerwise checkpointing in training mode (no dropout) take the packed path too."""
    model = make_model(norm_prior_count=3, swiglu=True, rescale_nffn=True, scale_emb=True, layerwise_ckpt=True)
    model.train()
    check_packed(model, documents([6, 11, 0, 20]))


def test_packed_triton_interpreter():
    """One small case on the Triton backend (run in the interpreter; the documents alone run on
    the torch backend, same parameters, to keep the interpreter's share small)."""
    model = make_model(torch.float32, backend="triton", num_layers=1)
    reference = make_model(torch.float32, backend="torch", num_layers=1)
    check_packed(model, documents([3, 10, 0, 9]), backend="triton", reference=reference)


@torch.no_grad()
def test_segment_ids_equal_cu_seqlens():
    model = make_model()
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(3))
    # row 1 starts with the id row 0 ends with, and row 2 repeats an id after a change: both
    # still start new documents
    segment_ids = torch.tensor([[4, 4, 4, 4, 4, 7, 7, 7, 7, 7, 7, 7],
                                [7, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
                                [3, 3, 3, 5, 5, 3, 3, 3, 3, 3, 3, 3]])
    cu = segment_ids_to_cu_seqlens(segment_ids, tokens)
    assert cu.tolist() == [0, 5, 12, 14, 23, 24, 27, 29, 36]
    assert cu.dtype == torch.int64
    logits = model(tokens, segment_ids=segment_ids)
    assert logits.shape == (3, 12, VOCAB)
    packed = model(tokens.reshape(1, -1), cu_seqlens=cu).view(3, 12, VOCAB)
    assert torch.equal(logits, packed)
    flat = tokens.reshape(-1)
    alone = torch.cat([model(flat[a:b][None]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert_close("segment_ids logits", logits.reshape(1, -1, VOCAB), alone, tol("torch", torch.float64, "fwd"))
    # one id per row: the rows are independent sequences, as in the unpacked batch
    same = torch.zeros_like(tokens)
    assert_close("one document per row", model(tokens, segment_ids=same), model(tokens),
                 tol("torch", torch.float64, "fwd"))


def test_pack_round_trip():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([], dtype=torch.long), torch.tensor([8]), torch.tensor([9, 1])]
    tokens, cu = pack(docs)
    assert tokens.shape == (1, 6) and tokens.dtype == torch.long
    assert cu.tolist() == [0, 3, 3, 4, 6] and cu.dtype == torch.int64
    for d, doc in enumerate(docs):
        assert torch.equal(tokens[0, cu[d]:cu[d + 1]], doc)
    tokens32, cu32 = pack(tuple(d.to(torch.int32) for d in docs), dtype=torch.int32)
    assert tokens32.dtype == torch.int32 and cu32.dtype == torch.int32
    assert cu32.tolist() == cu.tolist() and torch.equal(tokens32.long(), tokens)


def test_pack_refuses_bad_input():
    one = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="documents must be a list"):
        pack(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="documents must be a list"):
        pack(iter([one]))
    with pytest.raises(ValueError, match="at least one document"):
        pack([])
    with pytest.raises(TypeError, match=r"documents\[1\] must be a 1-D integer torch.Tensor"):
        pack([one, [3, 4]])
    with pytest.raises(ValueError, match=r"documents\[0\] must be 1-D"):
        pack([one[None]])
    with pytest.raises(TypeError, match=r"documents\[1\] must hold integer token ids"):
        pack([one, torch.tensor([1.0])])
    with pytest.raises(TypeError, match=r"documents\[0\] must hold integer token ids"):
        pack([torch.tensor([True])])
    with pytest.raises(TypeError, match="share one dtype"):
        pack([one, one.to(torch.int32)])
    with pytest.raises(ValueError, match="one device"):
        pack([one, torch.tensor([3], device="meta")])
    with pytest.raises(ValueError, match="no tokens"):
        pack([one[:0], one[:0]])
    with pytest.raises(TypeError, match="dtype"):
        pack([one], dtype=torch.float32)


def test_bad_input_is_refused():
    model = make_model(torch.float32)
    tokens, cu = pack(documents([4, 6]))
    with pytest.raises(ValueError, match="cache"):
        model(tokens, model.init_cache(1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cache"):
        model(tokens, model.init_cache(1), segment_ids=torch.zeros_like(tokens))
    with pytest.raises(ValueError, match="either cu_seqlens or segment_ids"):
        model(tokens, cu_seqlens=cu, segment_ids=torch.zeros_like(tokens))
    with pytest.raises(ValueError, match="batch size 1"):
        model(tokens.reshape(2, 5), cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        model(tokens, cu_seqlens=cu.float())
    with pytest.raises(TypeError, match="cu_seqlens"):
        model(tokens, cu_seqlens=cu.bool())
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=cu[None])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=torch.tensor([0, 4, 9]))  # does not end at L
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=torch.tensor([0, 6, 4, 10]))  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=torch.tensor([1, 4, 10]))  # not starting at 0
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=cu.to("meta"))
    with pytest.raises(TypeError, match="segment_ids"):
        model(tokens, segment_ids=torch.zeros(1, 10))
    with pytest.raises(TypeError, match="segment_ids"):
        model(tokens, segment_ids=torch.zeros(1, 10, dtype=torch.bool))
    with pytest.raises(TypeError, match="segment_ids"):
        model(tokens, segment_ids=[0] * 10)
    with pytest.raises(ValueError, match="segment_ids must have the shape of tokens"):
        model(tokens, segment_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids=torch.zeros(1, 10, dtype=torch.long, device="meta"))
