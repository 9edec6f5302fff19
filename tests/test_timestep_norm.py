"""TimestepNorm on every backend against the float64 loop reference: y, count, mean, var and
every gradient (x, scale, bias, prev_mean, prev_var) for one table of cases (torch, Triton in the
interpreter, CUDA in the emulator), with padding (NaN/inf in padded rows), priors, odd D / G,
several chunks; the streaming state, non-finite inputs, the chunk knob, fp32 accuracy with a large
mean / outlier first step, the CUDA kernels in both fiber orders, the reference's own checks
(finite differences, pooled moments, GroupNorm at step 0, streaming) and argument validation."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.cuda.launch import EmulatorLauncher as emu  # the launch descriptions in the emulator
from megalodon_kernels.ops.timestep_norm import cuda_impl as tsn_cuda, timestep_norm, torch_impl, triton_impl
from megalodon_kernels.reference import timestep_norm as ref
from support import PADDINGS, as_input, assert_close, err_ratio, to_np, tol, use_cpu_build
from support import timestep_norm_inputs as problem

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf lanes the Triton kernels mask away

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
LEAF_NAMES = ("x", "scale", "bias", "prev_mean", "prev_var")  # the differentiable inputs

#: (backend, dtype) pairs every case runs on
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
    ("cpu", F32), ("cpu", BF16), ("cpu", F64),
]]


ALL = ("torch", "triton", "cuda", "cpu")


def case(B, L, D, G, seed, *, pad="none", prior=True, center=0.0, contiguous=True, fresh_first=False,
         backends=ALL, id):
    """One problem; ``fresh_first``: batch row 0 starts from an empty state (prev_count 0)."""
    return pytest.param(dict(B=B, L=L, D=D, G=G, seed=seed, pad=pad, prior=prior, center=center,
                             contiguous=contiguous, fresh_first=fresh_first, backends=backends), id=id)


# Triton runs in the interpreter at a few seconds per case: it takes the cases sized for it (D = 30,
# D = 6, D = 100 with 5 chunks, the large mean), the other backends take every case.
NO_TRITON = ("torch", "cuda", "cpu")
CASES = [
    *(case(3, L, 60, 4, L, pad="mixed", backends=NO_TRITON, id=f"L{L}-D60-G4-mixed") for L in (1, 31, 33, 63, 129)),
    # D = 30: Dg = 15 or 30 (Triton tile 16 / 32, up to 3 chunks)
    *(case(3, L, 30, 1 if L == 129 else 2, L, pad="mixed", id=f"L{L}-D30-G{1 if L == 129 else 2}-mixed")
      for L in (1, 33, 129)),
    *(case(2, 33, 60, G, G, prior=prior, backends=NO_TRITON, id=f"L33-D60-G{G}-{'prior' if prior else 'no_prior'}")
      for G in (1, 3, 4, 12, 60) for prior in (False, True)),
    *(case(1, 33, 6, G, G, prior=False, id=f"L33-D6-G{G}-no_prior") for G in (1, 3, 6)),  # Dg = 6, 2, 1
    # L > chunk: whole leading chunks padded with an empty state in row 0
    *(case(4, 150, 12, 3, 7, pad=pad, fresh_first=True, backends=NO_TRITON, id=f"L150-D12-G3-pad_{pad}")
      for pad in PADDINGS),
    # Dg = 100 (Triton tile 256, T = 16): L = 70 spans 5 chunks, some wholly padded
    *(case(2, 70, 100, 1, 7, pad=pad, fresh_first=True, id=f"L70-D100-G1-pad_{pad}")
      for pad in ("left", "middle", "random", "all", "mixed")),
    case(3, 45, 20, 5, 11, pad="mixed", contiguous=False, backends=NO_TRITON, id="strided-L45-D20-G5-mixed"),
    # a large common mean: every backend takes its statistics relative to a shift K
    case(2, 40, 24, 2, 5, pad="random", center=1e3, contiguous=False, id="strided-mean1e3-L40-D24-G2"),
    case(2, 45, 8, 2, 13, pad="mixed", center=1.0, id="L45-D8-G2-mixed"),
]


def acc_of(dtype):
    return F64 if dtype == F64 else F32


def run(p, dtype, *, gen, contiguous=True, param_dtype=None, grads=True, name="", backend="torch"):
    """Run the op on ``backend`` in ``dtype`` and compare y, count, mean, var and every gradient to
    the reference; returns (y, count, mean, var)."""
    acc = acc_of(dtype)
    pdt = param_dtype or dtype
    x = as_input(p["x"], dtype, contiguous, requires_grad=True)
    scale = as_input(p["scale"], pdt, contiguous, requires_grad=True)
    bias = as_input(p["bias"], pdt, contiguous, requires_grad=True)
    extra, leaves = {}, {"x": x, "scale": scale, "bias": bias}
    for k in ("prev_count", "padding_mask"):
        if p.get(k) is not None:
            extra[k] = as_input(p[k], None, contiguous)
    for k in ("prev_mean", "prev_var"):
        if p.get(k) is not None:
            extra[k] = leaves[k] = as_input(p[k], pdt, contiguous, requires_grad=True)
    y, count, mean, var = timestep_norm(x, scale, bias, p["num_groups"], **extra, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert count.dtype == torch.int64 and mean.dtype == acc and var.dtype == acc
    # The reference sees exactly the rounded inputs the op saw.
    np_in = {k: to_np(v.detach()) for k, v in {**leaves, **extra}.items()}
    ry, rc, rm, rv = ref.timestep_norm(np_in["x"], np_in["scale"], np_in["bias"], p["num_groups"],
                                       np_in.get("prev_count"), np_in.get("prev_mean"), np_in.get("prev_var"),
                                       np_in.get("padding_mask"))
    ym, mm, vm = ref.timestep_norm_terms(np_in["x"], np_in["scale"], np_in["bias"], p["num_groups"],
                                         np_in.get("prev_count"), np_in.get("prev_mean"), np_in.get("prev_var"),
                                         np_in.get("padding_mask"))
    np.testing.assert_array_equal(count.numpy(), rc)
    assert_close(f"{name}y", y, ry, tol(backend, dtype, "fwd"), ym)
    assert_close(f"{name}mean", mean, rm, tol(backend, acc, "fwd"), mm)
    assert_close(f"{name}var", var, rv, tol(backend, acc, "fwd"), vm)
    if not grads:
        return y, count, mean, var
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    dm = torch.randn(mean.shape, generator=gen, dtype=torch.float64).to(acc)
    dv = torch.randn(var.shape, generator=gen, dtype=torch.float64).to(acc)
    got = dict(zip(leaves, torch.autograd.grad((y, mean, var), list(leaves.values()), (dy, dm, dv))))
    bwd_args = (to_np(dy), to_np(dm), to_np(dv), np_in["x"], np_in["scale"], np_in["bias"], p["num_groups"],
                np_in.get("prev_count"), np_in.get("prev_mean"), np_in.get("prev_var"), np_in.get("padding_mask"))
    want = dict(zip(LEAF_NAMES, ref.timestep_norm_bwd(*bwd_args)))
    terms = dict(zip(LEAF_NAMES, ref.timestep_norm_bwd_terms(*bwd_args)))
    for k, g in got.items():
        assert g.dtype == leaves[k].dtype and g.shape == leaves[k].shape
        # A gradient is rounded to its leaf's dtype: allow the coarser of the two precisions.
        t = max(tol(backend, dtype, "bwd"), tol(backend, g.dtype, "bwd"))
        assert_close(f"{name}d{k}", g, want[k], t, terms[k])
    return y, count, mean, var


@pytest.mark.parametrize("c, backend, dtype", [
    pytest.param(c.values[0], *bd.values, id=f"{c.id}-{bd.id}")
    for c in CASES for bd in BACKEND_DTYPES if bd.values[0] in c.values[0]["backends"]])
def test_matches_reference(c, backend, dtype):
    p, gen = problem(c["B"], c["L"], c["D"], c["G"], c["seed"], pad=c["pad"], prior=c["prior"], center=c["center"])
    if c["fresh_first"]:
        p["prev_count"][0] = 0
    run(p, dtype, gen=gen, contiguous=c["contiguous"], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cpu"])
def test_leading_padded_chunks_no_prior_gradients_finite(backend):
    # Upstream produced NaN prev grads when whole leading chunks are padded and prev_count = 0
    # (docs/math.md, TimestepNorm). Here: 3 whole torch chunks padded (with NaN in x), then data.
    p, gen = problem(2, 200, 8, 2, seed=3, prior=True)
    p["prev_count"][:] = 0
    mask = torch.zeros(2, 200, dtype=torch.bool)
    mask[:, :3 * torch_impl.DEFAULT_CONFIG["chunk"]] = True
    p["x"][mask] = float("nan")
    p["padding_mask"] = mask
    run(p, F32, gen=gen, backend=backend)


@pytest.mark.parametrize("dtype, param_dtype", [
    (F32, F64), (BF16, F32), (F16, F32), (F64, F32), (F32, BF16),
], ids=str)
def test_mixed_dtypes(dtype, param_dtype):
    # scale/bias/prev stats in another float dtype: computed in acc, grads back in their dtype.
    p, gen = problem(2, 40, 16, 4, seed=5, pad="middle", prior=True)
    run(p, dtype, gen=gen, param_dtype=param_dtype)


@given(
    B=st.integers(1, 3), L=st.integers(1, 140), Dg=st.sampled_from([1, 2, 5, 8]), G=st.sampled_from([1, 2, 3, 4]),
    pattern=st.sampled_from(PADDINGS), prior=st.booleans(), contiguous=st.booleans(),
    dtype=st.sampled_from([F32, F64]), chunk=st.sampled_from([1, 3, 16, 64, 256]),
    center=st.sampled_from([0.0, 50.0, -1e3]), seed=st.integers(0, 2**31),
)
def test_property(B, L, Dg, G, pattern, prior, contiguous, dtype, chunk, center, seed):
    p, gen = problem(B, L, Dg * G, G, seed, pad=pattern, prior=prior, center=center)
    with pytest.MonkeyPatch.context() as mp:  # a fixture would not be reset between examples
        mp.setitem(torch_impl.DEFAULT_CONFIG, "chunk", chunk)
        run(p, dtype, gen=gen, contiguous=contiguous)


@pytest.mark.parametrize("chunk", [1, 4, 64, 1000])
def test_chunk_knob_values_agree(chunk, monkeypatch):
    p, gen = problem(2, 150, 16, 4, seed=2, pad="mixed", prior=True)
    baseline = {}
    for T in (chunk, 1000):
        monkeypatch.setitem(torch_impl.DEFAULT_CONFIG, "chunk", T)
        leaves = [as_input(p[k], F64, requires_grad=True) for k in LEAF_NAMES]
        out = timestep_norm(leaves[0], leaves[1], leaves[2], 4, p["prev_count"], leaves[3], leaves[4],
                            p["padding_mask"], backend="torch")
        g = torch.Generator().manual_seed(0)
        ups = [torch.randn(o.shape, generator=g, dtype=F64) for o in (out[0], out[2], out[3])]
        grads = torch.autograd.grad((out[0], out[2], out[3]), leaves, ups)
        baseline[T] = [out[0], out[2], out[3], *grads]
    for k, (a, b) in enumerate(zip(baseline[chunk], baseline[1000])):
        assert_close(f"chunk={chunk} vs one chunk, output {k}", a, to_np(b), 1e-13)
    monkeypatch.setitem(torch_impl.DEFAULT_CONFIG, "chunk", chunk)
    run(p, F32, gen=gen, name=f"T={chunk} ")


def test_triton_tiling_and_reasons():
    assert triton_impl._tiling(15, 4096) == (64, 16)
    assert triton_impl._tiling(1024, 4096) == (4, 1024)
    assert triton_impl.not_supported_reasons(torch.randn(1, 2, 2048), 1)


def _split_run(p, cut, dtype):
    """Run on [0, cut) then [cut, L) with the state carried; return outputs and leaves."""
    leaves = {k: as_input(p[k], dtype if k == "x" else acc_of(dtype), requires_grad=True)
              for k in ("x", "scale", "bias", "prev_mean", "prev_var")}
    x, mask = leaves["x"], p["padding_mask"]
    y1, n1, m1, v1 = timestep_norm(x[:, :cut], leaves["scale"], leaves["bias"], p["num_groups"], p["prev_count"],
                                   leaves["prev_mean"], leaves["prev_var"], mask[:, :cut], backend="torch")
    y2, n2, m2, v2 = timestep_norm(x[:, cut:], leaves["scale"], leaves["bias"], p["num_groups"], n1, m1, v1,
                                   mask[:, cut:], backend="torch")
    return (torch.cat((y1, y2), 1), n2, m2, v2), leaves


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("pattern", ["none", "left", "middle", "right", "mixed"])
@pytest.mark.parametrize("cut", [0, 1, 40, 99, 100])
def test_streaming_equivalence(dtype, pattern, cut):
    p, gen = problem(3, 100, 12, 3, seed=cut, pad=pattern, prior=True)
    if p["padding_mask"] is None:
        p["padding_mask"] = torch.zeros(3, 100, dtype=torch.bool)
    whole, lw = _split_run(p, 100, dtype)  # cut = L: the second call is empty
    split, ls = _split_run(p, cut, dtype)
    np.testing.assert_array_equal(whole[1].numpy(), split[1].numpy())
    f, b = tol("torch", dtype, "fwd"), tol("torch", dtype, "bwd")
    for name, a, e in (("y", split[0], whole[0]), ("mean", split[2], whole[2]), ("var", split[3], whole[3])):
        assert_close(f"split {name}", a, to_np(e), f)
    # Gradients through the carried state: the same upstream gradients on both graphs.
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in (whole[0], whole[2], whole[3])]
    gw = torch.autograd.grad((whole[0], whole[2], whole[3]), list(lw.values()), ups)
    gs = torch.autograd.grad((split[0], split[2], split[3]), list(ls.values()), ups)
    for name, a, e in zip(lw, gs, gw):
        assert_close(f"split d{name}", a, to_np(e), b)


def test_fully_padded_segment_keeps_state_exactly():
    p, gen = problem(2, 10, 8, 2, seed=1, prior=True)
    pm, pv = p["prev_mean"].float(), p["prev_var"].float()
    y, n, m, v = timestep_norm(p["x"].float(), p["scale"].float(), p["bias"].float(), 2, p["prev_count"], pm, pv,
                               torch.ones(2, 10, dtype=torch.bool))
    assert torch.equal(m, pm) and torch.equal(v, pv) and torch.equal(n, p["prev_count"])
    assert torch.equal(y, torch.zeros_like(y))


def test_int32_prev_count_gives_int64_count():
    x = torch.randn(2, 6, 4)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 2:] = True
    _, n, _, _ = timestep_norm(x, torch.ones(4), torch.zeros(4), 2, torch.tensor([7, 0], dtype=torch.int32),
                               padding_mask=mask)
    assert n.dtype == torch.int64 and n.tolist() == [13, 2]


def test_empty_length():
    pm = torch.randn(2, 2, requires_grad=True)
    pv = (torch.rand(2, 2) + 0.5).requires_grad_()
    x = torch.randn(2, 0, 8, requires_grad=True)
    y, n, m, v = timestep_norm(x, torch.ones(8), torch.zeros(8), 2, torch.tensor([3, 0]), pm, pv)
    assert y.shape == (2, 0, 8) and n.tolist() == [3, 0] and torch.equal(m, pm) and torch.equal(v, pv)
    gm, gv = torch.autograd.grad(m.sum() + 2 * v.sum(), [pm, pv])
    assert torch.equal(gm, torch.ones(2, 2)) and torch.equal(gv, torch.full((2, 2), 2.0))


def naive_cumsum_y(x, scale, bias, G, eps=1e-5):
    """The textbook shortcut: running sums of the mean and mean square (what we must NOT do)."""
    B, L, D = x.shape
    xg = x.reshape(B, L, G, D // G)
    gmu = xg.mean(-1)
    gsq = (xg - gmu[..., None]).square().mean(-1) + gmu * gmu
    n = torch.arange(1, L + 1, dtype=x.dtype)[None, :, None]
    mean = gmu.cumsum(1) / n
    var = (gsq.cumsum(1) / n - mean * mean).clamp_min(0.0)
    return ((xg - mean[..., None]) * torch.rsqrt(var + eps)[..., None] * scale.reshape(G, -1)
            + bias.reshape(G, -1)).reshape(B, L, D)


@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("case", ["large_mean", "outlier_first_step"])
def test_fp32_accuracy_large_mean(case, backend):
    # x = 1e3 + N(0,1) (and optionally x[:, 0] = 1e3 + 1e4 N(0,1)) in fp32 at L = 2048: the
    # forward must stay at fp32 rounding level (the naive cumsum form loses several digits). The
    # CUDA kernels too (in the emulator): their shift K, a median, ignores the outlier step.
    gen = torch.Generator().manual_seed(0)
    B, L, D, G = 1, 2048, 64, 4
    x = 1e3 + torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    if case == "outlier_first_step":
        x[:, 0] = 1e3 + 1e4 * torch.randn(B, D, generator=gen, dtype=torch.float64)
    p = dict(x=x, scale=1.0 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64),
             bias=0.1 * torch.randn(D, generator=gen, dtype=torch.float64), num_groups=G)
    x32 = p["x"].float()
    ry = ref.timestep_norm(to_np(x32), to_np(p["scale"].float()), to_np(p["bias"].float()), G)[0]
    y = timestep_norm(x32, p["scale"].float(), p["bias"].float(), G, backend=backend)[0]
    naive = naive_cumsum_y(x32, p["scale"].float(), p["bias"].float(), G)
    ours, theirs = err_ratio(y, ry)[1], err_ratio(naive, ry)[1]
    print(f"{case}: welford-scan y error {ours:.2e}, naive cumsum y error {theirs:.2e}")
    assert ours <= 1e-6  # ~100x below the fp32 table tolerance; measured ~2e-7
    if case == "large_mean":
        assert theirs > 1e-3  # shows the test input really is hard
    run(p, torch.float32, gen=gen, name=f"{case} ", backend=backend)


def test_nonfinite_inputs_propagate():
    # Genuine NaN/inf in unmasked rows reach y and the state from that step on (upstream dropped
    # infinities, docs/math.md, TimestepNorm); earlier steps and other rows stay finite and correct.
    p, gen = problem(4, 30, 8, 2, seed=9, prior=True)
    x = p["x"]
    x[0, 10, 1] = float("inf")
    x[1, 20, 4] = -float("inf")
    x[2, 5, 0] = float("nan")
    y, n, m, v = timestep_norm(x.float(), p["scale"].float(), p["bias"].float(), 2, p["prev_count"],
                               p["prev_mean"].float(), p["prev_var"].float())
    ry, rn, rm, rv = ref.timestep_norm(to_np(x.float()), to_np(p["scale"].float()), to_np(p["bias"].float()), 2,
                                       to_np(p["prev_count"]), to_np(p["prev_mean"].float()),
                                       to_np(p["prev_var"].float()))
    for name, a, e in (("y", y, ry), ("mean", m, rm), ("var", v, rv)):
        a = to_np(a)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(e), err_msg=f"{name}: non-finite pattern")
        fin = np.isfinite(e)
        assert_close(f"{name} (finite part)", a[fin], e[fin], tol("torch", torch.float32, "fwd"))
    assert not np.isfinite(to_np(y[0, 10:, :4])).any() and np.isfinite(to_np(y[0, :10])).all()
    assert np.isfinite(to_np(y[3])).all()


@pytest.mark.parametrize("what", ["y_only", "mean_only", "var_only"])
def test_partial_outputs_used(what):
    # Unused outputs get zero upstream gradients from autograd; the others must still be exact.
    p, gen = problem(2, 37, 12, 3, seed=4, pad="middle", prior=True)
    leaves = [as_input(p[k], torch.float64, requires_grad=True) for k in LEAF_NAMES]
    y, n, m, v = timestep_norm(leaves[0], leaves[1], leaves[2], 3, p["prev_count"], leaves[3], leaves[4],
                               p["padding_mask"])
    out = {"y_only": y, "mean_only": m, "var_only": v}[what]
    up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, up, allow_unused=True)
    ups = {"y_only": (to_np(up), None, None), "mean_only": (np.zeros(y.shape), to_np(up), None),
           "var_only": (np.zeros(y.shape), None, to_np(up))}[what]
    want = ref.timestep_norm_bwd(*ups, *[to_np(t.detach()) for t in leaves[:3]], 3, to_np(p["prev_count"]),
                                 to_np(leaves[3].detach()), to_np(leaves[4].detach()), to_np(p["padding_mask"]))
    for k, (g, w) in enumerate(zip(got, want)):
        g = torch.zeros_like(leaves[k]) if g is None else g
        assert_close(f"{what} grad {k}", g, w, tol("torch", torch.float64, "bwd"))


@pytest.mark.parametrize("backend", ["triton", "cuda", "cpu"])
def test_nonfinite_inputs_propagate_like_torch(backend):
    x = torch.randn(2, 20, 8)
    x[0, 5, 3] = float("inf")
    x[1, 7, 0] = float("nan")
    scale, bias = torch.ones(8), torch.zeros(8)
    a = timestep_norm(x, scale, bias, 1, backend=backend)
    b = timestep_norm(x, scale, bias, 1, backend="torch")
    for u, v in zip(a, b):
        assert torch.equal(torch.isnan(u), torch.isnan(v))
        assert torch.equal(torch.isinf(u), torch.isinf(v))


@pytest.mark.parametrize("backend", ["triton", "cuda", "cpu"])
def test_streaming_equals_one_call(backend):
    p, gen = problem(2, 150, 16, 2, seed=11, pad="random", prior=True)
    args = dict(prev_count=p["prev_count"], prev_mean=p["prev_mean"].float(), prev_var=p["prev_var"].float())
    x, s, b, m = p["x"].float(), p["scale"].float(), p["bias"].float(), p["padding_mask"]
    y, n, mu, var = timestep_norm(x, s, b, 2, padding_mask=m, backend=backend, **args)
    y1, n1, mu1, v1 = timestep_norm(x[:, :70], s, b, 2, padding_mask=m[:, :70], backend=backend, **args)
    y2, n2, mu2, v2 = timestep_norm(x[:, 70:], s, b, 2, n1, mu1, v1, padding_mask=m[:, 70:], backend=backend)
    assert torch.equal(n2, n)
    assert_close("y streamed", torch.cat((y1, y2), 1), to_np(y), 1e-5)
    assert_close("mean streamed", mu2, to_np(mu), 1e-5)
    assert_close("var streamed", v2, to_np(var), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_empty_segment_passes_state_through_like_torch(backend):
    x = torch.randn(2, 0, 8, requires_grad=True)
    pm = torch.randn(2, 2, requires_grad=True)
    pv = torch.rand(2, 2, requires_grad=True)
    outs = {}
    for be in (backend, "torch"):
        y, n, m, v = timestep_norm(x, torch.ones(8), torch.zeros(8), 2, torch.tensor([0, 3]), pm, pv, backend=be)
        outs[be] = (y, n, m, v, *torch.autograd.grad(m.sum() + 2 * v.sum(), [pm, pv]))
    for a, b in zip(outs[backend], outs["torch"]):
        assert torch.equal(a, b)


def test_cpu_backend_without_a_compiler_says_so_and_auto_falls_back(monkeypatch, tmp_path):
    from megalodon_kernels.ops.timestep_norm import BACKENDS, cpu_impl
    monkeypatch.setattr(cpu_impl, "CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGALODON_KERNELS_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setattr(cpu_impl, "_library", cpu_impl._library.__wrapped__)  # no remembered library
    x = torch.randn(1, 4, 8)
    why = cpu_impl.not_supported_reasons(x)
    assert len(why) == 1 and "could not be built" in why[0] and "backend='torch'" in why[0]
    assert BACKENDS.select("auto", {"x": x, "num_groups": 2}, device=x.device, dtype=x.dtype).name == "torch"


@pytest.mark.parametrize("vector", [[], ["-march=x86-64-v3"]], ids=["sse2", "avx2"])
def test_cpu_kernel_narrower_vector_builds(monkeypatch, vector):
    # The kernel's sums have one code path per vector width (8 doubles with AVX-512, 4 with AVX,
    # 2 otherwise); the build picks the widest this CPU has, so the test suite would only run
    # that one: build the narrower ones here (x86-64 only) and check them against the torch backend.
    from megalodon_kernels.ops.timestep_norm import cpu_impl
    use_cpu_build(monkeypatch, cpu_impl, vector)
    g = torch.Generator().manual_seed(3)
    B, L, D, G = 3, 77, 96, 4  # 24 features a group: 3 full lanes of 8, no tail; 77 steps
    x = (torch.randn(B, L, D, generator=g) * 3 + 100).requires_grad_()
    x.data[1, 5:9] = torch.randn(4, D, generator=g) * 1e3  # outliers inside a row
    scale, bias = torch.randn(D, generator=g, requires_grad=True), torch.randn(D, generator=g, requires_grad=True)
    w = torch.randn(B, L, D, generator=g)
    outs = {}
    for be in ("cpu", "torch"):
        y, n, m, v = timestep_norm(x, scale, bias, G, backend=be)
        outs[be] = (y, m, v, *torch.autograd.grad((y * w).sum() + m.sum() + v.sum(), [x, scale, bias]))
    for a, b in zip(outs["cpu"], outs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# ---------------------------------------------------------------------------------------------
# The CUDA kernels themselves (the launch description of cuda_impl.py in the emulator)


def _kernel_case(B, L, D, G, dtype, pad_kind, prev_count, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, L, D, generator=g) * 2 + 3).to(dtype)
    # side inputs in the kernel's accumulation type: genuine float64 values for float64 x, so a
    # kernel that rounded them through fp32 would show
    side = dict(generator=g, dtype=acc_of(dtype))
    scale = torch.randn(D, **side)
    bias = torch.randn(D, **side)
    pc = torch.tensor(prev_count, dtype=torch.int64)
    pm = torch.randn(B, G, **side)
    pv = torch.rand(B, G, **side) + 0.5
    mask = torch.zeros(B, L, dtype=torch.bool)
    if pad_kind == "left":
        mask[0, : L // 2] = True
    elif pad_kind == "mixed":
        mask[0, : L // 3] = True
        mask[-1, L // 4: L // 2] = True
        mask[-1, -3:] = True
    elif pad_kind == "all":
        mask[:] = True
    return x, scale, bias, pc, pm, pv, mask


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("B,L,D,G,pad_kind,prev_count", [
    (2, 1, 4, 1, "none", [0, 0]),
    (2, 31, 12, 3, "mixed", [0, 5]),
    (1, 129, 6, 6, "none", [0]),           # G = D (Dg = 1)
    (2, 700, 8, 2, "left", [0, 3]),        # 64 chunks; leading chunks fully padded
    (1, 40, 64, 2, "all", [4]),            # nothing observed: the prior comes back unchanged
], ids=["L1", "L31_mixed_pad", "L129_G_eq_D", "L700_left_pad", "all_padded"])
def test_cuda_kernels(ext, order, dtype, B, L, D, G, pad_kind, prev_count):
    x, scale, bias, pc, pm, pv, mask = _kernel_case(B, L, D, G, dtype, pad_kind, prev_count)
    y, count, mean, var, saved = tsn_cuda.launch_fwd(emu(ext), x, scale, bias, pc, pm, pv, mask, G, 1e-5)
    args = (to_np(x), scale.numpy(), bias.numpy(), G, pc.numpy(), pm.numpy(), pv.numpy(), mask.numpy())
    yr, cr, mr, vr = ref.timestep_norm(*args)
    assert y.dtype == dtype
    # the statistics and state come back in the accumulation type: float64 only for float64 x
    acc = acc_of(dtype)
    assert mean.dtype == var.dtype == saved[5].dtype == acc
    stat_tol = tol("cuda", F64, "fwd") if dtype == F64 else 2e-5
    assert_close("y", y, yr, tol("cuda", dtype, "fwd"))
    np.testing.assert_array_equal(count.numpy(), cr)
    assert_close("mean", mean, mr, stat_tol)
    assert_close("var", var, vr, stat_tol)
    g = torch.Generator().manual_seed(7)
    dy = torch.randn(B, L, D, generator=g).to(dtype)
    dm, dv = torch.randn(B, G, generator=g, dtype=acc), torch.randn(B, G, generator=g, dtype=acc)
    dx, dscale, dbias, dpm, dpv = tsn_cuda.launch_bwd(emu(ext), dy, dm, dv, saved, G)
    want = ref.timestep_norm_bwd(to_np(dy), dm.numpy(), dv.numpy(), *args[:3], G, *args[4:])
    for name, got, expected in zip(("dx", "dscale", "dbias", "dprev_mean", "dprev_var"),
                                   (dx, dscale, dbias, dpm, dpv), want):
        assert np.isfinite(to_np(got)).all(), name
        assert got.dtype == (dtype if name == "dx" else acc), name
        assert_close(name, got, expected, tol("cuda", dtype, "bwd") if name == "dx" or dtype == F64 else 5e-5)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_cuda_kernels_streaming_and_large_common_mean(ext, dtype):
    # two halves with the carried state == one call; a large common offset does not cancel
    B, L, D, G = 2, 300, 8, 2
    x, scale, bias, pc, pm, pv, mask = _kernel_case(B, L, D, G, dtype, "none", [0, 0], seed=3)
    x = x + 1000.0
    y, *_ = tsn_cuda.launch_fwd(emu(ext), x, scale, bias, pc, pm, pv, mask, G, 1e-5)
    y1, c1, m1, v1, _ = tsn_cuda.launch_fwd(emu(ext), x[:, :111], scale, bias, pc, pm, pv, mask[:, :111], G, 1e-5)
    y2, *_ = tsn_cuda.launch_fwd(emu(ext), x[:, 111:], scale, bias, c1, m1, v1, mask[:, 111:], G, 1e-5)
    # fp64: the offset of 1000 costs ~1e-13 relative in the group variances, far below 1e-10.
    # fp32 with the shift K: y 3.1e-7 against the reference; streamed 3.6e-6, the carried mean
    # (~1003, returned in fp32: half an ulp is 3e-5) starting the second call (measured here)
    streamed_tol, ref_tol = (1.5e-5, 1.3e-6) if dtype == F32 else (tol("cuda", F64, "fwd"),) * 2
    assert_close("streamed", torch.cat([y1, y2], 1), to_np(y), streamed_tol)
    yr, *_ = ref.timestep_norm(to_np(x), scale.numpy(), bias.numpy(), G, pc.numpy(), pm.numpy(), pv.numpy(),
                               mask.numpy())
    assert_close("y", y, yr, ref_tol)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_cuda_kernels_infinities_propagate(ext, dtype):
    x, scale, bias, pc, pm, pv, mask = _kernel_case(1, 20, 4, 1, dtype, "none", [0])
    x[0, 5, 1] = float("inf")
    x[0, 12, :] = float("nan")
    mask[0, 12] = True  # NaN in a padded step reaches nothing
    y, *_ = tsn_cuda.launch_fwd(emu(ext), x, scale, bias, pc, pm, pv, mask, 1, 1e-5)
    yr, *_ = ref.timestep_norm(to_np(x), scale.numpy(), bias.numpy(), 1, pc.numpy(), pm.numpy(), pv.numpy(),
                               mask.numpy())
    assert np.isfinite(to_np(y)[0, :5]).all()
    np.testing.assert_array_equal(np.isfinite(to_np(y)), np.isfinite(yr))
    assert (to_np(y)[0, 12] == 0).all()


# ---------------------------------------------------------------------------------------------
# The reference on its own: backward vs central finite differences, forward vs the closed form
# (pooled mean / population variance of every element seen so far), step 0 vs GroupNorm, streaming


def _reference_problem(seed, B=2, L=7, D=6, G=3, prior=True, pad=True):
    rng = np.random.default_rng(seed)
    x = 1.0 + 2.0 * rng.normal(size=(B, L, D))
    p = dict(x=x, scale=rng.normal(size=D), bias=rng.normal(size=D), num_groups=G)
    if prior:
        p.update(prev_count=rng.integers(0, 4, size=B), prev_mean=rng.normal(size=(B, G)),
                 prev_var=rng.uniform(0.5, 2.0, size=(B, G)))
        p["prev_count"][0] = 0
    if pad:
        m = np.zeros((B, L), dtype=bool)
        m[0, :2] = True  # leading padding with prev_count = 0
        m[0, 4] = True  # a hole: the next step must use the CARRIED mean (docs/math.md, TimestepNorm)
        m[-1, -1] = True
        x[m] = np.nan  # never read
        p["padding_mask"] = m
    return p, rng


@pytest.mark.parametrize("prior", [False, True], ids=["no_prior", "prior"])
@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("G", [1, 3, 6])
def test_reference_backward_matches_finite_differences(prior, pad, G):
    p, rng = _reference_problem(G, G=G, prior=prior, pad=pad)
    y, _, m, v = ref.timestep_norm(**p)
    dy, dm, dv = rng.normal(size=y.shape), rng.normal(size=m.shape), rng.normal(size=v.shape)
    names = ["x", "scale", "bias"] + (["prev_mean", "prev_var"] if prior else [])

    def loss(q):
        yy, _, mm, vv = ref.timestep_norm(**q)
        return float((dy * yy).sum() + (dm * mm).sum() + (dv * vv).sum())

    grads = ref.timestep_norm_bwd(dy, dm, dv, p["x"], p["scale"], p["bias"], G, p.get("prev_count"),
                                  p.get("prev_mean"), p.get("prev_var"), p.get("padding_mask"))
    h = 1e-6
    for name, g in zip(names, grads):
        fd = np.zeros_like(p[name])
        for idx in np.ndindex(fd.shape):
            if np.isnan(p[name][idx]):
                continue  # padded x: its gradient is 0 by construction (checked below)
            plus = {**p, name: p[name].copy()}
            minus = {**p, name: p[name].copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            fd[idx] = (loss(plus) - loss(minus)) / (2 * h)
        err = np.max(np.abs(g - fd)) / max(np.max(np.abs(fd)), 1e-30)
        print(f"d{name}: finite-difference relative error {err:.2e}")
        assert err < 1e-7, name
    if pad:
        assert np.all(grads[0][p["padding_mask"]] == 0)


def test_reference_forward_is_pooled_moments():
    # Without a prior, (mu_t, var_t) are the mean and population variance of ALL elements of the
    # group in unmasked steps <= t; with a prior, it counts as prev_count steps of that moment.
    p, _ = _reference_problem(1, B=2, L=9, D=8, G=2, prior=True, pad=True)
    y, count, mean, var = ref.timestep_norm(**p)
    s = ref._scan(p["x"], 2, p["prev_count"], p["prev_mean"], p["prev_var"], p["padding_mask"])
    x, m = p["x"], p["padding_mask"]
    for b in range(2):
        for g in range(2):
            seen = []
            for t in range(9):
                if not m[b, t]:
                    seen.append(x[b, t, 4 * g:4 * g + 4])
                if not seen:
                    continue
                data = np.concatenate(seen)
                k = len(seen)
                n0 = p["prev_count"][b]
                # pooled: prior (n0 steps with mean m0, var v0) + the observed elements
                tot = n0 + k
                mu = (n0 * p["prev_mean"][b, g] + k * data.mean()) / tot
                ex2 = (n0 * (p["prev_var"][b, g] + p["prev_mean"][b, g] ** 2) + k * np.mean(data ** 2)) / tot
                np.testing.assert_allclose(s["mu"][b, t, g], mu, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(s["var"][b, t, g], ex2 - mu ** 2, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(count, p["prev_count"] + (~m).sum(1))


def test_reference_first_step_is_group_norm():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 12))
    scale, bias = rng.normal(size=12), rng.normal(size=12)
    y = ref.timestep_norm(x, scale, bias, 4)[0]
    gn = torch.nn.functional.group_norm(torch.from_numpy(x[:, 0]), 4, torch.from_numpy(scale),
                                        torch.from_numpy(bias), eps=1e-5)
    np.testing.assert_allclose(y[:, 0], gn.numpy(), rtol=1e-12, atol=1e-12)


def test_reference_streaming():
    p, _ = _reference_problem(2, B=2, L=11, D=6, G=3, prior=True, pad=True)
    whole = ref.timestep_norm(**p)
    first = ref.timestep_norm(**{**p, "x": p["x"][:, :5], "padding_mask": p["padding_mask"][:, :5]})
    second = ref.timestep_norm(p["x"][:, 5:], p["scale"], p["bias"], 3, first[1], first[2], first[3],
                               p["padding_mask"][:, 5:])
    np.testing.assert_allclose(np.concatenate((first[0], second[0]), 1), whole[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(second[1], whole[1])
    np.testing.assert_allclose(second[2], whole[2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(second[3], whole[3], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Bad inputs


def _good():
    return dict(x=torch.randn(2, 5, 6), scale=torch.ones(6), bias=torch.zeros(6), num_groups=3)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(2, 5)), ValueError, r"x must have rank 3 \(B, L, D\)"),
    (dict(x=torch.randn(2, 5, 6, dtype=torch.complex64)), TypeError, "x must have dtype"),
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    (dict(num_groups=4), ValueError, "num_groups must divide D"),
    (dict(num_groups=0), ValueError, "num_groups must be >= 1"),
    (dict(num_groups=3.0), TypeError, "num_groups must be an int"),
    (dict(scale=torch.ones(5)), ValueError, r"scale must have shape \(D,\)"),
    (dict(bias=torch.ones(6, 1)), ValueError, r"bias must have rank 1 \(D,\)"),
    (dict(scale=torch.ones(6, dtype=torch.int64)), TypeError, "scale must have dtype"),
    (dict(prev_count=torch.zeros(3, dtype=torch.int64)), ValueError, r"prev_count must have shape \(B,\)"),
    (dict(prev_count=torch.zeros(2)), TypeError, "prev_count must have dtype"),
    (dict(prev_count=torch.tensor([1, -1])), ValueError, "prev_count must be >= 0"),
    (dict(prev_mean=torch.zeros(2, 2)), ValueError, r"prev_mean must have shape \(B, G\)"),
    (dict(prev_var=torch.ones(2)), ValueError, r"prev_var must have rank 2 \(B, G\)"),
    (dict(prev_var=torch.ones(2, 3, dtype=torch.int32)), TypeError, "prev_var must have dtype"),
    (dict(padding_mask=torch.zeros(2, 5)), TypeError, "padding_mask must have dtype in \\[bool\\]"),
    (dict(padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError, r"padding_mask must have shape \(B, L\)"),
    (dict(eps=0.0), ValueError, "eps must be >"),
    (dict(eps=-1e-5), ValueError, "eps must be >"),
    (dict(backend="cuDNN"), ValueError, "backend must be one of"),
    (dict(scale=torch.ones(6, device="meta")), ValueError, "scale is on meta"),
])
def test_bad_inputs(bad, exc, match):
    args = _good()
    args.update(bad)
    with pytest.raises(exc, match=match):
        timestep_norm(**args)
