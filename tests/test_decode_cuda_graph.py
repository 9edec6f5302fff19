"""The static decode step captured into a CUDA graph (marker ``gpu``; skipped without a CUDA device):
replaying the graph equals the eager step, token by token, on ragged rows, across chunk
boundaries, and after a row is replaced in place (MegalodonCache.write_rows_).

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_decode_cuda_graph.py
"""
import pytest
import torch

from megalodon_kernels.model import Megalodon, MegalodonConfig
from megalodon_kernels.model.decode import StaticDecoder
from support import perturb_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

C = 8
V = 53


def make_model():
    cfg = dict(num_layers=2, model_dim=32, z_dim=16, value_dim=32, num_heads=2, ffn_hidden_dim=48, cema_ndim=4,
               chunk_size=C, norm_num_groups=4, vocab_size=V, norm_prior_count=2)
    torch.manual_seed(0)
    return perturb_(Megalodon(MegalodonConfig(**cfg)).eval(), 100, 0.2).cuda()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-graph", "compiled-graph"])
@torch.no_grad()
def test_cuda_graph_replay_equals_eager(compiled):
    model = make_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).cuda() for n in (1, 5, 12, 7)]
    eager_cache, logits = model.prefill(prompts)
    graph_cache = eager_cache.clone()
    eager = StaticDecoder(model, eager_cache)
    graphed = StaticDecoder(model, graph_cache, cuda_graph=True,
                            compile={"backend": "inductor"} if compiled else None)
    tok = logits.argmax(-1)
    worst = 0.0
    for i in range(2 * C + 3):
        if i == C:
            fresh, first = model.prefill([prompts[2][:3]])
            for cache in (eager_cache, graph_cache):
                cache.write_rows_([1], fresh)
            tok = tok.clone()
            tok[1] = first.argmax(-1)[0]
        a = eager.step(tok).clone()
        b = graphed.step(tok).clone()
        worst = max(worst, rel_err(b, a))
        tok = a.argmax(-1)
    torch.cuda.synchronize()
    print(f"CUDA graph ({'compiled' if compiled else 'eager'} step) vs eager: relative max error {worst:.1e}")
    assert worst < 1e-5
    for x, y in zip(graph_cache.tensors(), eager_cache.tensors()):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
