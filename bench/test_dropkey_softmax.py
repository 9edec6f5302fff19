"""dropkey_softmax (causal, DropKey p=0.1 on the logits) on per-chunk scores vs masked softmax with
post-softmax dropout p=0.1. The scores are those of chunked attention: (B x chunks, H, C, C)."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "dropkey_softmax"
DROP = 0.1


def make(s, dtype, device):
    scores = torch.randn(s["B"], s["H"], s["L"], s["S"], device=device, dtype=dtype, requires_grad=True)
    call = {b: (lambda b=b: ops.dropkey_softmax(scores, True, DROP, 0, backend=b)) for b in ("torch", "triton", "cuda")}
    call["softmax_dropout"] = lambda: baselines.softmax_dropout(scores, DROP)
    return Case({"scores": scores}, call, [scores])


def test_dropkey_softmax(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
