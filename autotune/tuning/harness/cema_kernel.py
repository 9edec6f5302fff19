"""Tuning harness of cema_kernel: shape {B, D, N, L, hx}; k (and b with hx) and every coefficient
gradient. It dispatches on p's dtype (float32 unless float64), so that is the entry's dtype."""
import torch

from ....ops.cema_kernel import cema_kernel
from ....reference import cema_kernel as ref
from ... import registry
from . import TOLERANCE, cema_coefficients, grads, part, real_dtype, sample_rows, take, to_np, triton_prune


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    B, D, N, L = shape["B"], shape["D"], shape["N"], shape["L"]
    p, log_q, gamma = cema_coefficients(D, N, dtype, device, gen)
    hx = None
    if shape["hx"]:
        hx = torch.complex(torch.randn(B, D, N, dtype=torch.float64, generator=gen),
                           torch.randn(B, D, N, dtype=torch.float64, generator=gen)).to(device, log_q.dtype)
        hx.requires_grad_(True)
    real = real_dtype(dtype)
    dk = torch.randn(D, L, dtype=torch.float64, generator=gen).to(device, real)
    db = torch.randn(B, D, L, dtype=torch.float64, generator=gen).to(device, real) if shape["hx"] else None
    return registry.Case(inputs={"p": p, "log_q": log_q, "gamma": gamma, "length": L, "hx": hx},
                         data={"dk": dk, "db": db}, dtype=real)


def run(case, backend, config):
    i = case.inputs
    k, b = cema_kernel(i["p"], i["log_q"], i["gamma"], i["length"], i["hx"], backend=backend)
    wrt = {n: i[n] for n in ("p", "log_q", "gamma", "hx") if i[n] is not None}
    out = {"k": k, "b": b}
    g = grads(out, {"k": case.data["dk"], "b": case.data["db"]}, wrt)
    return {**{n: t for n, t in out.items() if t is not None}, **g}


def reference(case):
    i = case.inputs
    D, N = i["p"].shape
    B = 0 if i["hx"] is None else i["hx"].shape[0]
    rows = sample_rows(D, 2.0 * N * i["length"] * (1 + B))  # channels are independent
    p, lq, gm = (take(to_np(i[n]), rows, 0) for n in ("p", "log_q", "gamma"))
    hx = None if i["hx"] is None else take(to_np(i["hx"]), rows, 1)
    db = None if case.data["db"] is None else take(to_np(case.data["db"]), rows, 1)
    k, b = ref.cema_kernel(p, lq, gm, i["length"], hx)
    dp, dlq, dgm, dhx = ref.cema_kernel_bwd(take(to_np(case.data["dk"]), rows, 0), db, p, lq, gm, i["length"], hx)
    out = {"k": part(k, rows, 0), "dp": part(dp, rows, 0), "dlog_q": part(dlq, rows, 0),
           "dgamma": part(dgm, rows, 0)}
    if hx is not None:
        out.update(b=part(b, rows, 1), dhx=part(dhx, rows, 1))
    return out


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference, tolerance=TOLERANCE,
                           check_shape=lambda s: {**s, "B": 1},
                           prune=triton_prune("cema_kernel"))
