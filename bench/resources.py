"""Registers, spills and shared memory of every Triton kernel x config x arch, compiled offline.

    python -m megalodon_kernels.bench.resources [--ops rotary ...] [--arch 80 90]

Compiles with ``triton.compile`` for GPUTarget("cuda", 80|90, 32) (no GPU needed) and prints one
row per variant; a row is flagged when shared memory exceeds the arch's per-block limit or when
the kernel uses local memory (spills). Exit code 1 if any variant is flagged.
"""
from __future__ import annotations

import argparse
import sys

from megalodon_kernels.ops._triton_aot import ARCH_NAME, SMEM_LIMIT, TRITON_OPS, compile_all


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Triton kernel resources per config and arch (offline compile)")
    ap.add_argument("--ops", nargs="*", default=list(TRITON_OPS), choices=list(TRITON_OPS))
    ap.add_argument("--arch", nargs="*", type=int, default=[80, 90], choices=sorted(SMEM_LIMIT))
    a = ap.parse_args(argv)
    rows = compile_all(tuple(a.ops), tuple(a.arch))
    print(f"{'op':<14} {'kernel':<22} {'config':<34} {'arch':<13} {'regs':>5} {'smem B':>8} {'spill B':>8}  status")
    bad = 0
    for r in rows:
        status = []
        if not r.fits:
            status.append(f"SMEM > {SMEM_LIMIT[r.cc]}")
        if r.spills:
            status.append("SPILLS")
        bad += bool(status)
        print(f"{r.variant.op:<14} {r.variant.kernel:<22} {r.variant.label:<34} {ARCH_NAME[r.cc]:<13} "
              f"{r.regs:>5} {r.shared:>8} {r.local:>8}  {', '.join(status) or 'ok'}")
    print(f"\n{len(rows)} variants, {bad} flagged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
