"""Launch descriptions: what an op's ``cuda_impl.py`` says, and the two runtimes that execute it.

An op's CUDA path is a Python function that allocates its outputs and workspace and issues
:class:`Launch` records (kernel instantiation by name expression, grid, block, dynamic shared
memory, typed arguments) through a launcher. Two launchers execute the same records:

* :class:`EmulatorLauncher`: the CPU emulator extension (cuda/build.py) launches the kernel by
  its name expression; the extension instantiates exactly the name expressions the ops list in
  their ``KERNELS`` (cuda/instances.py), from the same ``.cuh`` files, and checks the argument
  count and sizes against the C++ signature.
* :class:`megalodon_kernels.cuda.runtime.GpuLauncher`: NVRTC-compiled cubins (cuda/nvrtc.py)
  launched through the CUDA driver on torch's current stream.

Both see the arguments as the bytes of their C types (:func:`packed`), which is what
``cuLaunchKernel`` copies, so a record of one equals a record of the other for the same call.

Both refuse, before anything runs, a launch the device could not take (:func:`fit_reason`: the
kernel's oldest architecture, dynamic + static shared memory above the block's opt-in limit, a grid
dimension above its maximum) with :class:`LaunchDoesNotFit`, so a launch description that forgot a
device limit fails with the reason instead of trapping on the GPU. The backends plan within the
same limits first (their ``not_supported_reasons``), so ``auto`` never gets there.
This module imports only cuda/device.py from the rest of the package.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import device as _device

#: The oldest architecture NVRTC 13 targets, and so every kernel's default minimum.
MIN_ARCH = 75
#: C argument types of the kernels, by tag (the emulator reports the same tags for its C++ types).
ARG_TYPES = {
    "ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64, "f32": ctypes.c_float, "f64": ctypes.c_double, "bool": ctypes.c_bool,
}
#: Dynamic shared memory above this needs the per-kernel opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_MAX_DYNAMIC_SMEM = 48 * 1024
#: C++ spelling of each torch element type in the kernels' template arguments.
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "mk::bf16", torch.float64: "double"}


@dataclass(frozen=True)
class Kernel:
    """One kernel instantiation: the header that defines it and its NVRTC name expression."""

    header: str
    name: str
    #: the oldest compute capability the kernel runs on (80 for flash attention's SM80 tensor-core
    #: MMA atoms and cp.async, which trap on older GPUs); everything else compiles for every arch
    min_arch: int = MIN_ARCH


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    #: (tag, value) per kernel parameter, in order; pointers as integers (0 for nullptr)
    args: tuple[tuple[str, object], ...]
    device: torch.device

    def packed(self) -> list[bytes]:
        return packed(self.args)


def c_value(tag: str, value):
    """The argument as its C type: a scalar or pointer by tag, or a struct (``struct_arg``) as is."""
    ctype = ARG_TYPES.get(tag)  # the scalar tags first: every launch packs a dozen of them
    if ctype is not None:
        return ctype(value)
    if tag.startswith("struct"):
        if not isinstance(value, ctypes.Structure) or tag != f"struct{ctypes.sizeof(value)}":
            raise TypeError(f"a {tag} argument must be a ctypes.Structure of that size, got {value!r}")
        return value
    raise TypeError(f"unknown kernel argument type {tag!r}")


def struct_arg(value: ctypes.Structure) -> tuple[str, ctypes.Structure]:
    """A struct passed by value (tag ``struct<size>``, as the emulator reports it); the
    ctypes.Structure must mirror the C++ struct's fields in order (same layout)."""
    return f"struct{ctypes.sizeof(value)}", value


def packed(args) -> list[bytes]:
    """The bytes of each argument as its C type (what cuLaunchKernel copies for the kernel)."""
    return [bytes(c_value(tag, value)) for tag, value in args]


def dim3(v) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, got {v!r}")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))


class LaunchDoesNotFit(ValueError):
    """A launch the device cannot take (the message says which limit and by how much)."""


def fit_reason(caps: "_device.DeviceCaps", kernel: Kernel, grid, block, smem: int, static_smem: int = 0) -> str | None:
    """Why ``kernel`` cannot launch with this grid / block / dynamic shared memory on a device with
    ``caps`` (None when it can); ``static_smem``: the kernel's own ``__shared__`` bytes when known."""
    short = kernel.name.split("<")[0]
    if caps.arch < kernel.min_arch:
        return (f"{short} needs sm_{kernel.min_arch} or newer, the device ({caps.name}) is {caps.sm}")
    total = int(smem) + int(static_smem)
    if total > caps.smem_per_block_optin:
        return (f"{short} needs {total} B of shared memory per block, above the {caps.smem_per_block_optin} B "
                f"{caps.name} ({caps.sm}) allows")
    threads = 1
    for n in dim3(block):
        threads *= n
    if threads > 1024:
        return f"{short} has {threads} threads per block, above the limit of 1024"
    reason = _device.grid_reason(dim3(grid), caps.max_grid)
    return None if reason is None else f"{short}: {reason}"


def check_fits(launch_: "Launch", caps: "_device.DeviceCaps", static_smem: int = 0) -> None:
    reason = fit_reason(caps, launch_.kernel, launch_.grid, launch_.block, launch_.smem, static_smem)
    if reason is not None:
        raise LaunchDoesNotFit(f"refusing a launch the device cannot take: {reason}")


def launch(launcher, kernel: Kernel, grid, block, smem: int, args, device: torch.device) -> None:
    launcher(Launch(kernel, dim3(grid), dim3(block), int(smem), tuple(args), device))


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def grid_1d(blocks: int, cap: int = 1 << 20) -> int:
    """At least one block, at most ``cap`` (the kernels loop grid-stride beyond)."""
    return max(1, min(int(blocks), cap))


def acc_dtype(like: torch.Tensor) -> torch.dtype:
    """The kernels' accumulation dtype for inputs like ``like``: float64 for float64, else float32."""
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def acc_tag(like: torch.Tensor) -> str:
    return "f64" if like.dtype == torch.float64 else "f32"


class EmulatorLauncher:
    """Runs launches in the CPU emulator by name; remembers them when ``records`` is a list."""

    device_type = "cpu"
    EMULATOR = True

    def __init__(self, ext, records: list | None = None):
        self.ext = ext
        self.records = records

    def __call__(self, launch: Launch) -> None:
        if launch.device.type != "cpu":
            raise ValueError(f"the CPU emulator needs cpu tensors, got a launch on {launch.device}")
        check_fits(launch, _device.emulated_caps())  # what the emulated GPU could launch (an A100 unless faked)
        data = launch.packed()
        cpp_tags = self.ext.launch_kernel(launch.kernel.name, launch.grid, launch.block, launch.smem, data)
        if self.records is not None:
            self.records.append((launch.kernel.name, launch.grid, launch.block, launch.smem,
                                 tuple(zip(cpp_tags, data))))
