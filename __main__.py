"""``python -m megalodon_kernels``: versions, backend availability, and a self-check.

Prints the library/torch/triton/numpy versions and the machine, says for every backend whether
it can run here and why not, then runs every op x usable backend x dtype on a small case against
its float64 NumPy reference, forward and backward, and prints one table row per check
(op, backend, dtype, pass, max abs and relative error). Exit code 1 if any check fails.

The cases live in ``selfcheck.py``; this file only reports.
"""
from __future__ import annotations

import os
import platform
import sys


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
    return rows


def main() -> int:
    from .selfcheck import run_checks

    print("megalodon_kernels self-check\n")
    for name, value in _versions():
        print(f"  {name:<18} {value}")
    rows, availability = run_checks()
    print("\nbackends (per op: usable here, or why not)")
    for op, per_backend in availability.items():
        for backend, status in per_backend.items():
            print(f"  {op:<16} {backend:<7} {status}")
    print()
    header = f"{'op':<16} {'backend':<8} {'dtype':<9} {'pass':<5} {'check':<26} {'max abs err':>12} {'rel err':>10} {'tol':>8}"
    print(header)
    print("-" * len(header))
    failed = 0
    for r in rows:
        ok = "yes" if r.passed else "NO"
        failed += not r.passed
        print(f"{r.op:<16} {r.backend:<8} {r.dtype:<9} {ok:<5} {r.check:<26} {r.max_abs:>12.3e} {r.rel:>10.3e} {r.tol:>8.1e}")
        if r.note:
            print(f"    {r.note}")
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
