"""Per-call cost of backend dispatch: ``OpBackends.select`` alone and a tiny op call around it.

    python bench/dispatch_overhead.py [--dispatch PATH] [--calls 500] [--repeats 21]

On one thread, for ``backend="auto"`` and ``backend="torch"``: the median over ``repeats`` batches
of ``calls`` back-to-back calls, per call, of

* ``select`` on the op's dispatch inputs (built once, as a repeated call in a model would be), and
* the public op: rotary on x r(1 4 1 8), timestep_norm on x r(1 4 8) with 2 groups, float32,
  forward only, no autograd graph.

The inputs are tiny so that what is measured is the Python around the kernels, not the kernels.
``--dispatch PATH`` times another version of ``ops/_dispatch.py`` (e.g. a copy of an older
commit's file): it is imported as a module of the package and each op's dispatcher is rebuilt
with its ``OpBackends``, so both versions run against the same ops, registry and tables.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time

import torch

from megalodon_kernels import ops
from megalodon_kernels.autotune import device as autotune_device

OPS = ("rotary", "timestep_norm")
BACKENDS = ("auto", "torch")


def load_dispatch(path: str | None):
    """The dispatch module to time: the package's own, or the file at ``path``."""
    if path is None:
        return importlib.import_module("megalodon_kernels.ops._dispatch")
    name = "megalodon_kernels.ops._dispatch_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use_dispatch(dispatch) -> None:
    """Give every timed op a dispatcher built by ``dispatch.OpBackends``."""
    for op in OPS:
        op_module = importlib.import_module(f"megalodon_kernels.ops.{op}")
        if not isinstance(op_module.BACKENDS, dispatch.OpBackends):
            op_module.BACKENDS = dispatch.OpBackends(op, op_module.BACKENDS._modules)


def cases():
    """op -> (dispatch inputs, device, dtype, call(backend))."""
    x = torch.randn(1, 4, 1, 8)
    positions = torch.arange(4)
    xn = torch.randn(1, 4, 8)
    scale, bias = torch.ones(8), torch.zeros(8)
    return {
        "rotary": ({"x": x}, x.device, x.dtype, lambda backend: ops.rotary(x, positions, backend=backend)),
        "timestep_norm": ({"x": xn, "num_groups": 2}, xn.device, xn.dtype,
                          lambda backend: ops.timestep_norm(xn, scale, bias, 2, backend=backend)),
    }


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` batches of the time per call, in microseconds."""
    fn()  # warm up: imports, first resolution, logging
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatch", help="path of an ops/_dispatch.py to time instead of the package's")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=21, help="timed batches (the median is reported)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dispatch = load_dispatch(args.dispatch)
    use_dispatch(dispatch)
    print(f"dispatch module: {dispatch.__file__}")
    print(f"device: {autotune_device.describe(autotune_device.identity(torch.device('cpu')))}, torch "
          f"{torch.__version__}, 1 thread, {args.repeats} x {args.calls} calls, "
          f"{dispatch.ENV_VAR}={os.environ.get(dispatch.ENV_VAR, '')!r}")
    print()
    print("| op | backend | select (us/call) | op call (us/call) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for op, (inputs, device, dtype, call) in cases().items():
            backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
            for backend in BACKENDS:
                select_us = per_call_us(lambda: backends.select(backend, inputs, device=device, dtype=dtype),
                                        args.calls, args.repeats)
                call_us = per_call_us(lambda: call(backend), args.calls, args.repeats)
                print(f"| {op} | {backend} | {select_us:.2f} | {call_us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
