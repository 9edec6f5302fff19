"""The host-cost benchmark's machinery (bench/host_cost.py, bench/launch_stubs.py) keeps working:
an op's CUDA backend runs its host code on CPU tensors over the no-op driver (a launch reaches
CuPy's stubbed driver call, nothing runs), and one measured row records the op's custom-op calls,
its backend calls and its select calls. Cheap: two calls and one round per level.

(The Triton stub needs kernels decorated with ``TRITON_INTERPRET`` unset, which this test process
cannot give: bench/host_cost.py clears it before importing the package.)"""
import importlib
import sys
from pathlib import Path

import pytest
import torch

from megalodon_kernels import ops

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = str(Path(__file__).resolve().parent.parent / "bench")


@pytest.fixture(scope="module")
def bench_modules():
    """(host_cost, launch_stubs), imported when the tests run (bench/ holds test_*.py files of its
    own: it is on sys.path only meanwhile, after every test module was collected)."""
    sys.path.append(BENCH)
    try:
        import host_cost
        import launch_stubs
        yield host_cost, launch_stubs
    finally:
        sys.path.remove(BENCH)


def test_the_stubbed_cuda_backend_runs_its_host_code_and_launches_nothing(bench_modules):
    _, launch_stubs = bench_modules
    backends = importlib.import_module("megalodon_kernels.ops.fftconv").BACKENDS
    launcher = launch_stubs.stubbed_cuda_launcher()
    x = torch.randn(2, 3, 8, requires_grad=True)
    k = torch.randn(3, 8, requires_grad=True)
    with backends.use("cuda", launch_stubs.host_only_backends("fftconv", "cuda", launcher)):
        y = ops.fftconv(x, k, backend="cuda")
        forward_launches = launcher.api.launches
        y.sum().backward()
    assert forward_launches >= 1 and launcher.api.launches > forward_launches
    assert x.grad.shape == x.shape and k.grad.shape == k.shape


def test_one_row_records_the_levels_of_a_call(bench_modules):
    host_cost, launch_stubs = bench_modules
    stubs = {"cuda": launch_stubs.stubbed_cuda_launcher()}
    clock = host_cost.CLOCKS["cpu"]
    row = host_cost.measure("fftconv", "cuda", host_cost.cases(torch.device("cpu")), 2, 1, clock, stubs, 0.0)
    assert row["forward"]["calls"] == {"op": ["fftconv"], "backend": ["forward"], "select": 1}
    both = row["forward+backward"]
    assert both["calls"] == {"op": ["fftconv", "fftconv_bwd"], "backend": ["forward", "backward"], "select": 2}
    for level in ("public", "op", "real", "direct", "select", "floor", "floor clones", "bare", "glue", "twin",
                  "twin clones", "twin beside"):
        assert both[level] > 0, level
    assert {"glue", "twin", "twin clones", "twin beside"} <= set(row["forward"])
    # the control is one call of the twin and then the math, in that order (not a timing check)
    order = []
    host_cost.beside(lambda: order.append("twin"), lambda: order.append("math"))()
    assert order == ["twin", "math"]
    assert host_cost.verdict({"public": 30.0, "direct": 10.0}, "forward") == "within"
    over = {"public": 300.0, "direct": 100.0, "bare": 190.0, "twin": 95.0, "twin clones": 5.0}
    assert host_cost.verdict(over, "forward+backward") == (
        "over: torch's autograd around the math alone 90 (ours beyond it 110); "
        "torch.library's own road for this signature alone 90")
    # forward: ours over 25, torch.library's road within it alone but above it beside the math
    fwd = {"public": 60.0, "direct": 20.0, "glue": 18.0, "twin": 22.0, "twin clones": 5.0, "twin beside": 72.0}
    assert host_cost.verdict(fwd, "forward") == (
        "over: torch.library's own road for this signature alone 17, beside the math 47 (ours is below it)")
    fwd["twin beside"] = 40.0  # beside the math 15: ours is the part over the target
    assert host_cost.verdict(fwd, "forward") == (
        "over: ours (18 alone, 22 more when run between the math's calls; torch.library's road 17 alone, "
        "15 beside the math)")
    assert host_cost.twin_cell(fwd) == "17.0 (15.0)"
    assert both["pieces"]["launch road (count)"] >= 2  # a forward and a backward launch at least
    assert host_cost.measure("rotary", "cpu", host_cost.cases(torch.device("cpu")), 2, 1, clock, stubs, 0.0) == {
        "skipped": "no cpu backend of rotary"}


def test_repeated_runs_merge_to_the_median_of_each_number(bench_modules):
    host_cost, _ = bench_modules
    runs = [{"ops": {"fftconv": {"cpu": {"forward": {"public": v, "calls": {"backend": ["forward"]}}}}},
             "arity": {"fftconv": 3}, "native": {"3": [v, 2 * v]}, "commit": "abc"} for v in (5.0, 1.0, 9.0, 2.0)]
    m = host_cost.median_of(runs)
    assert m["ops"]["fftconv"]["cpu"]["forward"] == {"public": 3.5, "calls": {"backend": ["forward"]}}
    assert m["arity"]["fftconv"] == 3 and isinstance(m["arity"]["fftconv"], int)
    assert m["native"]["3"] == [3.5, 7.0] and m["commit"] == "abc"
