"""Tuning harness of rotary: shape {B, L, H, d}; output y and gradient dx; RoPE positions 0..L-1."""
import torch

from ....ops.rotary import rotary
from ....reference import rotary as ref
from ... import registry
from . import TOLERANCE, random, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, L, H, d = shape["B"], shape["L"], shape["H"], shape["d"]
    x = random((B, L, H, d), dtype, device, gen, requires_grad=True)
    dy = random((B, L, H, d), dtype, device, gen)
    return registry.Case(inputs={"x": x}, data={"positions": torch.arange(L, device=device), "dy": dy})


def run(case, backend, config):
    x, pos, dy = case.inputs["x"], case.data["positions"], case.data["dy"]
    y = rotary(x, pos, backend=backend)
    (dx,) = torch.autograd.grad(y, x, dy)
    return {"y": y, "dx": dx}


def reference(case):
    x, pos, dy = to_np(case.inputs["x"]), case.data["positions"].cpu().numpy(), to_np(case.data["dy"])
    return {"y": ref.rotary(x, pos), "dx": ref.rotary_bwd(dy, pos)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},  # batch is not in the key
                           prune=triton_prune("rotary"))
