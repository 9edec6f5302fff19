"""The GPU runtime of the launch descriptions: NVRTC cubins launched through the CUDA driver.

:func:`gpu_launcher` returns the process-wide :class:`GpuLauncher`, or raises a RuntimeError
saying why the CUDA backend cannot run here (no CuPy / NVRTC, no CUDA torch or device, a driver
older than NVRTC, an arch NVRTC cannot target); the ops' ``not_supported_reasons`` report that
message and ``auto`` falls back. Nothing is imported or compiled before the first call.

A launch compiles its kernel instantiation for the device's arch (cuda/device.py, so a faked
profile is honoured) on first use (cuda/nvrtc.py, disk cache), checks that the device can take it
(the kernel's oldest arch, dynamic + the cubin's static shared memory, grid limits: a clear
LaunchDoesNotFit instead of a trap), loads the cubin into the device's primary context (the one
torch uses), opts in to large dynamic shared memory when the launch needs it, and launches on
torch's current stream of the tensors' device with the arguments packed as their C types
(cuda/launch.py). The driver calls go through :class:`CupyDriver`; tests substitute a recording fake.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

from . import device as _device
from . import nvrtc
from .launch import DEFAULT_MAX_DYNAMIC_SMEM, Launch, c_value, check_fits

#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED = 8
#: checked launches a GpuLauncher remembers (all forgotten beyond: a model launches a few hundred shapes)
_MAX_CHECKED = 4096


class CupyDriver:
    """The few CUDA driver calls the runtime makes, through CuPy's driver binding."""

    def __init__(self):
        self._driver = nvrtc.import_cupy("cupy_backends.cuda.api.driver")
        self._runtime = nvrtc.import_cupy("cupy_backends.cuda.api.runtime")

    def driver_version(self) -> int:
        return int(self._runtime.driverGetVersion())

    def _make_context_current(self) -> None:
        """Make the primary context of torch's current device current on this thread. torch
        selects a device without creating or binding a context where the device is already the
        selected one (autograd's per-device worker thread, for one), and every driver call below
        needs a current context: the first launch of a process from a backward failed with
        CUDA_ERROR_INVALID_CONTEXT on an H100. cudaSetDevice binds the primary context (the one
        torch uses); the check costs one driver call per launch."""
        if not self._driver.ctxGetCurrent():
            self._runtime.setDevice(torch.cuda.current_device())

    def load(self, cubin: bytes):
        self._make_context_current()
        return self._driver.moduleLoadData(cubin)

    def function(self, module, lowered_name: str):
        return self._driver.moduleGetFunction(module, lowered_name)

    def set_max_dynamic_smem(self, function, nbytes: int) -> None:
        self._make_context_current()
        self._driver.funcSetAttribute(function, _MAX_DYNAMIC_SHARED, nbytes)

    def launch(self, function, grid, block, smem: int, stream: int, values: list) -> None:
        self._make_context_current()
        params = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))
        self._driver.launchKernel(function, *grid, *block, smem, stream, ctypes.addressof(params), 0)


class GpuLauncher:
    EMULATOR = False

    def __init__(self, driver=None, compile_kernel=nvrtc.compile_kernel, arch_of=None, stream_of=None,
                 device_type: str = "cuda", caps_of=None):
        #: "cpu" only for tests that run this launcher's code over a fake driver on CPU tensors
        self.device_type = device_type
        self.driver = driver if driver is not None else CupyDriver()
        self.compile_kernel = compile_kernel
        #: the device's capabilities (cuda/device.py; the emulated profile for a "cpu" test launcher)
        self._caps_of = caps_of or _device.launch_caps
        self._arch_of = arch_of or (lambda device: self._caps_of(device).arch)
        self._stream_of = stream_of or _current_stream
        self._functions: dict = {}
        #: launches already checked against the device (check_fits) -> their function entry: a
        #: repeated launch (the same kernel, grid, block and smem on the same device and profile)
        #: skips the two checks and the lookup, about a third of this launcher's Python per launch
        self._checked: dict = {}
        self._lock = threading.Lock()

    def function(self, kernel, device: torch.device):
        """The loaded kernel for ``device`` (compiled and loaded on first use)."""
        arch = self._arch_of(device)
        key = (device.index, arch, kernel)  # the arch too: a faked profile is another device
        with self._lock:
            if key not in self._functions:
                compiled = self.compile_kernel(kernel.header, kernel.name, arch)
                with _on_device(device):
                    module = self.driver.load(compiled.cubin)
                    fn = self.driver.function(module, compiled.lowered_name)
                self._functions[key] = [module, fn, DEFAULT_MAX_DYNAMIC_SMEM, compiled.resources.static_smem]
            return self._functions[key]

    def __call__(self, launch: Launch) -> None:
        if launch.device.type != self.device_type:
            raise ValueError(f"the CUDA runtime needs {self.device_type} tensors, got a launch on {launch.device}")
        key = (launch.device, _device.generation(), launch.kernel, launch.grid, launch.block, launch.smem)
        entry = self._checked.get(key)
        if entry is None:
            caps = self._caps_of(launch.device)
            check_fits(launch, caps)  # before compiling: an arch the kernel cannot target fails here, not in NVRTC
            entry = self.function(launch.kernel, launch.device)
            check_fits(launch, caps, static_smem=entry[3])
            if len(self._checked) >= _MAX_CHECKED:
                self._checked.clear()
            self._checked[key] = entry
        values = [c_value(tag, value) for tag, value in launch.args]
        with _on_device(launch.device):
            if launch.smem > entry[2]:
                self.driver.set_max_dynamic_smem(entry[1], launch.smem)
                entry[2] = launch.smem
            self.driver.launch(entry[1], launch.grid, launch.block, launch.smem, self._stream_of(launch.device),
                               values)


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def unavailable_reason() -> str | None:
    """Why the GPU runtime cannot run here (None when it can); cheap after the first call."""
    global _reason
    if _reason is _UNSET:
        _reason = _check()
    return _reason


_UNSET = object()
_reason = _UNSET
_launcher: GpuLauncher | None = None


def _check() -> str | None:
    # No GPU first: on such a machine that is the one reason, and advice to install the CUDA extra
    # (CuPy, NVRTC) would only mislead.
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (a CUDA build of torch and an NVIDIA driver are needed)"
    try:
        nvrtc.nvrtc_binding()
        nvrtc.include_dirs()
    except nvrtc.NvrtcUnavailable as exc:
        return str(exc)
    try:
        driver = CupyDriver()
        version = driver.driver_version()
    except Exception as exc:  # no libcuda, or CuPy built for another CUDA major
        return f"the CUDA driver cannot be queried through CuPy ({type(exc).__name__}: {exc})"
    major, minor = nvrtc.nvrtc_version()
    if version < 1000 * major:
        return (f"the NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10} but NVRTC is {major}.{minor}: "
                f"its cubins need a driver for CUDA {major}.x (upgrade the driver, or install the CuPy/NVRTC wheels "
                f"for CUDA {version // 1000}: see README)")
    # a GPU NVRTC cannot target (sm_70 and older for NVRTC 13) is refused per call, by arch_reason
    # of the tensors' device: the other GPUs of a mixed machine keep the CUDA backend
    return None


def arch_reason(device) -> str | None:
    """Why NVRTC cannot compile for the CUDA ``device`` (None when it can, or when the runtime is
    unavailable anyway: unavailable_reason says why)."""
    if unavailable_reason() is not None:
        return None
    arch = _device.caps(device).arch
    archs = nvrtc.supported_archs()
    if arch in archs:
        return None
    major, minor = nvrtc.nvrtc_version()
    return (f"NVRTC {major}.{minor} cannot compile for {torch.device(device)} (sm_{arch}; it targets {archs}); "
            f"use backend='triton' or 'torch' there")


def gpu_launcher() -> GpuLauncher:
    """The process-wide GPU launcher, or RuntimeError(reason) when the runtime cannot run here."""
    global _launcher
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the CUDA backend is unavailable: {reason}")
    if _launcher is None:
        _launcher = GpuLauncher()
    return _launcher
