"""Where the Triton fftconv kernels' instructions go: the SASS mix per loop iteration (one row pair;
one pair and slice on the slice path) grouped by what the source does, from
:mod:`megalodon_kernels.bench.sass_profile`'s listing with source lines.

    python -m megalodon_kernels.bench.fftconv_sass_mix --match "tile fwd x=fp32 N=2048" [--arch 90]
    python -m megalodon_kernels.bench.fftconv_sass_mix --sass-dir DIR --source-root ROOT   (dumped listings)

Each instruction is attributed to the innermost function of ops/fftconv/triton_impl.py or
ops/_triton_common.py that holds its source line, and that function to a role:

* ``tensor``: the HGMMA / HMMA instructions themselves;
* ``dot prep``: the rest of the dots: the tf32x3 head/tail split of the operands, the NaN guards,
  the staging of operands in shared memory, the fences and the wgmma waits;
* ``layout``: the shared-memory round trips and shuffles of the permutes between levels;
* ``twiddle``: the DFT-matrix and twiddle loads and their index arithmetic (the slice path's
  computed twiddles included);
* ``pointwise``: the complex products (twiddles, spectra);
* ``data``: the loads, stores, masks and addresses of x, k, y and the workspaces.

It also sums the shared-memory bytes a warp moves per iteration (its STS / LDS / LDSM / STSM,
by width, plus a quarter of the 512 B B operand that each 64x16x8 TF32 HGMMA of a 4-warp group reads
from shared memory), in
128-byte wavefronts of the SM's L1/shared data path: the lower bound for conflict-free accesses.
"""
from __future__ import annotations

import ast
import collections
import glob
import os
import re

from .sass_profile import parse, regions

ROLES = {
    "dot prep": ("mm_right", "mm_left", "level16", "level8", "stage_a"),
    "layout": ("rot", "unrot", "radix4", "radix2"),
    # table_twiddle: the per-level table gathers before the contiguous tiles (listings of a0f4572)
    "twiddle": ("table_tile", "table_twiddle", "twiddle_a", "twiddle_n", "dft16", "opaque_zero", "tile_offsets",
                "slice_offsets", "twiddle", "sincos_quarter", "table_root"),
    "pointwise": ("cmul",),
}
_ROLE_OF = {fn: role for role, fns in ROLES.items() for fn in fns}
_FILES = ("ops/fftconv/triton_impl.py", "ops/_triton_common.py")
#: bytes per warp of one shared-memory instruction, by its width suffix
_SHARED_BYTES = {"": 128, "64": 256, "128": 512, "U8": 32, "U16": 64, "S16": 64}


def function_spans(root: str) -> dict:
    """{basename: [(first line, last line, function name)]} of the kernels' source files under ``root``."""
    out = {}
    for rel in _FILES:
        tree = ast.parse(open(os.path.join(root, rel)).read())
        out[os.path.basename(rel)] = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree)
                                      if isinstance(n, ast.FunctionDef)]
    return out


def function_of(spans: dict, line: str | None) -> str:
    if line is None:
        return "?"
    name, _, num = line.rpartition(":")
    best = None
    for a, b, fn in spans.get(name, []):
        if a <= int(num) <= b and (best is None or b - a < best[1] - best[0]):
            best = (a, b, fn)
    return best[2] if best else "?"


def role_of(instr, fn: str) -> str:
    if instr.cls == "tensor":
        return "tensor"
    if fn in _ROLE_OF:
        return _ROLE_OF[fn]
    if instr.cls in ("sync", "shared", "shuffle") and fn in ("?",):
        return "layout"
    return "data"


def shared_bytes(instr) -> int:
    """Bytes per warp that a shared-memory instruction (or an HGMMA's B operand) moves."""
    if instr.cls == "tensor":
        return 128 if instr.base == "HGMMA" else 0      # B [8, 16] TF32 = 512 B per warpgroup of 4 warps
    if instr.cls != "shared":
        return 0
    if instr.base in ("LDSM", "STSM"):
        return 512 if instr.opcode.endswith(".4") else 256 if instr.opcode.endswith(".2") else 128
    width = re.search(r"\.(128|64|U8|U16|S16)\b", instr.opcode)
    return _SHARED_BYTES[width.group(1) if width else ""]


def mix(sass: str, spans: dict) -> list[dict]:
    """Per region (kernel, depth-1 loops): instruction count, counts per role, shared wavefronts."""
    instrs, labels = parse(sass)
    out = []
    for r in regions(instrs, labels):
        if r.depth > 1:
            continue
        roles, shared = collections.Counter(), collections.Counter()
        for i in r.instrs:
            role = role_of(i, function_of(spans, i.line))
            roles[role] += 1
            shared[role] += shared_bytes(i) / 128
        wavefronts = sum(shared.values())
        hgmma = sum(1 for i in r.instrs if i.cls == "tensor")
        out.append({"region": r.name, "instructions": r.count, "roles": dict(roles.most_common()),
                    "shared_wavefronts": wavefronts,
                    "shared_by_role": {k: v for k, v in shared.most_common() if v}, "tensor": hgmma})
    return out


def report(title: str, rows: list[dict]) -> str:
    lines = [title]
    for row in rows:
        roles = ", ".join(f"{k} {v}" for k, v in row["roles"].items())
        lines.append(f"  {row['region']:6s} {row['instructions']:6d} instructions ({roles}); "
                     f"shared-memory wavefronts {row['shared_wavefronts']:.0f} per warp ("
                     + ", ".join(f"{k} {v:.0f}" for k, v in row["shared_by_role"].items()) + ")")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", help="regular expression on fftconv's 'kernel label' (compiles them)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass-dir", help="read dumped listings (sass_profile --dump) instead of compiling")
    ap.add_argument("--source-root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="checkout whose source the listings were compiled from (line -> function)")
    args = ap.parse_args(argv)
    spans = function_spans(args.source_root)
    if args.sass_dir:
        for path in sorted(glob.glob(os.path.join(args.sass_dir, "*.sass"))):
            if args.match and not re.search(args.match, os.path.basename(path).replace("_", " ")):
                continue
            print(report(os.path.basename(path), mix(open(path).read(), spans)))
    else:
        from .sass_profile import variant_sass

        for v, sass in variant_sass("fftconv", args.match, args.arch):
            print(report(f"{v.kernel} [{v.label}] sm_{args.arch}, {v.num_warps} warps", mix(sass, spans)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
