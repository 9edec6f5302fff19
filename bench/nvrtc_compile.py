"""First-call NVRTC compile time of each kernel instantiation (no cache), with its resources.

    python bench/nvrtc_compile.py [--arch 80 90] [--out bench/results/nvrtc_compile.md]

Covers every instantiation (cuda/instances.py: the launch descriptions' KERNELS). What a user waits for on the first call of an op on a GPU machine is the sum over the
instantiations that op launches; later calls and processes read the disk cache. Each compile also
fills the cache, so ``python -m megalodon_kernels.cuda compile`` afterwards is quick.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from megalodon_kernels.cuda import nvrtc
from megalodon_kernels.cuda.instances import all_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, nargs="+", default=[80])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows, per_header = [], defaultdict(float)
    for arch in args.arch:
        for k in all_kernels():
            c = nvrtc.compile_kernel(k.header, k.name, arch, use_cache=False)
            nvrtc.write_entry(nvrtc.cache_dir(), nvrtc.cache_key(k.header, k.name, arch), c)
            r = c.resources
            per_header[(k.header, arch)] += c.compile_seconds
            rows.append(f"| sm_{arch} | `{k.name}` | {c.compile_seconds:.2f} | {r.registers} | {r.spills} | "
                        f"{r.static_smem} |")
            print(rows[-1], flush=True)
    major, minor = nvrtc.nvrtc_version()
    totals = [f"| `{h}` | sm_{a} | {s:.1f} |" for (h, a), s in sorted(per_header.items())]
    text = "\n".join([
        f"# First-call NVRTC compile time per kernel instantiation (NVRTC {major}.{minor})", "",
        f"`python bench/nvrtc_compile.py --arch {' '.join(map(str, args.arch))}`: no cache, one NVRTC program per "
        "instantiation, on the project machine (2 cores shared with other jobs while it ran, so the times are "
        "upper bounds; no GPU). Registers, spill bytes (stores + loads) and static shared memory from ptxas's "
        "report.", "",
        "## Total per header", "", "| header | arch | seconds |", "|---|---|---|", *totals, "",
        "## Per instantiation", "",
        "| arch | instantiation | seconds | registers | spills (B) | static smem (B) |", "|---|---|---|---|---|---|",
        *rows, ""])
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
