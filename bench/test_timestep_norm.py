"""timestep_norm (Welford/Kahan cumulative group norm) vs the naive cumsum(x)/cumsum(x^2) form."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "timestep_norm"


def make(s, dtype, device):
    B, L, D, G = s["B"], s["L"], s["D"], s["G"]
    x = (torch.randn(B, L, D, device=device) + 3).to(dtype).requires_grad_()
    scale = torch.randn(D, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(D, device=device, dtype=dtype, requires_grad=True)
    call = {b: (lambda b=b: ops.timestep_norm(x, scale, bias, G, backend=b)[0]) for b in ("torch", "triton", "cuda", "cpu")}
    call["cumsum_norm"] = lambda: baselines.cumsum_norm(x, scale, bias, G)
    return Case({"x": x, "num_groups": G}, call, [x, scale, bias])


def test_timestep_norm(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
