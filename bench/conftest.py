"""pytest-benchmark machinery shared by the bench/test_<op>.py modules.

    pytest bench/ --shape-set cpu|a100|h100 [--benchmark-json out.json]

Every test module defines ``OP`` and ``make(s, dtype, device) -> Case``; this file parametrizes
each test over the set's lengths x modes (fwd, bwd, fwd+bwd) x providers (every library backend
plus the op's baselines from ``baselines.py``) and times one case per test:

* fwd: the forward under ``torch.no_grad()`` (inference);
* bwd: the backward only (a fresh forward runs in the untimed setup of every round);
* fwd+bwd: forward then ``torch.autograd.grad`` of all outputs (no .grad accumulation).

A library backend the machine cannot run (``BACKENDS.reasons``: no GPU, no Triton interpreter, no
built CUDA extension) is skipped with its reason; so are the GPU sets without a GPU. Warm-up: one
untimed call, then a calibration call decides the number of rounds (about ``--bench-budget``
seconds per case, 5 to 200 rounds), then one more untimed warm-up round inside pedantic. On a GPU
every timed call ends with ``torch.cuda.synchronize()``. Each benchmark's ``extra_info`` holds the
op, provider, kind, mode, L, shape, dtype, device, p20/p80 and the ideal bytes/FLOPs
(``roofline.ideal``); machine_info gains torch/triton versions and the device name.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import sys
import time
from typing import Callable

import pytest
import torch

from megalodon_kernels.bench import roofline
from megalodon_kernels.bench.baselines import BASELINES
from megalodon_kernels.bench.shapes import BENCH_SETS, DEFAULT_SET, dtype_name, shape

LIBRARY_BACKENDS = ("cuda", "triton", "cpu", "torch")
MODES = ("fwd", "bwd", "fwd+bwd")


@dataclasses.dataclass
class Case:
    """One op at one shape: tensors are built once; ``call[provider]()`` returns the output(s)."""

    inputs: dict  # the dict the op's BACKENDS.reasons() takes
    call: dict[str, Callable]
    leaves: list  # tensors that require grad (gradients are taken w.r.t. these)


def pytest_addoption(parser):
    g = parser.getgroup("megalodon bench")
    g.addoption("--shape-set", default=DEFAULT_SET, choices=sorted(BENCH_SETS),
                help="shape set: cpu (scaled, runs here), a100/h100 (paper 7B, need that GPU)")
    g.addoption("--bench-budget", type=float, default=0.15,
                help="approximate timed seconds per case (rounds = budget / one call, 5..200)")
    g.addoption("--threads", type=int, default=None,
                help="torch CPU threads for the run (default: 1 for the cpu set, torch's default otherwise; "
                     "0 = torch's default)")


def pytest_configure(config):
    if not hasattr(config.option, "shape_set"):
        return
    threads = config.getoption("--threads")
    if threads is None:
        threads = 1 if BENCH_SETS[config.getoption("--shape-set")].device_type == "cpu" else 0
    if threads > 0:
        # On a small shared CPU, torch's intra-op pool stalls whenever another process takes a core,
        # so multi-threaded medians measure the neighbours; one thread measures the code.
        torch.set_num_threads(threads)


def pytest_generate_tests(metafunc):
    mod = metafunc.module
    if not hasattr(mod, "OP") or "provider" not in metafunc.fixturenames:
        return
    set_name = metafunc.config.getoption("--shape-set")
    lengths = BENCH_SETS[set_name].lengths
    providers = list(LIBRARY_BACKENDS) + list(BASELINES[mod.OP])
    metafunc.parametrize("L", lengths, ids=[f"L{L}" for L in lengths])
    metafunc.parametrize("mode", MODES)
    metafunc.parametrize("provider", providers)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def pytest_benchmark_update_machine_info(config, machine_info):
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine_info.update(torch=torch.__version__, triton=tv, cuda=torch.version.cuda, gpu=gpu,
                        torch_threads=torch.get_num_threads(), shape_set=config.getoption("--shape-set"),
                        cpu_count=os.cpu_count(), command=" ".join(["pytest", *sys.argv[1:]]))


#: "op provider" -> reason, for the report (skipped tests leave no benchmark row)
SKIPPED: dict[str, str] = {}


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["skipped"] = dict(SKIPPED)


@pytest.fixture(scope="session")
def bench_set(request):
    name = request.config.getoption("--shape-set")
    s = BENCH_SETS[name]
    if s.device_type == "cuda":
        if not torch.cuda.is_available():
            SKIPPED["all"] = f"shape set {name!r} needs a GPU; none here"
            pytest.skip(f"shape set {name!r} is the paper's 7B setting for a GPU ({s.note}); no CUDA device here, "
                        f"so it is skipped (run --shape-set cpu on this machine)")
        dev = torch.device("cuda")
        want = name.upper()
        if want not in torch.cuda.get_device_name(dev).upper():
            pytest.skip(f"shape set {name!r} must run on an {want}; this GPU is {torch.cuda.get_device_name(dev)}")
    else:
        dev = torch.device("cpu")
    return name, dev


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _outs(o):
    o = o if isinstance(o, (tuple, list)) else (o,)
    return [t for t in o if isinstance(t, torch.Tensor) and t.requires_grad]


@pytest.fixture
def run_case(benchmark, bench_set, request):
    """run_case(make, op, L, mode, provider): build the case and time it with pytest-benchmark."""
    set_name, dev = bench_set
    budget = request.config.getoption("--bench-budget")

    def run(make, op, L, mode, provider):
        s = shape(op, set_name, L)
        dtype = getattr(torch, dtype_name(set_name))
        torch.manual_seed(0)
        case = make(s, dtype, dev)
        kind = "library" if provider in LIBRARY_BACKENDS else "baseline"
        if kind == "library":
            why = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS.reasons(provider, case.inputs)
            if why:
                SKIPPED[f"{op} {provider}"] = "; ".join(why)
                pytest.skip(f"{op} backend {provider!r} cannot run here: " + "; ".join(why))
        fn = case.call[provider]
        leaves = case.leaves
        # Warm-up (allocations, lazy imports, tables, autotune lookups) and the output gradients.
        outs = _outs(fn())
        grads = [torch.randn_like(o) for o in outs]
        _sync(dev)

        def fwd():
            with torch.no_grad():
                fn()
            _sync(dev)

        def both():
            o = _outs(fn())
            torch.autograd.grad(o, leaves, grads, allow_unused=True)
            _sync(dev)

        def setup_bwd():
            o = _outs(fn())
            _sync(dev)
            return (o,), {}

        def bwd(o):
            torch.autograd.grad(o, leaves, grads, allow_unused=True)
            _sync(dev)

        # Calibrate: one untimed call of the timed target decides the rounds.
        if mode == "bwd":
            args, _ = setup_bwd()
            t0 = time.perf_counter()
            bwd(*args)
        else:
            target = fwd if mode == "fwd" else both
            t0 = time.perf_counter()
            target()
        one = max(time.perf_counter() - t0, 1e-6)
        rounds = int(min(200, max(5, budget / one)))
        if mode == "bwd":
            benchmark.pedantic(bwd, setup=setup_bwd, rounds=rounds, iterations=1, warmup_rounds=1)
        else:
            benchmark.pedantic(target, rounds=rounds, iterations=1, warmup_rounds=1)
        data = sorted(benchmark.stats.stats.data)
        q = lambda f: data[min(len(data) - 1, int(f * len(data)))]  # noqa: E731
        nbytes, flops = roofline.ideal(op, s, dtype_name(set_name))["fwd" if mode == "fwd" else "bwd"]
        if mode == "fwd+bwd":
            f = roofline.ideal(op, s, dtype_name(set_name))["fwd"]
            nbytes, flops = nbytes + f[0], flops + f[1]
        benchmark.group = f"{op} {mode}"
        benchmark.extra_info.update(
            op=op, provider=provider, kind=kind, mode=mode, L=L, shape=s, shape_set=set_name,
            dtype=dtype_name(set_name), device=dev.type, device_name=_device_name(dev), tokens=BENCH_SETS[set_name].batch(L) * L,
            p20=q(0.2), p80=q(0.8), rounds=rounds, ideal_bytes=nbytes, ideal_flops=flops,
        )

    return run
