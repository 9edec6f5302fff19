"""TimestepNorm torch backend vs the float64 loop reference: forward, every gradient, the streaming
state, padding (with NaN in padded rows), non-finite inputs, the chunk knob, fp32 accuracy with a
large mean / outlier first step, and argument validation."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.timestep_norm import timestep_norm, torch_impl
from megalodon_kernels.reference import timestep_norm as ref
from support import as_input, assert_close, err_ratio, to_np, tol

PATTERNS = ["none", "left", "middle", "right", "random", "all", "mixed"]
LEAF_NAMES = ("x", "scale", "bias", "prev_mean", "prev_var")  # the differentiable inputs


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def pad_mask(kind: str, B: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """(B, L) bool, True = padded, in one of the named layouts."""
    m = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        k = kind if kind != "mixed" else ["none", "left", "middle", "right", "random", "all"][b % 6]
        a, c = sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())
        if k == "left":
            m[b, :c] = True
        elif k == "right":
            m[b, a:] = True
        elif k == "middle":
            m[b, a:c] = True
        elif k == "random":
            m[b] = torch.rand(L, generator=gen) < 0.3
        elif k == "all":
            m[b] = True
    return m


def problem(B, L, D, G, seed, *, pad="none", prior=True, center=0.0, spread=1.0, nan_in_pad=True):
    """Random float64 inputs; padded rows of x hold NaN/inf (they must never matter)."""
    gen = torch.Generator().manual_seed(seed)
    x = center + spread * torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    mask = pad_mask(pad, B, L, gen)
    if nan_in_pad and mask.any():
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=torch.float64)
        x[mask] = junk[torch.randint(0, 4, (int(mask.sum()), 1), generator=gen)].expand(-1, D)
    p = dict(
        x=x,
        scale=1.0 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64),
        bias=0.5 * torch.randn(D, generator=gen, dtype=torch.float64),
        num_groups=G,
        padding_mask=mask if pad != "none" else None,
    )
    if prior:
        p["prev_count"] = torch.randint(0, 6, (B,), generator=gen)
        p["prev_mean"] = center + torch.randn(B, G, generator=gen, dtype=torch.float64)
        p["prev_var"] = 0.5 + spread ** 2 * torch.rand(B, G, generator=gen, dtype=torch.float64)
    return p, gen


def run(p, dtype, *, gen, contiguous=True, param_dtype=None, grads=True, name="", backend="torch"):
    """Run the op on ``backend`` in ``dtype`` and compare y, count, mean, var and every gradient to
    the reference (shared with the Triton and CUDA tests); returns (y, count, mean, var)."""
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
    np.testing.assert_array_equal(count.numpy(), rc)
    assert_close(f"{name}y", y, ry, tol(backend, dtype, "fwd"))
    assert_close(f"{name}mean", mean, rm, tol(backend, acc, "fwd"))
    assert_close(f"{name}var", var, rv, tol(backend, acc, "fwd"))
    if not grads:
        return y, count, mean, var
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    dm = torch.randn(mean.shape, generator=gen, dtype=torch.float64).to(acc)
    dv = torch.randn(var.shape, generator=gen, dtype=torch.float64).to(acc)
    got = dict(zip(leaves, torch.autograd.grad((y, mean, var), list(leaves.values()), (dy, dm, dv))))
    want = dict(zip(["x", "scale", "bias", "prev_mean", "prev_var"], ref.timestep_norm_bwd(
        to_np(dy), to_np(dm), to_np(dv), np_in["x"], np_in["scale"], np_in["bias"], p["num_groups"],
        np_in.get("prev_count"), np_in.get("prev_mean"), np_in.get("prev_var"), np_in.get("padding_mask"))))
    for k, g in got.items():
        assert g.dtype == leaves[k].dtype and g.shape == leaves[k].shape
        # A gradient is rounded to its leaf's dtype: allow the coarser of the two precisions.
        t = max(tol(backend, dtype, "bwd"), tol(backend, g.dtype, "bwd"))
        assert_close(f"{name}d{k}", g, want[k], t)
    return y, count, mean, var


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
def test_matches_reference(dtype, L):
    p, gen = problem(3, L, 60, 4, seed=L, pad="mixed", prior=True)
    run(p, dtype, gen=gen)


@pytest.mark.parametrize("G", [1, 3, 4, 12, 60])
@pytest.mark.parametrize("prior", [False, True], ids=["no_prior", "prior"])
def test_group_counts(G, prior):
    p, gen = problem(2, 33, 60, G, seed=G, pad="none", prior=prior)
    run(p, torch.float32, gen=gen)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_padding(pattern, dtype):
    # L > chunk so that whole leading chunks can be padded with prev_count = 0 (spec 8.4).
    p, gen = problem(4, 150, 12, 3, seed=7, pad=pattern, prior=True)
    p["prev_count"][0] = 0
    run(p, dtype, gen=gen)


def test_leading_padded_chunks_no_prior_gradients_finite():
    # Spec 8.4: upstream produced NaN prev grads when whole leading chunks are padded and
    # prev_count = 0. Here: 3 whole chunks padded (with NaN/inf in x), then data.
    p, gen = problem(2, 200, 8, 2, seed=3, prior=True)
    p["prev_count"][:] = 0
    mask = torch.zeros(2, 200, dtype=torch.bool)
    mask[:, :3 * torch_impl.DEFAULT_CONFIG["chunk"]] = True
    p["x"][mask] = float("nan")
    p["padding_mask"] = mask
    run(p, torch.float32, gen=gen)


def test_noncontiguous_inputs():
    p, gen = problem(3, 45, 20, 5, seed=11, pad="mixed", prior=True)
    run(p, torch.float32, gen=gen, contiguous=False)


@pytest.mark.parametrize("dtype, param_dtype", [
    (torch.float32, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.float64, torch.float32), (torch.float32, torch.bfloat16),
], ids=str)
def test_mixed_dtypes(dtype, param_dtype):
    # scale/bias/prev stats in another float dtype: computed in acc, grads back in their dtype.
    p, gen = problem(2, 40, 16, 4, seed=5, pad="middle", prior=True)
    run(p, dtype, gen=gen, param_dtype=param_dtype)


@given(
    B=st.integers(1, 3), L=st.integers(1, 140), Dg=st.sampled_from([1, 2, 5, 8]), G=st.sampled_from([1, 2, 3, 4]),
    pattern=st.sampled_from(PATTERNS), prior=st.booleans(), contiguous=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]), chunk=st.sampled_from([1, 3, 16, 64, 256]),
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
        leaves = [as_input(p[k], torch.float64, requires_grad=True) for k in LEAF_NAMES]
        out = timestep_norm(leaves[0], leaves[1], leaves[2], 4, p["prev_count"], leaves[3], leaves[4],
                            p["padding_mask"], backend="torch")
        g = torch.Generator().manual_seed(0)
        ups = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in (out[0], out[2], out[3])]
        grads = torch.autograd.grad((out[0], out[2], out[3]), leaves, ups)
        baseline[T] = [out[0], out[2], out[3], *grads]
    for k, (a, b) in enumerate(zip(baseline[chunk], baseline[1000])):
        assert_close(f"chunk={chunk} vs one chunk, output {k}", a, to_np(b), 1e-13)
    monkeypatch.setitem(torch_impl.DEFAULT_CONFIG, "chunk", chunk)
    run(p, torch.float32, gen=gen, name=f"T={chunk} ")


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


@pytest.mark.parametrize("case", ["large_mean", "outlier_first_step"])
def test_fp32_accuracy_large_mean(case):
    # x = 1e3 + N(0,1) (and optionally x[:, 0] = 1e3 + 1e4 N(0,1)) in fp32 at L = 2048: the
    # forward must stay at fp32 rounding level (the naive cumsum form loses several digits).
    gen = torch.Generator().manual_seed(0)
    B, L, D, G = 1, 2048, 64, 4
    x = 1e3 + torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    if case == "outlier_first_step":
        x[:, 0] = 1e3 + 1e4 * torch.randn(B, D, generator=gen, dtype=torch.float64)
    p = dict(x=x, scale=1.0 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64),
             bias=0.1 * torch.randn(D, generator=gen, dtype=torch.float64), num_groups=G)
    x32 = p["x"].float()
    ry = ref.timestep_norm(to_np(x32), to_np(p["scale"].float()), to_np(p["bias"].float()), G)[0]
    y = timestep_norm(x32, p["scale"].float(), p["bias"].float(), G, backend="torch")[0]
    naive = naive_cumsum_y(x32, p["scale"].float(), p["bias"].float(), G)
    ours, theirs = err_ratio(y, ry)[1], err_ratio(naive, ry)[1]
    print(f"{case}: welford-scan y error {ours:.2e}, naive cumsum y error {theirs:.2e}")
    assert ours <= 1e-6  # ~100x below the fp32 table tolerance; measured ~2e-7
    if case == "large_mean":
        assert theirs > 1e-3  # shows the test input really is hard
    run(p, torch.float32, gen=gen, name=f"{case} ")


def test_nonfinite_inputs_propagate():
    # Genuine NaN/inf in unmasked rows reach y and the state from that step on (upstream dropped
    # infinities, spec 8.6); earlier steps and other rows stay finite and correct.
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
