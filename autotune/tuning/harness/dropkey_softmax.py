"""Tuning harness of dropkey_softmax: scores {B, H, L, S}, causal, no DropKey (p = 0); y and dscores."""
import numpy as np
import torch

from ....ops.dropkey_softmax import dropkey_softmax
from ....reference import attention as ref
from ... import registry
from . import TOLERANCE, grads, part, random, sample_rows, take, to_np, triton_prune


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
    B, H, L, S = case.inputs["scores"].shape
    rows = sample_rows(L, 8.0 * B * H * S)  # query rows are independent
    scores, dy = (take(to_np(t), rows, 2) for t in (case.inputs["scores"], case.data["dy"]))
    i = np.arange(L) if rows is None else rows
    # the bottom-right causal mask of the sampled rows, given explicitly (the reference would
    # otherwise align the sampled rows as if they were the last ones)
    visible = np.broadcast_to(np.arange(S)[None, :] <= (i + (S - L))[:, None], scores.shape)
    return {"y": part(ref.dropkey_softmax(scores, causal=False, keep_mask=visible), rows, 2),
            "dscores": part(ref.dropkey_softmax_bwd(dy, scores, causal=False, keep_mask=visible), rows, 2)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("dropkey_softmax"))
