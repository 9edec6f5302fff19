"""First-call NVRTC compile time of each kernel instantiation (no cache), with its resources.

    python bench/nvrtc_compile.py [--arch 80] [--out bench/results/nvrtc_compile.md]

Covers every instantiation (cuda/instances.py: the launch descriptions' and the compiled
launchers'); the flash attention kernels (CuTe) are the slowest to compile. What a user waits for on the first call of an op on a GPU machine is the sum over the
instantiations that op launches; later calls and processes read the disk cache.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from megalodon_kernels.cuda import nvrtc
from megalodon_kernels.cuda.instances import all_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=80)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    jobs = [(k.header, k.name) for k in all_kernels()]
    rows = []
    for header, name in jobs:
        start = time.perf_counter()
        c = nvrtc.compile_kernel(header, name, args.arch, use_cache=False)
        wall = time.perf_counter() - start
        r = c.resources
        rows.append(f"| `{name}` | {wall:.2f} | {r.registers} | {r.spills} | {r.static_smem} |")
        print(rows[-1], flush=True)
    major, minor = nvrtc.nvrtc_version()
    text = "\n".join([
        f"# First-call NVRTC compile time per kernel instantiation (sm_{args.arch}, NVRTC {major}.{minor})", "",
        "`python bench/nvrtc_compile.py --arch 80` on the project machine (2 shared cores, no GPU), no cache; "
        "registers / spill bytes / static shared memory from ptxas's report.", "",
        "| instantiation | seconds | registers | spills (B) | static smem (B) |", "|---|---|---|---|---|", *rows, ""])
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
