"""Registers, spills and shared memory of every Triton kernel x config x arch, compiled offline.

    python -m megalodon_kernels.bench.resources [--ops rotary ...] [--arch 80 90] [--workers N]
    python -m megalodon_kernels.bench.resources --write     # regenerate the committed report

Compiles with ``triton.compile`` for GPUTarget("cuda", 80|90, 32) (no GPU needed) and prints one
row per variant; a row is flagged when shared memory exceeds the arch's per-block limit or when
the kernel uses local memory (spills). Exit code 1 if any variant is flagged.

``--write`` compiles every variant of every op for both archs and writes the committed report of
the running Triton release: bench/results/aot_sm80.json, aot_sm90.json (one row per variant:
registers, shared memory bytes, spill bytes per thread) and aot_resources.md (the same as one
table) for the newest tested release; aot_sm80_triton3.6.json etc. for the oldest (run it with
that release installed). What spills on a release is pruned for it in
ops/_triton_common.RELEASE_PRUNES, listed in its markdown. The test suite checks that the
report lists exactly the declared variants and compiles, per kernel, the heaviest one it names.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .aot import (ARCH_NAME, REPORT_COMMAND, RESULTS_DIR, SMEM_LIMIT, TRITON_OPS, compile_all, report_path,
                  report_tritons, triton_tag)


def markdown_path(triton: tuple[int, int] | None = None) -> str:
    return os.path.join(RESULTS_DIR, f"aot_resources{triton_tag(triton)}.md")


def running_triton() -> tuple[int, int]:
    from .._versions import parse

    return parse(_triton_version())[:2]


def _flags(r) -> list[str]:
    status = []
    if not r.fits:
        status.append(f"SMEM > {SMEM_LIMIT[r.cc]}")
    if r.spills:
        status.append("SPILLS")
    return status


def _triton_version() -> str:
    import triton

    return triton.__version__


def _prune_lines(triton) -> list[str]:
    """The markdown list of what ops/_triton_common.RELEASE_PRUNES leaves out on this release."""
    from ..ops._triton_common import RELEASE_PRUNES

    mine = [p for p in RELEASE_PRUNES if triton < p.below]
    if not mine:
        return ["Nothing is pruned on this release (ops/_triton_common.RELEASE_PRUNES).", ""]
    lines = [f"Pruned on Triton {triton[0]}.{triton[1]} (ops/_triton_common.RELEASE_PRUNES; flagged rows below):", ""]
    for p in mine:
        what = (f"config {', '.join(f'{k}={v}' for k, v in p.config.items())} left out of the candidate space"
                if p.config else f"launches with {', '.join(f'{k}={v}' for k, v in p.launch.items())} refused")
        lines.append(f"- {p.op}: {what} before Triton {p.below[0]}.{p.below[1]}: {p.why} "
                     f"({', '.join(f'`{k} [{lab}]`' for k, lab in p.variants)})")
    return lines + [""]


def write_report(rows, ccs, match: str | None = None) -> list[str]:
    """Write the per-arch JSON reports and the markdown table; returns the paths written."""
    paths = []
    triton = running_triton()
    if triton not in report_tritons():
        raise SystemExit(f"Triton {_triton_version()} is not a release the committed report covers "
                         f"({', '.join('%d.%d' % t for t in report_tritons())}); compile without --write")
    for cc in ccs:
        mine = [r for r in rows if r.cc == cc]
        doc = {
            "generated_by": REPORT_COMMAND,
            "about": "Every Triton kernel x variant (bench/triton_variants.py) compiled ahead of time: registers "
                     "per thread, shared memory bytes per block, local memory (spill) bytes per thread. "
                     "Do not edit: regenerate with the command above.",
            "arch": f"sm_{cc}",
            "smem_limit_bytes": SMEM_LIMIT[cc],
            "triton": _triton_version(),
            "ops": sorted({r.variant.op for r in mine}),
            "match": match,  # None: every variant of these ops; else the regular expression of a selection
            "variants": len(mine),
            "spilling": sum(r.spills for r in mine),
            "over_smem_limit": sum(not r.fits for r in mine),
            "rows": [{"op": r.variant.op, "kernel": r.variant.kernel, "label": r.variant.label, "regs": r.regs,
                      "smem": r.shared, "spill": r.local} for r in mine],
        }
        with open(report_path(cc, triton), "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        paths.append(report_path(cc, triton))
    return paths + [write_markdown(rows, ccs, triton, _triton_version(), match)]


def markdown_from_json(triton: tuple[int, int], ccs=(80, 90)) -> str:
    """Rewrite release ``triton``'s markdown table from its committed JSON reports (no compiling:
    after a change of RELEASE_PRUNES or of the table's layout)."""
    from types import SimpleNamespace

    from .aot import Resources, load_report

    rows, version, match = [], None, None
    for cc in ccs:
        doc = load_report(cc, triton)
        version, match = doc["triton"], doc.get("match")
        for r in doc["rows"]:
            v = SimpleNamespace(op=r["op"], kernel=r["kernel"], label=r["label"],
                                ident=(r["op"], r["kernel"], r["label"]))
            rows.append(Resources(v, cc, regs=r["regs"], shared=r["smem"], local=r["spill"]))
    return write_markdown(rows, ccs, triton, version, match)


def write_markdown(rows, ccs, triton, version: str, match: str | None = None) -> str:
    """The markdown table of ``rows`` (one Triton release; ``match``: the selection compiled, None
    for every variant of the ops in ``rows``); returns its path."""
    by_ident: dict = {}
    for r in rows:
        by_ident.setdefault(r.variant.ident, {})[r.cc] = r
    lines = [
        "# Triton kernels: resources per variant and arch",
        "",
        f"Generated by `{REPORT_COMMAND}` (Triton {version}; no GPU needed: `triton.compile` for "
        "the target arch, resources read from the cubin). Do not edit by hand.",
        "",
        "regs: registers per thread; smem: shared memory bytes per block (limit "
        + ", ".join(f"sm_{cc}: {SMEM_LIMIT[cc]}" for cc in ccs)
        + "); spill: local memory bytes per thread (0 = no spills). "
        + "; ".join(f"sm_{cc}: {sum(r.cc == cc for r in rows)} variants, "
                    f"{sum(r.cc == cc and r.spills for r in rows)} spilling, "
                    f"{sum(r.cc == cc and not r.fits for r in rows)} over the shared-memory limit" for cc in ccs)
        + ".",
        "",
        *([f"**A selection, not every variant**: the ops {', '.join(sorted({r.variant.op for r in rows}))}, "
           f"variants whose `kernel label` matches `{match}`. Every other variant is not compiled for this "
           f"release here: `{REPORT_COMMAND}` with this release installed compiles them all.", ""] if match else []),
        "One report per tested Triton release: " + ", ".join(
            f"{t[0]}.{t[1]}: `{os.path.basename(markdown_path(t))}`" for t in report_tritons()) + ".",
        "",
        *_prune_lines(triton),
        "| op | kernel | variant | " + " | ".join(f"sm_{cc} regs | smem | spill" for cc in ccs) + " | flags |",
        "|---|---|---|" + "---:|---:|---:|" * len(ccs) + "---|",
    ]
    for (op, kernel, label), per_cc in by_ident.items():
        cells = []
        flags = []
        for cc in ccs:
            r = per_cc.get(cc)
            cells.append("-" if r is None else f"{r.regs} | {r.shared} | {r.local}")
            flags += [f"sm_{cc} {f}" for f in (_flags(r) if r is not None else [])]
        lines.append(f"| {op} | {kernel} | {label} | " + " | ".join(cells) + f" | {', '.join(flags)} |")
    with open(markdown_path(triton), "w") as f:
        f.write("\n".join(lines) + "\n")
    return markdown_path(triton)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Triton kernel resources per config and arch (offline compile)")
    ap.add_argument("--ops", nargs="*", default=list(TRITON_OPS), choices=list(TRITON_OPS))
    ap.add_argument("--arch", nargs="*", type=int, default=[80, 90], choices=sorted(SMEM_LIMIT))
    ap.add_argument("--workers", type=int, default=None, help="parallel compile processes (default: CPU count)")
    ap.add_argument("--write", action="store_true",
                    help="write the committed report bench/results/aot_sm*.json and aot_resources.md "
                         "(every op, both archs)")
    ap.add_argument("--match", metavar="REGEX",
                    help="only the variants whose 'kernel label' matches (with --write: an older release's "
                         "report of that selection, recorded in it)")
    ap.add_argument("--markdown-only", metavar="X.Y",
                    help="rewrite the markdown table of Triton release X.Y from its committed JSON reports "
                         "(no compiling)")
    a = ap.parse_args(argv)
    if a.markdown_only:
        from .._versions import parse

        print(f"wrote {markdown_from_json(parse(a.markdown_only)[:2])}")
        return 0
    if a.write and sorted(a.arch) != sorted(SMEM_LIMIT):
        ap.error("--write regenerates the report of every arch: use it without --arch")
    if a.write and sorted(a.ops) != sorted(TRITON_OPS) and running_triton() == report_tritons()[-1]:
        ap.error("--write on the newest tested Triton regenerates the whole report: use it without --ops")
    if a.write and a.match and running_triton() == report_tritons()[-1]:
        ap.error("--write on the newest tested Triton regenerates the whole report: use it without --match")
    rows = compile_all(tuple(a.ops), tuple(a.arch), workers=a.workers, match=a.match)
    print(f"{'op':<14} {'kernel':<22} {'config':<34} {'arch':<13} {'regs':>5} {'smem B':>8} {'spill B':>8}  status")
    bad = 0
    for r in rows:
        status = _flags(r)
        bad += bool(status)
        print(f"{r.variant.op:<14} {r.variant.kernel:<22} {r.variant.label:<34} {ARCH_NAME[r.cc]:<13} "
              f"{r.regs:>5} {r.shared:>8} {r.local:>8}  {', '.join(status) or 'ok'}")
    print(f"\n{len(rows)} variants, {bad} flagged")
    if a.write:
        for path in write_report(rows, tuple(sorted(a.arch)), a.match):
            print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
