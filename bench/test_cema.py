"""cema (kernel + FFT convolution + omega * x; training call: hx=None, no state) vs the composed
per-element exp Vandermonde + torch.fft convolution."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case
from megalodon_kernels.bench.test_cema_kernel import coefficients

OP = "cema"


def make(s, dtype, device):
    p, log_q, gamma = coefficients(s["D"], s["N"], device)
    omega = torch.randn(s["D"], device=device, requires_grad=True)
    x = torch.randn(s["B"], s["D"], s["L"], device=device, dtype=dtype, requires_grad=True)
    call = {b: (lambda b=b: ops.cema(x, p, log_q, gamma, omega, None, backend=b)) for b in ("torch", "triton", "cuda", "cpu", "auto")}
    call["cema_composed"] = lambda: baselines.cema_composed(x, p, log_q, gamma, omega)
    inputs = {"x": x, "p": p, "log_q": log_q, "gamma": gamma, "omega": omega, "hx": None}
    return Case(inputs, call, [x, p, log_q, gamma, omega])


def test_cema(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
