"""Build upstream Megalodon's CUDA extension from a source checkout the user names.

``python bench/upstream_build.py --src CHECKOUT [--build-dir DIR] [--arch 9.0] [--jobs 2] [--out DIR]``

Upstream (https://github.com/XuezheMax/megalodon) compiles its kernels (megalodon/csrc/ops/*_kernel.cu
and the .cc bindings) into one pybind11 extension, ``megalodon_extension`` with the submodule ``ops``.
Nothing of upstream is part of this repository: the user points ``--src`` at a checkout, this script

1. copies the sources to ``--build-dir`` with the compatibility edits of ``EDITS`` for the installed
   torch applied, each stated with its reason and refused loudly when the text it expects is not
   there (a changed upstream must be looked at); a file whose final content is already there is not
   rewritten, so a second run reuses the objects of the first (ninja rebuilds only what changed),
2. runs upstream's own ``setup.py build_ext --inplace`` unchanged with the interpreter running this
   script (so the module is tagged for that Python and built against its torch), for the archs of
   ``--arch`` (TORCH_CUDA_ARCH_LIST) with ``--jobs`` parallel compiles (MAX_JOBS),
3. logs one line per source file as ninja reports it compiled (seconds since the start, object size),
   and on failure the file ninja names and the compiler's first error lines,
4. copies the module into ``--out`` when given, stripped of its debug sections (Python's CFLAGS
   carry -g: 59 MiB with them, 18 MiB without), and checks that copy (or the built module): its
   size (at most 40 MiB), the ``sm_XX`` cubins it holds (cuobjdump, or the fatbin headers read
   directly), that it imports without a GPU in a fresh interpreter (after ``import torch``) and that
   ``megalodon_extension.ops`` exposes the functions vs_upstream.py calls; ``BUILD_INFO.json``
   beside it records the torch and Python versions, the arch and the edits.

The module must be built with the same Python minor version and torch version as the machine that
loads it (pybind11 modules are tagged for one CPython; the torch C++ ABI changes between releases).
Exit status 0 when the module was built and passed the checks, 1 otherwise, with the reason printed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

#: upstream's compiled sources, relative to the checkout (the list in its setup.py)
SOURCES = (
    "megalodon/csrc/blas.cc",
    "megalodon/csrc/megalodon_extension.cc",
    "megalodon/csrc/ops/attention.cc",
    "megalodon/csrc/ops/attention_kernel.cu",
    "megalodon/csrc/ops/attention_softmax.cc",
    "megalodon/csrc/ops/attention_softmax_kernel.cu",
    "megalodon/csrc/ops/ema_hidden.cc",
    "megalodon/csrc/ops/ema_hidden_kernel.cu",
    "megalodon/csrc/ops/ema_parameters.cc",
    "megalodon/csrc/ops/ema_parameters_kernel.cu",
    "megalodon/csrc/ops/fftconv.cc",
    "megalodon/csrc/ops/fftconv_kernel.cu",
    "megalodon/csrc/ops/sequence_norm.cc",
    "megalodon/csrc/ops/sequence_norm_kernel.cu",
    "megalodon/csrc/ops/timestep_norm.cc",
    "megalodon/csrc/ops/timestep_norm_kernel.cu",
)

#: (file, regex, replacement, reason). Minimal: only what the installed torch's headers refuse.
EDITS = (
    *((f, r"\n[ \t]*torch::globalContext\(\)\.alertCuBLASConfigNotDeterministic\(\);", "\n",
       "at::Context::alertCuBLASConfigNotDeterministic() was removed from torch's headers (absent in "
       "2.11); upstream calls it before its cuBLAS GEMMs only to warn under deterministic mode, so the "
       "call is deleted (no effect on the results)")
      for f in ("megalodon/csrc/ops/attention_kernel.cu",
                "megalodon/csrc/ops/ema_hidden_kernel.cu",
                "megalodon/csrc/ops/ema_parameters_kernel.cu")),
)

#: what vs_upstream.py calls on ``megalodon_extension.ops``
EXPECTED_FUNCTIONS = (
    "ema_parameters_fwd", "ema_parameters_bwd", "ema_hidden_fwd", "ema_hidden_bwd",
    "rfft", "fftconv_fwd", "fftconv_bwd", "group_timestep_norm_fwd", "group_timestep_norm_bwd",
    "attention_fwd", "attention_bwd", "attention_softmax_fwd", "attention_softmax_bwd",
)


def log(msg: str) -> None:
    print(f"[upstream-build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def edited_text(rel: str, text: str) -> tuple[str, list[str]]:
    """``text`` of the checkout's file ``rel`` with the EDITS for it applied, and a note per edit.
    Raises when an edit finds nothing to change while its target is still there (upstream changed the
    code around it: look at it)."""
    notes = []
    for f, pat, rep, why in EDITS:
        if f != rel:
            continue
        text, n = re.subn(pat, rep, text)
        if n == 0 and "alertCuBLASConfigNotDeterministic" in text:
            raise RuntimeError(f"edit of {f} found no match for {pat!r}: the source changed, look at it")
        notes.append(f"edit {f}: {n} replacement(s): {why}")
    return text, notes


def prepare_sources(src: Path, dst: Path) -> tuple[int, list[str]]:
    """Copy the checkout's setup.py and megalodon/csrc to dst with EDITS applied, writing only the
    files whose final content differs from what dst holds (unchanged files keep their mtimes, so
    ninja keeps their objects). Returns (files written, the edits' notes)."""
    written, notes = 0, []
    files = [src / "setup.py"] + [p for p in sorted((src / "megalodon" / "csrc").rglob("*")) if p.is_file()]
    for a in files:
        rel = a.relative_to(src).as_posix()
        b = dst / rel
        data = a.read_bytes()
        if any(e[0] == rel for e in EDITS):
            text, n = edited_text(rel, data.decode())
            notes += n
            data = text.encode()
        if b.exists() and b.read_bytes() == data:
            continue
        b.parent.mkdir(parents=True, exist_ok=True)
        b.write_bytes(data)
        written += 1
    return written, notes


#: ninja (torch's BuildExtension runs it verbose) prints "[finished/total] <command>" as each command
#: ends when its output is not a terminal: one line per compiled file
NINJA_DONE = re.compile(r"^\[(\d+)/(\d+)\] .*?(?:-c|\s)(\S+\.(?:cu|cc|cpp))\b.*?-o (\S+)")


def file_line(line: str, elapsed: float) -> Optional[str]:
    """The log line for a ninja status line that names a compiled source, else None."""
    m = NINJA_DONE.match(line)
    if not m:
        return None
    k, n, src, obj = m.groups()
    size = Path(obj).stat().st_size / 2**20 if Path(obj).exists() else 0.0
    return f"[{k:>2}/{n}] compiled {Path(src).name:<32} done at {elapsed:6.0f} s  object {size:6.2f} MiB"


def library_include_dir() -> str | None:
    """torch's CUDA headers include cuSPARSE / cuBLAS / cuFFT headers that a toolkit installed
    without those libraries (nvcc and the runtime only) lacks. torch's pip wheel depends on the
    nvidia-* pip packages, which ship the same headers (nvidia/cu13/include for CUDA 13): return
    that folder when CUDA_HOME has no cusparse.h, so it can go on CPATH (searched after -I, so the
    toolkit's own runtime headers still win)."""
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME and (Path(CUDA_HOME) / "include" / "cusparse.h").exists():
        return None
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for inc in sorted(Path(root).glob("cu*/include")):
            if (inc / "cusparse.h").exists():
                return str(inc)
    return None


def build(dst: Path, arch: str, jobs: int, verbose: bool) -> tuple[bool, str]:
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=str(jobs))
    inc = library_include_dir()
    if inc:
        env["CPATH"] = os.pathsep.join(p for p in (inc, os.environ.get("CPATH")) if p)
        log(f"CUDA_HOME lacks cusparse.h (torch's headers include it): CPATH += {inc} "
            "(the nvidia pip packages' headers)")
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    log(f"running {' '.join(cmd)} in {dst} (TORCH_CUDA_ARCH_LIST={arch} MAX_JOBS={jobs})")
    t0 = time.time()
    out_lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=dst, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    with open(dst / "build.log", "w", buffering=1) as blog:
        for line in proc.stdout:
            blog.write(line)
            out_lines.append(line.rstrip("\n"))
            done = file_line(line, time.time() - t0)
            if done:
                log(done)
            elif verbose or line.startswith("FAILED:") or ": error" in line:
                print("    " + line.rstrip("\n")[:400], flush=True)
            if "ninja: no work to do" in line:
                log("ninja: every object is up to date")
    rc = proc.wait()
    log(f"setup.py exited with {rc} after {time.time() - t0:.0f} s; full log: {dst / 'build.log'}")
    if rc == 0:
        return True, ""
    failed = [l for l in out_lines if l.startswith("FAILED:")]
    errors = [l for l in out_lines if re.search(r"(error|Error)[: ]", l)][:15]
    why = "\n".join(["failed objects: " + (", ".join(f.split()[-1] for f in failed) or "(none named)")]
                    + errors)
    return False, why


def find_module(dst: Path) -> Path | None:
    mods = sorted(dst.glob("megalodon_extension*.so"))
    return mods[0] if mods else None


IMPORT_CHECK = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import megalodon_extension
from megalodon_extension import ops
names = sorted(n for n in dir(ops) if not n.startswith('_'))
print(json.dumps({"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                  "functions": names, "file": megalodon_extension.__file__}))
"""


def fatbin_archs(path: Path) -> list[str]:
    """The device code in a module's fat binaries, as ``sm_XX`` (cubin) and ``ptx_XX`` entries, read from
    the fatbin containers (magic 0xBA55ED50) directly: for machines without cuobjdump."""
    data = path.read_bytes()
    magic = struct.pack("<I", 0xBA55ED50)
    found = set()
    i = data.find(magic)
    while i != -1:
        _version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        j, end = i + header, i + header + size
        while j + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, j)
            if kind not in (1, 2) or entry_header < 32:
                break
            found.add(("ptx" if kind == 1 else "sm") + f"_{struct.unpack_from('<I', data, j + 28)[0]}")
            j += entry_header + payload
        i = data.find(magic, max(end, i + 4))
    return sorted(found)


def strip_debug(src: Path, dst: Path) -> str:
    """Copy ``src`` to ``dst`` without debug sections (``strip --strip-debug``: the code, the symbols
    and the device code are unchanged). The build compiles with Python's CFLAGS, whose -g makes the
    module three times its size. Returns a note."""
    tool = shutil.which("strip")
    if tool is None:
        shutil.copy2(src, dst)
        return "strip not found: copied with its debug sections"
    subprocess.run([tool, "--strip-debug", "-o", str(dst), str(src)], check=True)
    return (f"stripped of debug sections: {src.stat().st_size / 2**20:.1f} MiB -> "
            f"{dst.stat().st_size / 2**20:.1f} MiB")


def check_module(mod: Path, arch: str) -> tuple[bool, dict]:
    info: dict = {"path": str(mod), "size_mib": round(mod.stat().st_size / 2**20, 2)}
    ok = True
    log(f"module {mod.name}: {info['size_mib']} MiB")
    if info["size_mib"] > 40:
        ok = False
        log("FAIL: larger than 40 MiB (the GPU run carries at most 64 MiB in all)")
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if Path(cuobjdump).exists():
        r = subprocess.run([cuobjdump, "--list-elf", str(mod)], capture_output=True, text=True)
        archs = sorted(set(re.findall(r"sm_\d+a?", r.stdout)))
        how = "cuobjdump --list-elf"
    else:
        archs = [a for a in fatbin_archs(mod) if a.startswith("sm_")]
        how = "its fatbin headers (no cuobjdump here)"
    info["cubin_archs"] = archs
    wanted = {"sm_" + a.replace(".", "").replace("+PTX", "") for a in re.split(r"[ ;]+", arch) if a}
    missing = wanted - set(archs)
    log(f"cubins for {', '.join(archs) or 'none'} (from {how})" + (f"; MISSING {sorted(missing)}" if missing else ""))
    if missing:
        ok = False
    r = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(mod.parent)], capture_output=True, text=True,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "")))
    if r.returncode != 0:
        log("FAIL: import megalodon_extension.ops failed:\n" + r.stderr[-3000:])
        return False, info
    got = json.loads(r.stdout.strip().splitlines()[-1])
    info.update(torch=got["torch"], functions=got["functions"])
    missing = [f for f in EXPECTED_FUNCTIONS if f not in got["functions"]]
    log(f"imports with torch {got['torch']} (cuda available: {got['cuda_available']}); "
        f"{len(got['functions'])} functions: {', '.join(got['functions'])}")
    if missing:
        ok = False
        log(f"FAIL: functions vs_upstream.py calls are missing: {missing}")
    return ok, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="a checkout of XuezheMax/megalodon")
    ap.add_argument("--build-dir", type=Path, default=Path("upstream-build"),
                    help="where the sources are copied and built (default ./upstream-build)")
    ap.add_argument("--arch", default=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
                    help="TORCH_CUDA_ARCH_LIST, e.g. '9.0' (H100/H200) or '8.0;9.0' (default 9.0)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compiles (MAX_JOBS, default 2)")
    ap.add_argument("--out", type=Path, help="copy the checked module into this folder")
    ap.add_argument("--check-only", action="store_true", help="skip the build, check the built module")
    ap.add_argument("--verbose", action="store_true", help="print the whole compiler output")
    a = ap.parse_args(argv)

    import torch  # noqa: F401  (the version the module is built against)
    log(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), nvcc {shutil.which('nvcc') or os.environ.get('CUDA_HOME', '?')}")
    src, dst = a.src.resolve(), a.build_dir.resolve()
    if not (src / "setup.py").is_file() or not all((src / s).is_file() for s in SOURCES):
        missing = [s for s in SOURCES if not (src / s).is_file()]
        log(f"FAIL: {src} is not a megalodon checkout (missing setup.py or {missing[:3]})")
        return 1
    if not a.check_only:
        try:
            n, notes = prepare_sources(src, dst)
        except RuntimeError as e:
            log(f"FAIL: {e}")
            return 1
        log(f"copied {src} -> {dst} ({n} file(s) written, the rest unchanged)")
        for note in notes:
            log(note)
        ok, why = build(dst, a.arch, a.jobs, a.verbose)
        if not ok:
            log("FAIL: the build failed\n" + why)
            return 1
    mod = find_module(dst)
    if mod is None:
        log(f"FAIL: no megalodon_extension*.so in {dst}")
        return 1
    strip_note = None
    if a.out:  # the carried copy, stripped of debug sections, is the one checked
        a.out.mkdir(parents=True, exist_ok=True)
        target = a.out / mod.name
        strip_note = strip_debug(mod, target)
        log(f"copied to {target}: {strip_note}")
        mod = target
    ok, info = check_module(mod, a.arch)
    if a.out:
        (a.out / "BUILD_INFO.json").write_text(json.dumps(
            dict(info, ok=ok, arch=a.arch, python=sys.version.split()[0],
                 built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), strip=strip_note,
                 edits=sorted({f"{e[0]}: {e[3]}" for e in EDITS}), sources=str(src)), indent=1))
    if not ok:
        return 1
    log("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
