"""fftconv (causal long convolution) vs a direct O(L^2) conv1d and a plain torch.fft convolution."""
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import baselines
from megalodon_kernels.bench.conftest import Case

OP = "fftconv"


def make(s, dtype, device):
    x = torch.randn(s["B"], s["D"], s["L"], device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(s["D"], s["L"], device=device, requires_grad=True)  # CEMA's kernel is fp32
    call = {b: (lambda b=b: ops.fftconv(x, k, backend=b)) for b in ("torch", "triton", "cuda", "cpu")}
    call["direct_conv"] = lambda: baselines.direct_conv(x, k)
    call["torch_fft"] = lambda: baselines.torch_fft(x, k)
    return Case({"x": x, "k": k}, call, [x, k])


def test_fftconv(run_case, L, mode, provider):
    run_case(make, OP, L, mode, provider)
