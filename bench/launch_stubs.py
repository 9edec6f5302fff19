"""Run the Triton and CUDA backends' host code on CPU tensors with the device launch a no-op.

What stays real is everything the host does per call up to the launch itself: for Triton, the
op's Python, ``JITFunction.run`` (argument binding and specialization, the kernel-cache key and
lookup, the grid, the launch metadata); for CUDA, the op's launch description (cuda_impl.py),
``GpuLauncher`` (fit checks, the loaded-function lookup, packing the arguments as their C types)
and ``CupyDriver.launch`` (the pointer array). What is replaced, at the lowest level:

* Triton: the compiled kernel (never compiled: :class:`StubKernel` stands for it, cached by the
  JIT like a real one) whose ``run`` (the compiled C launcher) does nothing, and the active
  driver (:class:`HostOnlyTritonDriver`: device 0, stream 0, an sm_90 target). On a GPU the C
  launcher parses the arguments and calls ``cuLaunchKernelEx`` (a few us, not measured here);
  the real driver's current-device and current-stream queries cost about 1 us.
* CUDA: CuPy's driver module under ``CupyDriver`` (:class:`NoOpCupyDriverApi`):
  ``launchKernel`` does nothing, no cubin is compiled or loaded (``fake_compile``).

Backends get CPU tensors, so each op's backend object is swapped in with its device reasons
answered for CPU (:func:`host_only_backends`); its choice is cached after the first call, so that
is not part of the per-call cost. Only for benchmarks (bench/host_cost.py): the results of such a
call are never read.

Triton decides at decoration time whether a kernel is interpreted: import this module's users
with ``TRITON_INTERPRET`` unset (bench/host_cost.py clears it before importing the package).
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch


class StubKernel:
    """What ``triton.compile`` returns, minus the code: the JIT caches it per specialization
    and calls ``run`` (the compiled launcher) with the grid, stream, metadata and arguments."""

    function = None
    packed_metadata = None

    def __init__(self, name):
        self.name = name
        self.launches = 0

    def run(self, *args):  # the compiled C launcher: here no launch at all
        self.launches += 1

    def launch_metadata(self, grid, stream, *args):  # as CompiledKernel's without a launch hook
        return None


class HostOnlyTritonDriver:
    """Triton's active driver for CPU tensors: a current device and stream, an sm_90 target."""

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@contextlib.contextmanager
def stubbed_triton():
    """Triton launches on CPU tensors run ``JITFunction.run`` and stop at the launcher; yields
    the stub kernels made ({name: StubKernel})."""
    import triton.compiler
    from triton.runtime.driver import driver

    made = {}

    def compile_stub(src, target=None, options=None, **_):
        kernel = StubKernel(getattr(getattr(src, "fn", None), "__name__", "kernel"))
        made.setdefault(kernel.name, []).append(kernel)
        return kernel

    saved_compile, saved_active = triton.compiler.compile, driver._active
    triton.compiler.compile = compile_stub
    driver.set_active(HostOnlyTritonDriver())
    try:
        yield made
    finally:
        triton.compiler.compile = saved_compile
        driver._active = saved_active


class NoOpCupyDriverApi:
    """Stands for ``cupy_backends.cuda.api.driver`` (and ``.runtime``): a context is current,
    modules load as handles, and ``launchKernel`` returns without launching."""

    def __init__(self):
        self.launches = 0

    def ctxGetCurrent(self):
        return 1

    def setDevice(self, device):
        pass

    def moduleLoadData(self, cubin):
        return 1

    def moduleGetFunction(self, module, name):
        return 2

    def funcSetAttribute(self, function, attribute, value):
        pass

    def launchKernel(self, *args):
        self.launches += 1


def stubbed_cuda_launcher():
    """A :class:`GpuLauncher` for CPU tensors over the real ``CupyDriver`` code with CuPy's driver
    calls replaced by :class:`NoOpCupyDriverApi` and no NVRTC compile."""
    from megalodon_kernels.cuda import nvrtc
    from megalodon_kernels.cuda.runtime import CupyDriver, GpuLauncher

    api = NoOpCupyDriverApi()
    driver = CupyDriver.__new__(CupyDriver)  # its methods, without importing CuPy's binding
    driver._driver = driver._runtime = api

    def fake_compile(header, name, arch):
        return nvrtc.Compiled(header, name, arch, f"lowered {name}", b"", "", nvrtc.Resources(0, 0, 0, 0, 0), 0.0,
                              "stub")

    launcher = GpuLauncher(driver=driver, compile_kernel=fake_compile, stream_of=lambda device: 0, device_type="cpu")
    launcher.api = api
    return launcher


class _CpuTensorsOk(types.SimpleNamespace):
    """A Triton backend module seen through for CPU tensors: its reasons without the device one."""

    def not_supported_reasons(self, **inputs):
        return [r for r in self.module.not_supported_reasons(**inputs) if "Triton needs CUDA tensors" not in r]

    def __getattr__(self, name):
        return getattr(self.module, name)


def host_only_backends(op: str, backend: str, cuda_launcher=None):
    """The object to swap in (``OpBackends.use``) as ``op``'s ``backend`` so that it runs its host
    code on CPU tensors with a no-op launch; None for torch and cpu (their own modules)."""
    if backend == "cuda":
        impl = importlib.import_module(f"megalodon_kernels.ops.{op}.cuda_impl")
        launcher = cuda_launcher or stubbed_cuda_launcher()
        return type(impl._GPU)(lambda: launcher, "cpu")
    if backend == "triton":
        return _CpuTensorsOk(module=importlib.import_module(f"megalodon_kernels.ops.{op}.triton_impl"))
    return None
