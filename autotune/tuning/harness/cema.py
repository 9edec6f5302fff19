"""Tuning harness of cema (kernel + fftconv + skip): shape {B, D, N, L}; y and every gradient."""
import torch

from ....ops.cema import cema
from ....reference import cema as ref
from ... import registry
from . import TOLERANCE, cema_coefficients, grads, part, random, sample_rows, take, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, D, N, L = shape["B"], shape["D"], shape["N"], shape["L"]
    p, log_q, gamma = cema_coefficients(D, N, dtype, device, gen)
    omega = random((D,), p.dtype, device, gen, requires_grad=True)
    x = random((B, D, L), dtype, device, gen, requires_grad=True)
    dy = random((B, D, L), dtype, device, gen)
    return registry.Case(inputs={"x": x, "p": p, "log_q": log_q, "gamma": gamma, "omega": omega, "hx": None},
                         data={"dy": dy})


def run(case, backend, config):
    i = case.inputs
    y, _ = cema(i["x"], i["p"], i["log_q"], i["gamma"], i["omega"], backend=backend)
    wrt = {n: i[n] for n in ("x", "p", "log_q", "gamma", "omega")}
    return {"y": y, **grads({"y": y}, {"y": case.data["dy"]}, wrt)}


def reference(case):
    B, D, L = case.inputs["x"].shape
    rows = sample_rows(D, 4.0 * B * case.inputs["p"].shape[1] * L)  # channels are independent
    axis = {"x": 1, "p": 0, "log_q": 0, "gamma": 0, "omega": 0}
    a = {n: take(to_np(case.inputs[n]), rows, ax) for n, ax in axis.items()}
    y, _ = ref.cema(a["x"], a["p"], a["log_q"], a["gamma"], a["omega"])
    dx, dp, dlq, dgm, dom, _ = ref.cema_bwd(take(to_np(case.data["dy"]), rows, 1), None, a["x"], a["p"], a["log_q"],
                                            a["gamma"], a["omega"])
    return {"y": part(y, rows, 1), "dx": part(dx, rows, 1), "dp": part(dp, rows, 0), "dlog_q": part(dlq, rows, 0),
            "dgamma": part(dgm, rows, 0), "domega": part(dom, rows, 0)}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("cema"))
