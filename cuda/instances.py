"""Every kernel instantiation of the package, as NVRTC name expressions: the ``KERNELS`` lists of
the ops' launch descriptions (``ops/<op>/cuda_impl.py``), which the ops hand to this loader.

The package's ``__init__.py`` calls :func:`provide` with a function returning the ops' launch
descriptions. The GPU runtime compiles the kernels with NVRTC on first use (``python -m
megalodon_kernels.cuda compile`` compiles them all ahead of time); the emulator build
(cuda/build.py) registers them, plus the ops' ``EMULATOR_KERNELS`` (configurations that exist only
on the CPU, such as flash attention's fp32 tiles), for launch by name.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .launch import Kernel

#: the functions the ops handed over (:func:`provide`), each returning launch descriptions:
#: objects with ``KERNELS`` (and optionally ``EMULATOR_KERNELS``) lists of Kernel
_providers: list[Callable[[], Iterable]] = []


def provide(descriptions: Callable[[], Iterable]) -> None:
    """Register a function that returns launch descriptions (called by ``megalodon_kernels.ops``
    at import; lazy, so importing the ops loads no CUDA description). Registering the same
    function again changes nothing."""
    if descriptions not in _providers:
        _providers.append(descriptions)


def described_kernels(emulator: bool = False) -> list[Kernel]:
    """[Kernel] of every launch description handed over, in order, without duplicates;
    ``emulator``: with the ops' emulator-only instantiations."""
    if not _providers:
        raise RuntimeError("no CUDA launch descriptions were handed to cuda/instances.py: import "
                           "megalodon_kernels (its __init__ provides the ops' descriptions)")
    out = []
    for descriptions in _providers:
        for module in descriptions():
            for k in [*module.KERNELS, *(getattr(module, "EMULATOR_KERNELS", []) if emulator else [])]:
                if k not in out:
                    out.append(k)
    return out


def all_kernels(arch: int | None = None) -> list[Kernel]:
    """Every instantiation a GPU can launch; with ``arch``, those a GPU of that compute capability
    can (the flash attention kernels need sm_80: Kernel.min_arch)."""
    return [k for k in described_kernels() if arch is None or k.min_arch <= arch]
