"""Which device a measurement belongs to, and the software it was measured with.

A table is only valid on the device it was measured on (Kernel Tuner refuses foreign cache
files too): a GPU is identified by its name and compute capability, a CPU by its model string
and core count. Identities are plain dicts so they go into JSON as they are and compare with ==.

Runtime layer: the dispatcher's table lookups identify the device here; imports torch and the
standard library only.
"""
from __future__ import annotations

import functools
import os
import platform

import torch


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU model string, e.g. ``Intel(R) Xeon(R) Processor`` (``/proc/cpuinfo`` on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


@functools.lru_cache(maxsize=None)
def _identity(kind: str, index: int | None) -> tuple:
    if kind == "cuda":
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        return ("type", "cuda"), ("name", name), ("capability", f"{major}.{minor}")
    if kind == "cpu":
        return ("type", "cpu"), ("name", cpu_model()), ("cores", os.cpu_count() or 1)
    return ("type", kind), ("name", kind)


def identity(device) -> dict:
    """Identity of a ``torch.device`` (or a string like ``"cuda:1"``), e.g.
    ``{"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}``."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return dict(_identity(device.type, index))


def describe(ident: dict) -> str:
    """One line for humans: ``cpu Intel(R) Xeon(R) Processor (2 cores)`` or ``cuda NVIDIA A100 (sm 8.0)``."""
    extra = f" ({ident['cores']} cores)" if "cores" in ident else ""
    extra += f" (sm {ident['capability']})" if "capability" in ident else ""
    return f"{ident.get('type')} {ident.get('name')}{extra}"


def versions() -> dict:
    """Library, torch, triton and Python versions (triton None when absent)."""
    from .. import __version__

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional
        triton_version = None
    return {
        "megalodon_kernels": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }
