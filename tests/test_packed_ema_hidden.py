"""ema_hidden with cu_seqlens (packed documents) on every backend (torch, Triton in the interpreter,
CUDA in the emulator): each document's last state from its own hx (or 0) equals a separate call on
that document, and so do dx, dp, dlog_q and dhx, with and without hx, with log_q needing a
gradient or not, for documents of length 1, shorter / longer than a kernel tile, empty documents
(h = hx, dhx = dh) and one document; long-memory coefficients (1 - |q| down to 1e-6), where a state
leaking across a boundary would show; one backend call per bucket of row lengths; bad input."""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.ema_hidden import torch_impl, triton_impl
from megalodon_kernels.reference import ema_hidden as hidden_ref
from support import assert_close, cema_coefficients, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
EMA_HIDDEN = importlib.import_module("megalodon_kernels.ops.ema_hidden")
OPS = torch.ops.megalodon_kernels
D, N = 3, 4

#: (backend, x dtype, coefficient dtype): what each backend takes
BACKEND_DTYPES = [("torch", F32, F32), ("torch", BF16, F32), ("torch", F64, F64), ("torch", F32, F64),
                  ("triton", F32, F32), ("triton", BF16, F32),
                  ("cuda", F32, F32), ("cuda", BF16, F32), ("cuda", F64, F64)]
#: empty documents first and in the middle, 1, short, a power of two, longer than a 32-step tile,
#: several tiles
LENGTHS = [0, 1, 5, 0, 8, 33, 3, 70]
#: 1 - |q| log-uniform in [1e-6, 1e-3]: the states barely decay over a document
LONG_MEMORY = dict(min_gap=1e-6, max_gap=1e-3)


def packed_inputs(lengths, xdtype, cdtype, with_hx=True, seed=0, memory=None):
    """x (1, D, L), p, log_q and hx (n, D, N) or None as leaves, an upstream gradient dh and cu_seqlens."""
    n, L = len(lengths), sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    c = cema_coefficients(gen, D, N, n if with_hx else None, cdtype, **(memory or {}))
    x = torch.randn(1, D, L, generator=gen, dtype=F64).to(xdtype)
    dh = torch.complex(torch.randn(n, D, N, generator=gen, dtype=F64), torch.randn(n, D, N, generator=gen, dtype=F64))
    leaves = [t if t is None else t.detach().requires_grad_() for t in (x, c.p, c.log_q, c.hx)]
    return (*leaves, dh.to(c.log_q.dtype), torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0))


def run(x, p, log_q, hx, dh, **kw):
    """h and the gradients of (x, p, log_q, hx) that are leaves needing one (None otherwise)."""
    h = ema_hidden(x, p, log_q, hx, **kw)
    leaves = [t for t in (x, p, log_q, hx) if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(h, leaves, dh))
    return (h, *(next(grads) if t is not None and t.requires_grad else None for t in (x, p, log_q, hx)))


def separate(x, p, log_q, hx, dh, cu, **kw):
    """h and the gradients from one call per document; an empty document's state is its hx."""
    n = cu.shape[0] - 1
    h = log_q.new_zeros(n, D, N) if hx is None else hx.detach().clone()
    dx, dp, dlq = torch.zeros(x.shape, dtype=F64), torch.zeros_like(p), torch.zeros_like(log_q)
    dhx = None if hx is None else dh.clone()  # d(h = hx) / dhx for the empty documents
    for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        xd = x.detach()[:, :, a:b].requires_grad_()
        hxd = None if hx is None else hx.detach()[d:d + 1].requires_grad_()
        lq = log_q if log_q.requires_grad else log_q.detach()
        hd, gx, gp, glq, ghx = run(xd, p, lq, hxd, dh[d:d + 1], **kw)
        h[d] = hd[0].detach()
        dx[:, :, a:b] = gx.double()
        dp += gp
        if glq is not None:
            dlq += glq
        if ghx is not None:
            dhx[d] = ghx[0]
    return h, dx.to(x.dtype), dp, (dlq if log_q.requires_grad else None), dhx


def terms(x, p, log_q, hx, dh, cu):
    """The magnitude of the terms (reference.terms) of h, dx, dp, dlog_q and dhx, document by
    document (an empty document's h is its hx, and dhx its dh)."""
    x, p, lq, dh = to_np(x), to_np(p), to_np(log_q), to_np(dh)
    hx = None if hx is None else to_np(hx)
    hm = np.zeros(dh.shape) if hx is None else np.abs(hx)
    dxm, dpm, dlqm = np.zeros(x.shape), np.zeros(p.shape), np.zeros(p.shape)
    dhxm = None if hx is None else np.abs(dh)
    for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        hxd = None if hx is None else hx[d:d + 1]
        hm[d] = np.abs(hidden_ref.ema_hidden_terms(x[:, :, a:b], p, lq, hxd)[0])
        gx, gp, glq, ghx = hidden_ref.ema_hidden_bwd_terms(dh[d:d + 1], x[:, :, a:b], p, lq, hxd)
        dxm[:, :, a:b], dpm, dlqm = gx, dpm + gp, dlqm + np.abs(glq)
        if ghx is not None:
            dhxm[d] = np.abs(ghx[0])
    return hm, dxm, dpm, dlqm, dhxm


def compare(packed, expected, backend, xdtype, cdtype, magnitudes):
    """The backend's tolerance against the magnitude of the terms: h and the coefficient
    gradients in the coefficient dtype, dx in x's dtype."""
    names = ("h", "dx", "dp", "dlog_q", "dhx")
    kinds = (("fwd", cdtype), ("bwd", xdtype), ("bwd", cdtype), ("bwd", cdtype), ("bwd", cdtype))
    for name, a, e, (kind, dtype), m in zip(names, packed, expected, kinds, magnitudes):
        assert (a is None) == (e is None), name
        if a is None:
            continue
        assert a.shape == e.shape and a.dtype == e.dtype and torch.isfinite(torch.view_as_real(a) if a.is_complex()
                                                                            else a.float()).all(), name
        bound = tol(backend, xdtype if name == "dx" else cdtype, kind)
        assert_close(name, a, to_np(e), bound, m)


@pytest.mark.parametrize("backend, xdtype, cdtype", BACKEND_DTYPES)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no_hx"])
def test_packed_equals_separate_documents(backend, xdtype, cdtype, with_hx):
    x, p, log_q, hx, dh, cu = packed_inputs(LENGTHS, xdtype, cdtype, with_hx)
    compare(run(x, p, log_q, hx, dh, cu_seqlens=cu, backend=backend),
            separate(x, p, log_q, hx, dh, cu, backend=backend), backend, xdtype, cdtype,
            terms(x, p, log_q, hx, dh, cu))


@pytest.mark.parametrize("backend, xdtype, cdtype", [("torch", F64, F64), ("triton", F32, F32), ("cuda", F32, F32),
                                                     ("cuda", F64, F64)])
def test_long_memory_and_no_log_q_gradient(backend, xdtype, cdtype):
    """1 - |q| <= 1e-3: every state carries almost all of its past (a leak would be O(1)); log_q
    without a gradient takes the inference path (no weighted sums)."""
    x, p, log_q, hx, dh, cu = packed_inputs(LENGTHS, xdtype, cdtype, seed=3, memory=LONG_MEMORY)
    log_q = log_q.detach()
    compare(run(x, p, log_q, hx, dh, cu_seqlens=cu, backend=backend),
            separate(x, p, log_q, hx, dh, cu, backend=backend), backend, xdtype, cdtype,
            terms(x, p, log_q, hx, dh, cu))


@given(lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 16, 31, 33, 64, 100, 257]), min_size=1, max_size=7),
       with_hx=st.booleans(), long_memory=st.booleans(), seed=st.integers(0, 2**16))
def test_random_documents_torch_float64(lengths, with_hx, long_memory, seed):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    x, p, log_q, hx, dh, cu = packed_inputs(lengths, F64, F64, with_hx, seed, LONG_MEMORY if long_memory else None)
    compare(run(x, p, log_q, hx, dh, cu_seqlens=cu, backend="torch"),
            separate(x, p, log_q, hx, dh, cu, backend="torch"), "torch", F64, F64,
            terms(x, p, log_q, hx, dh, cu))


@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 4, 9, 33, 40]), min_size=1, max_size=4), with_hx=st.booleans(),
       seed=st.integers(0, 2**16))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_random_documents_kernels(backend, lengths, with_hx, seed):
    if sum(lengths) == 0:
        lengths = lengths + [2]
    x, p, log_q, hx, dh, cu = packed_inputs(lengths, F32, F32, with_hx, seed, LONG_MEMORY)
    compare(run(x, p, log_q, hx, dh, cu_seqlens=cu, backend=backend),
            separate(x, p, log_q, hx, dh, cu, backend=backend), backend, F32, F32,
            terms(x, p, log_q, hx, dh, cu))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_nothing_crosses_a_document_boundary(backend):
    """With long memory, document 1's state is the same bit for bit whatever document 0 holds, and
    its gradient reaches no step of document 0; the unpacked row's last state (document 0
    leaking into it) is far from it, so the check would see a leak."""
    x, p, log_q, _, dh, cu = packed_inputs([40, 25], F32, F32, with_hx=False, memory=LONG_MEMORY)
    bumped = x.detach().clone()
    bumped[:, :, :40] = 3.0 * bumped[:, :, :40] + 1.0
    h = ema_hidden(x, p, log_q, cu_seqlens=cu, backend=backend)
    h_bumped = ema_hidden(bumped, p, log_q, cu_seqlens=cu, backend=backend)
    assert torch.equal(h[1], h_bumped[1]) and not torch.equal(h[0], h_bumped[0])
    (dx,) = torch.autograd.grad(h[1], (x,), dh[1])
    assert torch.count_nonzero(dx[..., :40]) == 0 and torch.count_nonzero(dx[..., 40:]) > 0
    unpacked = ema_hidden(x, p, log_q, backend=backend)[0]
    assert (unpacked - h[1]).abs().max() > 0.5 * h[1].abs().max()


@pytest.mark.parametrize("backend, dtype", [("torch", F64), ("triton", F32), ("cuda", F32)])
def test_one_document_is_the_unpacked_call(backend, dtype):
    x, p, log_q, hx, dh, _ = packed_inputs([37], dtype, dtype)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    for a, e in zip(run(x, p, log_q, hx, dh, cu_seqlens=cu, backend=backend), run(x, p, log_q, hx, dh, backend=backend)):
        # q**len from another (exact) formula: h and its gradients, so the gradient budget
        assert_close("packed", a, to_np(e), tol(backend, dtype, "bwd"))


def test_empty_documents_keep_their_state():
    x, p, log_q, hx, dh, cu = packed_inputs([0, 4, 0], F64, F64)
    h, _, _, _, dhx = run(x, p, log_q, hx, dh, cu_seqlens=cu, backend="torch")
    assert torch.equal(h[0], hx[0]) and torch.equal(h[2], hx[2])
    assert torch.equal(dhx[0], dh[0]) and torch.equal(dhx[2], dh[2])
    h = ema_hidden(x, p, log_q, cu_seqlens=cu, backend="torch")
    assert torch.count_nonzero(h[0]) == 0 and torch.count_nonzero(h[1]) > 0


def test_log_q_gradient_without_the_weighted_sums():
    """The op called without weighted sums (W a placeholder) still gives dlog_q: the packed
    backward recomputes them."""
    x, p, log_q, hx, dh, cu = packed_inputs([3, 0, 9], F64, F64)
    h = OPS.ema_hidden(x, p, log_q, hx, False, "torch", cu)[0]
    dlq = torch.autograd.grad(h, (log_q,), dh)[0]
    assert_close("dlog_q", dlq, to_np(separate(x, p, log_q, hx, dh, cu, backend="torch")[3]), tol("torch", F64, "bwd"))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_one_backend_call_per_bucket(backend, monkeypatch):
    """45 documents of lengths 0..5 fall into the row lengths 1, 2, 4 and 8: four forward and
    four backward calls of the backend, each on a batch of rows, not one per document."""
    module = {"torch": torch_impl, "triton": triton_impl}.get(backend) or EMA_HIDDEN.BACKENDS._load("cuda")
    calls = {"forward": [], "backward": []}
    for name, seen in calls.items():
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _inner=inner, _seen=seen, **kw: _seen.append(a[0].shape[0])
                            or _inner(*a, **kw))
    x, p, log_q, hx, dh, cu = packed_inputs([1, 2, 3, 4, 5, 0, 3, 1, 2] * 5, F32, F32)
    run(x, p, log_q, hx, dh, cu_seqlens=cu, backend=backend)
    assert calls["forward"] == [10, 10, 15, 5] and calls["backward"] == [10, 10, 15, 5]


def test_bad_input():
    x, p, log_q, hx, _, cu = packed_inputs([3, 4], F32, F32)
    xb = x.detach().expand(2, -1, -1)
    cases = [
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.float())),
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.bool())),
        (ValueError, "cu_seqlens", dict(cu_seqlens=cu[None])),
        (ValueError, "cu_seqlens must start at 0", dict(cu_seqlens=torch.tensor([1, 3, 7]))),
        (ValueError, "cu_seqlens must be non-decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 7]))),
        (ValueError, "cu_seqlens must end at", dict(cu_seqlens=torch.tensor([0, 3, 6]))),
        (ValueError, "cu_seqlens is on meta", dict(cu_seqlens=cu.to("meta"))),
        (ValueError, "x must hold one packed row", dict(x=xb, cu_seqlens=cu)),
        (ValueError, "hx must hold one state per document", dict(hx=hx[:1], cu_seqlens=cu)),
        (ValueError, "hx must hold one state per document", dict(hx=torch.cat([hx, hx]), cu_seqlens=cu)),
        (ValueError, "hx must have rank 3", dict(hx=hx[0], cu_seqlens=cu)),
    ]
    for error, words, kw in cases:
        with pytest.raises(error, match=words):
            ema_hidden(**{"x": x, "p": p, "log_q": log_q, **kw})
