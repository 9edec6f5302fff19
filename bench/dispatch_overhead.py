"""Per-call cost of backend dispatch: ``OpBackends.select`` alone and a tiny op call around it.

    python bench/dispatch_overhead.py [--dispatch PATH] [--calls 500] [--repeats 21]
    python bench/dispatch_overhead.py --per-op [--clock wall|cpu] [--calls 200] [--repeats 11] [--json]

On one thread, for ``backend="auto"`` and ``backend="torch"``: the median over ``repeats`` batches
of ``calls`` back-to-back calls, per call, of

* ``select`` on the op's dispatch inputs (built once, as a repeated call in a model would be), and
* the public op: rotary on x r(1 4 1 8), timestep_norm on x r(1 4 8) with 2 groups, float32,
  forward only, no autograd graph.

The inputs are tiny so that what is measured is the Python around the kernels, not the kernels.
``--dispatch PATH`` times another version of ``ops/_dispatch.py`` (e.g. a copy of an older
commit's file): it is imported as a module of the package and each op's dispatcher is rebuilt
with its ``OpBackends``, so both versions run against the same ops, registry and tables.

``--per-op``: the eager cost of one call of every public op through its custom op
(ops/_library.py) on the torch backend, tiny float32 inputs, one thread: the forward under
``torch.no_grad()``, the forward with inputs that require grad (autograd records a node), and
forward + backward of the outputs' sum; and per token of the tiny model's ``generate``. To compare two versions of the package, run it with each
on ``PYTHONPATH`` (a directory holding a ``megalodon_kernels`` copy), alternating, on the same
machine (bench/results/library_fast_path.md).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
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


def op_calls():
    """op -> a function that calls the op once on tiny inputs (``grad``: inputs that require grad)
    and returns the outputs to sum for a backward."""
    def gen():
        return torch.Generator().manual_seed(0)

    def x(*shape, grad=False):
        return torch.randn(*shape, generator=gen()).requires_grad_(grad)

    def coefficients(grad, D=3, N=2):
        g = gen()
        p = torch.rand(D, N, generator=g).requires_grad_(grad)
        log_q = torch.complex(-torch.rand(D, N, generator=g) - 0.1, torch.rand(D, N, generator=g)).requires_grad_(grad)
        gamma = torch.randn(D, N, generator=g, dtype=torch.complex64).requires_grad_(grad)
        return p, log_q, gamma

    def build(grad):
        kw = dict(backend="torch")
        q, k, v = x(1, 5, 2, 4, grad=grad), x(1, 5, 2, 4, grad=grad), x(1, 5, 2, 4, grad=grad)
        coef = coefficients(grad)
        xc, hx, xs = x(2, 3, 6, grad=grad), x(3, grad=grad), x(1, 2, 4, 5, grad=grad)
        xf, kf, xr, pos = x(2, 3, 8, grad=grad), x(3, 8, grad=grad), x(1, 5, 2, 4, grad=grad), torch.arange(5)
        xn, wn, bn = x(2, 5, 4, grad=grad), x(4, grad=grad), x(4, grad=grad)
        return {
            "attention": lambda: ops.attention(q, k, v, scale=0.5, **kw),
            "cema": lambda: ops.cema(xc, *coef, hx, return_state=True, **kw),
            "cema_kernel": lambda: ops.cema_kernel(*coef, 6, **kw),
            "dropkey_softmax": lambda: ops.dropkey_softmax(xs, True, 0.2, 3, **kw),
            "ema_hidden": lambda: ops.ema_hidden(xc, *coef[:2], **kw),
            "fftconv": lambda: ops.fftconv(xf, kf, **kw),
            "rotary": lambda: ops.rotary(xr, pos, **kw),
            "timestep_norm": lambda: ops.timestep_norm(xn, wn, bn, 2, **kw),
        }
    return build(False), build(True)


def summed(out):
    total = 0
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            total = total + (t.abs() if t.is_complex() else t).sum()
    return total


def per_op(calls: int, repeats: int, clock) -> dict:
    """op -> (forward no_grad, forward recording a node, forward + backward), us per call; and
    "decode (tiny model)" -> us per decoded token of the tiny model (where many small op calls
    add up), the same in all three columns."""
    plain, graded = op_calls()
    result = {}
    for op in plain:
        with torch.no_grad():
            nograd = per_call_us(plain[op], calls, repeats, clock)
        fwd = per_call_us(graded[op], calls, repeats, clock)
        both = per_call_us(lambda: summed(graded[op]()).backward(), calls, repeats, clock)
        result[op] = (nograd, fwd, both)
    from megalodon_kernels.model import Megalodon, get_config
    torch.manual_seed(0)
    model = Megalodon(get_config("tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 8))
    new = max(calls // 10, 4)
    with torch.no_grad():
        token = per_call_us(lambda: model.generate(prompt, new, greedy=True), 1, repeats, clock) / new
    result["decode (tiny model)"] = (token, token, token)
    return result


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def per_call_us(fn, calls: int, repeats: int, clock=time.perf_counter_ns) -> float:
    """Median over ``repeats`` batches of the time per call, in microseconds (``clock``: wall
    time, or this thread's CPU time, which other jobs on a loaded machine disturb less)."""
    fn()  # warm up: imports, first resolution, logging
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - start) / calls / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatch", help="path of an ops/_dispatch.py to time instead of the package's")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=21, help="timed batches (the median is reported)")
    parser.add_argument("--per-op", action="store_true",
                        help="time every public op's eager call (forward, forward with autograd, forward + backward)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="with --per-op: wall time or the thread's CPU time")
    parser.add_argument("--json", action="store_true", help="with --per-op: print one JSON object instead of a table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.per_op:
        result = per_op(args.calls, args.repeats, CLOCKS[args.clock])
        if args.json:
            print(json.dumps({"torch": torch.__version__, "package": os.path.dirname(ops.__file__), "us": result}))
            return 0
        print(f"package: {os.path.dirname(ops.__file__)}, torch {torch.__version__}, 1 thread, "
              f"{args.repeats} x {args.calls} calls, backend='torch', {args.clock} clock")
        print()
        print("| op | forward, no_grad (us) | forward, autograd (us) | forward + backward (us) |")
        print("|---|---|---|---|")
        for op, (a, b, c) in result.items():
            print(f"| {op} | {a:.1f} | {b:.1f} | {c:.1f} |")
        return 0
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
