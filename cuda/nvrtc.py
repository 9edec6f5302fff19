"""Run-time compilation of the CUDA kernels by NVRTC, through CuPy's low-level NVRTC binding.

One NVRTC program per kernel instantiation: the program is ``#include "<header>.cuh"`` and the
instantiation is a name expression (``mk::rotary_kernel<float, false>``), so the compiled cubin
holds exactly that kernel. Nothing here needs a GPU or a driver (the low-level binding calls
libnvrtc only), nor a CUDA toolkit: the headers come from pip packages (``nvidia-cuda-runtime``
for cuda_bf16.h and friends, ``nvidia-cuda-cccl`` for libcu++, ``nvidia-cutlass`` for CuTe).

Compiled kernels are cached on disk (:func:`cache_dir`): the key covers the program text, every
header of this folder it includes (transitively), the versions of the header packages, the arch,
the NVRTC version and the options. Writers hold a file lock and publish by atomic rename; an
entry that does not verify (truncated, edited) is recompiled with one warning. A folder written
by ``python -m megalodon_kernels.cuda compile --out DIR`` and named by
``$MEGALODON_KERNELS_CUBIN_DIR`` is read (never written) before the cache.

Resources (registers, spills, stack, static shared memory) come from ptxas's verbose report in
the NVRTC log (``--ptxas-options=-v``). This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent
#: Per-block shared memory limits (opt-in maximum) by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
#: The pip packages whose headers the kernels include (their versions are part of the cache key).
HEADER_PACKAGES = ("nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cutlass")
#: -default-device: CUTLASS/CuTe have constexpr helpers without __host__ __device__, which NVRTC
#: would otherwise reject as host code.
OPTIONS = ("-std=c++20", "-default-device", "--ptxas-options=-v", "-DNDEBUG", "-lineinfo")
_MAGIC = b"MKNVRTC1\n"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class NvrtcUnavailable(RuntimeError):
    """NVRTC or the pip header packages are missing (the message says which and how to install)."""


class NvrtcError(RuntimeError):
    """NVRTC rejected a program; the message holds the instantiation and NVRTC's log."""


@dataclass(frozen=True)
class Resources:
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    static_smem: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class Compiled:
    """One kernel instantiation compiled for one arch."""

    header: str
    name_expression: str
    arch: int
    lowered_name: str
    cubin: bytes = field(repr=False)
    log: str = field(repr=False)
    resources: Resources
    #: seconds NVRTC took (0.0 when the cubin came from a cache or a prebuilt folder)
    compile_seconds: float
    origin: str  # "nvrtc", "cache" or "prebuilt"


# ------------------------------------------------------------------------------------------------
# NVRTC and the header packages
# ------------------------------------------------------------------------------------------------

def import_cupy(module: str):
    """Import a CuPy module while a source checkout of this package is on sys.path: its top level
    holds this ``cuda/`` folder, which would shadow NVIDIA's ``cuda`` namespace package that CuPy
    imports (cuda.pathfinder). If the checkout's folder was already imported as ``cuda``, it is put
    back afterwards (CuPy keeps its own references to the submodules it imported), so modules that
    cached it (inspect's file cache) keep seeing the same object. Installed wheels are not affected."""
    checkout = CUDA_DIR.parent
    shadow = sys.modules.get("cuda")
    if shadow is not None and Path(getattr(shadow, "__file__", None) or "/").resolve().parent == CUDA_DIR:
        del sys.modules["cuda"]
    else:
        shadow = None
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != checkout]
    try:
        return importlib.import_module(module)
    finally:
        sys.path[:] = saved
        if shadow is not None:
            sys.modules["cuda"] = shadow


def nvrtc_binding():
    """CuPy's low-level NVRTC module (no driver needed), or NvrtcUnavailable saying what to install."""
    try:
        nvrtc = import_cupy("cupy_backends.cuda.libs.nvrtc")
        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or libnvrtc missing (RuntimeError / OSError from CuPy)
        raise NvrtcUnavailable(
            f"NVRTC through CuPy is not available ({type(exc).__name__}: {exc}); install the cuda extra, "
            f"from a checkout: pip install -e '.[cuda]' (CuPy and NVRTC for CUDA 13; for CUDA 12 see README)") from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(nvrtc_binding().getVersion())


def supported_archs() -> list[int]:
    """Compute capabilities (e.g. 80, 90) this NVRTC can compile for."""
    return [int(a) for a in nvrtc_binding().getSupportedArchs()]


def _package_dir(name: str) -> Path | None:
    dirs = _package_dirs(name)
    return dirs[0] if dirs else None


def _package_dirs(name: str) -> list[Path]:
    """Every folder of (namespace) package ``name`` on sys.path: the ``nvidia`` wheels of one
    environment may be split between site-packages and a ``--target`` folder on PYTHONPATH."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


@functools.lru_cache(maxsize=None)
def include_dirs() -> tuple[str, ...]:
    """The CUDA headers (cuda_bf16.h, ...), CCCL and CuTe, all from pip packages."""
    # CUDA 13 wheels share nvidia/cu13/include; CUDA 12 wheels have one folder per component
    includes = [d for nvidia in _package_dirs("nvidia")
                for d in sorted(nvidia.glob("cu*/include")) + sorted(nvidia.glob("cuda_runtime/include"))]
    runtime = next((d for d in includes if (d / "cuda_bf16.h").exists()), None)
    if runtime is None:
        raise NvrtcUnavailable("the CUDA headers are missing: pip install nvidia-cuda-runtime "
                               "(part of the cuda extra)")
    cccl = next((c for d in includes for c in (d / "cccl", d.parent.parent / "cuda_cccl" / "include")
                 if (c / "cuda" / "std" / "cstdint").exists()), None)
    if cccl is None:
        raise NvrtcUnavailable("the CCCL headers (libcu++) are missing: pip install 'nvidia-cuda-cccl==13.0.*' "
                               "(part of the cuda extra)")
    dirs = [str(runtime), str(cccl)]
    if cccl.name == "cccl" and cccl.parent != runtime:
        # CuTe includes libcu++ as <cccl/cuda/std/...> when CCCL sits in a folder of its own
        dirs.append(str(cccl.parent))
    cutlass = _package_dir("cutlass_library")
    if cutlass is not None and (cutlass / "source" / "include" / "cute" / "tensor.hpp").exists():
        dirs.append(str(cutlass / "source" / "include"))
    return tuple(dirs)


def _package_versions() -> str:
    out = []
    for name in HEADER_PACKAGES:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} missing")
    return ";".join(out)


# ------------------------------------------------------------------------------------------------
# Cache keys
# ------------------------------------------------------------------------------------------------

def program_source(header: str) -> str:
    return f'#include "{header}"\n'


def local_headers(header: str, root: Path = CUDA_DIR) -> list[Path]:
    """Every file of ``root`` the header includes with quotes, transitively (itself first)."""
    seen: list[Path] = []
    stack = [root / header]
    while stack:
        path = stack.pop()
        if path in seen or not path.exists():
            continue
        seen.append(path)
        for inc in _INCLUDE.findall(path.read_text()):
            for base in (path.parent, root):
                if (base / inc).exists():
                    stack.append((base / inc).resolve())
                    break
    return seen


def cache_key(header: str, name_expression: str, arch: int, options=OPTIONS, root: Path = CUDA_DIR) -> str:
    h = hashlib.sha256()
    for part in (program_source(header), name_expression, f"sm_{arch}", "nvrtc %d.%d" % nvrtc_version(),
                 " ".join(options), _package_versions()):
        h.update(part.encode())
        h.update(b"\0")
    for path in local_headers(header, root):
        h.update(path.relative_to(root).as_posix().encode() if path.is_relative_to(root) else path.name.encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    """``$MEGALODON_KERNELS_CUDA_CACHE/nvrtc``, else ``$MEGALODON_KERNELS_CACHE/cuda/nvrtc``, else
    ``~/.cache/megalodon_kernels/cuda/nvrtc`` (``$XDG_CACHE_HOME`` honoured)."""
    root = os.environ.get("MEGALODON_KERNELS_CUDA_CACHE")
    if root:
        path = Path(root)
    else:
        base = os.environ.get("MEGALODON_KERNELS_CACHE")
        xdg = os.environ.get("XDG_CACHE_HOME")
        home = Path(xdg) if xdg else Path.home() / ".cache"
        path = (Path(base) if base else home / "megalodon_kernels") / "cuda"
    return path / "nvrtc"


def prebuilt_dir() -> Path | None:
    root = os.environ.get("MEGALODON_KERNELS_CUBIN_DIR")
    return Path(root) if root else None


# ------------------------------------------------------------------------------------------------
# Entries: magic, one JSON line (names, log, digest of the cubin), the cubin
# ------------------------------------------------------------------------------------------------

def _entry_bytes(c: Compiled) -> bytes:
    meta = {"header": c.header, "name_expression": c.name_expression, "arch": c.arch,
            "lowered_name": c.lowered_name, "log": c.log, "sha256": hashlib.sha256(c.cubin).hexdigest()}
    return _MAGIC + json.dumps(meta).encode() + b"\n" + c.cubin


def _read_entry(path: Path, origin: str) -> Compiled:
    """The entry at ``path``; ValueError when it does not verify."""
    data = path.read_bytes()
    if not data.startswith(_MAGIC):
        raise ValueError("bad header")
    line_end = data.index(b"\n", len(_MAGIC))
    meta = json.loads(data[len(_MAGIC):line_end])
    cubin = data[line_end + 1:]
    if hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
        raise ValueError("the cubin does not match its digest")
    return Compiled(meta["header"], meta["name_expression"], int(meta["arch"]), meta["lowered_name"], cubin,
                    meta["log"], parse_ptxas_log(meta["log"], meta["lowered_name"]), 0.0, origin)


def write_entry(directory: Path, key: str, c: Compiled) -> Path:
    """Publish ``c`` as ``directory/key.cubin`` by atomic rename (readers never see a partial file)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_entry_bytes(c))
        os.replace(tmp, directory / f"{key}.cubin")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory / f"{key}.cubin"


# ------------------------------------------------------------------------------------------------
# ptxas report
# ------------------------------------------------------------------------------------------------

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, lowered_name: str) -> Resources:
    """The resources ptxas reported for the entry function ``lowered_name``."""
    current, found = None, {}
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            current = m.group(1)
            found[current] = {"stack": 0, "spill_stores": 0, "spill_loads": 0, "registers": 0, "static_smem": 0}
            continue
        if current is None:
            continue
        m = _PTXAS_FRAME.search(line)
        if m:
            found[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_USED.search(line)
        if m:
            found[current].update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    if lowered_name not in found:
        raise NvrtcError(f"ptxas reported no resources for {lowered_name} (log: {log[:2000]})")
    return Resources(**found[lowered_name])


# ------------------------------------------------------------------------------------------------
# Compile
# ------------------------------------------------------------------------------------------------

def _nvrtc_compile(header: str, name_expression: str, arch: int, options, root: Path) -> Compiled:
    nvrtc = nvrtc_binding()
    if arch not in supported_archs():
        raise NvrtcUnavailable(f"NVRTC {'%d.%d' % nvrtc_version()} cannot compile for sm_{arch} "
                               f"(it supports {supported_archs()})")
    opts = [f"-arch=sm_{arch}", *options, f"-I{root}", *(f"-I{d}" for d in include_dirs())]
    start = time.perf_counter()
    prog = nvrtc.createProgram(program_source(header), f"{Path(header).stem}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            raise NvrtcError(f"NVRTC failed to compile {name_expression} ({header}, sm_{arch}): {exc}\n"
                             f"{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, name_expression)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - start
    return Compiled(header, name_expression, arch, lowered, bytes(cubin), log, parse_ptxas_log(log, lowered),
                    seconds, "nvrtc")


_warned_corrupt = False


def _warn_corrupt(path: Path, why: str) -> None:
    global _warned_corrupt
    if not _warned_corrupt:
        _warned_corrupt = True
        warnings.warn(f"megalodon_kernels: corrupt NVRTC cache entry {path} ({why}); recompiling "
                      f"(further corrupt entries are recompiled silently)", RuntimeWarning, stacklevel=3)


def compile_kernel(header: str, name_expression: str, arch: int, *, use_cache: bool = True,
                   options=OPTIONS, root: Path = CUDA_DIR) -> Compiled:
    """``name_expression`` from ``header`` (a file of ``root``, this folder by default) compiled for
    ``sm_<arch>``: from the prebuilt folder, the disk cache, or NVRTC (then cached)."""
    key = cache_key(header, name_expression, arch, options, root)
    prebuilt = prebuilt_dir()
    if use_cache and prebuilt is not None and (prebuilt / f"{key}.cubin").exists():
        try:
            return _read_entry(prebuilt / f"{key}.cubin", "prebuilt")
        except (ValueError, KeyError, OSError) as exc:
            _warn_corrupt(prebuilt / f"{key}.cubin", str(exc))
    if not use_cache:
        return _nvrtc_compile(header, name_expression, arch, options, root)
    import filelock  # a dependency of torch

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.cubin"
    with filelock.FileLock(str(directory / f"{key}.lock")):
        if path.exists():
            try:
                return _read_entry(path, "cache")
            except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
                _warn_corrupt(path, str(exc) or type(exc).__name__)
        compiled = _nvrtc_compile(header, name_expression, arch, options, root)
        write_entry(directory, key, compiled)
        return compiled
