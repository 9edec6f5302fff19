"""cema with cu_seqlens (packed documents) on its backends (torch, cpu; Triton in the interpreter, CUDA
in the emulator): y, the
returned per-document state h and every gradient (x, p, log_q, gamma, omega, hx) equal separate
calls on each document from its own hx, for documents of length 1, rows on the direct and the FFT
convolution paths, empty documents (h = hx) and one document; every combination of inputs needing
a gradient and of outputs receiving one; long-memory coefficients (1 - |q| down to 1e-6), where a
state leaking across a boundary would show; the saved kernel k; one backend call per bucket of
row lengths; bad input."""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.cema import cema
from megalodon_kernels.ops.cema import torch_impl, triton_impl
from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.ema_hidden import torch_impl as hidden_torch
from megalodon_kernels.ops.ema_hidden import triton_impl as hidden_triton
from megalodon_kernels.reference import cema as cema_ref
from support import assert_close, cema_coefficients, to_np, tol

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
OPS = torch.ops.megalodon_kernels
NAMES = ("x", "p", "log_q", "gamma", "omega", "hx")
D, N = 3, 4
#: empty documents first and in the middle, 1, short, a power of two, 17 (a row of 32: the torch
#: FFT path), 70 (a row of 128: the Triton FFT tile path; shorter rows take its direct path)
LENGTHS = [0, 1, 5, 0, 8, 17, 3, 70]
#: 1 - |q| log-uniform in [1e-6, 1e-3]: the state barely decays over a document
LONG_MEMORY = dict(min_gap=1e-6, max_gap=1e-3)


def packed_inputs(lengths, xdtype, cdtype, with_hx=True, seed=0, memory=None):
    """The cema arguments as a dict (x (1, D, L); hx (n, D, N) or None), upstream gradients dy, dh
    and cu_seqlens."""
    n, L = len(lengths), sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    c = cema_coefficients(gen, D, N, n if with_hx else None, cdtype, **(memory or {}))._asdict()
    c["x"] = torch.randn(1, D, L, generator=gen, dtype=F64).to(xdtype)
    c["omega"] = (0.5 * torch.randn(D, generator=gen, dtype=F64)).to(cdtype)
    args = {name: c[name] for name in NAMES}
    dy = torch.randn(1, D, L, generator=gen, dtype=F64).to(xdtype)
    dh = torch.complex(torch.randn(n, D, N, generator=gen, dtype=F64),
                       torch.randn(n, D, N, generator=gen, dtype=F64)).to(c["log_q"].dtype)
    return args, dy, dh, torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def leaves(args, needs):
    return {k: None if v is None else v.detach().requires_grad_(k in needs) for k, v in args.items()}


def run(args, dy, dh, return_state, use=("y", "h"), **kw):
    """(y, h or None, and the gradient of each argument needing one, by name) of one call."""
    y, h = cema(*(args[k] for k in NAMES), return_state, **kw)
    outs = [(y, dy)] + ([(h, dh)] if return_state else [])
    outs = [(o, g) for (o, g), name in zip(outs, ("y", "h")) if name in use]
    wanted = [k for k in NAMES if args[k] is not None and args[k].requires_grad]
    grads = torch.autograd.grad([o for o, _ in outs], [args[k] for k in wanted], [g for _, g in outs])
    return y.detach(), (None if h is None else h.detach()), dict(zip(wanted, grads))


def separate(args, dy, dh, cu, return_state, use=("y", "h"), **kw):
    """y, h and the gradients from one call per document; an empty document's state is its hx."""
    n = cu.shape[0] - 1
    x, hx = args["x"], args["hx"]
    ys = []
    h = args["log_q"].new_zeros(n, D, N) if hx is None else hx.detach().clone()
    grads = {k: torch.zeros(v.shape, dtype=F64 if k == "x" else v.dtype) for k, v in args.items()
             if v is not None and v.requires_grad}
    if "hx" in grads and return_state and "h" in use:
        grads["hx"] += dh  # the empty documents' h = hx (the others are overwritten below)
    for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        doc = dict(args, x=x.detach()[:, :, a:b].requires_grad_(x.requires_grad),
                   hx=None if hx is None else hx.detach()[d:d + 1].requires_grad_(hx.requires_grad))
        yd, hd, gd = run(doc, dy[:, :, a:b], dh[d:d + 1], return_state, use, **kw)
        ys.append(yd)
        if return_state:
            h[d] = hd[0]
        for k, g in gd.items():
            if k == "x":
                grads[k][:, :, a:b] = g.double()
            elif k == "hx":
                grads[k][d] = g[0]
            else:
                grads[k] += g
    if "x" in grads:
        grads["x"] = grads["x"].to(x.dtype)
    return torch.cat(ys, 2), (h if return_state else None), grads


def terms(args, dy, dh, cu, return_state, use=("y", "h")):
    """The magnitude of the terms (reference.terms) of y, h and every gradient, document by
    document (an empty document's h is its hx, and dhx its dh)."""
    a = {k: None if v is None else to_np(v) for k, v in args.items()}
    dy, dh = to_np(dy) * ("y" in use), to_np(dh) * (return_state and "h" in use)
    coef = ("p", "log_q", "gamma", "omega")
    ym = np.zeros(a["x"].shape)
    hm = np.zeros(dh.shape) if a["hx"] is None else np.abs(a["hx"])
    grads = {"x": np.zeros(a["x"].shape), **{k: np.zeros(a[k].shape) for k in coef},
             "hx": None if a["hx"] is None else np.abs(dh).astype(np.float64)}
    for d, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s0 == s1:
            continue
        hx = None if a["hx"] is None else a["hx"][d:d + 1]
        doc = [a["x"][:, :, s0:s1], *(a[k] for k in coef), hx]
        ym[:, :, s0:s1], h_doc = cema_ref.cema_terms(*doc, return_state=True)
        hm[d] = np.abs(h_doc[0])
        g = cema_ref.cema_bwd_terms(dy[:, :, s0:s1], dh[d:d + 1], *doc, return_state=True)
        grads["x"][:, :, s0:s1] = g[0]
        for k, gk in zip(coef, g[1:5]):
            grads[k] += np.abs(gk)
        if hx is not None:
            grads["hx"][d] = np.abs(g[5][0])
    return ym, (hm if return_state else None), grads


def compare(packed, expected, backend, xdtype, cdtype, magnitudes):
    """The backend's tolerance against the magnitude of the terms: y and dx in x's dtype, h and
    the coefficient gradients in the coefficient dtype."""
    (y, h, grads), (y_sep, h_sep, grads_sep) = packed, expected
    y_terms, h_terms, grad_terms = magnitudes

    def bound(dtype, kind):
        return tol(backend, dtype, kind)

    assert y.dtype == xdtype and torch.isfinite(y.float()).all()
    assert_close("y", y, to_np(y_sep), bound(xdtype, "fwd"), y_terms)
    assert (h is None) == (h_sep is None)
    if h is not None:
        assert h.shape == h_sep.shape and h.dtype == h_sep.dtype
        assert_close("h", h, to_np(h_sep), bound(cdtype, "fwd"), h_terms)
    assert grads.keys() == grads_sep.keys()
    for k, g in grads.items():
        assert g.dtype == grads_sep[k].dtype and g.shape == grads_sep[k].shape, k
        assert_close(f"d{k}", g, to_np(grads_sep[k]), bound(xdtype if k == "x" else cdtype, "bwd"), grad_terms[k])


def check(backend, args, dy, dh, cu, return_state, needs=NAMES, use=("y", "h")):
    args = leaves(args, needs)
    xdtype, cdtype = args["x"].dtype, args["p"].dtype
    compare(run(args, dy, dh, return_state, use, cu_seqlens=cu, backend=backend),
            separate(args, dy, dh, cu, return_state, use, backend=backend), backend, xdtype, cdtype,
            terms(args, dy, dh, cu, return_state, use))


#: (backend, x dtype, coefficient dtype, with hx, return_state)
CASES = [(b, x, c, hx, rs) for b, x, c in [("torch", F32, F32), ("torch", BF16, F32), ("torch", F64, F64),
                                           ("triton", F32, F32), ("triton", BF16, F32),
                                           ("cpu", F32, F32), ("cpu", F64, F64),
                                           ("cuda", F32, F32), ("cuda", BF16, F32), ("cuda", F64, F64)]
         for hx, rs in [(True, True), (False, False), (True, False), (False, True)]
         # the interpreter and the emulator are slow: their bf16 (and CUDA's fp64) take the full mode only
         if not ((b, x) in (("triton", BF16), ("cuda", BF16), ("cuda", F64)) and not (hx and rs))]


@pytest.mark.parametrize("backend, xdtype, cdtype, with_hx, return_state", CASES)
def test_packed_equals_separate_documents(backend, xdtype, cdtype, with_hx, return_state):
    args, dy, dh, cu = packed_inputs(LENGTHS, xdtype, cdtype, with_hx)
    check(backend, args, dy, dh, cu, return_state)


#: the inputs needing a gradient: each alone (so every needs[] combination of the backward has one
#: True entry at least once), the coefficients without x, x with hx
NEEDS = [("x",), ("p",), ("log_q",), ("gamma",), ("omega",), ("hx",), ("p", "log_q", "gamma", "omega"), ("x", "hx")]


@pytest.mark.parametrize("needs", NEEDS, ids="-".join)
@pytest.mark.parametrize("use", [("y", "h"), ("y",), ("h",)], ids="+".join)
def test_every_gradient_combination_torch_float64(needs, use):
    args, dy, dh, cu = packed_inputs(LENGTHS, F64, F64, seed=1, memory=LONG_MEMORY)
    check("torch", args, dy, dh, cu, True, needs, use)


@pytest.mark.parametrize("needs, use", [(("x",), ("y", "h")), (("log_q",), ("h",)), (("hx", "gamma"), ("y",))],
                         ids=lambda v: "-".join(v))
def test_gradient_combinations_triton(needs, use):
    args, dy, dh, cu = packed_inputs([2, 0, 9, 20], F32, F32, seed=2, memory=LONG_MEMORY)
    check("triton", args, dy, dh, cu, True, needs, use)


@given(lengths=st.lists(st.sampled_from([0, 1, 2, 3, 7, 16, 17, 31, 33, 64, 100]), min_size=1, max_size=6),
       with_hx=st.booleans(), return_state=st.booleans(), long_memory=st.booleans(), seed=st.integers(0, 2**16))
def test_random_documents_torch_float64(lengths, with_hx, return_state, long_memory, seed):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    args, dy, dh, cu = packed_inputs(lengths, F64, F64, with_hx, seed, LONG_MEMORY if long_memory else None)
    check("torch", args, dy, dh, cu, return_state)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu", "cuda"])
def test_nothing_crosses_a_document_boundary(backend):
    """With long memory, document 1's outputs and state are the same bit for bit whatever document
    0 holds, and their gradients reach no step of document 0; the unpacked row (document 0's
    state flowing into document 1) is far from them, so the check would see a leak."""
    args, dy, dh, cu = packed_inputs([12, 9], F32, F32, with_hx=False, memory=LONG_MEMORY)
    args = leaves(args, ("x",))
    coef = [args[k] for k in ("p", "log_q", "gamma", "omega")]
    bumped = args["x"].detach().clone()
    bumped[:, :, :12] = 3.0 * bumped[:, :, :12] + 1.0
    y, h = cema(args["x"], *coef, return_state=True, cu_seqlens=cu, backend=backend)
    y_bumped, h_bumped = cema(bumped, *coef, return_state=True, cu_seqlens=cu, backend=backend)
    assert torch.equal(y[..., 12:], y_bumped[..., 12:]) and torch.equal(h[1], h_bumped[1])
    assert not torch.equal(y[..., :12], y_bumped[..., :12]) and not torch.equal(h[0], h_bumped[0])
    (dx,) = torch.autograd.grad([y[..., 12:], h[1]], (args["x"],), [dy[..., 12:], dh[1]])
    assert torch.count_nonzero(dx[..., :12]) == 0 and torch.count_nonzero(dx[..., 12:]) > 0
    y_row, h_row = cema(args["x"], *coef, return_state=True, backend=backend)
    assert (y_row[..., 12:] - y[..., 12:]).abs().max() > 0.1 * y[..., 12:].abs().max()
    assert (h_row[0] - h[1]).abs().max() > 0.5 * h[1].abs().max()


@pytest.mark.parametrize("backend, dtype", [("torch", F64), ("triton", F32), ("cpu", F64), ("cuda", F64)])
def test_one_document_is_the_unpacked_call(backend, dtype):
    args, dy, dh, _ = packed_inputs([37], dtype, dtype)
    args = leaves(args, NAMES)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    y, h, grads = run(args, dy, dh, True, cu_seqlens=cu, backend=backend)
    y_row, h_row, grads_row = run(args, dy, dh, True, backend=backend)
    assert torch.equal(y, y_row)
    # the state and its gradients take q**len from another (exact) formula
    for name, a, e in [("h", h, h_row), *((f"d{k}", grads[k], grads_row[k]) for k in grads)]:
        assert_close(name, a, to_np(e), tol(backend, dtype, "fwd" if name == "h" else "bwd"))


def test_saved_kernel_is_the_longest_rows():
    """The residual k r(D L): the kernel of the longest row (here 32 for a 17-step document),
    zeros beyond it (no row reads them)."""
    args, _, _, cu = packed_inputs([5, 17, 3], F64, F64)
    out = OPS.cema(*(args[k] for k in NAMES), True, False, "torch", cu)
    k = out[2]
    assert k.shape == (D, 25)
    want = cema_kernel(args["p"], args["log_q"], args["gamma"], 25)[0]
    assert_close("k", k[:, :25], to_np(want), tol("torch", F64, "fwd"))
    args, _, _, cu = packed_inputs([5, 3, 9], F64, F64)  # rows of 8 and 16 < L = 17
    k = OPS.cema(*(args[k] for k in NAMES), False, False, "torch", cu)[2]
    assert_close("k", k[:, :16], to_np(cema_kernel(args["p"], args["log_q"], args["gamma"], 16)[0]),
                 tol("torch", F64, "fwd"))
    assert torch.count_nonzero(k[:, 16:]) == 0


def test_empty_documents_keep_their_state():
    args, dy, dh, cu = packed_inputs([0, 4, 0], F64, F64)
    y, h = cema(*(args[k] for k in NAMES), True, cu_seqlens=cu, backend="torch")
    assert torch.equal(h[0], args["hx"][0]) and torch.equal(h[2], args["hx"][2])
    y, h = cema(*(args[k] for k in NAMES[:5]), None, True, cu_seqlens=cu, backend="torch")
    assert torch.count_nonzero(h[0]) == 0 and torch.count_nonzero(h[1]) > 0


def test_log_q_gradient_without_the_weighted_sums():
    """The op called without the state's weighted sums (W a placeholder) still gives dlog_q: the
    packed backward recomputes them."""
    args, dy, dh, cu = packed_inputs([3, 0, 9], F64, F64)
    args = leaves(args, ("log_q",))
    y, h = OPS.cema(*(args[k] for k in NAMES), True, False, "torch", cu)[:2]
    (dlq,) = torch.autograd.grad([y, h], (args["log_q"],), [dy, dh])
    assert_close("dlog_q", dlq, to_np(separate(args, dy, dh, cu, True, backend="torch")[2]["log_q"]),
                 tol("torch", F64, "bwd"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_backend_call_per_bucket(backend, monkeypatch):
    """18 documents of lengths 0..5 fall into the row lengths 1, 2, 4 and 8: four cema forward and
    four backward calls (y), four ema_hidden forward and backward calls (the state), each on a
    batch of rows, not one per document."""
    modules = {"torch": (torch_impl, hidden_torch), "triton": (triton_impl, hidden_triton)}[backend]
    calls = {}
    for module, op in zip(modules, ("cema", "ema_hidden")):
        for name in ("forward", "backward"):
            seen = calls.setdefault(f"{op}.{name}", [])
            # the rows of x (cema's backward: dy, dh, x, ...) or of dh
            index = 2 if (op, name) == ("cema", "backward") else 0
            monkeypatch.setattr(module, name, lambda *a, _inner=getattr(module, name), _seen=seen, _i=index, **kw:
                                _seen.append(a[_i].shape[0]) or _inner(*a, **kw))
    args, dy, dh, cu = packed_inputs([1, 2, 3, 4, 5, 0, 3, 1, 2] * 2, F32, F32)
    run(leaves(args, NAMES), dy, dh, True, cu_seqlens=cu, backend=backend)
    assert calls == {name: [4, 4, 6, 2] for name in calls}


def test_bad_input():
    args, _, _, cu = packed_inputs([3, 4], F32, F32)
    hx = args["hx"]
    xb = args["x"].expand(2, -1, -1)
    cases = [
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.float())),
        (TypeError, "cu_seqlens", dict(cu_seqlens=cu.bool())),
        (ValueError, "cu_seqlens", dict(cu_seqlens=cu[None])),
        (ValueError, "cu_seqlens must start at 0", dict(cu_seqlens=torch.tensor([1, 3, 7]))),
        (ValueError, "cu_seqlens must be non-decreasing", dict(hx=None, cu_seqlens=torch.tensor([0, 5, 3, 7]))),
        (ValueError, "cu_seqlens must end at", dict(cu_seqlens=torch.tensor([0, 3, 6]))),
        (ValueError, "cu_seqlens is on meta", dict(cu_seqlens=cu.to("meta"))),
        (ValueError, "x must hold one packed row", dict(x=xb, cu_seqlens=cu)),
        (ValueError, "hx must hold one state per document", dict(hx=hx[:1], cu_seqlens=cu)),
        (ValueError, "hx must hold one state per document", dict(hx=torch.cat([hx, hx]), cu_seqlens=cu)),
    ]
    for error, words, kw in cases:
        with pytest.raises(error, match=words):
            cema(**{**args, "return_state": True, **kw})
