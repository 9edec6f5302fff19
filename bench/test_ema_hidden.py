"""ema_hidden (last CEMA state) vs an einsum over a per-element exp power tensor."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case
from megalodon_kernels.bench.test_cema_kernel import coefficients

OP = "ema_hidden"


def make(s, dtype, device):
    p, log_q, _ = coefficients(s["D"], s["N"], device)
    x = torch.randn(s["B"], s["D"], s["L"], device=device, dtype=dtype, requires_grad=True)
    call = {b: (lambda b=b: ops.ema_hidden(x, p, log_q, None, backend=b)) for b in ("torch", "triton", "cuda")}
    call["ema_hidden_einsum"] = lambda: baselines.ema_hidden_einsum(x, p, log_q)
    return Case({"x": x, "p": p, "log_q": log_q, "hx": None}, call, [x, p, log_q])


def test_ema_hidden(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
