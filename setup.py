"""Installs the repository as ONE import package, ``megalodon_kernels``.

The repository's top level *is* the package (docs/design.md, Layout): ``ops/`` becomes
``megalodon_kernels.ops``, ``reference/`` becomes ``megalodon_kernels.reference`` and so on.
Nothing installs as a top-level ``ops`` or ``reference``.

A CPU install never needs nvcc. The ops with a launch description (cema_kernel, ema_hidden,
fftconv, timestep_norm, rotary) need no build at all: their kernels are compiled at run time by
NVRTC (the ``cuda`` extra). The CUDA extension ``megalodon_kernels.cuda._C`` (cuda/*.cu +
cuda/bindings.cpp: the launchers of attention and dropkey_softmax) is built only when a CUDA toolkit and a CUDA-enabled torch are importable at
build time, or when ``MEGALODON_KERNELS_BUILD_CUDA=1`` forces it (an error then says what is
missing); ``MEGALODON_KERNELS_BUILD_CUDA=0`` never builds it. Arch list: ``TORCH_CUDA_ARCH_LIST``
(default "8.0;9.0"); parallel compile jobs: ``MAX_JOBS``. Build against the installed torch:

    MEGALODON_KERNELS_BUILD_CUDA=1 pip install -e . --no-build-isolation

The test suite never needs that extension: it builds a CPU emulator extension from the same
kernel sources on demand (cuda/build.py).
"""
import glob
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


def _cuda_extension():
    """([CUDAExtension], cmdclass) when the CUDA build applies, else ([], {})."""
    mode = os.environ.get("MEGALODON_KERNELS_BUILD_CUDA", "auto").strip().lower()
    force = mode in ("1", "true", "yes", "on")
    if mode in ("0", "false", "no", "off"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        if force:
            raise RuntimeError(f"MEGALODON_KERNELS_BUILD_CUDA=1 needs torch at build time ({exc}); "
                               "install torch first and pass --no-build-isolation") from exc
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        if force:
            raise RuntimeError("MEGALODON_KERNELS_BUILD_CUDA=1 but "
                               + ("no CUDA toolkit was found (set CUDA_HOME)" if CUDA_HOME is None
                                  else f"torch {torch.__version__} is a CPU-only build"))
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources = sorted(glob.glob(os.path.join("cuda", "*.cu"))) + [os.path.join("cuda", "bindings.cpp")]
    ext = CUDAExtension(
        name="megalodon_kernels.cuda._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "cuda"), *_cute_include_dirs()],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20", "-DMK_EXT_NAME=_C"],
            "nvcc": ["-O3", "-std=c++20", "-lineinfo"],  # no --use_fast_math: the kernels rely on IEEE fp32
        },
    )
    return [ext], {"build_ext": BuildExtension}


def _cute_include_dirs():
    """--- attention --- CuTe/CUTLASS headers for cuda/flash_attention*.cu, from the PyPI package
    nvidia-cutlass (cutlass_library/source/include); nothing is vendored."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building the CUDA extension needs the CuTe headers: pip install nvidia-cutlass")
    return [os.path.join(list(spec.submodule_search_locations)[0], "source", "include")]


_ext_modules, _cmdclass = _cuda_extension()

setup(
    packages=["megalodon_kernels", *_find_subpackages()],
    package_dir={"megalodon_kernels": "."},
    package_data={
        # Autotune tables are data files of the autotune package (one JSON per measured device).
        "megalodon_kernels.autotune": ["tables/*.json"],
        # Kernel sources ship with the package: the CPU emulator extension builds from them on demand.
        "megalodon_kernels.cuda": ["*.cu", "*.cuh", "*.h", "*.cpp", "*.md", "emu/*", "cute_host/*"],
    },
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
)
