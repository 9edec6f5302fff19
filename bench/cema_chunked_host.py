"""The host side of the Triton cema's chunked form: what one call does besides its Triton kernels.

    python bench/cema_chunked_host.py [--shape 2 256 16 4096] [--calls 20] [--out FILE]

Runs the public ``cema(..., backend="triton")`` on CPU tensors with the Triton launches stubbed
(bench/launch_stubs.py: everything up to the compiled launcher is real), forward without autograd
and forward + backward, and counts per call

* the torch operations that launch a kernel on a GPU (aten calls other than views), in total and
  inside the chunked form's host pieces: the per-feature tables (``Tables``), the float64 finish
  of the coefficient gradients (``finish``);
* the Triton launches;
* the wall time per call on this CPU (median of ``--calls``; the table and finish ops do real,
  small CPU work here, where on a GPU each is a launch of a few microseconds of host time).

On a GPU every counted torch operation costs host time (on the H200 machine of
bench/results/gpu/h200_run4 a native op took ~9 us through the dispatcher, host_cost_h200.md),
which a call at a small shape cannot hide behind its kernels.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the stubbed launches need compilable (not interpreted) kernels

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_stubs  # noqa: E402

from megalodon_kernels.ops.cema import BACKENDS, cema  # noqa: E402
from megalodon_kernels.ops.cema import triton_chunked  # noqa: E402

#: aten operations that only make a view (no kernel launch on a GPU)
VIEWS = ("select", "slice", "unsqueeze", "view", "transpose", "expand", "_conj", "alias", "permute", "as_strided",
         "detach", "squeeze", "real", "imag", "_reshape_alias", "lift_fresh", "t.default", "split", "unbind")

#: aten operations that return their input unchanged when there is nothing to do (no aten call below)
MAYBE_NO_OP = ("aten::to", "aten::contiguous", "aten::reshape", "aten::type_as", "aten::flatten")


def launches(op_name: str) -> bool:
    """Whether an aten call ("aten.mul.Tensor") launches a kernel on a GPU (is not a view)."""
    return not any(op_name.startswith("aten." + v) for v in VIEWS)


def count_ops(fn):
    """{"all": n, "tables": n, "finish": n, "top": Counter} of the first-level aten calls that launch
    (an aten call made by another aten call, e.g. copy_ inside to, is part of its caller) in
    ``fn()``, from the CPU profiler; Tables() and finish() marked by record_function."""
    saved_init, saved_finish = triton_chunked.Tables.__init__, triton_chunked.finish

    def tables_init(self, *a, **k):
        with torch.profiler.record_function("chunked::tables"):
            saved_init(self, *a, **k)

    def finish(*a, **k):
        with torch.profiler.record_function("chunked::finish"):
            return saved_finish(*a, **k)

    triton_chunked.Tables.__init__, triton_chunked.finish = tables_init, finish
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        triton_chunked.Tables.__init__, triton_chunked.finish = saved_init, saved_finish
    out = {"all": 0, "tables": 0, "finish": 0, "top": collections.Counter()}
    for ev in prof.events():
        parent = ev.cpu_parent
        if not ev.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        if not launches("aten." + ev.name[len("aten::"):]):
            continue
        if ev.name in MAYBE_NO_OP and not any(c.name.startswith("aten::") for c in ev.cpu_children):
            continue  # e.g. to() of a tensor already in that dtype returns it
        out["all"] += 1
        out["top"][ev.name[len("aten::"):]] += 1
        while parent is not None:
            if parent.name in ("chunked::tables", "chunked::finish"):
                out[parent.name.split("::")[1]] += 1
                break
            parent = parent.cpu_parent
    return out


def inputs(B, D, N, L, grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D, L, generator=g)
    p = torch.rand(D, N, generator=g)
    log_q = torch.complex(-torch.rand(D, N, generator=g) - 1e-3, torch.rand(D, N, generator=g))
    gamma = torch.randn(D, N, dtype=torch.complex64, generator=g)
    omega = torch.randn(D, generator=g)
    ts = [x, p, log_q, gamma, omega]
    if grad:
        for t in ts:
            t.requires_grad_(True)
    return ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs=4, type=int, default=[2, 256, 16, 4096], metavar=("B", "D", "N", "L"))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    B, D, N, L = a.shape
    torch.set_num_threads(1)
    module = launch_stubs.host_only_backends("cema", "triton")
    lines = [f"# Host side of the Triton cema's chunked form (B{B} D{D} N{N} L{L}, fp32, CPU tensors, launches stubbed)",
             "", f"Command: `python bench/cema_chunked_host.py --shape {B} {D} {N} {L} --calls {a.calls}` "
             f"(torch {torch.__version__}, 1 thread)", "",
             "| call | torch ops that launch | of them: tables | of them: finish | Triton launches | "
             "CPU ms per call (median) |", "|---|---:|---:|---:|---:|---:|"]
    with launch_stubs.stubbed_triton() as made, BACKENDS.use("triton", module):
        for phase in ("forward", "forward+backward"):
            grad = phase != "forward"

            x, p, lq, gm, om = inputs(B, D, N, L, grad)
            gy = torch.ones(B, D, L)

            def one_call():
                with (contextlib.nullcontext() if grad else torch.no_grad()):
                    y, _ = cema(x, p, lq, gm, om, backend="triton")
                    if grad:
                        y.backward(gy)

            one_call()  # warm: the backend's selection cached, the stub kernels made
            before = sum(k.launches for ks in made.values() for k in ks)
            counts = count_ops(one_call)
            n_launch = sum(k.launches for ks in made.values() for k in ks) - before
            times = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                one_call()
                times.append((time.perf_counter() - t0) * 1e3)
            lines.append(f"| {phase} | {counts['all']} | {counts['tables']} | {counts['finish']} | "
                         f"{n_launch} | {statistics.median(times):.2f} |")
            top = ", ".join(f"{k} {v}" for k, v in counts["top"].most_common(8))
            lines.append(f"| ({phase}: most frequent) | {top} | | | | |")
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
