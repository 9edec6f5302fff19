"""Shared test helpers: the tolerance table, error reporting, awkward inputs.

Errors are measured norm-wise: max|actual - expected| / max|expected| (a per-element relative
error is meaningless where outputs cancel to ~0). Each comparison prints its errors before
asserting, so a failing run shows by how much.
"""
from __future__ import annotations

import contextlib
import importlib

import numpy as np
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
    # fp64 kernels accumulate in double; the fp32 side of the budget is never needed.
    ("cuda", torch.float64): {"fwd": 1e-10, "bwd": 1e-9},
}

# Per-op widening, with the reason. Keep this small and justified.
OP_TOLERANCE_FACTOR: dict[str, float] = {}


def tol(backend: str, dtype: torch.dtype, kind: str, op: str | None = None) -> float:
    return TOLERANCES[(backend, dtype)][kind] * OP_TOLERANCE_FACTOR.get(op, 1.0)


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


def assert_close(name: str, actual, expected, tolerance: float) -> None:
    max_err, ratio = err_ratio(actual, expected)
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
