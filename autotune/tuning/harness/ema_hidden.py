"""Tuning harness of ema_hidden: shape {B, D, N, L}; h and the gradients of x, p, log_q."""
import torch

from ....ops.ema_hidden import ema_hidden
from ....reference import ema_hidden as ref
from ... import registry
from . import TOLERANCE, cema_coefficients, grads, part, random, sample_rows, take, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, D, N, L = shape["B"], shape["D"], shape["N"], shape["L"]
    p, log_q, _ = cema_coefficients(D, N, dtype, device, gen)
    x = random((B, D, L), dtype, device, gen, requires_grad=True)
    dh = torch.complex(torch.randn(B, D, N, dtype=torch.float64, generator=gen),
                       torch.randn(B, D, N, dtype=torch.float64, generator=gen)).to(device, log_q.dtype)
    return registry.Case(inputs={"x": x, "p": p, "log_q": log_q, "hx": None}, data={"dh": dh})


def run(case, backend, config):
    i = case.inputs
    h = ema_hidden(i["x"], i["p"], i["log_q"], None, backend=backend)
    return {"h": h, **grads({"h": h}, {"h": case.data["dh"]}, {n: i[n] for n in ("x", "p", "log_q")})}


def reference(case):
    i = case.inputs
    B, D, L = i["x"].shape
    rows = sample_rows(D, 3.0 * B * i["p"].shape[1] * L)  # channels are independent
    x, dh = take(to_np(i["x"]), rows, 1), take(to_np(case.data["dh"]), rows, 1)
    p, lq = take(to_np(i["p"]), rows, 0), take(to_np(i["log_q"]), rows, 0)
    dx, dp, dlq, _ = ref.ema_hidden_bwd(dh, x, p, lq)
    return {"h": part(ref.ema_hidden(x, p, lq), rows, 1), "dx": part(dx, rows, 1), "dp": part(dp, rows, 0),
            "dlog_q": part(dlq, rows, 0)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("ema_hidden"))
