"""The errors the op tests see, per op x backend x dtype x direction: the measured table behind the
tolerances of tests/support.py (docs/verification.md, "What the tests see").

    python bench/accuracy_tests.py --run tests/test_fftconv.py tests/test_packed_fftconv.py ...
    python bench/accuracy_tests.py LOG.jsonl ...          # tabulate logs written earlier

``--run`` runs each test file on its own (``CI=1 python -m pytest FILE -q``) with
``MK_ACCURACY_LOG`` set, so that every ``support.assert_close`` appends its error and the budget it
was held to (the op, backend, dtype and direction ``support.tol`` was asked for); then it prints
one markdown row per budget: the worst relative error any comparison under that budget saw, the
test that saw it, the number of comparisons, and the current tolerance with its ratio to the worst
error. Comparisons held to a literal number rather than a ``tol()`` budget are listed apart;
comparisons that failed (expected failures, or failures the run reports) are left out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(files: list[str], log: str) -> None:
    for f in files:
        start = time.time()
        env = dict(os.environ, MK_ACCURACY_LOG=log, CI="1")
        rc = subprocess.call([sys.executable, "-m", "pytest", f, "-q", "-p", "no:cacheprovider"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"# {f}: exit {rc}, {time.time() - start:.0f} s", file=sys.stderr)


def records(logs: list[str], only_terms: bool = False):
    """(budget key or None, record) for every comparison logged in ``logs``; with ``only_terms``
    those measured against the magnitude of the terms alone (support.MEASURED_TERMS)."""
    for path in logs:
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if only_terms and rec.get("scale") != "max(terms)":
                continue
            if not rec["rel"] <= rec["tol"]:
                # a comparison that failed: one a test expects to fail (pytest.raises, e.g. a
                # deliberately wrong kernel) or a real failure, which the run itself reports
                continue
            key = tuple(rec["key"]) or None
            if key and key[0] is None:  # logged before tol() named its op: the test file's op
                name = rec["test"].split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
                key = (name.removeprefix("test_").removeprefix("packed_"),) + key[1:]
            yield key, rec


def table(logs: list[str], only_terms: bool = False) -> str:
    worst: dict[tuple, dict] = {}
    count: dict[tuple, int] = defaultdict(int)
    literal: dict[tuple, dict] = {}
    for key, rec in records(logs, only_terms):
        if key:
            count[key] += 1
            if key not in worst or rec["rel"] > worst[key]["rel"]:
                worst[key] = rec
        else:  # a literal tolerance: one row per test function and output name
            key = (rec["test"].split("[")[0], rec["name"])
            if key not in literal or rec["rel"] > literal[key]["rel"]:
                literal[key] = rec
    order = {"float32": 0, "float64": 1, "bfloat16": 2, "float16": 3}
    lines = ["| op | backend | dtype | dir | worst rel. error | comparisons | tolerance | tol / worst | worst case |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(worst, key=lambda k: (k[0], k[1], order.get(k[2], 9), k[3])):
        rec = worst[key]
        ratio = rec["tol"] / rec["rel"] if rec["rel"] > 0 else float("inf")
        case = rec["test"].split("::", 1)[-1]
        lines.append(f"| {' | '.join(key)} | {rec['rel']:.1e} | {count[key]} | {rec['tol']:.1e} | "
                     f"{ratio:.1f} | `{case}` {rec['name']} |")
    if literal:
        lines += ["", "| literal tolerance: test, output | worst rel. error | tolerance |", "|---|---|---|"]
        for key in sorted(literal):
            rec = literal[key]
            lines.append(f"| `{key[0]}` {key[1]} | {rec['rel']:.1e} | {rec['tol']:.1e} |")
    return "\n".join(lines)


def measured_dict(logs: list[str], only_terms: bool = False) -> str:
    """The worst errors as tests/support.py's MEASURED table: (op, backend, dtype) -> (fwd, bwd)."""
    worst: dict[tuple, float] = defaultdict(float)
    for key, rec in records(logs, only_terms):
        if key:
            worst[key] = max(worst[key], rec["rel"])
    short = {"float32": "F32", "float64": "F64", "bfloat16": "BF16", "float16": "F16"}
    rows = sorted({k[:3] for k in worst})
    return "\n".join(f'    ("{op}", "{b}", {short[d]}): ({worst.get((op, b, d, "fwd"), 0.0):.2e}, '
                     f'{worst.get((op, b, d, "bwd"), 0.0):.2e}),' for op, b, d in rows if d in ("float32", "float64"))


def doc_table(logs: list[str], only_terms: bool = False) -> str:
    """The worst errors per op x backend x dtype with the budgets tests/support.py derives from them
    (fp32/fp64: selfcheck.budget, 3x-4x; bf16/fp16: the fixed half-precision budgets)."""
    from megalodon_kernels.selfcheck import budget
    half = {"bfloat16": (2e-2, 4e-2), "float16": (4e-3, 8e-3)}
    worst: dict[tuple, float] = defaultdict(float)
    for key, rec in records(logs, only_terms):
        if key:
            worst[key] = max(worst[key], rec["rel"])
    order = {"float32": 0, "float64": 1, "bfloat16": 2, "float16": 3}
    lines = ["| op | backend | dtype | forward: worst | budget | gradients: worst | budget |",
             "|---|---|---|---|---|---|---|"]
    for op, b, d in sorted({k[:3] for k in worst}, key=lambda k: (k[0], order.get(k[2], 9), k[1])):
        cells = []
        for i, kind in enumerate(("fwd", "bwd")):
            m = worst.get((op, b, d, kind))
            if m is None:
                cells += ["-", "-"]
                continue
            allowed = half[d][i] if d in half else (budget(m) if m > 0 else 0.0)
            cells += [f"{m:.1e}", f"{allowed:.1e}"]
        lines.append(f"| {op} | {b} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="*", help="MK_ACCURACY_LOG files to tabulate")
    ap.add_argument("--run", nargs="+", metavar="TEST_FILE", help="run these test files first, logging")
    ap.add_argument("--python", action="store_true", help="print the worst errors as support.MEASURED entries")
    ap.add_argument("--doc", action="store_true", help="print the table of docs/verification.md (with budgets)")
    ap.add_argument("--terms", action="store_true",
                    help="only the comparisons against the magnitude of the terms (support.MEASURED_TERMS)")
    args = ap.parse_args()
    logs = list(args.logs)
    if args.run:
        fd, log = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        run(args.run, log)
        logs.append(log)
    print(measured_dict(logs, args.terms) if args.python else doc_table(logs, args.terms) if args.doc
          else table(logs, args.terms))


if __name__ == "__main__":
    main()
