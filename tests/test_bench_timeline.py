"""bench/op_timeline.py: the union of kernel intervals, the host operations it counts, and one
profiled call on the CPU (no kernels: the host side only). Cheap: tiny inputs, one call each."""
from __future__ import annotations

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import gpu_cases, op_timeline

pytestmark = pytest.mark.usefixtures("one_thread")


def test_union_counts_overlapping_kernels_once():
    assert op_timeline.union_us([]) == 0.0
    assert op_timeline.union_us([(0, 10), (5, 12), (20, 25)]) == 17.0
    assert op_timeline.union_us([(20, 25), (0, 10), (2, 3)]) == 15.0  # unordered, nested


def test_a_cpu_call_reports_its_host_operations_and_no_kernels():
    x = torch.randn(2, 3, 200, requires_grad=True)  # past the direct path: FFTs
    k = torch.randn(3, 200, requires_grad=True)

    def call():
        y = ops.fftconv(x, k, backend="torch")
        torch.autograd.grad(y, (x, k), torch.ones_like(y))
    r = op_timeline.timeline(call, torch.device("cpu"))
    assert r["kernels"] == 0 and r["gpu_busy_us"] == 0 and r["gpu_idle_us"] is None and r["gaps"] == []
    assert r["wall_us"] > 0
    names = dict(r["host_by_name"])
    # the torch backend's forward transforms (x, k) and the backward's, each counted at the top level
    assert names.get("aten::fft_rfft", 0) >= 3 and names.get("aten::fft_irfft", 0) >= 2, names
    assert not any(n.startswith("aten::_fft") for n in names)  # the ops inside them are not counted
    assert r["host_ops"] == sum(c for n, c in r["host_by_name"] if n.startswith("aten::"))


def test_the_report_of_a_case_has_both_phases(monkeypatch):
    small = gpu_cases.Case(lambda d: [torch.randn(1, 2, 8, dtype=torch.float64, device=d),
                                      torch.randn(2, 8, dtype=torch.float64, device=d)],
                           lambda a, b: ops.fftconv(a[0], a[1], backend=b), 1, gpu_cases.F32, {})
    device = torch.device("cpu")
    calls = op_timeline.phases(small, "torch", torch.float32, device)
    results = {p: op_timeline.timeline(fn, device) for p, fn in calls.items()}
    lines = op_timeline.report("small", "torch", torch.float32, device, results)
    rows = [line for line in lines if line.startswith("| fwd")]
    assert [row.split(" | ")[0] for row in rows] == ["| fwd", "| fwd+bwd"]
    assert results["fwd+bwd"]["host_ops"] > results["fwd"]["host_ops"] > 0
