"""The ops' ``backend="cuda"`` on CPU tensors, through the SIMT emulator (cuda/emu/).

For measurement scripts on a machine without a GPU: :func:`install` builds (or loads) the emulator
extension and plugs the CUDA backend classes of cuda/backend.py over it into each op's dispatcher,
as the tests do, so ``ops.<op>(..., backend="cuda")`` runs the same kernel sources on the CPU. The
emulator is built with the device model (FMA contraction as nvcc does it, the math functions with
the device's documented error bounds: cuda/emu/device_math.h), so the numbers are what a GPU may
produce, not what the host's libm produces.
"""
from __future__ import annotations

import importlib

#: op -> backend class name in megalodon_kernels.cuda.backend
CLASSES = {
    "cema_kernel": "CemaKernelBackend",
    "ema_hidden": "EmaHiddenBackend",
    "fftconv": "FftconvBackend",
    "timestep_norm": "TimestepNormBackend",
    "attention": "AttentionBackend",
    "dropkey_softmax": "DropKeySoftmaxBackend",
    "rotary": "RotaryBackend",
}


def install(ops=None, verbose: bool = True) -> None:
    """Route ``backend="cuda"`` of ``ops`` (default: every op with a CUDA backend) to the emulator."""
    from megalodon_kernels.cuda import backend, build

    ext = build.load_emulator(verbose=verbose)
    for op in ops or CLASSES:
        impl = getattr(backend, CLASSES[op])(lambda: ext, "cpu")
        backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
        backends._modules["cuda"] = f"(emulated) megalodon_kernels.cuda.backend.{op}"
        backends._loaded["cuda"] = impl


def use(backend: str, ops=None) -> None:
    """For a script's ``--backend``: install the emulator when "cuda" is asked for without a GPU."""
    import torch

    if backend == "cuda" and not torch.cuda.is_available():
        install(ops)
