"""attention (chunked causal, DropKey p=0.1) vs chunked attention materialising the probability
matrix with post-softmax dropout p=0.1."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "attention"
DROP = 0.1


def make(s, dtype, device):
    B, L, H, dh, dv, C = s["B"], s["L"], s["H"], s["dh"], s["dv"], min(s["chunk"], s["L"])
    q, k = (torch.randn(B, L, H, dh, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, L, H, dv, device=device, dtype=dtype, requires_grad=True)
    scale = dh ** -0.5
    call = {b: (lambda b=b: ops.attention(q, k, v, scale=scale, chunk_size=C, dropkey_p=DROP, seed=0, backend=b))
            for b in ("torch", "triton", "cuda")}
    call["materialized"] = lambda: baselines.materialized(q, k, v, C, scale, DROP)
    inputs = {"q": q, "k": k, "v": v, "chunk_size": C, "causal": True, "block_causal": False, "dropkey": True}
    return Case(inputs, call, [q, k, v])


def test_attention(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
