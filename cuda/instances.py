"""Every kernel instantiation of the package, as NVRTC name expressions: the ``KERNELS`` lists of
the ops' launch descriptions (``ops/<op>/cuda_impl.py``).

The GPU runtime compiles them with NVRTC on first use (``python -m megalodon_kernels.cuda
compile`` compiles them all ahead of time); the emulator build (cuda/build.py) registers them,
plus the ops' ``EMULATOR_KERNELS`` (configurations that exist only on the CPU, such as flash
attention's fp32 tiles), for launch by name.
"""
from __future__ import annotations

import importlib

from .launch import Kernel

#: the ops with a CUDA backend, each a launch description (ops/<op>/cuda_impl.py with KERNELS)
DESCRIBED_OPS = ("rotary", "timestep_norm", "cema_kernel", "ema_hidden", "fftconv", "dropkey_softmax", "attention")


def described_kernels(emulator: bool = False) -> list[Kernel]:
    """[Kernel] over DESCRIBED_OPS, in order, without duplicates; ``emulator``: with the ops'
    emulator-only instantiations."""
    out = []
    for op in DESCRIBED_OPS:
        module = importlib.import_module(f"megalodon_kernels.ops.{op}.cuda_impl")
        for k in [*module.KERNELS, *(getattr(module, "EMULATOR_KERNELS", []) if emulator else [])]:
            if k not in out:
                out.append(k)
    return out


def all_kernels(arch: int | None = None) -> list[Kernel]:
    """Every instantiation a GPU can launch; with ``arch``, those a GPU of that compute capability
    can (the flash attention kernels need sm_80: Kernel.min_arch)."""
    return [k for k in described_kernels() if arch is None or k.min_arch <= arch]
