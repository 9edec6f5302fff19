"""TimestepNorm on packed rows (``cu_seqlens``): a packed call equals each document run on its own
(batch 1) from its own initial state, on every backend (torch, Triton in the interpreter, CUDA in
the emulator, the compiled CPU kernel), fp32/bf16/fp64: y, the returned (count, mean, var) per
document, and the gradients of x, scale, bias, prev_mean and prev_var, from y and from (mean, var)
separately. Documents have
their own level and spread, so a statistic leaking across a boundary fails the comparison (checked
below). Also: one backend call per packed call, not per document; bad input."""
import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from megalodon_kernels.ops.timestep_norm import BACKENDS, timestep_norm
from megalodon_kernels.reference import timestep_norm as ref
from support import assert_close, backend_module, err_ratio, knobs, to_np, tol

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN lanes the Triton kernels mask away

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
LEAVES = ("x", "scale", "bias", "prev_mean", "prev_var")

#: (backend, dtype) pairs; Triton takes no float64
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
    ("cpu", F32), ("cpu", BF16), ("cpu", F64),
]]

#: short time chunks, so that documents of a few dozen steps span one, several or a fraction of one
#: (torch: chunk T; Triton: T = block_elems / 16 for group sizes <= 16; CUDA: always 32 or more
#: chunks, one or two steps each at these lengths)
SHORT_CHUNKS = {"torch": {"chunk": 8}, "triton": {"block_elems": 128}, "cuda": {}, "cpu": {}}


def acc_of(dtype):
    return F64 if dtype == F64 else F32


def budget(backend, dtype, kind):
    """Packed vs separate: the backend's tolerance in that dtype."""
    return tol(backend, dtype, kind)


def documents(lengths, D, G, seed, *, pad, prior, padded_docs=(), int32=False):
    """A packed row of documents with the given lengths: each with its own level (~ N(0, 9)) and
    spread; with ``pad`` ~30% of the steps padded, and every step of the documents
    ``padded_docs``, their x holding NaN/inf; with ``prior`` an initial state per document (some
    with prev_count 0). float64; cu_seqlens int64 (or int32)."""
    gen = torch.Generator().manual_seed(seed)
    n, L = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                      dtype=torch.int32 if int32 else torch.int64)
    level = 3.0 * torch.randn(n, generator=gen, dtype=F64)
    spread = 0.2 + 2.0 * torch.rand(n, generator=gen, dtype=F64)
    doc = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths, dtype=torch.int64))
    x = (level[doc, None] + spread[doc, None] * torch.randn(L, D, generator=gen, dtype=F64))[None]
    p = dict(x=x, cu_seqlens=cu, num_groups=G,
             scale=1.0 + 0.5 * torch.randn(D, generator=gen, dtype=F64),
             bias=0.5 * torch.randn(D, generator=gen, dtype=F64))
    if pad or padded_docs:
        mask = (torch.rand(1, L, generator=gen) < 0.3) if pad else torch.zeros(1, L, dtype=torch.bool)
        for d in padded_docs:
            mask[:, cu[d]:cu[d + 1]] = True
        x[mask] = torch.tensor([float("nan"), float("inf")], dtype=F64)[
            torch.randint(0, 2, (int(mask.sum()), 1), generator=gen)].expand(-1, D)
        p["padding_mask"] = mask
    if prior:
        p["prev_count"] = torch.randint(0, 4, (n,), generator=gen)
        p["prev_mean"] = level[:, None] + torch.randn(n, G, generator=gen, dtype=F64)
        p["prev_var"] = 0.5 + torch.rand(n, G, generator=gen, dtype=F64)
    return p


def leaves_of(p, dtype):
    acc = acc_of(dtype)
    return {k: p[k].to(dtype if k in ("x", "scale", "bias") else acc).requires_grad_()
            for k in LEAVES if k in p}


def run_packed(p, leaves, backend):
    return timestep_norm(leaves["x"], leaves["scale"], leaves["bias"], p["num_groups"], p.get("prev_count"),
                         leaves.get("prev_mean"), leaves.get("prev_var"), p.get("padding_mask"),
                         cu_seqlens=p["cu_seqlens"], backend=backend)


def run_separate(p, leaves, backend):
    """Each document on its own (batch 1, its own initial state); outputs concatenated like the
    packed ones. Empty documents are calls with L = 0."""
    cu = p["cu_seqlens"].tolist()
    outs = []
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        state = {k: v[d:d + 1] for k, v in (("prev_count", p.get("prev_count")), ("prev_mean", leaves.get("prev_mean")),
                                             ("prev_var", leaves.get("prev_var"))) if v is not None}
        mask = p.get("padding_mask")
        outs.append(timestep_norm(leaves["x"][:, a:b], leaves["scale"], leaves["bias"], p["num_groups"],
                                  padding_mask=None if mask is None else mask[:, a:b], backend=backend, **state))
    return tuple(torch.cat(t, dim=1 if i == 0 else 0) for i, t in enumerate(zip(*outs)))


def terms(p, leaves, up):
    """The magnitude of the terms (reference.terms) of y, mean and var and of every leaf's gradient
    for the upstream gradients ``up`` (dy, dmean, dvar), document by document."""
    a = {k: to_np(v.detach()) for k, v in leaves.items()}
    for k in ("prev_count", "padding_mask"):
        if p.get(k) is not None:
            a[k] = to_np(p[k])
    G, (dy, dm, dv) = p["num_groups"], (to_np(u) for u in up)
    cu = p["cu_seqlens"].tolist()
    fwd = [np.zeros(a["x"].shape), np.zeros(dm.shape), np.zeros(dm.shape)]
    grads = {k: np.zeros(v.shape) for k, v in a.items() if k in leaves}

    def state(k, d):
        return None if a.get(k) is None else a[k][d:d + 1]

    for d, (s0, s1) in enumerate(zip(cu[:-1], cu[1:])):
        doc = (a["x"][:, s0:s1], a["scale"], a["bias"], G, state("prev_count", d), state("prev_mean", d),
               state("prev_var", d), None if a.get("padding_mask") is None else a["padding_mask"][:, s0:s1])
        fwd[0][:, s0:s1], fwd[1][d], fwd[2][d] = (np.squeeze(t, 0) if i else t
                                                  for i, t in enumerate(ref.timestep_norm_terms(*doc)))
        dx, dscale, dbias, dpm, dpv = ref.timestep_norm_bwd_terms(dy[:, s0:s1], dm[d:d + 1], dv[d:d + 1], *doc)
        grads["x"][:, s0:s1] = dx
        grads["scale"] += dscale
        grads["bias"] += dbias
        for k, g in (("prev_mean", dpm), ("prev_var", dpv)):
            if k in grads:
                grads[k][d] = g[0]
    return fwd, grads


def compare(p, dtype, backend, seed=0):
    """Packed == separate: outputs, states, and the gradients of every leaf from y alone and from
    (mean, var) alone."""
    acc = acc_of(dtype)
    leaves = leaves_of(p, dtype)
    got = run_packed(p, leaves, backend)
    want = run_separate(p, leaves, backend)
    n = p["cu_seqlens"].shape[0] - 1
    assert got[0].dtype == dtype and got[0].shape == p["x"].shape
    assert got[1].dtype == torch.int64 and got[1].shape == (n,)
    assert got[2].dtype == acc and got[2].shape == got[3].shape == (n, p["num_groups"])
    assert torch.equal(got[1], want[1])
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(t.shape, generator=gen, dtype=F64).to(t.dtype) for t in (got[0], got[2], got[3])]
    zero = [torch.zeros_like(u) for u in ups]
    sources = {"y": [ups[0], *zero[1:]], "state": [zero[0], *ups[1:]]}
    magnitudes = {source: terms(p, leaves, up) for source, up in sources.items()}
    fwd_terms = magnitudes["y"][0]   # the forward's terms do not depend on the upstream gradients
    for name, a, b, dt, m in (("y", got[0], want[0], dtype, fwd_terms[0]), ("mean", got[2], want[2], acc, fwd_terms[1]),
                              ("var", got[3], want[3], acc, fwd_terms[2])):
        assert_close(name, a, to_np(b), budget(backend, dt, "fwd"), m)
    for source, up in sources.items():
        grad_terms = magnitudes[source][1]
        g_got = torch.autograd.grad((got[0], got[2], got[3]), list(leaves.values()), up, retain_graph=True)
        g_want = torch.autograd.grad((want[0], want[2], want[3]), list(leaves.values()), up, retain_graph=True)
        for k, a, b in zip(leaves, g_got, g_want):
            assert a.dtype == leaves[k].dtype and a.shape == leaves[k].shape
            t = max(budget(backend, dtype, "bwd"), budget(backend, a.dtype, "bwd"))
            assert_close(f"d{k} from {source}", a, to_np(b), t, grad_terms[k])


@contextlib.contextmanager
def short_chunks(backend):
    with knobs(backend_module("timestep_norm", backend), **SHORT_CHUNKS[backend]):
        yield


# ---------------------------------------------------------------------------------------------
# packed == separate


#: hand-picked rows: one document (== no packing), empty documents first / inside / last, lengths
#: 1, below / at / above a chunk (8) and several chunks; in "mixed" the last document is wholly
#: padded (its state passes through a bucket unchanged)
ROWS = {
    "single": [23],
    "mixed": [1, 0, 8, 23, 0, 3],
    "empty-ends": [0, 9, 17, 0],
}


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("row", list(ROWS))
def test_packed_equals_separate(backend, dtype, row):
    p = documents(ROWS[row], 8, 2, seed=len(ROWS[row]), pad=row != "single", prior=row != "empty-ends",
                  padded_docs=(5,) if row == "mixed" else (), int32=row == "mixed")
    with short_chunks(backend):
        compare(p, dtype, backend)


LENGTH = st.one_of(st.just(0), st.integers(1, 4), st.integers(5, 40))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cpu"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(LENGTH, min_size=1, max_size=6), Dg=st.sampled_from([1, 3, 8]), G=st.sampled_from([1, 2]),
       pad=st.booleans(), prior=st.booleans(), fp64=st.booleans(), int32=st.booleans(), seed=st.integers(0, 2**31))
def test_property(backend, lengths, Dg, G, pad, prior, fp64, int32, seed):
    dtype = F64 if fp64 and backend != "triton" else F32
    p = documents(lengths, Dg * G, G, seed, pad=pad, prior=prior, int32=int32)
    with short_chunks(backend):
        compare(p, dtype, backend, seed)


@pytest.mark.parametrize("backend", ["torch", "cuda", "cpu"])
def test_whole_row_statistics_would_fail_the_comparison(backend):
    """The comparison has teeth: the same row run unpacked (statistics running across document
    boundaries) is far outside the tolerance of packed == separate."""
    p = documents(ROWS["mixed"], 8, 2, seed=6, pad=True, prior=True)
    leaves = leaves_of(p, F32)
    want = run_separate(p, leaves, backend)
    leaky = timestep_norm(leaves["x"], leaves["scale"], leaves["bias"], 2, padding_mask=p["padding_mask"],
                          backend=backend)
    assert err_ratio(leaky[0], to_np(want[0]))[1] > 1e3 * tol(backend, F32, "fwd")


# ---------------------------------------------------------------------------------------------
# one backend call per packed call, whatever the number of documents


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cpu"])
def test_one_backend_call_per_packed_call(backend, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 6, (48,), generator=gen).tolist()  # 48 documents, some empty
    p = documents(lengths, 4, 1, seed=3, pad=True, prior=True)
    leaves = leaves_of(p, F32)
    L = p["x"].shape[1]
    module = BACKENDS.select(backend, {"x": p["x"].float(), "num_groups": 1}, device=p["x"].device, dtype=F32).module
    rows = {"forward": [], "backward": []}
    for kind in rows:
        fn = getattr(module, kind)
        monkeypatch.setattr(module, kind,
                            lambda *a, _fn=fn, _rows=rows[kind], **kw: (_rows.append(a[0].shape[:2]), _fn(*a, **kw))[1])
    with short_chunks(backend):
        y, count, mean, var = run_packed(p, leaves, backend)
        torch.autograd.grad((y.sum() + mean.sum() + var.sum()), list(leaves.values()))
    # every backend reads the document bounds itself: the packed row is one call, forward and backward
    assert rows["forward"] == [(1, L)] and rows["backward"] == [(1, L)]


# ---------------------------------------------------------------------------------------------
# bad input


def _call(cu=None, B=1, L=6, n_state=None, **kw):
    x = torch.randn(B, L, 4)
    cu = torch.tensor([0, 2, L]) if cu is None else cu
    state = {} if n_state is None else {"prev_count": torch.zeros(n_state, dtype=torch.int64),
                                        "prev_mean": torch.zeros(n_state, 2), "prev_var": torch.ones(n_state, 2)}
    state.update(kw)
    return timestep_norm(x, torch.ones(4), torch.zeros(4), 2, cu_seqlens=cu, **state)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: _call(torch.tensor([0.0, 2.0, 6.0])), TypeError, "cu_seqlens"),
    (lambda: _call(torch.tensor([False, True, True])), TypeError, "cu_seqlens"),
    (lambda: _call([0, 2, 6]), TypeError, "cu_seqlens"),
    (lambda: _call(torch.tensor([[0, 2, 6]])), ValueError, "cu_seqlens"),
    (lambda: _call(torch.tensor([0])), ValueError, "cu_seqlens"),
    (lambda: _call(torch.tensor([1, 2, 6])), ValueError, "cu_seqlens must start at 0"),
    (lambda: _call(torch.tensor([0, 4, 2, 6])), ValueError, "cu_seqlens must be non-decreasing"),
    (lambda: _call(torch.tensor([0, 2, 5])), ValueError, "cu_seqlens must end at"),
    (lambda: _call(B=2), ValueError, "batch size 1"),
    (lambda: _call(torch.tensor([0, 2, 6], device="meta")), ValueError, "cu_seqlens is on meta"),
    (lambda: _call(prev_count=torch.zeros(1, dtype=torch.int64)), ValueError, "prev_count"),
    (lambda: _call(prev_mean=torch.zeros(1, 2)), ValueError, "prev_mean"),
    (lambda: _call(prev_var=torch.ones(3, 2)), ValueError, "prev_var"),
    (lambda: _call(prev_count=torch.tensor([0, -1])), ValueError, "prev_count"),
    (lambda: _call(padding_mask=torch.zeros(1, 5, dtype=torch.bool)), ValueError, "padding_mask"),
], ids=["float", "bool", "list", "2-D", "no-document", "start", "decreasing", "end", "batch", "device",
        "prev_count-size", "prev_mean-size", "prev_var-size", "prev_count-negative", "padding_mask-size"])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_states_per_document_are_accepted():
    y, count, mean, var = _call(n_state=2)
    assert count.shape == (2,) and mean.shape == var.shape == (2, 2) and y.shape == (1, 6, 4)
