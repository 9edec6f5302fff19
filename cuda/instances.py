"""Every kernel instantiation of the package: the ``KERNELS`` lists of the ops' ``cuda_impl.py``.

The emulator build (cuda/build.py) registers them for launch by name, and
``python -m megalodon_kernels.cuda compile`` compiles them with NVRTC.
"""
from __future__ import annotations

import importlib

#: the ops whose CUDA path is a launch description (ops/<op>/cuda_impl.py with KERNELS)
DESCRIBED_OPS = ("rotary", "timestep_norm")


def all_kernels():
    """[Kernel] over DESCRIBED_OPS, in order, without duplicates."""
    out = []
    for op in DESCRIBED_OPS:
        for k in importlib.import_module(f"megalodon_kernels.ops.{op}.cuda_impl").KERNELS:
            if k not in out:
                out.append(k)
    return out
