"""The Triton cema's chunked kernels from their SASS: instructions per block iteration, registers,
programs per SM, and the issue bound of each launch at the probe and 7B shapes (no GPU).

    python bench/cema_chunked_profile.py [--arch 90] [--out FILE]

Each kernel variant (x dtype of the shape, no hx) is compiled for sm_<arch> with the running
Triton (bench/sass_profile.py: nvdisasm -c -g, loops from the backward branches). Per program and
warp the instructions issued are the kernel's static count plus, per loop, its body once more for
every further iteration: the forward's block loop and the scan kernel's two passes run nblk =
ceil(L / (C BM)) times, the sums kernel's block loop B nblk times (nested in its loop over b), the
tables kernel has no loop. The issue bound (sass_profile.issue_bound_ms) assumes every SM busy:
at the probe's 256-512 programs (one or two waves) a launch is latency-bound well above it.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megalodon_kernels.bench.aot import compile_all  # noqa: E402
from megalodon_kernels.bench.sass_profile import issue_bound_ms, parse, regions, variant_sass  # noqa: E402

#: (name, B, D, L, x dtype): the H100 probe and the paper-7B shape of bench gpu's CEMA rows
SHAPES = (("probe B2 D256 L4096", 2, 256, 4096, "fp32"), ("7B B4 D4096 L4096", 4, 4096, 4096, "bf16"))
#: kernel -> its variant label's pattern ({C}, {BM}, {x}: the chunk, block and the shape's x dtype);
#: the tables and the finish kernel run once per pass (the finish in the backward only)
KERNELS = (("_tables_kernel", r"tables C={C} BM={BM}$"), ("_fwd_kernel", r"C={C} BM={BM} x={x} hx=False"),
           ("_bwd_scan_kernel", r"C={C} BM={BM} x={x} hx=False warps=\d+ dx={x}"),
           ("_bwd_sums_kernel", r"C={C} BM={BM} x={x} "), ("_finish_kernel", r"finish C={C}$"))
REGISTERS_PER_SM, MAX_WARPS_PER_SM = 65536, 64


def per_program(kernel: str, sass: str, B: int, nblk: int) -> tuple[int, list[int], dict]:
    """(warp-instructions one warp of one program issues, the loop bodies' sizes, the HMMA, SHFL
    and BAR instructions of the outermost loop bodies)."""
    rs = regions(*parse(sass))
    ops = {op: sum(sum(i.base == op for i in r.instrs) for r in rs[1:] if r.depth == 1) for op in ("HMMA", "SHFL", "BAR")}
    top = [r.count for r in rs[1:] if r.depth == 1]
    inner = [r.count for r in rs[1:] if r.depth == 2]
    total = rs[0].count
    if kernel == "_fwd_kernel":
        total += (nblk - 1) * top[0]
    elif kernel == "_bwd_scan_kernel":
        total += (nblk - 1) * (top[0] + top[1])
    elif kernel == "_bwd_sums_kernel":
        total += (B - 1) * top[0] + B * (nblk - 1) * inner[0]
    return total, top + inner, ops


def programs_per_sm(regs: int, warps: int, smem: int, cc: int) -> int:
    from megalodon_kernels.bench.aot import SMEM_LIMIT

    per_warp = math.ceil(regs * 32 / 256) * 256  # registers are allocated per warp in units of 256
    return min(REGISTERS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps,
               (SMEM_LIMIT[cc] // smem) if smem else 10**9)


@functools.cache
def compiled(match: str, cc: int):
    """(variant, SASS, aot.Resources) of the one variant ``match`` selects."""
    (variant, sass), = variant_sass("cema", match, cc)
    res, = compile_all(("cema",), (cc,), workers=1, match=match)
    return variant, sass, res


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=(80, 90))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    C, BM = 32, 16
    lines = [f"Triton {triton.__version__}, sm_{a.arch}, chunk C = {C}, BM = {BM}; command: `python bench/cema_chunked_profile.py --arch {a.arch}`", "",
             "| shape | kernel | programs | regs | programs/SM | loop bodies (instr/warp) | HMMA / SHFL / BAR in them | "
             "instr/warp/program | issue bound ms |", "|---|---|---:|---:|---:|---|---|---:|---:|"]
    for name, B, D, L, x in SHAPES:
        nblk = -(-L // (C * BM))
        bounds = {}
        for kernel, pattern in KERNELS:
            match = f"^{kernel} .*" + pattern.format(C=C, BM=BM, x=x)
            try:
                variant, sass, res = compiled(match, a.arch)
            except ValueError:
                continue  # a kernel this version does not have
            n, loops, ops = per_program(kernel, sass, B, nblk)
            progs = D if kernel in ("_tables_kernel", "_bwd_sums_kernel", "_finish_kernel") else B * D
            bound = issue_bound_ms(progs * variant.num_warps * n, a.arch)
            bounds[kernel] = bound
            lines.append(f"| {name} | {kernel} | {progs} | {res.regs} | "
                         f"{programs_per_sm(res.regs, variant.num_warps, res.shared, a.arch)} | {loops} | "
                         f"{ops['HMMA']} / {ops['SHFL']} / {ops['BAR']} | {n} | "
                         f"{bound:.3f} |")
        tables = bounds.get("_tables_kernel", 0.0)  # one launch per pass
        lines.append(f"| {name} | forward (tables + fwd) | | | | | | | {tables + bounds['_fwd_kernel']:.3f} |")
        backward = tables + bounds["_bwd_scan_kernel"] + bounds["_bwd_sums_kernel"] + bounds.get("_finish_kernel", 0.0)
        lines.append(f"| {name} | backward (tables + scan + sums + finish) | | | | | | | {backward:.3f} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
