"""Shared test helpers: the tolerance table, error reporting, awkward inputs.

Errors are measured norm-wise against the magnitude of the terms: max|actual - expected| /
max(terms), where ``terms`` is what the reference computes beside each output (the same
computation on |inputs|, reference/terms.py; by hand for the nonlinear ops), the scale that
rounding in any algorithm for that output takes. An output whose terms cancel (a gradient summed
over a single channel) is held to the rounding of its terms, not to its own small value; a
comparison that passes no terms falls back to max|expected| (a per-element relative error is
meaningless where outputs cancel to ~0). Each comparison prints its errors before asserting, so a
failing run shows by how much.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16

#: the ops with tolerance budgets (and "model": the whole model against its float64 self)
OPS = ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax",
       "rotary", "model")

# Budgets: allowed max-abs-error / max-abs-reference per op x backend x dtype, for forward outputs
# ("fwd") and gradients ("bwd"); tol() looks them up, the op named by the calling test file.
#
# float32 and float64: budget() of the worst error that op's tests see with that backend
# (MEASURED), i.e. 3x to 4x of it: a kernel that loses accuracy, or has a 1e-5 gain error
# (tests/test_tolerance_sensitivity.py), fails, while rounding noise does not. MEASURED is the table
# of docs/verification.md ("What the tests see"), made by
#     python bench/accuracy_tests.py --python --run tests/test_<op>.py tests/test_packed_<op>.py ...
# with Triton in the interpreter, tl.dot rounded like the tensor cores (tests/device_model.py), and
# CUDA in the SIMT emulator (nvcc's FMA contraction, the device math library's error bounds).
# Re-measure after changing a kernel's arithmetic; a figure that needs more than the rest of its
# op says why next to it. A comparison that needs its own number (not a budget) carries it, with
# the measured figure, in its test.
MEASURED: dict[tuple, tuple[float, float]] = {
    # (op, backend, dtype): (worst forward error, worst gradient error)
    ("attention", "cuda", F32): (4.57e-07, 1.16e-06),
    ("attention", "cuda", F64): (8.43e-16, 7.72e-16),
    ("attention", "torch", F32): (4.16e-07, 6.78e-07),
    ("attention", "torch", F64): (7.87e-16, 1.06e-15),
    # gradients 2.8e-6: dk of blockcausal rows with 90% of the keys dropped (test_empty_rows_...),
    # a small max|dk| against tf32x3 products of O(1) operands (9.2e-7 with exact dots, as CUDA)
    ("attention", "triton", F32): (9.52e-07, 2.76e-06),
    ("cema", "cpu", F32): (2.44e-07, 1.54e-06),  # as torch
    ("cema", "cpu", F64): (9.65e-15, 1.40e-14),
    ("cema", "cuda", F32): (4.87e-07, 8.96e-08),  # y 4.9e-7: test_streaming's split after 1 step
    ("cema", "cuda", F64): (1.27e-15, 2.74e-15),
    ("cema", "torch", F32): (4.05e-07, 1.54e-06),  # domega 1.5e-6 at L = 2049
    ("cema", "torch", F64): (2.02e-14, 2.24e-14),
    ("cema", "triton", F32): (3.41e-07, 6.77e-07),
    ("cema_kernel", "cuda", F32): (3.31e-07, 5.75e-07),
    ("cema_kernel", "cuda", F64): (2.45e-14, 7.18e-14),
    ("cema_kernel", "torch", F32): (2.31e-07, 4.09e-07),
    ("cema_kernel", "torch", F64): (3.07e-14, 5.26e-14),
    ("cema_kernel", "triton", F32): (2.75e-07, 6.47e-07),
    ("dropkey_softmax", "cuda", F32): (1.82e-07, 5.37e-07),
    ("dropkey_softmax", "cuda", F64): (5.02e-16, 8.87e-16),
    ("dropkey_softmax", "torch", F32): (2.37e-07, 1.13e-06),
    ("dropkey_softmax", "torch", F64): (5.02e-16, 1.14e-15),
    ("dropkey_softmax", "triton", F32): (1.67e-07, 2.55e-07),
    ("ema_hidden", "cuda", F32): (2.85e-07, 2.79e-07),
    ("ema_hidden", "cuda", F64): (5.50e-14, 3.94e-13),  # dhx 3.9e-13 at L = 5000 with 1 - |q| ~ 1e-3
    ("ema_hidden", "torch", F32): (2.74e-07, 7.97e-07),
    ("ema_hidden", "torch", F64): (1.14e-14, 3.34e-14),
    ("ema_hidden", "triton", F32): (5.97e-07, 4.93e-07),
    ("fftconv", "cpu", F32): (2.24e-07, 1.93e-07),
    ("fftconv", "cpu", F64): (8.07e-16, 9.35e-16),
    ("fftconv", "cuda", F32): (3.97e-07, 3.54e-07),
    ("fftconv", "cuda", F64): (2.17e-15, 2.45e-15),
    ("fftconv", "torch", F32): (3.31e-07, 2.70e-07),
    ("fftconv", "torch", F64): (5.52e-16, 4.87e-16),
    ("fftconv", "triton", F32): (2.95e-07, 3.51e-07),
    # forward 4.5e-7: test_model.py's lm logits (its own check(), printed with -s, not logged)
    ("model", "torch", F32): (4.50e-07, 1.42e-06),
    # float64 model gradients are held to the forward budget (test_packed_model)
    ("model", "torch", F64): (6.15e-15, 0.00e+00),
    ("model", "triton", F32): (3.66e-07, 1.39e-06),
    ("rotary", "cuda", F32): (9.48e-08, 9.25e-08),
    ("rotary", "cuda", F64): (3.51e-16, 4.35e-16),
    ("rotary", "torch", F32): (9.48e-08, 9.39e-08),
    ("rotary", "torch", F64): (4.20e-14, 4.35e-16),  # 4.2e-14: test_xpos_limit, xPos scales near the float64 limit
    ("rotary", "triton", F32): (9.48e-08, 9.25e-08),
    ("timestep_norm", "cpu", F32): (5.49e-08, 3.06e-06),  # dscale 3.1e-6 at G = D = 60 without a prior
    ("timestep_norm", "cpu", F64): (1.60e-13, 2.50e-13),
    # as torch (mean 4.4e-6 at L150-D12-G3, dx 4.6e-6 at G = D). Since 69216b4 (scaled backward
    # carries) test_cuda_kernels[L129_G_eq_D] dx is 7.5e-6 (was 1.8e-6): within this budget (1.5e-5)
    # but not yet explained; left here, not folded into the figure, until it is
    ("timestep_norm", "cuda", F32): (4.37e-06, 4.57e-06),
    ("timestep_norm", "cuda", F64): (1.53e-13, 2.64e-13),
    # mean 2e-6: a zero-mean case's running mean is small, its norm-wise error is not; dx 3.4e-6:
    # G = D without a prior (one channel per group, the first steps' variance over 1-2 values)
    ("timestep_norm", "torch", F32): (2.05e-06, 3.35e-06),
    ("timestep_norm", "torch", F64): (2.61e-13, 3.84e-13),
    ("timestep_norm", "triton", F32): (2.69e-06, 8.45e-06),  # as torch; dx 8.5e-6 at G = D without a prior
}

# The same on the scale of the terms (assert_close with terms=): the worst max|err| / max(terms)
# the op's tests see, measured by
#     python bench/accuracy_tests.py --terms --python --run tests/test_<op>.py tests/test_packed_<op>.py ...
# (docs/verification.md, "Bounds on the magnitude of the terms"). A comparison with terms is held
# to this budget where its (op, backend, dtype) has one, else to MEASURED's, which bounds it too
# (max(terms) >= max|ref|) but more loosely. About 1-2 units of float32 rounding (u = 6e-8) at
# worst, whatever the output cancels; timestep_norm on CUDA 6e-7 (the running mean of a bf16 input
# over 150 steps, the figure MEASURED's note on that backend leaves unexplained too).
MEASURED_TERMS: dict[tuple, tuple[float, float]] = {
    ("attention", "cuda", F32): (1.13e-07, 1.11e-07),
    ("attention", "cuda", F64): (6.45e-17, 9.08e-17),
    ("attention", "torch", F32): (5.37e-08, 4.79e-08),
    ("attention", "torch", F64): (6.52e-17, 8.04e-17),
    ("attention", "triton", F32): (4.22e-08, 6.21e-08),
    ("cema", "cpu", F32): (6.59e-08, 8.96e-08),
    ("cema", "cpu", F64): (8.25e-16, 7.36e-15),
    ("cema", "cuda", F32): (6.59e-08, 8.96e-08),
    ("cema", "cuda", F64): (4.41e-16, 2.74e-15),
    ("cema", "torch", F32): (6.59e-08, 9.65e-08),
    ("cema", "torch", F64): (1.54e-15, 7.36e-15),
    ("cema", "triton", F32): (1.03e-07, 8.96e-08),
    ("cema_kernel", "cuda", F32): (1.09e-07, 4.54e-08),
    ("cema_kernel", "cuda", F64): (5.33e-15, 3.49e-15),
    ("cema_kernel", "torch", F32): (8.15e-08, 4.93e-08),
    ("cema_kernel", "torch", F64): (1.26e-14, 4.89e-15),
    ("cema_kernel", "triton", F32): (1.02e-07, 6.46e-08),
    ("dropkey_softmax", "cuda", F32): (1.76e-08, 1.63e-08),
    ("dropkey_softmax", "cuda", F64): (4.31e-17, 2.08e-17),
    ("dropkey_softmax", "torch", F32): (2.41e-08, 1.71e-08),
    ("dropkey_softmax", "torch", F64): (4.31e-17, 4.13e-17),
    ("dropkey_softmax", "triton", F32): (1.26e-08, 9.61e-09),
    ("ema_hidden", "cuda", F32): (6.59e-08, 9.62e-08),
    ("ema_hidden", "cuda", F64): (1.10e-15, 1.93e-14),
    ("ema_hidden", "torch", F32): (6.59e-08, 9.84e-08),
    ("ema_hidden", "torch", F64): (1.76e-15, 1.08e-14),
    ("ema_hidden", "triton", F32): (1.04e-07, 8.67e-08),
    ("fftconv", "cpu", F32): (1.03e-07, 1.07e-07),
    ("fftconv", "cpu", F64): (3.01e-16, 3.05e-16),
    ("fftconv", "cuda", F32): (1.07e-07, 1.32e-07),
    ("fftconv", "cuda", F64): (2.42e-16, 2.86e-16),
    ("fftconv", "torch", F32): (7.81e-08, 1.16e-07),
    ("fftconv", "torch", F64): (2.42e-16, 2.11e-16),
    ("fftconv", "triton", F32): (1.35e-07, 1.39e-07),
    ("rotary", "cuda", F32): (6.09e-08, 6.85e-08),
    ("rotary", "cuda", F64): (2.48e-16, 3.08e-16),
    ("rotary", "torch", F32): (6.09e-08, 6.85e-08),
    ("rotary", "torch", F64): (2.48e-16, 3.08e-16),
    ("rotary", "triton", F32): (6.09e-08, 6.85e-08),
    ("timestep_norm", "cpu", F32): (3.56e-08, 2.65e-08),
    ("timestep_norm", "cpu", F64): (6.77e-16, 1.93e-16),
    ("timestep_norm", "cuda", F32): (5.93e-07, 6.93e-08),
    ("timestep_norm", "cuda", F64): (6.77e-16, 1.77e-16),
    ("timestep_norm", "torch", F32): (1.47e-07, 4.96e-08),
    ("timestep_norm", "torch", F64): (7.96e-16, 2.36e-16),
    ("timestep_norm", "triton", F32): (8.76e-08, 5.67e-08),
}

# bfloat16 and float16 keep FlashAttention's rule of thumb: about 2x what a plain PyTorch
# computation in that dtype loses (one bf16 rounding is 2**-9 relative, one fp16 rounding 2**-12).
# The tests measure at most 5.4e-3 / 8.9e-3 (bf16 forward / gradients) and 4.2e-4 / 8.9e-4 (fp16)
# against these budgets (docs/verification.md); the gradients get twice the forward budget.
HALF = {F16: {"fwd": 4e-3, "bwd": 8e-3}, BF16: {"fwd": 2e-2, "bwd": 4e-2}}


def budget(measured: float) -> float:
    """3x the measured error rounded up to 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k (so 3x to 4x
    of it): the self-check's rule too (megalodon_kernels.selfcheck.budget)."""
    from megalodon_kernels.selfcheck import budget as rule
    return rule(measured)


#: (op, backend, dtype) -> {"fwd": budget, "bwd": budget}, from MEASURED
TOLERANCES: dict[tuple, dict[str, float]] = {
    key: {kind: budget(m) if m > 0 else 0.0 for kind, m in (("fwd", fwd), ("bwd", bwd))}
    for key, (fwd, bwd) in MEASURED.items()}

#: (op, backend, dtype name, kind) -> the budget on the scale of the terms, from MEASURED_TERMS
TERMS_TOLERANCES: dict[tuple, float] = {
    (op, backend, str(dtype).replace("torch.", ""), kind): budget(m)
    for (op, backend, dtype), ms in MEASURED_TERMS.items() for kind, m in zip(("fwd", "bwd"), ms)}


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
    if dtype in HALF:
        value = HALF[dtype][kind]
    elif (op, backend, dtype) in TOLERANCES:
        value = TOLERANCES[(op, backend, dtype)][kind]
    else:
        raise KeyError(f"no measured {dtype} budget for {op} on {backend}: measure it (bench/accuracy_tests.py) "
                       "and add it to support.MEASURED")
    return Tol(value, (op, backend, str(dtype).replace("torch.", ""), kind))


def to_np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.is_complex():
            return t.to(torch.complex128).numpy()
        if t.is_floating_point():
            return t.to(torch.float64).numpy()
        return t.numpy()
    return np.asarray(t)


def err_ratio(actual, expected, terms=None) -> tuple[float, float]:
    """(max|actual - expected|, that over the scale): max(terms), or max|expected| without terms."""
    a, e = to_np(actual), np.asarray(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: actual {a.shape} vs expected {e.shape}")
    if a.size == 0:
        return 0.0, 0.0
    diff = np.abs(a - e)
    if terms is None:
        scale = max(float(np.max(np.abs(e))), 1e-30)
    else:
        m = np.abs(np.asarray(terms))
        if m.shape != e.shape:
            raise AssertionError(f"shape mismatch: terms {m.shape} vs expected {e.shape}")
        finite = np.isfinite(m)
        scale = max(float(np.max(m, initial=0.0, where=finite)), 1e-30)
        # the terms bound the value (up to the rounding of an expected value computed in low
        # precision: bfloat16's is 2**-9): a value far above them is a wrong magnitude
        bad = finite & np.isfinite(e) & (np.abs(e) > m + 1e-2 * scale)
        if bad.any():
            raise AssertionError(f"terms below |expected| at {np.argwhere(bad)[0].tolist()}: the magnitude is wrong")
    max_err = float(np.nanmax(diff)) if not np.isnan(diff).all() else float("nan")
    if np.isnan(diff).any():
        # NaN where the reference has none is a failure; NaN matching NaN is agreement.
        if not np.array_equal(np.isnan(a), np.isnan(e)):
            return float("inf"), float("inf")
    return max_err, max_err / scale


def log_accuracy(name: str, max_err: float, ratio: float, tolerance: float, against: str = "max|ref|") -> None:
    """With MK_ACCURACY_LOG=<file>, append one JSON line per comparison (test id, budget key, errors):
    what bench/tolerance_table.py turns into the measured table of docs/verification.md."""
    path = os.environ.get("MK_ACCURACY_LOG")
    if not path:
        return
    import json
    key = getattr(tolerance, "key", ())
    rec = dict(test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], name=name,
               key=list(key), max_abs=max_err, rel=ratio, tol=float(tolerance), scale=against)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def assert_close(name: str, actual, expected, tolerance: float, terms=None) -> None:
    """max|actual - expected| <= tolerance * max(terms) (or * max|expected| without ``terms``).
    With terms, a budget from :func:`tol` becomes its (op, backend, dtype) budget on the scale of
    the terms (MEASURED_TERMS) where there is one; a literal tolerance stays as it is."""
    if terms is not None and getattr(tolerance, "key", ()) in TERMS_TOLERANCES:
        tolerance = Tol(TERMS_TOLERANCES[tolerance.key], tolerance.key)
    max_err, ratio = err_ratio(actual, expected, terms)
    against = "max|ref|" if terms is None else "max(terms)"
    log_accuracy(name, max_err, ratio, tolerance, against)
    print(f"{name}: max abs err {max_err:.3e}, relative to {against} {ratio:.3e} (tol {tolerance:.1e})")
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


# --- multi-process tests (chunk parallelism, FSDP2): one worker process per rank -----------------

def start_ranks(argvs: list[list[str]]) -> list[subprocess.Popen]:
    """One Python process per rank, ``python *argv``, one intra-op thread each (the ranks share
    the cores), stdout and stderr captured together."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for argv in argvs]


@contextlib.contextmanager
def ranks_finished(procs: list[subprocess.Popen], timeout: float = 150):
    """Around the parent's own work while the ranks run (the reference, say): then waits for every
    rank and asserts each exited 0, showing the failed rank's output; a rank still running after
    an error or the timeout is killed, so no worker outlives the test."""
    outs = []
    try:
        yield
        outs.extend(p.communicate(timeout=timeout)[0] for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-6000:]}"
