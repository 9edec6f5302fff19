"""The ops' ``backend="cuda"`` on CPU tensors, through the SIMT emulator (cuda/emu/).

For measurement scripts on a machine without a GPU: :func:`install` builds (or loads) the emulator
extension and plugs each op's CUDA backend class over it into each op's dispatcher,
as the tests do, so ``ops.<op>(..., backend="cuda")`` runs the same kernel sources on the CPU. The
emulator is built with the device model (FMA contraction as nvcc does it, the math functions with
the device's documented error bounds: cuda/emu/device_math.h), so the numbers are what a GPU may
produce, not what the host's libm produces.
"""
from __future__ import annotations

import importlib

#: op -> (module, backend class): each op's launch description (ops/<op>/cuda_impl.py) runs over
#: the emulator by name
CLASSES = {
    "cema": ("megalodon_kernels.ops.cema.cuda_impl", "CemaBackend"),
    "cema_kernel": ("megalodon_kernels.ops.cema_kernel.cuda_impl", "CemaKernelBackend"),
    "ema_hidden": ("megalodon_kernels.ops.ema_hidden.cuda_impl", "EmaHiddenBackend"),
    "fftconv": ("megalodon_kernels.ops.fftconv.cuda_impl", "FftconvBackend"),
    "timestep_norm": ("megalodon_kernels.ops.timestep_norm.cuda_impl", "TimestepNormBackend"),
    "attention": ("megalodon_kernels.ops.attention.cuda_impl", "AttentionBackend"),
    "dropkey_softmax": ("megalodon_kernels.ops.dropkey_softmax.cuda_impl", "DropKeySoftmaxBackend"),
    "rotary": ("megalodon_kernels.ops.rotary.cuda_impl", "RotaryBackend"),
}


def install(ops=None, verbose: bool = True) -> None:
    """Route ``backend="cuda"`` of ``ops`` (default: every op with a CUDA backend) to the emulator."""
    from megalodon_kernels.cuda import build
    from megalodon_kernels.cuda.launch import EmulatorLauncher

    launcher = EmulatorLauncher(build.load_emulator(verbose=verbose))
    for op in ops or CLASSES:
        module, cls = CLASSES[op]
        impl = getattr(importlib.import_module(module), cls)(lambda: launcher, "cpu")
        backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
        backends._modules["cuda"] = f"(emulated) {module}"
        backends._loaded["cuda"] = impl


def use(backend: str, ops=None) -> None:
    """For a script's ``--backend``: install the emulator when "cuda" is asked for without a GPU."""
    import torch

    if backend == "cuda" and not torch.cuda.is_available():
        install(ops)
