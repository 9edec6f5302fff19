"""Self-check cases behind ``python -m megalodon_kernels``.

One small case per op, run with every backend in every dtype the op takes (float32, bfloat16,
float16 and float64; cema_kernel's inputs are the CEMA coefficients, float32 or float64 only),
on every local device (the CPU, and the current CUDA device when there is one). A backend that
refuses the inputs (not built, wrong device, a dtype it has no kernel for) is recorded with its
reasons and produces no row; every case that runs is compared forward and backward (random
upstream gradients into every output) with the float64 NumPy reference. Sizes are deliberately
awkward (odd lengths, D not a power of two) and small, so the whole check takes seconds.

In float64 every input of a case is float64 (complex128 coefficients), so the check is of the
float64 arithmetic end to end; in the other dtypes the side inputs (CEMA coefficients, norm
scale and state, fftconv's kernel) are float32, as the model layer passes them.

Each comparison's budget (:func:`tolerance`) is per op and dtype: 3x to 4x the worst error its
case showed on any backend under the CPU models (:data:`MEASURED`), plus, on a GPU, what the
device computes less accurately than those models (:data:`ON_GPU`, with its reason). So an fp32
kernel that loses a factor of 4 in accuracy, or has a 1e-5 gain error, fails the check
(tests/test_tolerance_sensitivity.py).
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import ops
from .ops._dispatch import PRIORITY, NoBackendError

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

#: The worst max|err| / max|ref| each op's case showed, per input dtype, (forward, backward),
#: over every backend that ran it: torch and cpu on the CPU, Triton in its interpreter with tl.dot
#: rounded like the tensor cores (tests/device_model.py: tf32 / tf32x3 per input_precision), CUDA
#: in the SIMT emulator (FMA contraction, the device math library's documented error bounds).
#: Measured 2026-11-27 by :func:`run_checks` on the CPU three ways: as it is (torch, cpu), with
#: TRITON_INTERPRET=1 under ``python tests/device_model.py`` (Triton), and after
#: ``bench.emulated_cuda.install()`` (CUDA); docs/verification.md, "The self-check's budgets".
#: In bf16/fp16 "forward" includes ema_hidden's h, whose dtype is the coefficients' (complex64):
#: hence its fp32-sized figure.
MEASURED = {
    "cema_kernel": {F32: (1.2e-07, 3.2e-07), F64: (2.4e-15, 2.1e-15)},
    "ema_hidden": {F32: (6.5e-08, 1.5e-07), BF16: (8.4e-08, 3.1e-03), F16: (7.0e-08, 3.2e-04),
                   F64: (5.6e-16, 5.6e-16)},
    "fftconv": {F32: (2.0e-07, 2.3e-07), BF16: (2.3e-03, 2.6e-03), F16: (3.3e-04, 2.1e-04), F64: (3.9e-16, 4.7e-16)},
    # fp32 1.7e-7 / 3.6e-7 (y, dp): the CUDA cema in the emulator, 2026-11-28 (the others 1.1e-7 / 2.4e-7)
    "cema": {F32: (1.7e-07, 3.6e-07), BF16: (2.4e-03, 3.3e-03), F16: (3.0e-04, 4.0e-04), F64: (2.3e-15, 5.5e-15)},
    "timestep_norm": {F32: (2.8e-07, 5.0e-07), BF16: (2.1e-03, 3.4e-03), F16: (2.5e-04, 3.6e-04),
                      F64: (4.2e-15, 5.6e-15)},
    "attention": {F32: (4.3e-07, 4.2e-07), BF16: (3.6e-03, 3.2e-03), F16: (3.6e-04, 3.8e-04), F64: (8.2e-16, 4.0e-16)},
    "dropkey_softmax": {F32: (2.0e-07, 5.5e-07), BF16: (1.9e-03, 4.5e-03), F16: (2.4e-04, 5.0e-04),
                        F64: (4.4e-16, 7.6e-16)},
    "rotary": {F32: (9.3e-08, 7.7e-08), BF16: (2.3e-03, 2.2e-03), F16: (3.0e-04, 3.0e-04), F64: (2.0e-16, 2.7e-16)},
}

#: What a GPU computes less accurately than the models above, per (backend, dtype): added to the
#: budget when the case runs on a CUDA device. Triton's tl.exp / tl.log compile to the GPU's
#: approximate exp2 / log2 (ex2.approx, lg2.approx: about 2 ulp, 2.4e-7 relative in fp32), which
#: the interpreter computes exactly; one such error per output is allowed. The CUDA kernels' math
#: functions are already modelled at their documented bounds, and tensor-core products of
#: bf16/fp16 inputs are exact in fp32, so nothing is added for them. fp32 attention on the CUDA
#: backend uses cuBLAS through torch (the matmul path): exact fp32 under the default
#: ``torch.set_float32_matmul_precision("highest")``; a process that allows TF32 (precision "high"
#: or TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1) makes errors of about 1e-3, which this check reports
#: as a failure: TF32 is not fp32 accuracy.
ON_GPU = {("triton", F32): 2.5e-7}


def budget(measured: float) -> float:
    """3x the measured error rounded up to 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k (no step
    above 4/3): between 3x and 4x the measurement, so any real loss of accuracy shows while
    rounding noise does not."""
    target = 3.0 * measured
    exponent = math.floor(math.log10(target))
    for step in (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        if step * 10.0 ** exponent >= target * (1 - 1e-9):
            return float(f"{step * 10.0 ** exponent:.2g}")
    raise AssertionError(target)


def tolerance(op: str, backend: str, dtype: torch.dtype, kind: str, device: torch.device | str = "cpu") -> float:
    """Allowed max|err| / max|ref| of one comparison (kind "fwd" or "bwd") of ``op``'s case."""
    value = budget(MEASURED[op][dtype][0 if kind == "fwd" else 1])
    if torch.device(device).type == "cuda":
        value += ON_GPU.get((backend, dtype), 0.0)
    return value


#: Every dtype a sequence op takes, in report order.
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Row:
    op: str
    backend: str
    device: str
    dtype: str
    check: str
    max_abs: float
    rel: float
    tol: float
    passed: bool
    note: str = ""


@dataclass
class Availability:
    """What one backend did with one op's case on one device: the dtypes it ran, and for each
    dtype it refused, its reasons (one sentence each, with a hint how to fix it)."""

    ran: list[str] = field(default_factory=list)
    refused: dict[str, list[str]] = field(default_factory=dict)


def _np(t):
    t = t.detach().cpu()
    return t.to(torch.complex128 if t.is_complex() else torch.float64).numpy()


def _compare(where: tuple, check, actual, expected, tol) -> Row:
    a, e = _np(actual), np.asarray(expected)
    if a.shape != e.shape:
        return Row(*where, check, float("nan"), float("nan"), tol, False, f"shape {a.shape} != reference {e.shape}")
    diff = np.abs(a - e)
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = max_abs / max(float(np.abs(e).max()) if e.size else 0.0, 1e-30)
    ok = bool(np.isfinite(rel) and rel <= tol)
    return Row(*where, check, max_abs, rel, tol, ok)


def _grads(outputs, inputs, gen):
    """Random upstream gradients into every output; returns (upstream grads, input grads)."""
    outs = [o for o in outputs if o is not None and o.requires_grad]
    ups = []
    for o in outs:
        g = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        if o.is_complex():
            g = torch.complex(g, torch.randn(o.shape, generator=gen, dtype=torch.float64))
        ups.append(g.to(o.device, o.dtype))
    grads = torch.autograd.grad(outs, inputs, ups, allow_unused=True)
    return ups, grads


def _side(dtype):
    """Dtype of a case's side inputs: float64 in a float64 check, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _leaf(t, device, dtype):
    """A float64 CPU draw as a differentiable leaf of the given device and dtype."""
    return t.to(device, dtype).requires_grad_()


# ----------------------------------------------------------------------------- cases
# Each case: (backend, dtype, device) -> list of (check name, actual tensor, expected ndarray, kind)


def _case_rotary(backend, dtype, device):
    gen = torch.Generator().manual_seed(1)
    x = _leaf(torch.randn(2, 33, 3, 8, generator=gen, dtype=torch.float64), device, dtype)
    pos = torch.arange(1000, 1033)
    y = ops.rotary(x, pos.to(device), xpos_scale_base=512.0, backend=backend)
    (dy,), (dx,) = _grads([y], [x], gen)
    return [
        ("y", y, _ref("rotary").rotary(_np(x), pos.numpy(), 10000.0, 512.0), "fwd"),
        ("dx", dx, _ref("rotary").rotary_bwd(_np(dy), pos.numpy(), 10000.0, 512.0), "bwd"),
    ]


def _cema_coeffs(gen, D, N, B, real, device):
    cplx = torch.complex64 if real == torch.float32 else torch.complex128
    f64 = dict(generator=gen, dtype=torch.float64)
    p = _leaf(torch.rand(D, N, **f64), device, real)
    # |q| in (0.5, 1): slow decays, the regime that matters for long contexts
    log_q = _leaf(torch.complex(-0.7 * torch.rand(D, N, **f64), 3.0 * torch.rand(D, N, **f64)), device, cplx)
    gamma = _leaf(torch.complex(torch.randn(D, N, **f64), torch.randn(D, N, **f64)), device, cplx)
    hx = _leaf(torch.complex(torch.randn(B, D, N, **f64), torch.randn(B, D, N, **f64)), device, cplx)
    return p, log_q, gamma, hx


def _case_cema_kernel(backend, dtype, device):
    gen = torch.Generator().manual_seed(2)
    p, log_q, gamma, hx = _cema_coeffs(gen, 6, 5, 2, dtype, device)
    L = 37
    k, b = ops.cema_kernel(p, log_q, gamma, L, hx, backend=backend)
    (dk, db), grads = _grads([k, b], [p, log_q, gamma, hx], gen)
    rk, rb = _ref("cema_kernel").cema_kernel(_np(p), _np(log_q), _np(gamma), L, _np(hx))
    rgrads = _ref("cema_kernel").cema_kernel_bwd(_np(dk), _np(db), _np(p), _np(log_q), _np(gamma), L, _np(hx))
    names = ("dp", "dlog_q", "dgamma", "dhx")
    return [("k", k, rk, "fwd"), ("b", b, rb, "fwd")] + [
        (n, g, r, "bwd") for n, g, r in zip(names, grads, rgrads)]


def _case_ema_hidden(backend, dtype, device):
    gen = torch.Generator().manual_seed(3)
    p, log_q, _, hx = _cema_coeffs(gen, 6, 5, 2, _side(dtype), device)
    x = _leaf(torch.randn(2, 6, 33, generator=gen, dtype=torch.float64), device, dtype)
    h = ops.ema_hidden(x, p, log_q, hx, backend=backend)
    (dh,), grads = _grads([h], [x, p, log_q, hx], gen)
    r = _ref("ema_hidden")
    rgrads = r.ema_hidden_bwd(_np(dh), _np(x), _np(p), _np(log_q), _np(hx))
    return [("h", h, r.ema_hidden(_np(x), _np(p), _np(log_q), _np(hx)), "fwd")] + [
        (n, g, rg, "bwd") for n, g, rg in zip(("dx", "dp", "dlog_q", "dhx"), grads, rgrads)]


def _case_fftconv(backend, dtype, device):
    gen = torch.Generator().manual_seed(4)
    x = _leaf(torch.randn(2, 5, 63, generator=gen, dtype=torch.float64), device, dtype)
    # k as CEMA passes it: float32 next to half-precision x, else x's dtype
    k_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    k = _leaf(torch.randn(5, 63, generator=gen, dtype=torch.float64), device, k_dtype)
    y = ops.fftconv(x, k, backend=backend)
    (dy,), (dx, dk) = _grads([y], [x, k], gen)
    r = _ref("fftconv")
    rdx, rdk = r.fftconv_bwd(_np(dy), _np(x), _np(k))
    return [("y", y, r.fftconv(_np(x), _np(k)), "fwd"), ("dx", dx, rdx, "bwd"), ("dk", dk, rdk, "bwd")]


def _case_cema(backend, dtype, device):
    gen = torch.Generator().manual_seed(5)
    p, log_q, gamma, hx = _cema_coeffs(gen, 6, 5, 2, _side(dtype), device)
    x = _leaf(torch.randn(2, 6, 31, generator=gen, dtype=torch.float64), device, dtype)
    omega = _leaf(torch.randn(6, generator=gen, dtype=torch.float64), device, _side(dtype))
    y, h = ops.cema(x, p, log_q, gamma, omega, hx, return_state=True, backend=backend)
    (dy, dh), grads = _grads([y, h], [x, p, log_q, gamma, omega, hx], gen)
    r = _ref("cema")
    ry, rh = r.cema(_np(x), _np(p), _np(log_q), _np(gamma), _np(omega), _np(hx), True)
    rgrads = r.cema_bwd(_np(dy), _np(dh), _np(x), _np(p), _np(log_q), _np(gamma), _np(omega), _np(hx), True)
    names = ("dx", "dp", "dlog_q", "dgamma", "domega", "dhx")
    return [("y", y, ry, "fwd"), ("h", h, rh, "fwd")] + [(n, g, rg, "bwd") for n, g, rg in zip(names, grads, rgrads)]


def _case_timestep_norm(backend, dtype, device):
    gen = torch.Generator().manual_seed(6)
    B, L, D, G = 2, 33, 60, 4
    side = _side(dtype)
    x = _leaf(torch.randn(B, L, D, generator=gen, dtype=torch.float64) * 2 + 50, device, dtype)
    scale = _leaf(torch.randn(D, generator=gen, dtype=torch.float64), device, side)
    bias = _leaf(torch.randn(D, generator=gen, dtype=torch.float64), device, side)
    count0 = torch.tensor([0, 7])
    mean0 = _leaf(torch.randn(B, G, generator=gen, dtype=torch.float64) + 50, device, side)
    var0 = _leaf(torch.rand(B, G, generator=gen, dtype=torch.float64) + 1, device, side)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, :3] = True
    pad[1, 10:12] = True
    y, count, mean, var = ops.timestep_norm(x, scale, bias, G, count0.to(device), mean0, var0, pad.to(device),
                                            backend=backend)
    (dy, dmean, dvar), grads = _grads([y, mean, var], [x, scale, bias, mean0, var0], gen)
    r = _ref("timestep_norm")
    args = (_np(x), _np(scale), _np(bias), G, count0.numpy(), _np(mean0), _np(var0), pad.numpy())
    ry, rcount, rmean, rvar = r.timestep_norm(*args)
    rgrads = r.timestep_norm_bwd(_np(dy), _np(dmean), _np(dvar), *args)
    names = ("dx", "dscale", "dbias", "dprev_mean", "dprev_var")
    return [("y", y, ry, "fwd"), ("count", count, rcount, "fwd"), ("mean", mean, rmean, "fwd"),
            ("var", var, rvar, "fwd")] + [(n, g, rg, "bwd") for n, g, rg in zip(names, grads, rgrads)]


def _case_attention(backend, dtype, device):
    from .ops.dropkey_rule import dropkey_mask

    gen = torch.Generator().manual_seed(7)
    B, L, S, H, dh, dv = 2, 33, 45, 2, 8, 12
    mk = lambda *s: _leaf(torch.randn(*s, generator=gen, dtype=torch.float64), device, dtype)  # noqa: E731
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


def _case_dropkey_softmax(backend, dtype, device):
    from .ops.dropkey_rule import dropkey_mask

    gen = torch.Generator().manual_seed(8)
    s = _leaf(3 * torch.randn(2, 3, 31, 40, generator=gen, dtype=torch.float64), device, dtype)
    y = ops.dropkey_softmax(s, True, 0.3, 99, backend=backend)
    (dy,), (ds,) = _grads([y], [s], gen)
    r = _ref("attention")
    keep = dropkey_mask(99, 0.3, 2, 3, 31, 40).numpy()
    return [("y", y, r.dropkey_softmax(_np(s), True, keep), "fwd"),
            ("dscores", ds, r.dropkey_softmax_bwd(_np(dy), _np(s), True, keep), "bwd")]


CASES: dict[str, tuple[tuple[torch.dtype, ...], Callable]] = {
    "cema_kernel": ((torch.float32, torch.float64), _case_cema_kernel),
    "ema_hidden": (ALL_DTYPES, _case_ema_hidden),
    "fftconv": (ALL_DTYPES, _case_fftconv),
    "cema": (ALL_DTYPES, _case_cema),
    "timestep_norm": (ALL_DTYPES, _case_timestep_norm),
    "attention": (ALL_DTYPES, _case_attention),
    "dropkey_softmax": (ALL_DTYPES, _case_dropkey_softmax),
    "rotary": (ALL_DTYPES, _case_rotary),
}


def _ref(name: str):
    return importlib.import_module(f"megalodon_kernels.reference.{name}")


def local_devices() -> list[torch.device]:
    """The CPU, and the current CUDA device when there is one (where the GPU backends can run)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    return devices


def run_checks(devices=None) -> tuple[list[Row], dict[str, dict[str, dict[str, Availability]]]]:
    """Run every case with every backend on every device.

    Returns (rows, availability) with availability[device][op][backend] an :class:`Availability`.
    """
    rows: list[Row] = []
    availability: dict[str, dict[str, dict[str, Availability]]] = {}
    for device in devices or local_devices():
        dev = str(device)
        per_op = availability.setdefault(dev, {})
        for op, (dtypes, case) in CASES.items():
            per_backend = per_op.setdefault(op, {b: Availability() for b in PRIORITY})
            for backend in PRIORITY:
                seen = per_backend[backend]
                for dtype in dtypes:
                    where = (op, backend, dev, dtype_name(dtype))
                    try:
                        results = case(backend, dtype, device)
                    except NoBackendError as exc:  # this backend cannot run these inputs here: why, no row
                        why = getattr(exc, "reasons", {}).get(backend) or [str(exc)]
                        seen.refused[dtype_name(dtype)] = list(why)
                        continue
                    except Exception as exc:  # a crash is a failed check, reported, not a traceback
                        seen.ran.append(dtype_name(dtype))
                        rows.append(Row(*where, "run", float("nan"), float("nan"), 0.0, False,
                                        f"{type(exc).__name__}: {exc}"))
                        continue
                    seen.ran.append(dtype_name(dtype))
                    for check, actual, expected, kind in results:
                        tol = tolerance(op, backend, dtype, kind, device)
                        rows.append(_compare(where, check, actual, expected, tol))
    return rows, availability
