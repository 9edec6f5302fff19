"""CUDA C++ kernels of megalodon_kernels (see cuda/README.md).

* ``extension()`` returns the compiled product extension ``megalodon_kernels.cuda._C`` (built by
  setup.py on a machine with a CUDA toolkit and a CUDA-enabled torch), or None;
  ``extension_error()`` says why it is missing and how to build it.
* :mod:`.kernels` is the tensor-level API over the launchers (shared by the product extension
  and the CPU emulator); :mod:`.build` builds the emulator extension and runs nvcc for resources.
* The ops with a launch description (``ops/<op>/cuda_impl.py``) need no extension: :mod:`.launch`
  (records, the emulator launcher), :mod:`.runtime` (the GPU launcher), :mod:`.nvrtc` (run-time
  compilation and its cache), :mod:`.instances` (every instantiation).

Imports nothing from the rest of the package.
"""
from __future__ import annotations

import importlib

BUILD_HINT = ("build it on a machine with nvcc and a CUDA-enabled torch: "
              "MEGALODON_KERNELS_BUILD_CUDA=1 pip install -e . --no-build-isolation "
              "(arch list: TORCH_CUDA_ARCH_LIST, default '8.0;9.0'; parallel jobs: MAX_JOBS)")

_ext = None
_err: str | None = None


def extension():
    """The product CUDA extension module, or None when it is not built (see extension_error)."""
    global _ext, _err
    if _ext is None and _err is None:
        try:
            _ext = importlib.import_module(f"{__name__}._C")
        except ImportError as exc:
            _err = f"the CUDA extension {__name__}._C is not built ({exc}); {BUILD_HINT}"
    return _ext


def extension_error() -> str | None:
    """Why :func:`extension` returned None (None when the extension is available)."""
    extension()
    return _err
