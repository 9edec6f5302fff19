"""Tuning harness of timestep_norm: shape {B, L, D, G}, no carried state or padding (training);
y, mean, var and the gradients of x, scale, bias from all three."""
import numpy as np
import torch

from ....ops.timestep_norm import timestep_norm
from ....reference import timestep_norm as ref
from ... import registry
from . import TOLERANCE, grads, part, random, sample_rows, take, to_np, triton_prune


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
    B, L, D = case.inputs["x"].shape
    G = d["G"]
    groups = sample_rows(G, 12.0 * B * L * (D // G))  # groups are independent
    # the features of the sampled groups
    feats = None if groups is None else (groups[:, None] * (D // G) + np.arange(D // G)).reshape(-1)
    x, dy = take(to_np(case.inputs["x"]), feats, 2), take(to_np(d["up"]["y"]), feats, 2)
    scale, bias = take(to_np(d["scale"]), feats, 0), take(to_np(d["bias"]), feats, 0)
    dmean, dvar = take(to_np(d["up"]["mean"]), groups, 1), take(to_np(d["up"]["var"]), groups, 1)
    g = G if groups is None else len(groups)
    y, _, mean, var = ref.timestep_norm(x, scale, bias, g)
    dx, dscale, dbias, _, _ = ref.timestep_norm_bwd(dy, dmean, dvar, x, scale, bias, g, None, None, None, None)
    return {"y": part(y, feats, 2), "mean": part(mean, groups, 1), "var": part(var, groups, 1),
            "dx": part(dx, feats, 2), "dscale": part(dscale, feats, 0), "dbias": part(dbias, feats, 0)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("timestep_norm"))
