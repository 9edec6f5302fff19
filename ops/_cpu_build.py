"""Building and loading the compiled CPU backends ("cpu": C++ with OpenMP, one source per op).

A backend's source is compiled on first use with the system's C++ compiler (``CXX``, default g++)
into the user cache directory (``MEGALODON_KERNELS_CACHE``, default ~/.cache/megalodon_kernels,
subdirectory ``cpu``), once per source, compiler version and flags, under a file lock and an atomic
rename, so concurrent processes build it once and never load a half-written file. Without a
working compiler :func:`load` returns the exception instead of a library: the backend's
``not_supported_reasons`` reports it and ``auto`` falls back to the torch backend.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from ..cuda.build import FileLock, digest, run_tool, tool_version

CXX = os.environ.get("CXX", "g++")


def vector_flags() -> list[str]:
    """The widest x86-64 microarchitecture level this CPU has: AVX-512 (x86-64-v4) or AVX2 + FMA
    (x86-64-v3) vectors instead of SSE2's. The flags are part of the cache key, so a cache directory
    shared with an older CPU holds a separate build (never -march=native, whose meaning the key
    could not see)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"} <= flags:
        return ["-march=x86-64-v4"]
    return ["-march=x86-64-v3"] if {"avx2", "fma", "bmi2"} <= flags else []


# -fno-math-errno: sqrt without the errno branch, so loops over it vectorise (NaN still propagates)
FLAGS = ["-std=c++17", "-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", *vector_flags()]


def cache_dir() -> Path:
    base = os.environ.get("MEGALODON_KERNELS_CACHE")
    path = (Path(base) if base else Path.home() / ".cache" / "megalodon_kernels") / "cpu"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(source: Path, name: str, cxx: str, flags: list[str]) -> ctypes.CDLL | Exception:
    """The library built from ``source`` (cached as ``<name>_<key>.so``), or the exception that
    prevented building or loading it (no compiler, a failed build, an unloadable file)."""
    try:
        key = digest(source.read_bytes(), tool_version(cxx), *flags)
        out = cache_dir() / f"{name}_{key}.so"
        if not out.exists():
            with FileLock(out.with_suffix(".lock")):
                if not out.exists():
                    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
                    run_tool([cxx, *flags, "-o", str(tmp), str(source)], f"building the CPU {name} kernel")
                    os.replace(tmp, out)
        return ctypes.CDLL(str(out))
    except Exception as exc:
        return exc


def unsupported(lib, cxx: str) -> list[str]:
    """``not_supported_reasons``' entry for a library that :func:`load` could not provide."""
    if not isinstance(lib, Exception):
        return []
    first = str(lib).splitlines()[0] if str(lib) else ""
    return [f"the C++ kernel could not be built with {cxx} ({type(lib).__name__}: {first}); use backend='torch'"]


def kernel(lib, symbol: str, work: torch.dtype, what: str):
    """The entry point ``<symbol>_f32`` or ``<symbol>_f64`` (by the work dtype) of a library
    :func:`load` returned; a RuntimeError naming ``what`` if it could not be built."""
    if isinstance(lib, Exception):
        raise RuntimeError(f"the cpu {what} kernel is unavailable: {lib}")
    return getattr(lib, f"{symbol}_{'f64' if work == torch.float64 else 'f32'}")


def as_work(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a kernel reads it: contiguous in ``dtype``. The per-call cost matters at small sizes, so
    a tensor already in that dtype and layout is passed as it is, without a conversion call."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
