"""Installs the repository as ONE import package, ``megalodon_kernels``.

The repository's top level *is* the package (DESIGN.md section 1): ``ops/`` becomes
``megalodon_kernels.ops``, ``reference/`` becomes ``megalodon_kernels.reference`` and so on.
Nothing installs as a top-level ``ops`` or ``reference``.

A CPU install never needs nvcc: the CUDA extension is built only by the CUDA backend issue's
build step, and only where a CUDA toolkit and a CUDA-enabled torch are present.
"""
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

# Sub-packages that ship; tests/, bench/ suites and examples/ are run from a checkout.
SUBPACKAGES = ["ops", "reference", "bench", "autotune"]


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
    # Autotune tables are data files of the autotune package (one JSON per measured device).
    package_data={"megalodon_kernels.autotune": ["tables/*.json"]},
)
