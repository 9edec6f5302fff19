"""Argument validation shared by every public op.

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong rank, shape,
device or value) and names the argument and what was expected, so a user never has to read a
kernel to learn why a call was refused. Nothing is silently cast, truncated or broadcast.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    shape: Sequence,
    dtypes: Sequence[torch.dtype],
    *,
    device: torch.device | None = None,
    dims: str | None = None,
) -> None:
    """Check that ``t`` is a tensor of the given symbolic shape, dtype and device.

    ``shape`` holds ints (exact size) or None (any size); its length is the required rank.
    ``dims`` is the human notation used in the message, e.g. ``"(B, D, L)"``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {_notation(shape, dims)}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in [{_dtype_names(dtypes)}], got {t.dtype}")
    got = t.shape
    if len(got) != len(shape):
        raise ValueError(
            f"{name} must have rank {len(shape)} {_notation(shape, dims)}, got shape {tuple(got)}"
        )
    for axis, want in enumerate(shape):
        if want is not None and want != got[axis]:
            raise ValueError(
                f"{name} must have shape {_notation(shape, dims)} = "
                f"{tuple('*' if s is None else s for s in shape)}, got {tuple(got)} "
                f"(dimension {axis} is {got[axis]}, expected {want})"
            )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def _notation(shape, dims) -> str:
    """The shape as the message writes it (built only for a message: the checks run on every call)."""
    return dims or "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def device_reasons(backend: str, device_type: str, **tensors) -> list[str]:
    """For a backend whose kernels run on ``device_type`` tensors only: why it cannot take these
    (the first tensor elsewhere; None entries are absent inputs), as ``not_supported_reasons``
    sentences; empty when it can."""
    for name, t in tensors.items():
        if t is not None and t.device.type != device_type:
            return [f"{name} is on {t.device}: the {backend} backend runs on {device_type.upper()} tensors "
                    f"(use backend='torch')"]
    return []


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0].dtype
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != first:
            raise TypeError(f"{n} has dtype {t.dtype} but {names[0]} has dtype {first}; they must match")


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and (v > high or (high_open and v == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {v}")
    return v


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


COEF_DTYPES = (torch.float32, torch.float64)


def check_sequence(x):
    """x r(B D L) with L >= 1 (fftconv, ema_hidden, cema); returns (B, D, L)."""
    check_tensor("x", x, (None, None, None), REAL_DTYPES, dims="(B, D, L)")
    B, D, L = x.shape
    if L < 1:
        raise ValueError(f"x must have length L >= 1 in its last dimension (B, D, L), got shape {tuple(x.shape)}")
    return B, D, L


def check_coefficients(p, log_q, gamma=None, hx=None, *, D=None, B=None, device=None):
    """Validate the CEMA coefficients (cema_kernel, ema_hidden, cema); returns (D, N).

    p r(D N) float32/float64; log_q, gamma c(D N) and hx c(B D N) of the matching complex dtype.
    """
    check_tensor("p", p, (D, None), COEF_DTYPES, device=device, dims="(D, N)")
    device = p.device
    D, N = p.shape
    cdt = (complex_of(p.dtype),)
    check_tensor("log_q", log_q, (D, N), cdt, device=device, dims="(D, N)")
    if gamma is not None:
        check_tensor("gamma", gamma, (D, N), cdt, device=device, dims="(D, N)")
    if hx is not None:
        check_tensor("hx", hx, (B, D, N), cdt, device=device, dims="(B, D, N)")
    return D, N


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else computes in float32."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32


def complex_of(real: torch.dtype) -> torch.dtype:
    return torch.complex128 if real == torch.float64 else torch.complex64
