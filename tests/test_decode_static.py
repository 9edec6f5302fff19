"""The static decode step (model/decode.py): torch.compile(fullgraph=True) of it equals eager, and
one graph serves every step (no recompilation across chunk boundaries, ragged rows or rows
replaced in place). fullgraph=True also proves the step never reads a tensor on the host: a
``.item()``, ``bool(t)`` or ``nonzero`` would break the graph, which fullgraph turns into an error.

The default run compiles with the aot_eager backend (graph capture and functionalisation, a few
seconds); ``--stress`` also compiles with inductor (generated C++, about a minute on a loaded CPU).
"""
import pytest
import torch
import torch._dynamo

from megalodon_kernels.model import Megalodon, MegalodonConfig
from megalodon_kernels.model.decode import StaticDecoder, decode_step
from support import perturb_

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

C = 4
V = 29
CFG = dict(num_layers=2, model_dim=16, z_dim=8, value_dim=12, num_heads=2, ffn_hidden_dim=24, cema_ndim=2,
           chunk_size=C, norm_num_groups=4, vocab_size=V, backend="torch", norm_prior_count=2)


def make_model(**kw):
    torch.manual_seed(0)
    return perturb_(Megalodon(MegalodonConfig(**{**CFG, **kw})).eval(), 100, 0.2)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def run_compiled(model, backend, steps=2 * C + 1):
    """Eager and compiled decoders over the same ragged rows; returns the largest logits error."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (1, 6, 3)]  # three chunk positions
    eager_cache, logits = model.prefill(prompts)
    comp_cache = eager_cache.clone()
    eager = StaticDecoder(model, eager_cache)
    comp = StaticDecoder(model, comp_cache, compile={"backend": backend})
    tok = logits.argmax(-1)
    worst = 0.0
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            if i == C:  # a row replaced in place mid-run (continuous batching on a fixed batch)
                fresh, first = model.prefill([prompts[1][:2]])
                for cache in (eager_cache, comp_cache):
                    cache.write_rows_([0], fresh)
                tok = torch.cat([first.argmax(-1), tok[1:]])
            a = eager.step(tok).clone()
            b = comp.step(tok).clone()
            worst = max(worst, rel_err(b, a))
            tok = a.argmax(-1)
    for x, y in zip(comp_cache.tensors(), eager_cache.tensors()):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    return worst


@torch.no_grad()
def test_compiled_fullgraph_equals_eager_without_recompiling():
    err = run_compiled(make_model(num_layers=1), "aot_eager")
    print(f"aot_eager vs eager: relative max error {err:.1e}")
    assert err < 1e-6


@torch.no_grad()
def test_compiled_inductor_equals_eager(stress):
    if not stress:
        pytest.skip("inductor compile takes about a minute on the CPU: run with --stress")
    err = run_compiled(make_model(attn_fn="laplace", swiglu=True), "inductor")
    print(f"inductor vs eager: relative max error {err:.1e}")
    assert err < 1e-5


@torch.no_grad()
def test_step_equals_general_path_with_laplace_and_fp64():
    """The step against the multi-token streaming path (ops), fp64: the same math to 1e-12."""
    model = make_model(attn_fn="laplace", swiglu=True, scale_emb=True, rescale_nffn=True).double()
    tokens = torch.randint(0, V, (2, 3 * C + 1), generator=torch.Generator().manual_seed(4))
    full = model(tokens)
    cache = model.init_cache(2)
    model(tokens[:, :2], cache=cache)
    stepped = torch.stack([decode_step(model, cache, tokens[:, i]) for i in range(2, tokens.shape[1])], 1)
    err = rel_err(stepped, full[:, 2:])
    print(f"fp64 step vs full forward: {err:.1e}")
    assert err < 1e-12


def test_static_decoder_refuses_what_it_cannot_run():
    model = make_model()
    with pytest.raises(TypeError, match="cache must be a MegalodonCache"):
        StaticDecoder(model, None)
    with pytest.raises(ValueError, match="cuda_graph=True needs a cache on a CUDA device"):
        StaticDecoder(model, model.init_cache(2), cuda_graph=True)
    model.train()
    with pytest.raises(ValueError, match="eval mode"):
        StaticDecoder(model, model.init_cache(2))


def test_one_token_with_autograd_recording_keeps_gradients():
    """The step is inference-only (no_grad); with autograd recording, one-token streaming takes
    the general path, and gradients flow."""
    model = make_model()
    cache = model.init_cache(2)
    with torch.no_grad():
        model(torch.randint(0, V, (2, 3)), cache=cache)
    logits = model(torch.randint(0, V, (2, 1)), cache=cache)
    assert logits.requires_grad
    logits.sum().backward()
    assert model.embed.weight.grad is not None and model.layers[0].mega.wz.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert not model(torch.randint(0, V, (2, 1)), cache=cache).requires_grad
