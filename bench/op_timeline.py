"""Where one op call's time goes on a GPU: its kernels, the host, and the gaps between them.

    python bench/op_timeline.py --case cema --backend triton [--dtype float32] [--out FILE] [--trace FILE]

One call of a bench/gpu_cases.py case (model-sized inputs: ``cema`` is B2 D256 N16 L4096) is run
under torch's profiler, forward under ``torch.no_grad()`` and forward + backward, after two warm
calls. For each it reports:

* the wall time of the call (host clock, the device synchronised before and after);
* the GPU busy time (the union of the kernels' intervals), the sum of the kernel times and the
  number of kernels, and the GPU idle time inside the call (wall - busy);
* the longest gaps between consecutive kernels, each with the host operations that started while
  the GPU waited (top-level ``aten::`` ops, Triton and CUDA launch calls, our ``record_function``
  ranges): a gap the host fills is host cost the call's kernels could not hide;
* the kernels by total time, and the host operations by count.

That answers what a timing alone cannot: whether a slow call is slow in its kernels or between
them. The chunked Triton cema's backward took 3.2 ms at the probe on the H200 of
bench/results/gpu/h200_run4. docs/math.md splits that as about 3 ms of host, of which its
counted torch operations explain about 1 ms, with the split inferred from two shapes. Without a GPU the
same run reports the host side only (no kernels). ``--trace`` writes the profiler's Chrome trace
for a closer look. The profiler adds a few microseconds to each host operation, so the profiled
call's wall time is an upper bound on the unprofiled one's.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

from megalodon_kernels.bench import gpu_cases

#: host-side events that issue work to the device, besides the aten ops
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                "cudaMemsetAsync")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_kernel(ev) -> bool:
    return ev.device_type != torch.autograd.DeviceType.CPU


def _top_level_host(events):
    """The host events a reader counts: aten ops not inside another aten op, launch calls, and
    record_function ranges (ours and torch's autograd nodes)."""
    out = []
    for ev in events:
        if _is_kernel(ev):
            continue
        name = ev.name
        if name.startswith("aten::"):
            parent = ev.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if parent is None:
                out.append(ev)
        elif name in LAUNCH_NAMES or name.startswith("autograd::engine::evaluate_function"):
            out.append(ev)
    return out


def union_us(intervals) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def timeline(fn, device, gaps: int = 5, trace: str | None = None) -> dict:
    """Profile one call of ``fn`` (after two warm calls): see the module docstring for the fields."""
    fn()
    fn()
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    if trace:
        prof.export_chrome_trace(trace)
    events = list(prof.events())
    kernels = sorted((ev for ev in events if _is_kernel(ev)), key=lambda ev: ev.time_range.start)
    host = _top_level_host(events)
    busy = union_us([(k.time_range.start, k.time_range.end) for k in kernels])
    found = []
    for before, after in zip(kernels, kernels[1:]):
        a, b = before.time_range.end, after.time_range.start
        if b > a:
            issued = collections.Counter(ev.name for ev in host if a <= ev.time_range.start < b)
            found.append({"us": b - a, "after": before.name[:80], "before": after.name[:80],
                          "host": issued.most_common(6)})
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_kernel[k.name[:100]][0] += 1
        by_kernel[k.name[:100]][1] += k.time_range.elapsed_us()
    return {
        "wall_us": wall_us,
        "kernels": len(kernels),
        "kernel_sum_us": sum(k.time_range.elapsed_us() for k in kernels),
        "gpu_busy_us": busy,
        "gpu_idle_us": max(0.0, wall_us - busy) if kernels else None,
        "host_ops": len([ev for ev in host if ev.name.startswith("aten::")]),
        "launch_calls": len([ev for ev in host if ev.name in LAUNCH_NAMES]),
        "host_by_name": collections.Counter(ev.name for ev in host).most_common(),
        "gaps": sorted(found, key=lambda g: -g["us"])[:gaps],
        "by_kernel": sorted(((n, c, t) for n, (c, t) in by_kernel.items()), key=lambda r: -r[2])[:12],
    }


def phases(case: gpu_cases.Case, backend: str, dtype: torch.dtype, device) -> dict:
    """{"fwd": call, "fwd+bwd": call} of one gpu_cases case on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    inputs = [gpu_cases.as_dtype(t, dtype, i < case.n_main).detach().requires_grad_()
              for i, t in enumerate(case.make(device))]
    out = gpu_cases.outputs(case.call(inputs, backend))
    ups = [torch.randn_like(o) for o in out]

    def forward():
        with torch.no_grad():
            case.call(inputs, backend)

    def both():
        o = gpu_cases.outputs(case.call(inputs, backend))
        torch.autograd.grad(o, inputs, ups, allow_unused=True)
    return {"fwd": forward, "fwd+bwd": both}


def report(name: str, backend: str, dtype: torch.dtype, device, results: dict) -> list[str]:
    lines = [f"# Timeline of one {name} call, backend {backend}, {str(dtype).replace('torch.', '')}, {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (no GPU: host side only)"),
             "", f"Command: `python bench/op_timeline.py {' '.join(sys.argv[1:])}` (torch {torch.__version__})", "",
             "| phase | wall us | kernels | kernel sum us | GPU busy us | GPU idle in the call us | host aten ops | "
             "launch calls |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for phase, r in results.items():
        idle = f"{r['gpu_idle_us']:.0f}" if r["gpu_idle_us"] is not None else "-"
        lines.append(f"| {phase} | {r['wall_us']:.0f} | {r['kernels']} | {r['kernel_sum_us']:.0f} | "
                     f"{r['gpu_busy_us']:.0f} | {idle} | {r['host_ops']} | {r['launch_calls']} |")
    for phase, r in results.items():
        lines += ["", f"## {phase}", "", "Longest gaps between kernels (what the host issued meanwhile):", ""]
        lines += [f"- {g['us']:.0f} us after `{g['after']}`, before `{g['before']}`: "
                  + (", ".join(f"{n} x{c}" for n, c in g["host"]) or "nothing recorded") for g in r["gaps"]] or ["- none"]
        lines += ["", "Kernels by time:", "", "| kernel | count | us |", "|---|---:|---:|"]
        lines += [f"| `{n}` | {c} | {t:.0f} |" for n, c, t in r["by_kernel"]] or ["| (none) | 0 | 0 |"]
        lines += ["", "Host operations by count: " + ", ".join(f"{n} x{c}" for n, c in r["host_by_name"][:12])]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="cema", choices=sorted(gpu_cases.CASES))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gaps", type=int, default=5)
    parser.add_argument("--trace", help="write the Chrome trace of the forward + backward call here")
    parser.add_argument("--out", help="write the markdown report here (else print it)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    calls = phases(gpu_cases.CASES[args.case], args.backend, dtype, device)
    results = {phase: timeline(fn, device, args.gaps, args.trace if phase == "fwd+bwd" else None)
               for phase, fn in calls.items()}
    text = "\n".join(report(args.case, args.backend, dtype, device, results)) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
