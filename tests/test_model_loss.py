"""The fused output projection + cross-entropy (model/loss.py) and ``Megalodon(tokens, labels=...)``.

Everything is compared with the unfused path it replaces, ``F.cross_entropy`` over the logits
``hidden @ W.T + b`` (for the model: over ``model(tokens)``), in value and in every gradient:
float64 tightly, float32 to a few ulps of the largest entry, bf16 to its rounding. Block sizes
are forced small so that the last block is partial.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megalodon_kernels.model import Megalodon, get_config, linear_cross_entropy
from megalodon_kernels.model import loss as loss_mod
from support import perturb_

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def _close(name, actual, expected, tol):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
        f"{name}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    rel = float((a - e).abs().max()) / max(float(e.abs().max()), 1e-30)
    assert rel <= tol, f"{name}: relative error {rel:.3e} > {tol:.0e}"


def _reference(h, w, t, b, ignore_index=-100):
    logits = F.linear(h, w, b)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=ignore_index)


def _inputs(dtype, shape=(203,), D=24, V=37, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, shape, generator=g)
    return h, w, b, t


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [x for x in tensors if x is not None])


# ---------------------------------------------------------------------------------------------
# the function


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("ignored", [False, True], ids=["all", "ignored"])
def test_equals_cross_entropy_value_and_gradients(dtype, bias, ignored):
    h, w, b, t = _inputs(dtype, bias=bias)
    if ignored:
        t[::5] = -100  # every block partly ignored,
        t[128:192] = -100  # the third one wholly
    expected = _reference(h, w, t, b)
    expected_grads = _grads(expected, (h, w, b))
    actual = linear_cross_entropy(h, w, t, b, block_rows=64)  # 203 rows: blocks 64, 64, 64, 11
    _close("loss", actual, expected, TOL[dtype])
    for name, a, e in zip(("hidden", "weight", "bias"), _grads(actual, (h, w, b)), expected_grads):
        _close(f"d{name}", a, e, TOL[dtype])


@pytest.mark.parametrize("block_rows", [1, 7, 203, 1000, None])
def test_any_block_size_gives_the_same_result(block_rows):
    h, w, b, t = _inputs(torch.float64, shape=(3, 67), bias=True)
    t[1, 3:9] = -100
    expected = _reference(h, w, t, b)
    expected_grads = _grads(expected, (h, w, b))
    actual = linear_cross_entropy(h, w, t, b, block_rows=block_rows)
    _close("loss", actual, expected, TOL[torch.float64])
    for a, e in zip(_grads(actual, (h, w, b)), expected_grads):
        _close("grad", a, e, TOL[torch.float64])


def test_other_ignore_index_and_upstream_gradient():
    """ignore_index may be a valid class (that class is then left out), and the backward scales
    by the incoming gradient (here 3 * loss^2 through a square)."""
    h, w, b, t = _inputs(torch.float64, bias=True)
    expected = _reference(h, w, t, b, ignore_index=4) ** 3
    expected_grads = _grads(expected, (h, w, b))
    assert (t == 4).any()
    actual = linear_cross_entropy(h, w, t, b, ignore_index=4, block_rows=50) ** 3
    _close("loss", actual, expected, TOL[torch.float64])
    for a, e in zip(_grads(actual, (h, w, b)), expected_grads):
        _close("grad", a, e, TOL[torch.float64])


def test_every_target_ignored_gives_nan_and_zero_gradients_like_cross_entropy():
    h, w, b, t = _inputs(torch.float32, shape=(9,), bias=True)
    t[:] = -100
    expected = _reference(h, w, t, b)
    actual = linear_cross_entropy(h, w, t, b)
    assert torch.isnan(expected) and torch.isnan(actual)
    for a, e in zip(_grads(actual, (h, w, b)), _grads(expected, (h, w, b))):
        assert torch.equal(e, torch.zeros_like(e)) and torch.equal(a, e)


def _ops_run(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, [e.name for e in prof.events()]


def test_no_gradient_work_without_grad():
    """Under no_grad (or when nothing requires grad) the op runs the logits GEMM and the
    log-softmax only: no exp of the probabilities, no gradient GEMMs."""
    h, w, b, t = _inputs(torch.float32, bias=True)
    expected = _reference(h, w, t, b)
    for run in (lambda: linear_cross_entropy(h, w, t, b, block_rows=64),
                lambda: linear_cross_entropy(h.detach(), w.detach(), t, b.detach(), block_rows=64)):
        with torch.no_grad():
            out, names = _ops_run(run)
        _close("loss", out, expected, TOL[torch.float32])
        assert not out.requires_grad
        assert names.count("aten::addmm") == 4 and "aten::mm" not in names, names  # 4 blocks, logits only
        assert "aten::exp_" not in names and "aten::addmm_" not in names and "aten::scatter_add_" not in names


def test_only_the_gradients_asked_for_are_computed():
    """A frozen projection (weight and bias without grad): dh only, no dW GEMM; a frozen input: dW only."""
    h, w, b, t = _inputs(torch.float32, bias=True)
    expected = _reference(h, w, t, b)
    e_h, e_w, e_b = _grads(expected, (h, w, b))
    out, names = _ops_run(lambda: linear_cross_entropy(h, w.detach(), t, b.detach(), block_rows=64))
    assert "aten::addmm_" not in names and names.count("aten::mm") == 4, names
    _close("dhidden", torch.autograd.grad(out, h)[0], e_h, TOL[torch.float32])
    out, names = _ops_run(lambda: linear_cross_entropy(h.detach(), w, t, b, block_rows=64))
    assert names.count("aten::addmm_") == 4 and "aten::mm" not in names, names
    a_w, a_b = torch.autograd.grad(out, (w, b))
    _close("dweight", a_w, e_w, TOL[torch.float32])
    _close("dbias", a_b, e_b, TOL[torch.float32])


def test_autocast_runs_the_logits_gemm_in_the_autocast_dtype():
    """Under autocast the logits are those of the autocast linear (bf16), as the unfused path's."""
    h, w, b, t = _inputs(torch.float32, bias=True)
    with torch.autocast("cpu", torch.bfloat16):
        expected = _reference(h, w, t, b)
        expected_grads = _grads(expected, (h, w, b))
        actual = linear_cross_entropy(h, w, t, b, block_rows=64)
    assert actual.dtype == torch.float32
    fp32 = _reference(h, w, t, b)
    assert abs(float(fp32.detach() - expected.detach())) > 1e-4  # autocast did change the result
    _close("loss", actual, expected, 1e-6)
    for a, e in zip(_grads(actual, (h, w, b)), expected_grads):
        assert a.dtype == e.dtype == torch.float32
        _close("grad", a, e, TOL[torch.bfloat16])


def test_bad_inputs_are_refused():
    h, w, b, t = _inputs(torch.float32, bias=True)
    with pytest.raises(TypeError, match="hidden"):
        linear_cross_entropy(t, w, t)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(TypeError, match="weight dtype"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(h, w, t, b[:3])
    with pytest.raises(TypeError, match="bias dtype"):
        linear_cross_entropy(h, w, t, b.double())
    with pytest.raises(TypeError, match="target"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="block_rows"):
        linear_cross_entropy(h, w, t, block_rows=0)
    for bad in (w.shape[0], -1):
        t2 = t.clone()
        t2[7] = bad
        with pytest.raises(ValueError, match=f"target holds {bad}, outside"):
            linear_cross_entropy(h, w, t2)


def test_custom_op_registration():
    """Schema, fake implementation (shapes/dtypes for torch.compile) and autograd registration."""
    h, w, b, t = _inputs(torch.float32, bias=True)
    op = torch.ops.megalodon_kernels.linear_cross_entropy.default
    for args in ((h, w, b, t, -100, 64, True, True), (h, w, None, t, -100, 64, False, True),
                 (h, w, b, t, -100, 64, False, False)):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_autograd_registration"))


# ---------------------------------------------------------------------------------------------
# the model


def _model(dtype=torch.float64, **overrides):
    cfg = get_config("tiny", **{"num_layers": 2, "vocab_size": 50, "dropout": 0.0, "hidden_dropout": 0.0,
                                "attention_dropout": 0.0, **overrides})
    torch.manual_seed(0)
    return perturb_(Megalodon(cfg).to(dtype), 100).train()


def _step(model, run):
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_model(model, tokens, labels, tol, **kw):
    expected, e_grads = _step(model, lambda: F.cross_entropy(model(tokens, **kw).flatten(0, 1), labels.flatten()))
    actual, grads = _step(model, lambda: model(tokens, labels=labels, **kw))
    _close("loss", actual, expected, tol)
    assert grads.keys() == e_grads.keys() and model.output.output.weight.grad is not None
    for name in grads:
        _close(name, grads[name], e_grads[name], tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("share_emb", [False, True], ids=["untied", "tied"])
def test_model_labels_equal_cross_entropy_of_the_logits(dtype, share_emb, monkeypatch):
    # blocks of 64 rows: 2 x 45 = 90 rows end in a partial block
    monkeypatch.setattr(loss_mod, "_BLOCK_BYTES", 64 * 4 * 50)
    assert loss_mod.default_block_rows(50) == 64
    model = _model(dtype, share_emb=share_emb)
    assert (model.output.output.weight is model.embed.weight) == share_emb
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, 46), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # e.g. a prompt left out of the loss
    # fp64: the same sums in another order; fp32: dW sums 90 rows in two blocks instead of one GEMM
    _check_model(model, tokens[:, :-1], labels, 1e-11 if dtype == torch.float64 else 1e-5)


def test_model_labels_packed_rows(monkeypatch):
    monkeypatch.setattr(loss_mod, "_BLOCK_BYTES", 16 * 4 * 50)
    model = _model()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (2, 30), generator=g)
    labels = torch.randint(0, 50, (2, 30), generator=g)
    segment_ids = torch.tensor([[0] * 12 + [1] * 18, [0] * 30])
    _check_model(model, tokens, labels, 1e-11, segment_ids=segment_ids)
    _check_model(model, tokens[:1], labels[:1], 1e-11, cu_seqlens=torch.tensor([0, 7, 30]))


def test_model_labels_without_grad_and_through_a_cache():
    model = _model().eval()
    tokens = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    with torch.no_grad():
        expected = F.cross_entropy(model(tokens)[0], labels[0])
        loss = model(tokens, labels=labels)
        assert not loss.requires_grad
        cache = model.init_cache(1)
        first = model(tokens[:, :8], cache=cache, labels=labels[:, :8])
        second = model(tokens[:, 8:], cache=cache, labels=labels[:, 8:])
    _close("loss", loss, expected, 1e-12)
    _close("streamed loss", (first * 8 + second * 12) / 20, expected, 1e-12)


def test_model_labels_bad_inputs():
    model = _model()
    tokens = torch.randint(0, 50, (2, 9))
    with pytest.raises(ValueError, match="labels must have the tokens' shape"):
        model(tokens, labels=tokens[:, 1:])
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(tokens, labels=tokens.float())
    with pytest.raises(ValueError, match="target holds 50, outside"):
        model(tokens, labels=torch.full_like(tokens, 50))


def test_model_labels_compile_fullgraph_equals_eager():
    """The loss path compiles into one graph (the fused loss is an opaque custom op) whose loss
    and gradients equal eager."""
    torch._dynamo.reset()
    try:
        model = _model(torch.float32)
        g = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, 50, (2, 33), generator=g)
        labels = torch.randint(0, 50, (2, 33), generator=g)
        labels[1, -3:] = -100
        explain = torch._dynamo.explain(model)(tokens, labels=labels)
        assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
        torch._dynamo.reset()
        expected, e_grads = _step(model, lambda: model(tokens, labels=labels))
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        actual, grads = _step(model, lambda: compiled(tokens, labels=labels))
        _close("loss", actual, expected, 1e-6)
        assert grads.keys() == e_grads.keys()
        for name in grads:
            _close(name, grads[name], e_grads[name], 1e-5)
    finally:
        torch._dynamo.reset()
