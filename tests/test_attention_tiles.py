"""The torch backend's kept tiles (ops/attention/torch_impl.py, module doc): an eager forward that
autograd records returns its tiles' P (softmax) or DropKey masks as the op's fourth output, the
node saves it, and the backward reads it instead of rebuilding the tiles. The gradients must be
bit for bit those of a backward that rebuilds them, whatever thread runs the backward and in
whatever order several nodes are differentiated."""
from __future__ import annotations

import importlib
import threading

import pytest
import torch

from megalodon_kernels import ops

ATTENTION = importlib.import_module("megalodon_kernels.ops.attention")
torch_impl = importlib.import_module("megalodon_kernels.ops.attention.torch_impl")

# (chunk_size, block_causal, dropkey_p, attn_fn, kept tiles' dtype): the general and the
# chunk-batched path, P kept (softmax) and masks kept (Laplace with DropKey)
CASES = [(None, False, 0.0, "softmax", torch.float32), (None, False, 0.3, "laplace", torch.bool),
         (8, True, 0.3, "softmax", torch.float32), (8, False, 0.3, "laplace", torch.bool)]


def _inputs(seed=0, L=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, L, 2, 8, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _grads(q, k, v, keep_tiles, chunk_size, block_causal, dropkey_p, attn_fn, do, scale=0.5, seed=11):
    out = ATTENTION.attention_op(q, k, v, scale, True, chunk_size, block_causal, dropkey_p, seed, attn_fn, "torch",
                                 None, keep_tiles)
    return out, torch.autograd.grad(out[0], (q, k, v), do)


@pytest.mark.parametrize("chunk_size,block_causal,dropkey_p,attn_fn,kept", CASES)
def test_kept_tiles_give_the_rebuilt_gradients(chunk_size, block_causal, dropkey_p, attn_fn, kept):
    q, k, v = _inputs()
    do = torch.randn(2, 24, 2, 8)
    (o, _, _, tiles), grads = _grads(q, k, v, True, chunk_size, block_causal, dropkey_p, attn_fn, do)
    assert tiles.dtype == kept and tiles.numel() > 0
    (o_ref, _, _, none), ref = _grads(q, k, v, False, chunk_size, block_causal, dropkey_p, attn_fn, do)
    assert none.numel() == 0
    assert torch.equal(o, o_ref)
    for g, r in zip(grads, ref):
        assert torch.equal(g, r)


def test_the_public_call_keeps_tiles_and_the_backward_reads_them(monkeypatch):
    """attention() asks for tiles when autograd records it; its backward then builds no tile
    (the DropKey hash and softmax are not rerun)."""
    q, k, v = _inputs()
    o = ops.attention(q, k, v, dropkey_p=0.3, seed=5, backend="torch")
    built = []
    real = torch_impl._tile_mask
    monkeypatch.setattr(torch_impl, "_tile_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    o.sum().backward()
    assert built == []
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.setattr(torch_impl, "_tile_mask", real)
    _, ref = _grads(q, k, v, False, None, False, 0.3, "softmax", torch.ones(2, 24, 2, 8), scale=1.0, seed=5)
    for g, r in zip(grads, ref):
        assert torch.equal(g, r)


def test_tiles_ride_on_the_node_not_the_thread():
    """Two forwards, differentiated in reverse order, the first on another thread: each backward
    reads its own node's tiles (a per-thread hand-over would lose or mix them)."""
    a, b = _inputs(1), _inputs(2)
    oa = ops.attention(*a, chunk_size=8, dropkey_p=0.3, seed=1, backend="torch")
    ob = ops.attention(*b, chunk_size=8, dropkey_p=0.3, seed=2, backend="torch")
    ob.sum().backward()
    worker = threading.Thread(target=lambda: oa.sum().backward())
    worker.start()
    worker.join()
    for inputs, seed in ((a, 1), (b, 2)):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        ref = torch.autograd.grad(ATTENTION.attention_op(q, k, v, 1.0, True, 8, False, 0.3, seed, "softmax", "torch",
                                                         None, False)[0].sum(), (q, k, v))
        for t, r in zip(inputs, ref):
            assert torch.equal(t.grad, r)


def test_a_retained_graph_reads_the_tiles_twice():
    q, k, v = _inputs()
    o = ops.attention(q, k, v, dropkey_p=0.3, seed=3, backend="torch")
    first = torch.autograd.grad(o.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(o.sum(), (q, k, v))
    for f, s in zip(first, second):
        assert torch.equal(f, s)


def test_tiles_of_another_tiling_are_not_used():
    """The backward uses tiles only if they can be its own: a tensor of another size (another
    tiling) is ignored and the tiles are rebuilt."""
    q, k, v = (t.detach() for t in _inputs())
    o, lse = torch_impl.forward(q, k, v, scale=1.0, causal=True, chunk_size=None, block_causal=False,
                                dropkey_p=0.0, seed=0, attn_fn="softmax", **torch_impl.DEFAULT_CONFIG)
    do = torch.randn_like(o)
    kw = dict(scale=1.0, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax",
              **torch_impl.DEFAULT_CONFIG)
    ref = torch_impl.backward(do, q, k, v, o, lse, **kw)
    wrong = torch.full((7,), float("nan"))
    for g, r in zip(torch_impl.backward(do, q, k, v, o, lse, tiles=wrong, **kw), ref):
        assert torch.equal(g, r)


def test_a_traced_call_cannot_ask_for_tiles():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 4, 1, 8)
        with pytest.raises(ValueError, match="keep_tiles=True is for eager calls"):
            ATTENTION.attention_op(q, q, q, 1.0, True, None, False, 0.0, 0, "softmax", "torch", None, True)
