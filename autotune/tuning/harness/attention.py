"""Tuning harness of attention as Megalodon calls it: causal, block-diagonal chunks of ``chunk``,
softmax, no DropKey; shape {B, L, H, dh, dv, chunk}; o and dq, dk, dv.

With S = L and causal block-diagonal chunks, every chunk is an independent causal attention over
its own C positions: the reference runs chunk by chunk (C x C instead of L x L), and beyond two
chunks it checks the first and the last only (the tiling's edge cases), so the float64 reference
stays small at L = 32768.
"""
import numpy as np
import torch

from ....ops.attention import attention
from ....reference import attention as ref
from ... import registry
from . import TOLERANCE, grads, random, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, L, H, dh, dv = shape["B"], shape["L"], shape["H"], shape["dh"], shape["dv"]
    q = random((B, L, H, dh), dtype, device, gen, requires_grad=True)
    k = random((B, L, H, dh), dtype, device, gen, requires_grad=True)
    v = random((B, L, H, dv), dtype, device, gen, requires_grad=True)
    do = random((B, L, H, dv), dtype, device, gen)
    return registry.Case(inputs={"q": q, "k": k, "v": v, "chunk_size": shape["chunk"], "causal": True,
                                 "block_causal": False, "dropkey": False},
                         data={"chunk": shape["chunk"], "scale": dh ** -0.5, "do": do})


def run(case, backend, config):
    q, k, v = (case.inputs[n] for n in ("q", "k", "v"))
    d = case.data
    o = attention(q, k, v, scale=d["scale"], causal=True, chunk_size=d["chunk"], backend=backend)
    return {"o": o, **grads({"o": o}, {"o": d["do"]}, {"q": q, "k": k, "v": v})}


def reference(case):
    q, k, v, do = (to_np(t) for t in (*(case.inputs[n] for n in ("q", "k", "v")), case.data["do"]))
    L, C = q.shape[1], case.data["chunk"]
    starts = list(range(0, L, C))
    if len(starts) > 2:
        starts = [starts[0], starts[-1]]
    parts, rows = {"o": [], "dq": [], "dk": [], "dv": []}, []
    for s0 in starts:
        t = slice(s0, min(s0 + C, L))
        args = (q[:, t], k[:, t], v[:, t])
        parts["o"].append(ref.attention(*args, scale=case.data["scale"], causal=True))
        grads_t = ref.attention_bwd(do[:, t], *args, scale=case.data["scale"], causal=True)
        for name, g in zip(("dq", "dk", "dv"), grads_t):
            parts[name].append(g)
        rows.extend(range(t.start, t.stop))
    index = (slice(None), np.array(rows))
    return {name: registry.Part(index, np.concatenate(p, axis=1)) for name, p in parts.items()}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("attention"))
