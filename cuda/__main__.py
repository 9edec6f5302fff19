"""``python -m megalodon_kernels.cuda compile --arch 80 90 [--out DIR] [--only TEXT]``

Compiles every kernel instantiation of the ops (their KERNELS lists, cuda/instances.py) with NVRTC
for each arch (no GPU needed), prints one line per instantiation and arch with registers, spills,
stack and static shared memory, and exits 1 when one fails to compile or spills. ``--out DIR``
also writes the cubins where the runtime reads them instead of compiling: set
``MEGALODON_KERNELS_CUBIN_DIR=DIR`` on the machines that use them (same package and NVRTC versions).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import nvrtc
from .instances import all_kernels


def compile_all(archs, out: Path | None = None, only: str | None = None, stream=sys.stdout) -> int:
    """Compile and report; returns the exit status (1 on a failure or a spill)."""
    failed = 0
    count = 0
    start = time.perf_counter()
    for arch in archs:
        # only what a GPU of this arch can launch (flash attention needs sm_80: cuda/instances.py)
        kernels = [k for k in all_kernels(arch) if only is None or only in k.name]
        count += len(kernels)
        for k in kernels:
            try:
                c = nvrtc.compile_kernel(k.header, k.name, arch)
            except nvrtc.NvrtcError as exc:
                failed += 1
                print(f"sm_{arch}  FAILED  {k.name}\n{exc}", file=stream)
                continue
            r = c.resources
            flag = "  SPILLS" if r.spills else ""
            failed += bool(r.spills)
            print(f"sm_{arch}  {r.registers:3d} regs  {r.spill_stores + r.spill_loads:4d} B spills  {r.stack:4d} B stack"
                  f"  {r.static_smem:6d} B smem  {c.compile_seconds:6.2f} s {c.origin:8s} {k.name}{flag}", file=stream)
            if out is not None:
                nvrtc.write_entry(out, nvrtc.cache_key(k.header, k.name, arch), c)
    print(f"{count} compiles ({len(archs)} archs) in {time.perf_counter() - start:.1f} s, "
          f"{failed} failed or spilled", file=stream)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalodon_kernels.cuda")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile every kernel instantiation with NVRTC and report resources")
    comp.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (80 90)")
    comp.add_argument("--out", type=Path, help="also write the cubins here (for MEGALODON_KERNELS_CUBIN_DIR)")
    comp.add_argument("--only", help="only the instantiations whose name expression contains this text")
    args = parser.parse_args(argv)
    try:
        return compile_all(args.arch, args.out, args.only)
    except nvrtc.NvrtcUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
