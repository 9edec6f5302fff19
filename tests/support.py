"""Shared test helpers: the tolerance table, error reporting, awkward inputs.

Errors are measured norm-wise: max|actual - expected| / max|expected| (a per-element relative
error is meaningless where outputs cancel to ~0). Each comparison prints its errors before
asserting, so a failing run shows by how much.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch

# One table per backend and dtype: allowed max-abs-error / max-abs-reference, for forward
# outputs and for gradients. bf16/fp16 follow FlashAttention's rule of thumb: about 2x what a
# plain PyTorch computation in that dtype loses (one bf16 rounding is 2**-9 relative).
TOLERANCES = {
    ("torch", torch.float64): {"fwd": 1e-10, "bwd": 1e-9},
    ("torch", torch.float32): {"fwd": 2e-5, "bwd": 5e-5},
    ("torch", torch.float16): {"fwd": 4e-3, "bwd": 8e-3},
    ("torch", torch.bfloat16): {"fwd": 2e-2, "bwd": 4e-2},
    # Triton runs in the interpreter here, tl.dot rounded like the tensor cores (tests/device_model.py:
    # TF32 / tf32x3 per input_precision); same budget as torch.
    ("triton", torch.float32): {"fwd": 2e-5, "bwd": 5e-5},
    ("triton", torch.float16): {"fwd": 4e-3, "bwd": 8e-3},
    ("triton", torch.bfloat16): {"fwd": 2e-2, "bwd": 4e-2},
    # CUDA kernels run in the SIMT emulator here, with nvcc's FMA contraction and the device's math
    # functions (each off by up to its documented ulp bound: cuda/emu/device_math.h).
    ("cuda", torch.float32): {"fwd": 2e-5, "bwd": 5e-5},
    ("cuda", torch.bfloat16): {"fwd": 2e-2, "bwd": 4e-2},
    # float16: attention only (its flash and matmul paths), fp32 accumulation as for bf16.
    ("cuda", torch.float16): {"fwd": 4e-3, "bwd": 8e-3},
    # fp64 kernels accumulate in double; the fp32 side of the budget is never needed.
    ("cuda", torch.float64): {"fwd": 1e-10, "bwd": 1e-9},
    # The compiled C++ CPU kernels: timestep_norm's statistics in double whatever the input type,
    # fftconv's transforms in the arithmetic dtype as torch's library FFT; the same budget as torch.
    ("cpu", torch.float64): {"fwd": 1e-10, "bwd": 1e-9},
    ("cpu", torch.float32): {"fwd": 2e-5, "bwd": 5e-5},
    ("cpu", torch.float16): {"fwd": 4e-3, "bwd": 8e-3},
    ("cpu", torch.bfloat16): {"fwd": 2e-2, "bwd": 4e-2},
}

#: the ops with tolerance budgets (and "model": the whole model against its float64 self)
OPS = ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax",
       "rotary", "model")

# Per-op widening, with the reason. Keep this small and justified.
OP_TOLERANCE_FACTOR: dict[str, float] = {}


class Tol(float):
    """A tolerance that remembers which budget it came from (op, backend, dtype, kind), so
    :func:`assert_close` can log the error it saw against it (MK_ACCURACY_LOG)."""

    key: tuple = ()

    def __new__(cls, value: float, key: tuple):
        self = super().__new__(cls, value)
        self.key = key
        return self


def op_of_test_file(path: str) -> str | None:
    """The op a test file checks, by its name: tests/test_<op>.py and tests/test_packed_<op>.py;
    tests/test_model*.py and tests/test_packed_model.py are "model". None for any other file."""
    name = os.path.basename(path).removesuffix(".py")
    if not name.startswith("test_"):
        return None
    name = name.removeprefix("test_").removeprefix("packed_")
    if name.startswith("model"):
        return "model"
    return name if name in OPS else None


def tol(backend: str, dtype: torch.dtype, kind: str, op: str | None = None) -> float:
    if op is None:
        caller = sys._getframe(1).f_globals.get("__file__", "")
        op = op_of_test_file(caller)
        if op is None:
            raise ValueError(f"tol() called from {caller!r}, which is not tests/test_<op>.py: pass op=")
    return Tol(TOLERANCES[(backend, dtype)][kind] * OP_TOLERANCE_FACTOR.get(op, 1.0),
               (op, backend, str(dtype).replace("torch.", ""), kind))


def to_np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.is_complex():
            return t.to(torch.complex128).numpy()
        if t.is_floating_point():
            return t.to(torch.float64).numpy()
        return t.numpy()
    return np.asarray(t)


def err_ratio(actual, expected) -> tuple[float, float]:
    a, e = to_np(actual), np.asarray(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: actual {a.shape} vs expected {e.shape}")
    if a.size == 0:
        return 0.0, 0.0
    diff = np.abs(a - e)
    scale = max(float(np.max(np.abs(e))), 1e-30)
    max_err = float(np.nanmax(diff)) if not np.isnan(diff).all() else float("nan")
    if np.isnan(diff).any():
        # NaN where the reference has none is a failure; NaN matching NaN is agreement.
        if not np.array_equal(np.isnan(a), np.isnan(e)):
            return float("inf"), float("inf")
    return max_err, max_err / scale


def log_accuracy(name: str, max_err: float, ratio: float, tolerance: float) -> None:
    """With MK_ACCURACY_LOG=<file>, append one JSON line per comparison (test id, budget key, errors):
    what bench/tolerance_table.py turns into the measured table of docs/verification.md."""
    path = os.environ.get("MK_ACCURACY_LOG")
    if not path:
        return
    import json
    key = getattr(tolerance, "key", ())
    rec = dict(test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], name=name,
               key=list(key), max_abs=max_err, rel=ratio, tol=float(tolerance))
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def assert_close(name: str, actual, expected, tolerance: float) -> None:
    max_err, ratio = err_ratio(actual, expected)
    log_accuracy(name, max_err, ratio, tolerance)
    print(f"{name}: max abs err {max_err:.3e}, relative to max|ref| {ratio:.3e} (tol {tolerance:.1e})")
    assert ratio <= tolerance, f"{name}: relative error {ratio:.3e} > {tolerance:.1e} (max abs err {max_err:.3e})"


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values (every other element of a wider buffer)."""
    wide = torch.stack([t, torch.full_like(t, float("nan")) if t.is_floating_point() or t.is_complex()
                        else torch.zeros_like(t)], dim=-1)
    view = wide[..., 0]
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def as_input(t: torch.Tensor, dtype: torch.dtype | None = None, contiguous: bool = True,
             requires_grad: bool = False) -> torch.Tensor:
    t = t.to(dtype) if dtype is not None else t
    if not contiguous:
        t = noncontiguous(t)
    return t.detach().requires_grad_(requires_grad)


@contextlib.contextmanager
def knobs(backend_module, **config):
    """Run with these knob values for a backend module (the dispatcher copies its DEFAULT_CONFIG
    on every call, so patching the dict is enough); restored afterwards."""
    saved = dict(backend_module.DEFAULT_CONFIG)
    backend_module.DEFAULT_CONFIG.update(config)
    try:
        yield
    finally:
        backend_module.DEFAULT_CONFIG.clear()
        backend_module.DEFAULT_CONFIG.update(saved)


def backend_module(op: str, backend: str):
    """The module of one backend of ``op`` (ops/<op>/<backend>_impl.py), e.g. for :func:`knobs`."""
    return importlib.import_module(f"megalodon_kernels.ops.{op}.{backend}_impl")


def use_cpu_build(monkeypatch, cpu_impl, march: list[str]) -> None:
    """Make a compiled cpu backend module (ops/<op>/cpu_impl.py) build with the -march flags
    ``march`` instead of the widest this CPU has (the kernels' vector width follows the build, so
    the suite would otherwise run only one); skipped off x86-64 or without a compiler."""
    import functools
    import platform
    if platform.machine() != "x86_64" or isinstance(cpu_impl._library(), Exception):
        pytest.skip("x86-64 builds of the cpu kernel need an x86-64 machine with a C++ compiler")
    base = [f for f in cpu_impl.FLAGS if not f.startswith("-march=")]
    monkeypatch.setattr(cpu_impl, "FLAGS", base + march)
    monkeypatch.setattr(cpu_impl, "_library", functools.lru_cache(maxsize=None)(cpu_impl._library.__wrapped__))
    assert "-march=x86-64-v4" not in cpu_impl.FLAGS


# --- input builders ---------------------------------------------------------------------------

def perturb_(module: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Move a model's zero-initialised parameters (norm scales, biases, gamma/beta, priors) off zero:
    adds scale * N(0, 1), drawn in float32 from a generator seeded with ``seed``, to every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return module


def attention_inputs(B, L, S, H, dh, dv, dtype, contiguous=True, data_seed=0):
    """q (B, L, H, dh), k (B, S, H, dh), v (B, S, H, dv) as leaves and an upstream gradient do,
    drawn in float64 from one seeded generator, then rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(data_seed)
    q = as_input(torch.randn(B, L, H, dh, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    k = as_input(torch.randn(B, S, H, dh, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    v = as_input(torch.randn(B, S, H, dv, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    do = torch.randn(B, L, H, dv, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, do


#: padding layouts of :func:`padding_mask`; "mixed" gives each batch row another layout
PADDINGS = ["none", "left", "middle", "right", "random", "all", "mixed"]


def padding_mask(kind: str, B: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """(B, L) bool, True = padded, in one of the :data:`PADDINGS` layouts."""
    m = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        k = kind if kind != "mixed" else PADDINGS[b % 6]
        a, c = sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())
        if k == "left":
            m[b, :c] = True
        elif k == "right":
            m[b, a:] = True
        elif k == "middle":
            m[b, a:c] = True
        elif k == "random":
            m[b] = torch.rand(L, generator=gen) < 0.3
        elif k == "all":
            m[b] = True
    return m


def timestep_norm_inputs(B, L, D, G, seed, *, pad="none", prior=True, center=0.0, spread=1.0, nan_in_pad=True):
    """Random float64 timestep_norm arguments (x (B, L, D), scale, bias, num_groups, padding_mask
    and, with ``prior``, the state prev_count/prev_mean/prev_var) and the generator that drew them.
    Padded rows of x hold NaN/inf/1e30: they must never matter."""
    gen = torch.Generator().manual_seed(seed)
    x = center + spread * torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    mask = padding_mask(pad, B, L, gen)
    if nan_in_pad and mask.any():
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=torch.float64)
        x[mask] = junk[torch.randint(0, 4, (int(mask.sum()), 1), generator=gen)].expand(-1, D)
    p = dict(
        x=x,
        scale=1.0 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64),
        bias=0.5 * torch.randn(D, generator=gen, dtype=torch.float64),
        num_groups=G,
        padding_mask=mask if pad != "none" else None,
    )
    if prior:
        p["prev_count"] = torch.randint(0, 6, (B,), generator=gen)
        p["prev_mean"] = center + torch.randn(B, G, generator=gen, dtype=torch.float64)
        p["prev_var"] = 0.5 + spread ** 2 * torch.rand(B, G, generator=gen, dtype=torch.float64)
    return p, gen


# --- backends -----------------------------------------------------------------------------------

def on_backends(cases, runs_on, backends=("torch", "triton", "cuda")) -> list:
    """``pytest.param(backend, case)`` for every case of an op's table (``pytest.param(case, id=...)``)
    on every backend of ``backends`` that ``runs_on(backend, case)``, with ids ``<backend>-<case id>``.
    The CUDA ones run in the emulator (conftest.py)."""
    params = []
    for backend in backends:
        for c in cases:
            (case,) = c.values
            if runs_on(backend, case):
                params.append(pytest.param(backend, case, id=f"{backend}-{c.id}"))
    return params


# --- CEMA coefficients --------------------------------------------------------------------------

_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


class Coefficients(NamedTuple):
    p: torch.Tensor
    log_q: torch.Tensor
    gamma: torch.Tensor
    hx: torch.Tensor | None


def cema_coefficients(seed, D, N, B=None, dtype=torch.float32, *, min_gap=1e-3, max_gap=0.5) -> Coefficients:
    """CEMA coefficients as the model makes them: p r(D N) in (0.05, 0.95); log_q c(D N) with
    |q| = 1 - gap, gap log-uniform in [min_gap, max_gap], phase uniform in (-pi, pi]; gamma c(D N)
    ~ CN(0, 1/N); with B an initial state hx c(B D N) ~ CN(0, 2), else None.

    Drawn in float64 from ``seed`` (an int, or a torch.Generator that goes on to draw the test's
    other inputs) and rounded once to ``dtype`` (float32 or float64; complex parts to the matching
    complex dtype), so float64 coefficients carry full 53-bit values."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def cnormal(*shape):
        return torch.complex(torch.randn(*shape, generator=gen, dtype=f64),
                             torch.randn(*shape, generator=gen, dtype=f64))

    p = 0.05 + 0.9 * torch.rand(D, N, generator=gen, dtype=f64)
    u = torch.rand(D, N, generator=gen, dtype=f64)
    gap = torch.exp(math.log(min_gap) + (math.log(max_gap) - math.log(min_gap)) * u)
    theta = (2 * torch.rand(D, N, generator=gen, dtype=f64) - 1) * math.pi
    log_q = torch.complex(torch.log1p(-gap), theta)
    gamma = cnormal(D, N) / math.sqrt(2 * N)
    hx = None if B is None else cnormal(B, D, N).to(_COMPLEX[dtype])
    return Coefficients(p.to(dtype), log_q.to(_COMPLEX[dtype]), gamma.to(_COMPLEX[dtype]), hx)


def cema_powers(log_q, exponents, exact: bool = False) -> np.ndarray:
    """q**e for every coefficient, [D, N, E]: in float64, or with ``exact`` in x87 long double (64-bit
    mantissa) from the float64 log_q, the exact value for these inputs to ~1e-16 even at e = 2**16,
    where float64's exp(e * log_q) drifts by ~e * 2**-53 * |arg q|."""
    if exact:
        e = np.asarray(exponents, dtype=np.longdouble)
        return np.exp(e[None, None, :] * to_np(log_q).astype(np.clongdouble)[:, :, None])
    return np.exp(np.asarray(exponents, dtype=np.float64)[None, None, :] * to_np(log_q)[:, :, None])


def finite_difference_grad(loss, args: dict, name: str, step: float = 1e-6) -> np.ndarray:
    """Central-difference gradient of the scalar ``loss(args)`` w.r.t. the NumPy array ``args[name]``.
    Complex inputs are perturbed in their real and imaginary parts separately and assembled as
    dL/dRe + i dL/dIm (PyTorch's convention, which the references promise). In float64 with O(1)
    values the error is ~1e-9 (truncation) + ~1e-10 (rounding)."""
    base = np.asarray(args[name])
    grad = np.zeros(base.shape, dtype=base.dtype)
    for unit in ([1.0, 1j] if np.iscomplexobj(base) else [1.0]):
        for idx in np.ndindex(base.shape):
            vals = []
            for sign in (1.0, -1.0):
                pert = base.copy()
                pert[idx] += sign * step * unit
                vals.append(loss({**args, name: pert}))
            grad[idx] += unit * (vals[0] - vals[1]) / (2 * step)
    return grad
