"""TimestepNorm, Triton backend (interpreter) against the float64 loop reference: y, count, mean,
var and every gradient (x, scale, bias, prev_mean, prev_var), fp32 and bf16, padding with NaN/inf
in padded rows, priors with prev_count = 0, several chunks, odd D / G, streaming."""
import pytest
import torch

from megalodon_kernels.ops.timestep_norm import timestep_norm, triton_impl
from support import assert_close, to_np
from test_timestep_norm import problem
from test_timestep_norm import run as check_backend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf lanes the kernels mask away


def run(p, dtype, *, gen, contiguous=True, name=""):
    return check_backend(p, dtype, gen=gen, contiguous=contiguous, name=name, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L", [1, 33, 129])
def test_triton_timestep_norm_matches_reference(dtype, L):
    # D = 30, G = 2: Dg = 15 (tile 16, T = 64: up to 3 chunks); mixed padding and a prior
    p, gen = problem(3, L, 30, 1 if L == 129 else 2, seed=L, pad="mixed", prior=True)
    run(p, dtype, gen=gen)


@pytest.mark.parametrize("pattern", ["left", "middle", "random", "all", "mixed"])
def test_triton_timestep_norm_padding_several_chunks(pattern):
    # Dg = 100 -> tile 256, T = 16: L = 70 spans 5 chunks, some wholly padded, prev_count 0 in batch 0
    p, gen = problem(2, 70, 100, 1, seed=7, pad=pattern, prior=True)
    p["prev_count"][0] = 0
    run(p, torch.float32, gen=gen)


@pytest.mark.parametrize("G", [1, 3, 6])
def test_triton_timestep_norm_groups_no_prior(G):
    p, gen = problem(1, 33, 6, G, seed=G, pad="none", prior=False)  # Dg = 6, 2, 1
    run(p, torch.float32, gen=gen)


def test_triton_timestep_norm_large_mean_and_noncontiguous():
    p, gen = problem(2, 40, 24, 2, seed=5, pad="random", prior=True, center=1e3, spread=1.0)
    run(p, torch.float32, gen=gen, contiguous=False)


def test_triton_timestep_norm_nonfinite_propagates_like_torch():
    x = torch.randn(2, 20, 8)
    x[0, 5, 3] = float("inf")
    x[1, 7, 0] = float("nan")
    scale, bias = torch.ones(8), torch.zeros(8)
    a = timestep_norm(x, scale, bias, 1, backend="triton")
    b = timestep_norm(x, scale, bias, 1, backend="torch")
    for u, v in zip(a, b):
        assert torch.equal(torch.isnan(u), torch.isnan(v))
        assert torch.equal(torch.isinf(u), torch.isinf(v))


def test_triton_timestep_norm_streaming_equals_one_call():
    p, gen = problem(2, 150, 16, 2, seed=11, pad="random", prior=True)
    args = dict(prev_count=p["prev_count"], prev_mean=p["prev_mean"].float(), prev_var=p["prev_var"].float())
    x, s, b, m = p["x"].float(), p["scale"].float(), p["bias"].float(), p["padding_mask"]
    y, n, mu, var = timestep_norm(x, s, b, 2, padding_mask=m, backend="triton", **args)
    y1, n1, mu1, v1 = timestep_norm(x[:, :70], s, b, 2, padding_mask=m[:, :70], backend="triton", **args)
    y2, n2, mu2, v2 = timestep_norm(x[:, 70:], s, b, 2, n1, mu1, v1, padding_mask=m[:, 70:], backend="triton")
    assert torch.equal(n2, n)
    assert_close("y streamed", torch.cat((y1, y2), 1), to_np(y), 1e-5)
    assert_close("mean streamed", mu2, to_np(mu), 1e-5)
    assert_close("var streamed", v2, to_np(var), 1e-5)


def test_triton_timestep_norm_tiling_and_reasons():
    assert triton_impl._tiling(15, 4096) == (64, 16)
    assert triton_impl._tiling(1024, 4096) == (4, 1024)
    assert triton_impl.not_supported_reasons(torch.randn(1, 2, 2048), 1)


def test_triton_timestep_norm_empty_segment_passes_state_through():
    x = torch.randn(2, 0, 8, requires_grad=True)
    pm = torch.randn(2, 2, requires_grad=True)
    pv = torch.rand(2, 2, requires_grad=True)
    outs = {}
    for be in ("triton", "torch"):
        y, n, m, v = timestep_norm(x, torch.ones(8), torch.zeros(8), 2, torch.tensor([0, 3]), pm, pv, backend=be)
        outs[be] = (y, n, m, v, *torch.autograd.grad(m.sum() + 2 * v.sum(), [pm, pv]))
    for a, b in zip(outs["triton"], outs["torch"]):
        assert torch.equal(a, b)
