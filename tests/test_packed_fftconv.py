"""fftconv with cu_seqlens (packed documents) on every backend (torch: direct and FFT rows; Triton
in the interpreter: direct and FFT rows; CUDA in the emulator): a packed call equals separate
per-document calls (y, dx, and dk = the sum of the documents' dk, each zero past its length) for
documents of length 1, shorter / equal / longer than the direct-path limit and than an FFT tile,
empty documents, one document; nothing crosses a document boundary; one backend call per bucket
of row lengths; bad input."""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megalodon_kernels.ops.fftconv import fftconv
from megalodon_kernels.ops.fftconv import torch_impl, triton_impl
from megalodon_kernels.reference import fftconv as conv_ref
from support import assert_close, backend_module, knobs, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
FFTCONV = importlib.import_module("megalodon_kernels.ops.fftconv")
D = 3

#: (backend, x dtype, k dtype, path); CUDA has one (FFT) path, the others a direct one for short rows
CASES = [("torch", F32, F32, "direct"), ("torch", F32, F32, "fft"), ("torch", BF16, F32, "fft"),
         ("torch", F64, F64, "direct"), ("torch", F64, F64, "fft"), ("torch", F64, F32, "fft"),
         ("triton", F32, F32, "direct"), ("triton", F32, F32, "fft"), ("triton", BF16, F32, "fft"),
         ("triton", BF16, BF16, "direct"),
         ("cuda", F32, F32, "fft"), ("cuda", BF16, F32, "fft"), ("cuda", F64, F64, "fft"),
         ("cpu", F32, F32, "fft"), ("cpu", BF16, F32, "fft"), ("cpu", F64, F64, "fft")]
PATHS = {"direct": {"torch": dict(direct_max_len=1 << 30), "triton": dict(direct_max_len=64)},
         "fft": {"torch": dict(direct_max_len=0), "triton": dict(direct_max_len=0)}}
#: empty documents first and in the middle, 1, short, exactly a power of two (a full row), 16/17
#: around the torch direct limit, 40 (row 64, Triton's direct limit), 70 (a row of 128)
LENGTHS = [0, 1, 5, 0, 8, 17, 16, 40, 3, 70]


def packed_inputs(lengths, xdtype, kdtype, seed=0):
    """x (1, D, L) and k (D, L) leaves, an upstream gradient dy and cu_seqlens."""
    L = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, D, L, generator=gen, dtype=F64).to(xdtype).requires_grad_()
    k = (torch.randn(D, L, generator=gen, dtype=F64) / (1 + torch.arange(L)) ** 0.5).to(kdtype).requires_grad_()
    dy = torch.randn(1, D, L, generator=gen, dtype=F64).to(xdtype)
    return x, k, dy, torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def spans(cu):
    return [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]


def run(x, k, dy, **kw):
    y = fftconv(x, k, **kw)
    return (y, *torch.autograd.grad(y, (x, k), dy))


def separate(x, k, dy, cu, **kw):
    """y, dx, dk from one call per document on its own steps and the first len entries of k."""
    ys, dxs, dk = [], [], torch.zeros(k.shape, dtype=F64)
    for a, b in spans(cu):
        xd, kd = x.detach()[:, :, a:b].requires_grad_(), k.detach()[:, : b - a].requires_grad_()
        y, dx, dkd = run(xd, kd, dy[:, :, a:b], **kw)
        ys.append(y)
        dxs.append(dx)
        dk[:, : b - a] += dkd.double()
    return torch.cat(ys, 2).detach(), torch.cat(dxs, 2), dk


def terms(x, k, dy, cu):
    """The magnitude of the terms of y, dx and dk (reference.terms), document by document."""
    x, k, dy = to_np(x), to_np(k), to_np(dy)
    ym, dxm, dkm = np.zeros(x.shape), np.zeros(x.shape), np.zeros(k.shape)
    for a, b in spans(cu):
        ym[..., a:b] = conv_ref.fftconv_terms(x[..., a:b], k[:, : b - a])
        dxm[..., a:b], dk_doc = conv_ref.fftconv_bwd_terms(dy[..., a:b], x[..., a:b], k[:, : b - a])
        dkm[:, : b - a] += dk_doc
    return ym, dxm, dkm


def compare(packed, expected, backend, xdtype, kdtype, magnitudes):
    """The backend's tolerance (rows of another length may pick another path or tile, so the
    rounding may differ) against the magnitude of the terms; in fp64 with a float32 k, dk is
    rounded once to fp32 (4.5e-8 measured)."""
    for name, a, e, dtype, kind, m in zip(("y", "dx", "dk"), packed, expected, (xdtype, xdtype, kdtype),
                                          ("fwd", "bwd", "bwd"), magnitudes):
        assert a.shape == e.shape and a.dtype == dtype and torch.isfinite(a.float()).all(), name
        if xdtype == F64 and dtype != F64:
            bound = 1.5e-7  # fp64 arithmetic, dk rounded once to fp32 k
        else:
            bound = tol(backend, dtype, kind)
        assert_close(name, a, to_np(e), bound, m)


@pytest.mark.parametrize("backend, xdtype, kdtype, path", CASES)
def test_packed_equals_separate_documents(backend, xdtype, kdtype, path):
    x, k, dy, cu = packed_inputs(LENGTHS, xdtype, kdtype)
    with knobs(backend_module("fftconv", backend), **PATHS[path].get(backend, {})):
        compare(run(x, k, dy, cu_seqlens=cu, backend=backend), separate(x, k, dy, cu, backend=backend),
                backend, xdtype, kdtype, terms(x, k, dy, cu))


@given(lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100]), min_size=1, max_size=7),
       path=st.sampled_from(["direct", "fft"]), kdtype=st.sampled_from([F64, F32]), seed=st.integers(0, 2**16))
def test_random_documents_torch_float64(lengths, path, kdtype, seed):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    x, k, dy, cu = packed_inputs(lengths, F64, kdtype, seed)
    with knobs(torch_impl, **PATHS[path]["torch"]):
        compare(run(x, k, dy, cu_seqlens=cu, backend="torch"), separate(x, k, dy, cu, backend="torch"),
                "torch", F64, kdtype, terms(x, k, dy, cu))


@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 4, 9, 17, 33]), min_size=1, max_size=4),
       xdtype=st.sampled_from([F32, BF16]), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_random_documents_kernels(backend, lengths, xdtype, seed):
    if sum(lengths) == 0:
        lengths = lengths + [2]
    x, k, dy, cu = packed_inputs(lengths, xdtype, F32, seed)
    compare(run(x, k, dy, cu_seqlens=cu, backend=backend), separate(x, k, dy, cu, backend=backend),
            backend, xdtype, F32, terms(x, k, dy, cu))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cpu"])
def test_nothing_crosses_a_document_boundary(backend):
    """Changing document 0 changes nothing in document 1 (bit for bit), and the gradient of
    document 1's outputs reaches no step of document 0; the same change on the unpacked row does
    reach document 1, so the check would see a leak."""
    x, k, dy, cu = packed_inputs([6, 11], F32, F32)
    bumped = x.detach().clone()
    bumped[:, :, :6] = 3.0 * bumped[:, :, :6] + 1.0
    y = fftconv(x, k, cu_seqlens=cu, backend=backend)
    y_bumped = fftconv(bumped, k, cu_seqlens=cu, backend=backend)
    assert torch.equal(y[..., 6:], y_bumped[..., 6:])
    assert not torch.equal(y[..., :6], y_bumped[..., :6])
    dx, dk = torch.autograd.grad(y[..., 6:], (x, k), dy[..., 6:])
    assert torch.count_nonzero(dx[..., :6]) == 0 and torch.count_nonzero(dx[..., 6:]) > 0
    # k is shared: document 1 (11 steps) reads k[:, :11] only; a row of 16 transformed by FFTs
    # leaves rounding noise in dk[:, 11:16], a direct product exact zeros
    assert dk[:, 11:].abs().max() <= 1e-6 * dk[:, :11].abs().max()
    unpacked = fftconv(x, k, backend=backend)[..., 6:]
    assert not torch.allclose(unpacked, fftconv(bumped, k, backend=backend)[..., 6:])


@pytest.mark.parametrize("backend, dtype", [("torch", F64), ("triton", F32), ("cuda", F32), ("cpu", F32)])
def test_one_document_is_the_unpacked_call(backend, dtype):
    x, k, dy, _ = packed_inputs([37], dtype, dtype)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    for a, e in zip(run(x, k, dy, cu_seqlens=cu, backend=backend), run(x, k, dy, backend=backend)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_one_backend_call_per_bucket(backend, monkeypatch):
    """45 documents of lengths 0..5 fall into the row lengths 1, 2, 4 and 8: four forward and
    four backward calls of the backend, each on a batch of rows, not one per document."""
    module = {"torch": torch_impl, "triton": triton_impl}.get(backend) or FFTCONV.BACKENDS._load("cuda")
    calls = {"forward": [], "backward": []}
    for name, seen in calls.items():
        inner = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _inner=inner, _seen=seen, **kw: _seen.append(tuple(a[0].shape))
                            or _inner(*a, **kw))
    x, k, dy, cu = packed_inputs([1, 2, 3, 4, 5, 0, 3, 1, 2] * 5, F32, F32)
    run(x, k, dy, cu_seqlens=cu, backend=backend)
    rows = [(10, D, 1), (10, D, 2), (15, D, 4), (5, D, 8)]
    assert calls["forward"] == rows and calls["backward"] == rows


def test_only_the_gradient_asked_for():
    x, k, dy, cu = packed_inputs([4, 0, 9], F64, F64)
    y = fftconv(x, k.detach(), cu_seqlens=cu, backend="torch")
    (dx,) = torch.autograd.grad(y, (x,), dy)
    y = fftconv(x.detach(), k, cu_seqlens=cu, backend="torch")
    (dk,) = torch.autograd.grad(y, (k,), dy)
    _, dx_sep, dk_sep = separate(x, k, dy, cu, backend="torch")
    _, dx_terms, dk_terms = terms(x, k, dy, cu)
    assert_close("dx", dx, dx_sep, tol("torch", F64, "bwd"), dx_terms)
    assert_close("dk", dk, dk_sep, tol("torch", F64, "bwd"), dk_terms)


def test_bad_input():
    x, k, _, cu = packed_inputs([3, 4], F32, F32)
    xb = x.detach().expand(2, -1, -1)
    cases = [
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.float())),
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.bool())),
        (TypeError, "cu_seqlens", dict(cu_seqlens=[0, 3, 7])),
        (ValueError, "cu_seqlens", dict(cu_seqlens=cu[None])),
        (ValueError, "cu_seqlens", dict(cu_seqlens=cu[:1])),
        (ValueError, "cu_seqlens must start at 0", dict(cu_seqlens=torch.tensor([1, 3, 7]))),
        (ValueError, "cu_seqlens must be non-decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 7]))),
        (ValueError, "cu_seqlens must end at", dict(cu_seqlens=torch.tensor([0, 3, 6]))),
        (ValueError, "cu_seqlens is on meta", dict(cu_seqlens=cu.to("meta"))),
        (ValueError, "x must hold one packed row", dict(x=xb, cu_seqlens=cu)),
    ]
    for error, words, kw in cases:
        with pytest.raises(error, match=words):
            fftconv(**{"x": x, "k": k, **kw})
