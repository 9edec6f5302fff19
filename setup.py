"""Installs the repository as ONE import package, ``megalodon_kernels``.

The repository's top level *is* the package (docs/design.md, Layout): ``ops/`` becomes
``megalodon_kernels.ops``, ``reference/`` becomes ``megalodon_kernels.reference`` and so on.
Nothing installs as a top-level ``ops`` or ``reference``.

No extension is built and nvcc is never needed: every CUDA kernel is compiled at run time by
NVRTC through CuPy (the ``cuda`` extra; cuda/README.md), from the ``.cuh`` sources shipped in the
package. The test suite builds a CPU emulator extension from the same sources on demand
(cuda/build.py).
"""
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

# Sub-packages that ship; tests/, bench/ suites and examples/ are run from a checkout.
SUBPACKAGES = ["ops", "reference", "bench", "autotune", "cuda", "model"]


def _find_subpackages():
    found = []
    for top in SUBPACKAGES:
        for root, dirs, files in os.walk(os.path.join(HERE, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(root, HERE).replace(os.sep, ".")
                found.append("megalodon_kernels." + rel)
    return sorted(found)


setup(
    packages=["megalodon_kernels", *_find_subpackages()],
    package_dir={"megalodon_kernels": "."},
    package_data={
        # Autotune tables are data files of the autotune package (one JSON per measured device).
        "megalodon_kernels.autotune": ["tables/*.json", "gpu_defaults.json"],
        # Kernel sources ship with the package: NVRTC compiles them at run time, the CPU emulator
        # extension builds from them on demand.
        "megalodon_kernels.cuda": ["*.cuh", "*.cpp", "*.md", "emu/*", "cute_host/*"],
        # The compiled CPU backend's source: g++ builds it on first use.
        "megalodon_kernels.ops.timestep_norm": ["*.cpp"],
    },
)
