"""Self-check cases behind ``python -m megalodon_kernels``.

One small case per op: run it with every backend usable here, in every dtype the op takes,
forward and backward (random upstream gradients into every output), and compare with the
float64 NumPy reference. Sizes are deliberately awkward (odd lengths, D not a power of two) and
small, so the whole check takes seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import ops
import importlib
from .ops._dispatch import PRIORITY, NoBackendError

# Allowed max|err| / max|ref| per dtype (forward, backward): about 2x what one rounding in that
# dtype costs for bf16/fp16, and what fp32 accumulation over these small sizes costs.
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (5e-5, 1e-4),
    torch.bfloat16: (2e-2, 4e-2),
}


@dataclass
class Row:
    op: str
    backend: str
    dtype: str
    check: str
    max_abs: float
    rel: float
    tol: float
    passed: bool
    note: str = ""


def _np(t):
    t = t.detach().cpu()
    return t.to(torch.complex128 if t.is_complex() else torch.float64).numpy()


def _compare(op, backend, dtype, check, actual, expected, tol) -> Row:
    a, e = _np(actual), np.asarray(expected)
    if a.shape != e.shape:
        return Row(op, backend, str(dtype).replace("torch.", ""), check, float("nan"), float("nan"), tol, False,
                   f"shape {a.shape} != reference {e.shape}")
    diff = np.abs(a - e)
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = max_abs / max(float(np.abs(e).max()) if e.size else 0.0, 1e-30)
    ok = bool(np.isfinite(rel) and rel <= tol)
    return Row(op, backend, str(dtype).replace("torch.", ""), check, max_abs, rel, tol, ok)


def _grads(outputs, inputs, gen):
    """Random upstream gradients into every output; returns (upstream grads, input grads)."""
    outs = [o for o in outputs if o is not None and o.requires_grad]
    ups = []
    for o in outs:
        g = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        if o.is_complex():
            g = torch.complex(g, torch.randn(o.shape, generator=gen, dtype=torch.float64))
        ups.append(g.to(o.dtype))
    grads = torch.autograd.grad(outs, inputs, ups, allow_unused=True)
    return ups, grads


# ----------------------------------------------------------------------------- cases
# Each case: (backend, dtype) -> list of (check name, actual tensor, expected ndarray, kind)


def _case_rotary(backend, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 33, 3, 8, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    pos = torch.arange(1000, 1033)
    y = ops.rotary(x, pos, xpos_scale_base=512.0, backend=backend)
    (dy,), (dx,) = _grads([y], [x], gen)
    return [
        ("y", y, _ref("rotary").rotary(_np(x), pos.numpy(), 10000.0, 512.0), "fwd"),
        ("dx", dx, _ref("rotary").rotary_bwd(_np(dy), pos.numpy(), 10000.0, 512.0), "bwd"),
    ]


def _cema_coeffs(gen, D, N, B, real=torch.float32):
    cplx = torch.complex64 if real == torch.float32 else torch.complex128
    f64 = dict(generator=gen, dtype=torch.float64)
    p = torch.rand(D, N, **f64).to(real).requires_grad_()
    # |q| in (0.5, 1): slow decays, the regime that matters for long contexts
    log_q = torch.complex(-0.7 * torch.rand(D, N, **f64), 3.0 * torch.rand(D, N, **f64)).to(cplx).requires_grad_()
    gamma = torch.complex(torch.randn(D, N, **f64), torch.randn(D, N, **f64)).to(cplx).requires_grad_()
    hx = torch.complex(torch.randn(B, D, N, **f64), torch.randn(B, D, N, **f64)).to(cplx).requires_grad_()
    return p, log_q, gamma, hx


def _case_cema_kernel(backend, dtype):
    gen = torch.Generator().manual_seed(2)
    p, log_q, gamma, hx = _cema_coeffs(gen, 6, 5, 2, dtype)
    L = 37
    k, b = ops.cema_kernel(p, log_q, gamma, L, hx, backend=backend)
    (dk, db), grads = _grads([k, b], [p, log_q, gamma, hx], gen)
    rk, rb = _ref("cema_kernel").cema_kernel(_np(p), _np(log_q), _np(gamma), L, _np(hx))
    rgrads = _ref("cema_kernel").cema_kernel_bwd(_np(dk), _np(db), _np(p), _np(log_q), _np(gamma), L, _np(hx))
    names = ("dp", "dlog_q", "dgamma", "dhx")
    return [("k", k, rk, "fwd"), ("b", b, rb, "fwd")] + [
        (n, g, r, "bwd") for n, g, r in zip(names, grads, rgrads)]


def _case_ema_hidden(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    p, log_q, _, hx = _cema_coeffs(gen, 6, 5, 2)
    x = torch.randn(2, 6, 33, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    h = ops.ema_hidden(x, p, log_q, hx, backend=backend)
    (dh,), grads = _grads([h], [x, p, log_q, hx], gen)
    r = _ref("ema_hidden")
    rgrads = r.ema_hidden_bwd(_np(dh), _np(x), _np(p), _np(log_q), _np(hx))
    return [("h", h, r.ema_hidden(_np(x), _np(p), _np(log_q), _np(hx)), "fwd")] + [
        (n, g, rg, "bwd") for n, g, rg in zip(("dx", "dp", "dlog_q", "dhx"), grads, rgrads)]


def _case_fftconv(backend, dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 63, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(5, 63, generator=gen, dtype=torch.float64).to(torch.float32 if dtype == torch.bfloat16 else dtype)
    k.requires_grad_()
    y = ops.fftconv(x, k, backend=backend)
    (dy,), (dx, dk) = _grads([y], [x, k], gen)
    r = _ref("fftconv")
    rdx, rdk = r.fftconv_bwd(_np(dy), _np(x), _np(k))
    return [("y", y, r.fftconv(_np(x), _np(k)), "fwd"), ("dx", dx, rdx, "bwd"), ("dk", dk, rdk, "bwd")]


def _case_cema(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    p, log_q, gamma, hx = _cema_coeffs(gen, 6, 5, 2)
    x = torch.randn(2, 6, 31, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    omega = torch.randn(6, generator=gen, dtype=torch.float64).float().requires_grad_()
    y, h = ops.cema(x, p, log_q, gamma, omega, hx, return_state=True, backend=backend)
    (dy, dh), grads = _grads([y, h], [x, p, log_q, gamma, omega, hx], gen)
    r = _ref("cema")
    ry, rh = r.cema(_np(x), _np(p), _np(log_q), _np(gamma), _np(omega), _np(hx), True)
    rgrads = r.cema_bwd(_np(dy), _np(dh), _np(x), _np(p), _np(log_q), _np(gamma), _np(omega), _np(hx), True)
    names = ("dx", "dp", "dlog_q", "dgamma", "domega", "dhx")
    return [("y", y, ry, "fwd"), ("h", h, rh, "fwd")] + [(n, g, rg, "bwd") for n, g, rg in zip(names, grads, rgrads)]


def _case_timestep_norm(backend, dtype):
    gen = torch.Generator().manual_seed(6)
    B, L, D, G = 2, 33, 60, 4
    x = (torch.randn(B, L, D, generator=gen, dtype=torch.float64) * 2 + 50).to(dtype).requires_grad_()
    scale = torch.randn(D, generator=gen, dtype=torch.float64).float().requires_grad_()
    bias = torch.randn(D, generator=gen, dtype=torch.float64).float().requires_grad_()
    count0 = torch.tensor([0, 7])
    mean0 = (torch.randn(B, G, generator=gen, dtype=torch.float64) + 50).float().requires_grad_()
    var0 = (torch.rand(B, G, generator=gen, dtype=torch.float64) + 1).float().requires_grad_()
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, :3] = True
    pad[1, 10:12] = True
    y, count, mean, var = ops.timestep_norm(x, scale, bias, G, count0, mean0, var0, pad, backend=backend)
    (dy, dmean, dvar), grads = _grads([y, mean, var], [x, scale, bias, mean0, var0], gen)
    r = _ref("timestep_norm")
    args = (_np(x), _np(scale), _np(bias), G, count0.numpy(), _np(mean0), _np(var0), pad.numpy())
    ry, rcount, rmean, rvar = r.timestep_norm(*args)
    rgrads = r.timestep_norm_bwd(_np(dy), _np(dmean), _np(dvar), *args)
    names = ("dx", "dscale", "dbias", "dprev_mean", "dprev_var")
    return [("y", y, ry, "fwd"), ("count", count, rcount, "fwd"), ("mean", mean, rmean, "fwd"),
            ("var", var, rvar, "fwd")] + [(n, g, rg, "bwd") for n, g, rg in zip(names, grads, rgrads)]


def _case_attention(backend, dtype):
    from .ops.dropkey_rule import dropkey_mask

    gen = torch.Generator().manual_seed(7)
    B, L, S, H, dh, dv = 2, 33, 45, 2, 8, 12
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(B, L, H, dh), mk(B, S, H, dh), mk(B, S, H, dv)
    kw = dict(scale=0.4, causal=True, chunk_size=16, block_causal=True, dropkey_p=0.2, seed=1234)
    o = ops.attention(q, k, v, **kw, backend=backend)
    (do,), grads = _grads([o], [q, k, v], gen)
    r = _ref("attention")
    keep = dropkey_mask(1234, 0.2, B, H, L, S).numpy()
    rkw = dict(scale=0.4, causal=True, chunk_size=16, block_causal=True, keep_mask=keep)
    ro = r.attention(_np(q), _np(k), _np(v), **rkw)
    rgrads = r.attention_bwd(_np(do), _np(q), _np(k), _np(v), **rkw)
    return [("o (chunked, dropkey)", o, ro, "fwd")] + [
        (n, g, rg, "bwd") for n, g, rg in zip(("dq", "dk", "dv"), grads, rgrads)]


def _case_dropkey_softmax(backend, dtype):
    from .ops.dropkey_rule import dropkey_mask

    gen = torch.Generator().manual_seed(8)
    s = (3 * torch.randn(2, 3, 31, 40, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    y = ops.dropkey_softmax(s, True, 0.3, 99, backend=backend)
    (dy,), (ds,) = _grads([y], [s], gen)
    r = _ref("attention")
    keep = dropkey_mask(99, 0.3, 2, 3, 31, 40).numpy()
    return [("y", y, r.dropkey_softmax(_np(s), True, keep), "fwd"),
            ("dscores", ds, r.dropkey_softmax_bwd(_np(dy), _np(s), True, keep), "bwd")]


CASES: dict[str, tuple[tuple[torch.dtype, ...], Callable]] = {
    "cema_kernel": ((torch.float32, torch.float64), _case_cema_kernel),
    "ema_hidden": ((torch.float32, torch.bfloat16), _case_ema_hidden),
    "fftconv": ((torch.float32, torch.bfloat16), _case_fftconv),
    "cema": ((torch.float32, torch.bfloat16), _case_cema),
    "timestep_norm": ((torch.float32, torch.bfloat16), _case_timestep_norm),
    "attention": ((torch.float32, torch.bfloat16), _case_attention),
    "dropkey_softmax": ((torch.float32, torch.bfloat16), _case_dropkey_softmax),
    "rotary": ((torch.float32, torch.bfloat16), _case_rotary),
}


def _ref(name: str):
    return importlib.import_module(f"megalodon_kernels.reference.{name}")


def run_checks() -> tuple[list[Row], dict[str, dict[str, str]]]:
    """Run every case with every backend; returns (rows, availability[op][backend] = "usable" or why not)."""
    rows: list[Row] = []
    availability: dict[str, dict[str, str]] = {}
    for op, (dtypes, case) in CASES.items():
        availability[op] = {}
        for backend in PRIORITY:
            for dtype in dtypes:
                try:
                    results = case(backend, dtype)
                except NoBackendError as exc:  # this backend cannot run here: report why, no row
                    availability[op].setdefault(backend, "no (" + "; ".join(exc.reasons.get(backend, [str(exc)])) + ")")
                    continue
                except Exception as exc:  # a crash is a failed check, reported, not a traceback
                    rows.append(Row(op, backend, str(dtype).replace("torch.", ""), "run", float("nan"),
                                    float("nan"), 0.0, False, f"{type(exc).__name__}: {exc}"))
                    availability[op].setdefault(backend, "usable")
                    continue
                availability[op].setdefault(backend, "usable")
                for check, actual, expected, kind in results:
                    tol = TOL[dtype][0 if kind == "fwd" else 1]
                    rows.append(_compare(op, backend, dtype, check, actual, expected, tol))
    return rows, availability
