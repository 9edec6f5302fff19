"""``python -m megalodon_kernels``: versions, backend availability, and a self-check.

Prints the library/torch/triton/numpy versions and the machine; then, per device, a table of op x
backend saying whether the backend can run the op here ("yes", "no (n)", or the dtypes it runs
when it refuses some), with every distinct reason printed once beneath it, numbered; then one row
per check of every op x usable backend x dtype against its float64 NumPy reference, forward and
backward (op, backend, device, dtype, pass, the max abs error, the relative error and the relative
tolerance it must not exceed). Exit code 1 if any check fails.

A torch or Triton outside the tested range (``_versions.py``: torch 2.11-2.13, Triton 3.6-3.9),
or a combination known to fail, is listed after the versions with the reason and the fix; the
self-check still runs (it shows what works), a crash of it is reported as such, and the exit code
is 1.

The cases live in ``selfcheck.py``; this file only reports.
"""
from __future__ import annotations

import os
import platform
import sys
import textwrap

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _versions() -> list[tuple[str, str]]:
    import numpy
    import torch

    from . import __version__

    rows = [("megalodon_kernels", __version__), ("python", platform.python_version()),
            ("torch", torch.__version__), ("numpy", numpy.__version__)]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except Exception as exc:  # optional dependency
        rows.append(("triton", f"not importable ({type(exc).__name__}: {exc})"))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    rows.append(("cpu", f"{cpu} ({os.cpu_count()} cores)"))
    rows.append(("cuda device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"))
    from .cuda import nvrtc, runtime

    reason = runtime.unavailable_reason()
    try:
        compiler = "NVRTC %d.%d" % nvrtc.nvrtc_version()
    except nvrtc.NvrtcUnavailable:
        compiler = "no NVRTC"
    rows.append(("cuda runtime", f"{compiler}; " + (f"unavailable: {reason}" if reason else "available")))
    return rows


def version_problems() -> list[str]:
    """What is unsupported about the running torch / Triton / NumPy (``_versions.problems``).
    Triton's version comes from its installed metadata: a Triton that fails to import still has one."""
    from importlib import metadata

    import numpy
    import torch

    from ._versions import problems

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    return problems(torch.__version__, triton_version, numpy.__version__,
                    os.environ.get("TRITON_INTERPRET", "0") == "1")


def problem_lines(found) -> list[str]:
    from ._versions import TORCH_TESTED, TRITON_TESTED

    span = lambda r: "-".join(".".join(map(str, v)) for v in r)  # noqa: E731
    lines = [f"unsupported (tested: torch {span(TORCH_TESTED)}, triton {span(TRITON_TESTED)})"]
    for p in found:
        lines.append(textwrap.fill(p, width=100, initial_indent="  - ", subsequent_indent="    "))
    return lines + [""]


def cell_reasons(seen) -> list[str]:
    """The reasons a table cell points to. A backend that ran no dtype shows what stops it in
    every dtype (not built, wrong device), not also the dtype limits behind that; a backend that
    runs some dtypes shows why it refuses the others."""
    per_dtype = list(seen.refused.values())
    if not seen.ran and per_dtype:
        common = [r for r in per_dtype[0] if all(r in other for other in per_dtype[1:])]
        if common:
            return common
    return [r for reasons in per_dtype for r in reasons]


def availability_lines(availability, claimed) -> list[str]:
    """The op x backend table of each device, each distinct reason numbered once beneath it.

    ``claimed[op]`` lists the dtype names the op's case runs in: a backend that ran all of them
    is "yes", none "no (n, ...)", some "fp32 bf16 only (n, ...)".
    """
    lines: list[str] = []
    for device, per_op in availability.items():
        numbers: dict[str, int] = {}
        backends = list(next(iter(per_op.values())))
        table = []
        for op, per_backend in per_op.items():
            cells = []
            for backend in backends:
                seen = per_backend[backend]
                refs = sorted({numbers.setdefault(reason, len(numbers) + 1) for reason in cell_reasons(seen)})
                note = f" ({', '.join(map(str, refs))})" if refs else ""
                if not seen.refused and set(seen.ran) == set(claimed[op]):
                    cells.append("yes")
                elif not seen.ran:
                    cells.append("no" + note)
                else:
                    cells.append(" ".join(_SHORT.get(d, d) for d in seen.ran) + " only" + note)
            table.append((op, cells))
        widths = [max(len(b), *(len(cells[i]) for _, cells in table)) for i, b in enumerate(backends)]
        op_width = max(len("op"), *(len(op) for op, _ in table))
        lines.append(f"backends on {device} (usable here, or why not: reasons below)")
        lines.append("  " + "  ".join([f"{'op':<{op_width}}"] + [f"{b:<{w}}" for b, w in zip(backends, widths)]))
        for op, cells in table:
            lines.append(("  " + "  ".join([f"{op:<{op_width}}"] + [f"{c:<{w}}" for c, w in zip(cells, widths)])).rstrip())
        if numbers:
            lines.append("")
        for reason, n in numbers.items():
            lines.append(textwrap.fill(reason, width=100, initial_indent=f"  ({n}) ",
                                       subsequent_indent=" " * (len(f"({n}) ") + 2)))
        lines.append("")
    return lines


def check_lines(rows) -> list[str]:
    """One line per check (a note, such as a crash's message, on the line after)."""
    # pass = relative error <= relative tolerance; the relative error is the max abs error over the
    # reference's scale (selfcheck._compare), so the absolute column can exceed the tolerance
    header = (f"{'op':<16} {'backend':<8} {'device':<7} {'dtype':<9} {'pass':<5} {'check':<22} "
              f"{'max abs error':>13} {'relative error':>14} {'relative tolerance':>18}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ok = "yes" if r.passed else "NO"
        lines.append(f"{r.op:<16} {r.backend:<8} {r.device:<7} {r.dtype:<9} {ok:<5} {r.check:<22} "
                     f"{r.max_abs:>13.3e} {r.rel:>14.3e} {r.tol:>18.1e}")
        if r.note:
            lines.append(f"    {r.note}")
    return lines


def _parse(argv: list[str]) -> None:
    """``--help`` answers without importing the ops or running anything; there are no options."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m megalodon_kernels",
        description="Prints the versions of megalodon_kernels, Python, torch, NumPy and Triton and the machine; "
                    "then, per device, which backend (cuda, triton, cpu, torch) can run each op here and, "
                    "numbered beneath, why not; then checks every op x usable backend x dtype against its "
                    "float64 NumPy reference, forward and backward, one row per check. A row passes when its "
                    "relative error (max abs error / max |reference|) is at most its relative tolerance.",
        epilog="Exit status: 0 when every check passes on supported versions, else 1. "
               "Set TRITON_INTERPRET=1 to include the Triton kernels on a CPU (slow).",
    ).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    _parse([] if argv is None else argv)
    unsupported = version_problems()
    print("megalodon_kernels self-check\n")
    for name, value in _versions():
        print(f"  {name:<18} {value}")
    print()
    if unsupported:
        print("\n".join(problem_lines(unsupported)))
    try:
        from .selfcheck import CASES, dtype_name, run_checks

        rows, availability = run_checks()
    except Exception as exc:
        if not unsupported:
            raise
        # on an unsupported version a crash is expected; its reason is printed above
        print(f"the self-check could not run: {type(exc).__name__}: {exc}")
        print(f"{len(unsupported)} unsupported version(s): see above")
        return 1
    claimed = {op: [dtype_name(d) for d in dtypes] for op, (dtypes, _) in CASES.items()}
    print("\n".join(availability_lines(availability, claimed)))
    print("\n".join(check_lines(rows)))
    failed = sum(not r.passed for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    if unsupported:
        print(f"{len(unsupported)} unsupported version(s): see above")
    return 1 if failed or unsupported else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
