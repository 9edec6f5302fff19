"""Tuning harness of timestep_norm: shape {B, L, D, G}, no carried state or padding (training);
y, mean, var and the gradients of x, scale, bias from all three."""
import torch

from ...ops.timestep_norm import timestep_norm
from ...reference import timestep_norm as ref
from .. import registry
from . import TOLERANCE, grads, random, to_np


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, L, D, G = shape["B"], shape["L"], shape["D"], shape["G"]
    # An offset and a scale per feature, like activations, so the statistics are not trivial.
    x = torch.randn(B, L, D, dtype=torch.float64, generator=gen) * 2.0 + 0.5
    x = x.to(device, dtype).requires_grad_(True)
    scale = random((D,), dtype, device, gen, requires_grad=True)
    bias = random((D,), dtype, device, gen, requires_grad=True)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    up = {"y": random((B, L, D), dtype, device, gen), "mean": random((B, G), acc, device, gen),
          "var": random((B, G), acc, device, gen)}
    return registry.Case(inputs={"x": x, "num_groups": G}, data={"scale": scale, "bias": bias, "G": G, "up": up})


def run(case, backend, config):
    x, d = case.inputs["x"], case.data
    y, _, mean, var = timestep_norm(x, d["scale"], d["bias"], d["G"], backend=backend)
    out = {"y": y, "mean": mean, "var": var}
    return {**out, **grads(out, d["up"], {"x": x, "scale": d["scale"], "bias": d["bias"]})}


def reference(case):
    d = case.data
    x, scale, bias = to_np(case.inputs["x"]), to_np(d["scale"]), to_np(d["bias"])
    y, _, mean, var = ref.timestep_norm(x, scale, bias, d["G"])
    dx, dscale, dbias, _, _ = ref.timestep_norm_bwd(to_np(d["up"]["y"]), to_np(d["up"]["mean"]), to_np(d["up"]["var"]),
                                                    x, scale, bias, d["G"], None, None, None, None)
    return {"y": y, "mean": mean, "var": var, "dx": dx, "dscale": dscale, "dbias": dbias}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1})
