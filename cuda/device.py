"""What a CUDA device can run: compute capability, shared memory per block, grid limits.

Every CUDA and Triton backend asks :func:`caps` for the tensors' device before it picks a
configuration or refuses one (``not_supported_reasons``), so a kernel that would trap (an SM80
tensor-core atom on sm_75) or not launch (dynamic shared memory above the block's opt-in limit, a
grid dimension above its maximum) is never launched: ``auto`` falls back to a backend that fits.

The properties come from torch (``torch.cuda.get_device_properties``) once per device. Tests and
tools fake them at this boundary with :func:`faked` and the :data:`PROFILES` of real GPUs, so the
choice for a T4 or an L4 is checked on a machine without one. :func:`generation` changes whenever
a fake is entered or left: the dispatcher keys its cached choices on it.

Imports nothing from the rest of the package.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, replace

import torch

#: The CUDA grid limits of every architecture since sm_30: x up to 2^31 - 1, y and z up to 65535.
MAX_GRID = (2**31 - 1, 65535, 65535)
#: Opt-in dynamic shared memory per block by architecture (CUDA programming guide, "Technical
#: Specifications per Compute Capability"), used only where torch does not report it.
SMEM_OPTIN_BY_ARCH = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
                      100: 232448, 103: 232448, 110: 232448, 120: 101376, 121: 101376}


@dataclass(frozen=True)
class DeviceCaps:
    """The launch-relevant properties of one CUDA device."""

    name: str
    #: compute capability as 10 * major + minor (sm_90 -> 90)
    arch: int
    #: the most dynamic shared memory one block may opt in to, in bytes
    smem_per_block_optin: int
    multiprocessors: int
    max_grid: tuple[int, int, int] = MAX_GRID

    @property
    def sm(self) -> str:
        return f"sm_{self.arch}"


#: Real GPUs a user may have, for tests and docs (values from the vendors' specifications).
PROFILES: dict[str, DeviceCaps] = {
    "T4": DeviceCaps("Tesla T4", 75, 65536, 40),
    "A10": DeviceCaps("NVIDIA A10", 86, 101376, 72),
    "L4": DeviceCaps("NVIDIA L4", 89, 101376, 58),
    "A100": DeviceCaps("NVIDIA A100-SXM4-80GB", 80, 166912, 108),
    "H100": DeviceCaps("NVIDIA H100 80GB HBM3", 90, 232448, 132),
    "B200": DeviceCaps("NVIDIA B200", 100, 232448, 148),
    "RTX 5090": DeviceCaps("NVIDIA GeForce RTX 5090", 120, 101376, 170),
}

_lock = threading.Lock()
_faked: dict[int | None, DeviceCaps] = {}
_generation = 0


def generation() -> int:
    """Changes whenever :func:`faked` is entered or left (cached choices made under another
    profile are stale)."""
    return _generation


def _index(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device capabilities are for CUDA devices, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def caps(device) -> DeviceCaps:
    """The capabilities of a CUDA ``device`` (a torch.device, "cuda:1", ...), faked or real."""
    if _faked:
        device = torch.device(device)
        fake = _faked.get(device.index, _faked.get(None))
        if fake is not None:
            return fake
    return _query(_index(device))


@functools.lru_cache(maxsize=None)
def _query(index: int) -> DeviceCaps:
    props = torch.cuda.get_device_properties(index)
    arch = 10 * props.major + props.minor
    # shared_memory_per_block_optin is reported by torch >= 2.6; older releases fall back to the table
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_OPTIN_BY_ARCH.get(arch, 49152))
    return DeviceCaps(props.name, arch, smem, int(props.multi_processor_count))


@contextlib.contextmanager
def faked(profile: DeviceCaps | str, index: int | None = None):
    """Within the block, :func:`caps` reports ``profile`` (a :class:`DeviceCaps` or a key of
    :data:`PROFILES`) for CUDA device ``index`` (None: every CUDA device)."""
    global _generation
    if isinstance(profile, str):
        profile = PROFILES[profile]
    with _lock:
        previous = _faked.get(index)
        _faked[index] = profile
        _generation += 1
    try:
        yield profile
    finally:
        with _lock:
            if previous is None:
                _faked.pop(index, None)
            else:
                _faked[index] = previous
            _generation += 1


def with_smem(profile: DeviceCaps, nbytes: int) -> DeviceCaps:
    """``profile`` with another shared-memory limit (tests of the limit's edge)."""
    return replace(profile, smem_per_block_optin=nbytes)


def grid_reason(grid, limits: tuple[int, int, int] = MAX_GRID) -> str | None:
    """Why a launch grid exceeds the device's limits (None when it fits)."""
    for axis, n, limit in zip("xyz", grid, limits):
        if n > limit:
            return f"grid {axis} would be {n}, above the device's limit of {limit}"
    return None


#: What the CPU emulator's launches are checked against (the CUDA backends over CPU tensors in
#: tests): an A100, the architecture the kernels were first written for, unless a test fakes a
#: profile for every device (``faked(profile)`` with index None), which the emulator then reports.
EMULATED = PROFILES["A100"]


def emulated_caps() -> DeviceCaps:
    """The capabilities the emulator's launches see: the every-device fake, else :data:`EMULATED`."""
    return _faked.get(None, EMULATED)


def launch_caps(device) -> DeviceCaps:
    """The capabilities a CUDA backend plans for: :func:`caps` of a CUDA device, :func:`emulated_caps`
    for a CPU device (the emulator runs the same launch descriptions on CPU tensors)."""
    device = torch.device(device)
    return caps(device) if device.type == "cuda" else emulated_caps()
