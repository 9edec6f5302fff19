"""cema_kernel (CEMA Vandermonde, training call: hx=None) vs a per-element exp Vandermonde."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "cema_kernel"


def coefficients(D, N, device, grad=True):
    p = torch.rand(D, N, device=device)
    log_q = torch.complex(-torch.rand(D, N, device=device) * 0.1, torch.rand(D, N, device=device) * 3)
    gamma = torch.complex(torch.randn(D, N, device=device), torch.randn(D, N, device=device))
    return [t.requires_grad_(grad) for t in (p, log_q, gamma)]


def make(s, dtype, device):
    p, log_q, gamma = coefficients(s["D"], s["N"], device)  # CEMA coefficients are fp32 in every set
    L = s["L"]
    call = {b: (lambda b=b: ops.cema_kernel(p, log_q, gamma, L, None, backend=b)[0]) for b in ("torch", "triton", "cuda")}
    call["vandermonde_exp"] = lambda: baselines.vandermonde_exp(p, log_q, gamma, L)
    return Case({"p": p, "log_q": log_q, "gamma": gamma, "length": L, "hx": None}, call, [p, log_q, gamma])


def test_cema_kernel(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
