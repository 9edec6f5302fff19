"""Tuning harness of fftconv: shape {B, D, L}; k in float32 (as CEMA passes it); y, dx, dk."""
import torch

from ....ops.fftconv import fftconv
from ....reference import fftconv as ref
from ... import registry
from . import TOLERANCE, grads, part, random, real_dtype, sample_rows, take, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, D, L = shape["B"], shape["D"], shape["L"]
    x = random((B, D, L), dtype, device, gen, requires_grad=True)
    # A decaying kernel like CEMA's, so the output does not grow with L.
    decay = torch.exp(-torch.arange(L, dtype=torch.float64) / max(1.0, L / 8))
    k = (torch.randn(D, L, dtype=torch.float64, generator=gen) * decay).to(device, real_dtype(dtype))
    dy = random((B, D, L), dtype, device, gen)
    return registry.Case(inputs={"x": x, "k": k.requires_grad_(True)}, data={"dy": dy})


def run(case, backend, config):
    x, k = case.inputs["x"], case.inputs["k"]
    y = fftconv(x, k, backend=backend)
    return {"y": y, **grads({"y": y}, {"y": case.data["dy"]}, {"x": x, "k": k})}


def reference(case):
    B, D, L = case.inputs["x"].shape
    rows = sample_rows(D, 1.5 * B * L * L)  # channels are independent; 3 passes of L^2/2 each
    x, k, dy = (take(to_np(t), rows, axis=t.dim() - 2) for t in (case.inputs["x"], case.inputs["k"], case.data["dy"]))
    dx, dk = ref.fftconv_bwd(dy, x, k)
    return {"y": part(ref.fftconv(x, k), rows, 1), "dx": part(dx, rows, 1), "dk": part(dk, rows, 0)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("fftconv"))
