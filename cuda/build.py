"""Build helpers for the CUDA sources in this folder, usable without a GPU.

* :func:`load_emulator` compiles the kernel instantiations of the ops' launch descriptions (one
  generated registry file per header, or per kernel template for the CuTe header, as C++ with
  the SIMT emulator of ``emu/emu.cuh``), the emulator runtime and ``bindings.cpp`` into a CPU
  extension and imports it. Objects are cached by content hash (source, every header in this
  folder, flags, compiler), so a rebuild after an edit recompiles only what changed, and an
  unchanged tree loads in milliseconds. For tests and development only: on a GPU the kernels
  are compiled by NVRTC at run time (cuda/nvrtc.py).
* :func:`nvcc_resources` compiles one generated source that instantiates given kernels (the same
  name expressions) with ``nvcc -cubin -arch=sm_XX -Xptxas -v`` and returns the registers,
  spills, stack and static shared memory of every kernel in it (cached by content hash too): a
  cross-check of the NVRTC build with the toolkit's compiler where one is installed.

Cache folder: ``$MEGALODON_KERNELS_CUDA_CACHE``, else ``$MEGALODON_KERNELS_CACHE/cuda``, else
``~/.cache/megalodon_kernels/cuda``. Parallel compile jobs: ``$MAX_JOBS`` (default: CPU count).
This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent
EMU_DIR = CUDA_DIR / "emu"
EMULATOR_MODULE = "_mk_cuda_emu"
#: Per-block shared memory limits (opt-in maximum) by compute capability.
SMEM_LIMIT = {80: 166912, 90: 232448}
#: Registers per thread the hardware allows at 1024 threads per block (65536 / 1024).

CXX = os.environ.get("CXX", "g++")
def _host_has_fma() -> bool:
    try:
        return " fma " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


#: nvcc contracts a*b+c into one FMA by default (-fmad=true); g++ does not under -std=c++20, so the
#: emulator asks for it (with the host's FMA instructions; emu/device_math.h models the math library).
FMA_FLAGS = ["-ffp-contract=fast", "-mfma"] if _host_has_fma() else ["-ffp-contract=fast"]
CXXFLAGS = ["-std=c++20", "-O2", "-fPIC", "-Wall", "-Wno-unused-function", "-fno-strict-aliasing", *FMA_FLAGS]
BINDING_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-fvisibility=hidden"]
NVCC_FLAGS = ["-std=c++20", "-cubin", "-Xptxas", "-v", "-lineinfo"]


# --- attention (CuTe include dirs) ---
def cute_include_dirs() -> list[str]:
    """CUTLASS/CuTe headers of the PyPI package nvidia-cutlass (cutlass_library/source/include),
    [] when it is not installed. Found without importing cutlass_library (its import is heavy)."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return [str(inc)] if (inc / "cute" / "tensor.hpp").exists() else []


def _emulator_cute_flags() -> list[str]:
    """Flags that let the flash attention sources include CuTe on the host compiler: the CUTLASS
    headers, CCCL's libcu++ (cuda/std/*, from the CUDA toolkit) and cute_host/ (stand-ins for the
    CUDA headers CuTe names; emu/emu.cuh defines the CUDA types). Without either, those sources
    compile to launchers that raise (MK_HAVE_CUTE undefined)."""
    cute = cute_include_dirs()
    nvcc = nvcc_path()
    roots = [Path(nvcc).resolve().parent.parent / "include" / "cccl"] if nvcc else []
    roots.append(Path("/usr/local/cuda/include/cccl"))
    cccl = next((r for r in roots if (r / "cuda" / "std" / "utility").exists()), None)
    if not cute or cccl is None:
        return []
    return ["-DMK_HAVE_CUTE=1", f"-I{CUDA_DIR / 'cute_host'}", *(f"-isystem{d}" for d in cute), f"-isystem{cccl}"]


def _uses_cute(src: Path) -> bool:
    return b"MK_HAVE_CUTE" in Path(src).read_bytes()
# --- end attention ---


def emulator_sources() -> list[Path]:
    """The emulator's runtime and self-test kernels (the ops' kernels come from the registries)."""
    return sorted(EMU_DIR.glob("*.cu")) + sorted(EMU_DIR.glob("*.cpp"))


def cache_dir() -> Path:
    root = os.environ.get("MEGALODON_KERNELS_CUDA_CACHE")
    if root:
        path = Path(root)
    else:
        base = os.environ.get("MEGALODON_KERNELS_CACHE")
        path = (Path(base) if base else Path.home() / ".cache" / "megalodon_kernels") / "cuda"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jobs() -> int:
    try:
        return max(1, int(os.environ.get("MAX_JOBS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(list(CUDA_DIR.rglob("*.cuh")) + list(CUDA_DIR.rglob("*.h"))):
        h.update(str(p.relative_to(CUDA_DIR)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_tool_versions: dict[str, str] = {}


def tool_version(tool: str) -> str:
    if tool not in _tool_versions:
        try:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"cannot run {tool}: {exc}") from exc
        _tool_versions[tool] = out.strip()
    return _tool_versions[tool]


def digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def run_tool(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc


def _atomic_move(tmp: Path, dst: Path) -> None:
    os.replace(tmp, dst)


def _write_generated(path: Path, text: str) -> None:
    """Write a generated source whose name holds its content's digest: once, atomically (another
    process may be writing the same file)."""
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        _atomic_move(tmp, path)


class FileLock:
    """An exclusive file lock: concurrent test processes build the same cache safely."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = open(self.path, "w")
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.fd.close()


# ------------------------------------------------------------------------------------------------
# Emulator extension
# ------------------------------------------------------------------------------------------------

def _binding_includes() -> list[str]:
    incs = [sysconfig.get_paths()["include"]]
    try:
        import pybind11  # type: ignore

        incs.insert(0, pybind11.get_include())
    except ImportError:
        import torch  # torch wheels ship pybind11's headers

        incs.insert(0, str(Path(torch.__file__).parent / "include"))
    return incs


def _needs_cute(header: str) -> bool:
    return "<cute/" in (CUDA_DIR / header).read_text()


def _template(name: str) -> str:
    """'mk::flash::flash_fwd_kernel<...>' -> 'flash_fwd_kernel'."""
    return name.split("<")[0].split("::")[-1]


def registry_sources(gendir: Path) -> list[Path]:
    """Generated C++ files that register the ops' kernel instantiations (their KERNELS and
    EMULATOR_KERNELS lists, cuda/instances.py) for launch by name expression (emu/by_name.h): one
    per header, or per kernel template for the CuTe header (heavy objects, compiled in parallel;
    registered only when CuTe's headers are found, MK_HAVE_CUTE)."""
    from .instances import described_kernels

    groups: dict[tuple[str, str], list[str]] = {}
    for k in described_kernels(emulator=True):
        cute = _needs_cute(k.header)
        groups.setdefault((k.header, _template(k.name) if cute else ""), []).append(k.name)
    gendir.mkdir(parents=True, exist_ok=True)
    out = []
    for (header, template), names in sorted(groups.items()):
        lines = ["// generated by cuda/build.py from the ops' KERNELS lists"]
        if template:
            lines.append("#if MK_HAVE_CUTE")
        lines += [f'#include "{header}"', '#include "emu/by_name.h"', ""]
        lines += [f'MK_REGISTER_KERNEL(k{i}, "{name}", {name});' for i, name in enumerate(names)]
        if template:
            lines.append("#endif")
        text = "\n".join(lines) + "\n"
        path = gendir / f"registry_{Path(header).stem}{'_' + template if template else ''}-{digest(text)}.cpp"
        _write_generated(path, text)
        out.append(path)
    return out


def _compile_jobs(objdir: Path) -> list[tuple[Path, list[str], Path]]:
    headers = _headers_digest()
    cxx = tool_version(CXX)
    jobs = []
    for src in emulator_sources() + registry_sources(objdir.parent / "gen"):
        # Only the CuTe sources get the CuTe flags: the other objects keep their cache keys.
        cute = _emulator_cute_flags() if _uses_cute(src) else []
        flags = [*CXXFLAGS, "-x", "c++", f"-I{CUDA_DIR}", *cute]
        key = digest(src.read_bytes(), headers, flags, cxx)
        obj = objdir / f"{src.stem}-{key}.o"
        jobs.append((src, [CXX, *flags, "-c", str(src), "-o"], obj))
    src = CUDA_DIR / "bindings.cpp"
    flags = [*BINDING_FLAGS, f"-DMK_EXT_NAME={EMULATOR_MODULE}", "-DMK_EMULATOR_BUILD", f"-I{CUDA_DIR}",
             *(f"-I{i}" for i in _binding_includes())]
    key = digest(src.read_bytes(), headers, flags, cxx, sys.version)
    jobs.append((src, [CXX, *flags, "-c", str(src), "-o"], objdir / f"bindings-{key}.o"))
    return jobs


def build_emulator(verbose: bool = False) -> Path:
    """Compile (what changed) and link the emulator extension; return the path of the .so."""
    root = cache_dir() / "emu"
    objdir = root / "obj"
    objdir.mkdir(parents=True, exist_ok=True)
    jobs = _compile_jobs(objdir)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    link_key = digest(*(obj.name for _, _, obj in jobs), tool_version(CXX))
    so = root / f"lib-{link_key}" / f"{EMULATOR_MODULE}{suffix}"
    if so.exists():
        return so
    with FileLock(root / ".lock"):
        if so.exists():
            return so
        todo = [(src, cmd, obj) for src, cmd, obj in jobs if not obj.exists()]

        def compile_one(job):
            src, cmd, obj = job
            tmp = obj.with_suffix(f".tmp{os.getpid()}.o")
            if verbose:
                print(f"[mk-emu] compiling {src.name}", file=sys.stderr)
            run_tool([*cmd, str(tmp)], f"compiling {src.name}")
            _atomic_move(tmp, obj)

        # biggest first: bindings.cpp (pybind11) dominates
        todo.sort(key=lambda j: j[0].suffix != ".cpp")
        with ThreadPoolExecutor(max_workers=_jobs()) as pool:
            list(pool.map(compile_one, todo))
        so.parent.mkdir(parents=True, exist_ok=True)
        tmp = so.with_name(f".{so.name}.tmp{os.getpid()}")
        run_tool([CXX, "-shared", "-o", str(tmp), *(str(obj) for _, _, obj in jobs), "-lpthread"], "linking the emulator")
        _atomic_move(tmp, so)
    return so


_emulator = None


def load_emulator(verbose: bool = False):
    """The emulator extension module (built on first use, then cached on disk and in memory)."""
    global _emulator
    if _emulator is None:
        so = build_emulator(verbose)
        spec = importlib.util.spec_from_file_location(EMULATOR_MODULE, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _emulator = mod
    return _emulator


# ------------------------------------------------------------------------------------------------
# nvcc resource usage
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelResources:
    source: str
    arch: int
    kernel: str  # demangled name
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int


def nvcc_path() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> list[dict]:
    """Per entry function: registers, spills, stack and static smem from a ``-Xptxas -v`` log."""
    out: dict[str, dict] = {}
    current = None
    props_for = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {"mangled": current, "registers": 0, "spill_stores": 0, "spill_loads": 0,
                                     "stack": 0, "static_smem": 0})
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _SPILL.search(line)
        if m and props_for in out:
            out[props_for].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _USED.search(line)
        if m and current is not None:
            out[current]["registers"] = int(m.group(1))
            out[current]["static_smem"] = int(m.group(2) or 0)
    return list(out.values())


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return names
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    return lines if proc.returncode == 0 and len(lines) == len(names) else names


def nvcc_resources(src: Path, arch: int) -> list[KernelResources]:
    """Compile ``src`` for sm_<arch> (cubin, no GPU needed) and report every kernel's resources."""
    import json

    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or put the CUDA toolkit's bin on PATH)")
    src = Path(src)
    cute = [a for d in cute_include_dirs() for a in ("-isystem", d)] if _uses_cute(src) else []
    flags = [*NVCC_FLAGS, f"-arch=sm_{arch}", f"-I{CUDA_DIR}", *cute]
    key = digest(src.read_bytes(), _headers_digest(), flags, tool_version(nvcc))
    root = cache_dir() / "nvcc"
    root.mkdir(parents=True, exist_ok=True)
    entry = root / f"{src.stem}-sm{arch}-{key}.json"
    if not entry.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / f"{src.stem}.cubin"
            proc = run_tool([nvcc, *flags, str(src), "-o", str(cubin)], f"nvcc {src.name} sm_{arch}")
            rows = parse_ptxas(proc.stdout + proc.stderr)
        names = _demangle([r["mangled"] for r in rows])
        for r, n in zip(rows, names):
            r["kernel"] = n
        tmpf = entry.with_suffix(f".tmp{os.getpid()}")
        tmpf.write_text(json.dumps(rows, indent=1))
        os.replace(tmpf, entry)
    rows = json.loads(entry.read_text())
    return [KernelResources(src.name, arch, r["kernel"], r["registers"], r["spill_stores"], r["spill_loads"],
                            r["stack"], r["static_smem"]) for r in rows]


def nvcc_sources(kernels, gendir: Path | None = None) -> list[Path]:
    """Generated CUDA sources that instantiate ``kernels`` ([launch.Kernel]: the ops' name
    expressions) for nvcc by taking their addresses, one per (header, kernel template)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for k in kernels:
        groups.setdefault((k.header, _template(k.name)), []).append(k.name)
    gendir = cache_dir() / "nvcc" / "gen" if gendir is None else gendir
    gendir.mkdir(parents=True, exist_ok=True)
    out = []
    for (header, template), names in sorted(groups.items()):
        lines = ["// generated by cuda/build.py: the ops' kernel instantiations for nvcc"
                 + (" (MK_HAVE_CUTE: with CuTe's include dirs)" if _needs_cute(header) else ""),
                 f'#include "{header}"', "",
                 f"extern const void* const mk_{template}_instances[];",
                 f"const void* const mk_{template}_instances[] = {{"]
        lines += [f"    reinterpret_cast<const void*>(&{name})," for name in names]
        lines.append("};")
        text = "\n".join(lines) + "\n"
        path = gendir / f"{template}-{digest(text)}.cu"
        _write_generated(path, text)
        out.append(path)
    return out


def nvcc_resources_all(sources, archs=(80, 90)) -> list[KernelResources]:
    """:func:`nvcc_resources` over sources (:func:`nvcc_sources`) and archs, in parallel."""
    jobs = [(s, a) for s in sources for a in archs]
    with ThreadPoolExecutor(max_workers=_jobs()) as pool:
        results = list(pool.map(lambda j: nvcc_resources(*j), jobs))
    return [r for rows in results for r in rows]
