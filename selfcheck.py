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
from .ops._dispatch import PRIORITY

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


CASES: dict[str, tuple[tuple[torch.dtype, ...], Callable]] = {
    "rotary": ((torch.float32, torch.bfloat16), _case_rotary),
}


def _ref(name: str):
    return importlib.import_module(f"megalodon_kernels.reference.{name}")


def _op_backends(op: str):
    return importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS


def _probe_inputs(op: str) -> dict:
    """Representative small CPU fp32 inputs for not_supported_reasons."""
    x = torch.zeros(1, 4, 1, 2)
    return {"rotary": {"x": x}}.get(op, {})


def usable_backends(op: str) -> list[str]:
    table = _op_backends(op)
    return [b for b in PRIORITY if not table.reasons(b, _probe_inputs(op))]


def backend_report() -> list[str]:
    lines = []
    for op in CASES:
        table = _op_backends(op)
        parts = []
        for b, why in table.all_reasons(_probe_inputs(op)).items():
            parts.append(f"{b}: " + ("usable" if not why else "no (" + "; ".join(why) + ")"))
        lines.append(f"{op:<16} " + " | ".join(parts))
    return lines


def run_checks() -> list[Row]:
    rows: list[Row] = []
    for op, (dtypes, case) in CASES.items():
        for backend in usable_backends(op):
            for dtype in dtypes:
                try:
                    results = case(backend, dtype)
                except Exception as exc:  # a crash is a failed check, reported, not a traceback
                    rows.append(Row(op, backend, str(dtype).replace("torch.", ""), "run", float("nan"),
                                    float("nan"), 0.0, False, f"{type(exc).__name__}: {exc}"))
                    continue
                for check, actual, expected, kind in results:
                    tol = TOL[dtype][0 if kind == "fwd" else 1]
                    rows.append(_compare(op, backend, dtype, check, actual, expected, tol))
    return rows
