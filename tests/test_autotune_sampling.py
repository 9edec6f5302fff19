"""Sampled references of the tuning harnesses: at GPU shapes a full float64 reference is
unaffordable (fftconv's is O(L^2) per channel; cema_kernel's (D, N, L) at the 7B size is 34 GB), so
beyond ``harness.REFERENCE_BUDGET`` a harness computes the reference of evenly spaced independent
rows only and the tuner compares those rows (``registry.Part``). These tests force sampling on
small shapes and check that the sampled rows equal the full reference's rows exactly, and that
the tuner's error measure catches a wrong value in a sampled row."""
import importlib

import numpy as np
import pytest
import torch

from megalodon_kernels.autotune import registry
from megalodon_kernels.autotune.tuning import harness as harness_pkg
from megalodon_kernels.autotune.tuning import tuner

SMALL = {
    "fftconv": {"B": 2, "D": 7, "L": 16},
    "cema_kernel": {"B": 2, "D": 7, "N": 3, "L": 9, "hx": True},
    "ema_hidden": {"B": 2, "D": 7, "N": 3, "L": 9},
    "cema": {"B": 1, "D": 7, "N": 3, "L": 9},
    "timestep_norm": {"B": 2, "L": 7, "D": 12, "G": 6},
    "dropkey_softmax": {"B": 1, "H": 2, "L": 9, "S": 11},
}


def _harness(op):
    return importlib.import_module(f"megalodon_kernels.autotune.tuning.harness.{op}").HARNESS


def test_sample_rows_keeps_the_edges_and_respects_the_budget(monkeypatch):
    monkeypatch.setattr(harness_pkg, "REFERENCE_BUDGET", 100.0)
    assert harness_pkg.sample_rows(10, 10.0) is None  # 100 <= budget: every row
    rows = harness_pkg.sample_rows(1000, 10.0)
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 10 and np.all(np.diff(rows) > 0)
    rows = harness_pkg.sample_rows(1000, 1e6)  # one row over budget: still the two edges
    assert rows.tolist() == [0, 999]
    assert harness_pkg.sample_rows(1, 1e9).tolist() == [0]


@pytest.mark.parametrize("op", sorted(SMALL))
def test_sampled_reference_equals_the_full_reference_on_its_rows(op, monkeypatch):
    importlib.import_module(f"megalodon_kernels.ops.{op}")
    harness = _harness(op)
    case = harness.make_case(SMALL[op], torch.float32, torch.device("cpu"), 0)
    full = harness.reference(case)
    assert not any(isinstance(v, registry.Part) for v in full.values())
    monkeypatch.setattr(harness_pkg, "REFERENCE_BUDGET", 1.0)  # force the minimum: first and last row
    sampled = harness.reference(case)
    assert set(sampled) == set(full)
    parts = 0
    for name, value in sampled.items():
        if isinstance(value, registry.Part):
            parts += 1
            expect = full[name][value.index]
            assert value.value.shape == expect.shape, name
            np.testing.assert_allclose(value.value, expect, rtol=1e-12, atol=1e-12, err_msg=f"{op}/{name}")
        else:
            np.testing.assert_allclose(value, full[name], rtol=1e-12, atol=1e-12, err_msg=f"{op}/{name}")
    assert parts == len(sampled), f"{op}: every output of a row-separable op should be sampled"


@pytest.mark.parametrize("op", ["fftconv", "timestep_norm"])
def test_tuner_error_sees_a_wrong_sampled_row(op, monkeypatch):
    importlib.import_module(f"megalodon_kernels.ops.{op}")
    harness = _harness(op)
    case = harness.make_case(SMALL[op], torch.float32, torch.device("cpu"), 0)
    outputs = {n: torch.from_numpy(np.array(v)) for n, v in harness.reference(case).items()}
    monkeypatch.setattr(harness_pkg, "REFERENCE_BUDGET", 1.0)
    sampled = harness.reference(case)
    assert tuner.rel_error(outputs, sampled) == 0.0
    name = next(iter(sampled))
    bad = outputs[name].clone()
    bad[sampled[name].index] += 1.0  # wrong exactly where the check looks
    assert tuner.rel_error({**outputs, name: bad}, sampled) > 0.1
