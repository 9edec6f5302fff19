"""rotary (RoPE on adjacent pairs, float64 angle tables) vs complex RoPE with torch.polar."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "rotary"


def make(s, dtype, device):
    x = torch.randn(s["B"], s["L"], s["H"], s["d"], device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(s["L"], device=device)
    call = {b: (lambda b=b: ops.rotary(x, pos, backend=b)) for b in ("torch", "triton", "cuda")}
    call["complex_rope"] = lambda: baselines.complex_rope(x, pos)
    return Case({"x": x}, call, [x])


def test_rotary(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
