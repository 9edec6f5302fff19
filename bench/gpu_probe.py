"""GPU probe: each case of bench/gpu_cases.py x backend (cuda, triton, torch) x dtype on a GPU.

    python bench/gpu_probe.py [name filter ...]      (PROBE_DEVICE=cpu: the torch backend on the CPU, a dry run)

Errors are max|out - ref| / max|ref| against the torch backend in float64 on the same device, fed the
inputs rounded to the tested dtype (so the figure is the kernel's error, not the input rounding);
side inputs (CEMA coefficients, norm scale, fftconv's kernel) are float32 as the model passes them.
tests/test_gpu.py checks the same cases against their float32 tolerances. Times are CUDA-event means
over a few calls after one warm-up (indicative; bench/ has the real benchmarks). Then: an op on a
side stream equals the default stream, and CUDA-graph capture per backend.
Output: one line per case; bench/results/gpu/ holds the runs."""
import os
import sys
import time
import traceback

import torch

from megalodon_kernels import ops
from megalodon_kernels.bench.gpu_cases import CASES, errors, rel

dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
CUDA = dev.type == "cuda"
BACKENDS = ("cuda", "triton", "torch") if CUDA else ("torch",)


def timeit(fn, n=10):
    if not CUDA:
        fn(); t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def probe(name, case):
    for dtype in case.dtypes:
        for backend in BACKENDS:
            try:
                fe, be, _, run = errors(case, backend, dtype, dev)
                CUDA and torch.cuda.synchronize()
                fwd_ms = timeit(lambda: run()[0], 10)
                fb_ms = timeit(run, 5)
                print(f"{name:18s} {backend:7s} {str(dtype)[6:]:9s} fwd_err {fe:.2e} bwd_err {be:.2e}  "
                      f"fwd {fwd_ms:8.3f} ms  fwd+bwd {fb_ms:8.3f} ms", flush=True)
            except Exception as exc:
                msg = str(exc).replace("\n", " | ")[:400]
                print(f"{name:18s} {backend:7s} {str(dtype)[6:]:9s} ERROR {type(exc).__name__}: {msg}", flush=True)


if CUDA:
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
only = sys.argv[1:]
for name, case in CASES.items():
    if only and not any(o in name for o in only):
        continue
    t = time.perf_counter()
    try:
        probe(name, case)
    except Exception:
        traceback.print_exc()
    print(f"-- {name} {time.perf_counter() - t:.1f}s", flush=True)

if not CUDA: sys.exit(0)
# side stream: an op on a non-default stream equals the default stream's result
x, k = torch.randn(2, 64, 1000, device=dev), torch.randn(64, 1000, device=dev)
for b in BACKENDS:
    y0 = ops.fftconv(x, k, backend=b)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y1 = ops.fftconv(x, k, backend=b)
    s.synchronize()
    print("side stream", b, "equal" if torch.equal(y0, y1) else f"DIFFERS {rel(y1, y0):.2e}")
# CUDA graph capture of one op per backend
for b in BACKENDS:
    try:
        y = ops.fftconv(x, k, backend=b); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = ops.fftconv(x, k, backend=b)
        g.replay(); torch.cuda.synchronize()
        print("graph capture", b, "equal" if torch.equal(y, yg) else f"DIFFERS {rel(yg, y):.2e}")
    except Exception as exc:
        print("graph capture", b, "ERROR", type(exc).__name__, str(exc)[:300])
