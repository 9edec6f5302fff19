"""Tuning harness of dropkey_softmax: scores {B, H, L, S}, causal, no DropKey (p = 0); y and dscores."""
import torch

from ...ops.dropkey_softmax import dropkey_softmax
from ...reference import attention as ref
from .. import registry
from . import TOLERANCE, grads, random, to_np


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    dims = (shape["B"], shape["H"], shape["L"], shape["S"])
    scores = (torch.randn(dims, dtype=torch.float64, generator=gen) * 3.0).to(device, dtype).requires_grad_(True)
    return registry.Case(inputs={"scores": scores}, data={"dy": random(dims, dtype, device, gen)})


def run(case, backend, config):
    scores = case.inputs["scores"]
    y = dropkey_softmax(scores, causal=True, backend=backend)
    return {"y": y, **grads({"y": y}, {"y": case.data["dy"]}, {"scores": scores})}


def reference(case):
    scores, dy = to_np(case.inputs["scores"]), to_np(case.data["dy"])
    return {"y": ref.dropkey_softmax(scores, causal=True), "dscores": ref.dropkey_softmax_bwd(dy, scores, causal=True)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1})
