"""Ahead-of-time pruning of Triton configs in the tuner (issue: configs that do not compile or
do not fit shared memory for the target arch are pruned before they are timed).

``bench.aot.config_problems`` compiles every kernel variant one config launches for one arch
(spawned workers, no GPU); ``autotune.tuning.harness.triton_prune`` is the harness hook that asks
it for Triton candidates on CUDA devices; the tuner records such candidates as ``pruned``."""
import importlib

import pytest
import torch

from megalodon_kernels.autotune import registry
from megalodon_kernels.autotune.tuning import tuner
from megalodon_kernels.autotune.tuning.harness import triton_prune
from megalodon_kernels.bench import aot

ROTARY_DEFAULT = {"block_rows": 16, "block_pairs": 64, "num_warps": 4}


@pytest.fixture(autouse=True)
def fresh_problem_cache(monkeypatch):
    monkeypatch.setattr(aot, "_PROBLEMS", {})


@pytest.mark.parametrize("op", aot.TRITON_OPS)
def test_one_config_selects_a_nonempty_subset_of_the_variants(op):
    importlib.import_module(f"megalodon_kernels.ops.{op}")
    space = registry.get(op).space["triton"]
    every = {v.label + v.kernel for v in aot.all_variants((op,))}
    seen = set()
    for backend, config in registry.get(op).candidates():
        if backend != "triton":
            continue
        chosen = {v.label + v.kernel for v in aot.all_variants((op,), tuple(sorted(config.items())))}
        assert chosen and chosen <= every, f"{op} {config}"
        seen |= chosen
    assert seen == every, f"{op}: variants no registered config launches: {sorted(every - seen)[:3]}"
    assert set(space) == set(importlib.import_module(f"megalodon_kernels.ops.{op}.triton_impl").DEFAULT_CONFIG)


def test_config_problems_names_every_failing_variant(monkeypatch):
    variants = aot.all_variants(("rotary",), tuple(sorted(ROTARY_DEFAULT.items())))
    assert len(variants) == 3  # fp16, bf16, fp32
    limit = aot.SMEM_LIMIT[80]
    fake = [("rotary", 0, 80, (40, 1024, 0), None),          # fine
            ("rotary", 1, 80, (40, limit + 16, 0), None),    # shared memory does not fit
            ("rotary", 2, 80, None, "CompilationError: boom")]  # does not compile
    calls = []
    monkeypatch.setattr(aot, "_run_jobs", lambda jobs, workers=None: calls.append(jobs) or fake)
    problems = aot.config_problems("rotary", ROTARY_DEFAULT, 80)
    assert len(problems) == 2
    assert f"{limit + 16} B shared memory > {limit} B on sm_80" in problems[0] and variants[1].label in problems[0]
    assert "does not compile for sm_80: CompilationError: boom" in problems[1]
    assert aot.config_problems("rotary", ROTARY_DEFAULT, 80) == problems and len(calls) == 1  # cached
    fake[0] = ("rotary", 0, 80, (255, 1024, 96), None)
    assert any("spills 96 B" in p for p in aot.config_problems("rotary", ROTARY_DEFAULT, 90))
    with pytest.raises(ValueError, match="cc must be one of"):
        aot.config_problems("rotary", ROTARY_DEFAULT, 75)


def test_hook_asks_only_for_triton_on_a_known_cuda_arch(monkeypatch):
    asked = []
    monkeypatch.setattr(aot, "config_problems", lambda op, config, cc: asked.append((op, cc)) or ["no"])
    prune = triton_prune("rotary")
    a100 = {"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}
    h100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
    assert prune("torch", {}, {}, "float32", a100) == []
    assert prune("triton", ROTARY_DEFAULT, {}, "float32", {"type": "cpu", "name": "x", "cores": 2}) == []
    assert prune("triton", ROTARY_DEFAULT, {}, "float32", {**a100, "capability": "7.5"}) == []  # no known limit
    assert prune("triton", ROTARY_DEFAULT, {}, "float32", a100) == ["no"]
    assert prune("triton", ROTARY_DEFAULT, {}, "bfloat16", h100) == ["no"]
    assert asked == [("rotary", 80), ("rotary", 90)]


def test_tuner_never_runs_a_pruned_candidate():
    import numpy as np

    ran = []

    def make_case(shape, dtype, device, seed):
        x = torch.randn(shape["B"], shape["L"], generator=torch.Generator().manual_seed(seed))
        return registry.Case(inputs={"x": x})

    def run(case, backend, config):
        ran.append((backend, dict(config)))
        registry.forced("fake_prune", case.inputs)  # what a dispatcher does under the tuner's force()
        return {"y": case.inputs["x"] * 2}

    harness = registry.Harness(
        make_case=make_case, run=run, reference=lambda case: {"y": 2 * case.inputs["x"].double().numpy()},
        tolerance={"float32": 1e-6},
        prune=lambda backend, config, shape, dtype, ident: ["too big"] if config["block"] == 64 else [])
    tunable = registry.register("fake_prune", key=lambda x: {"L": registry.pow2_bucket(x.shape[1])},
                                space={"torch": {"block": [16, 64]}}, harness=harness, replace=True)
    try:
        _, entry = tuner.tune_shape(tunable, {"B": 2, "L": 8}, torch.float32, "cpu", budget_s=0.01)
    finally:
        registry.unregister("fake_prune")
    status = {c["config"]["block"]: (c["status"], c["note"]) for c in entry["candidates"]}
    assert status[64] == ("pruned", "too big") and status[16][0] == "ok"
    assert all(cfg["block"] == 16 for _, cfg in ran) and ran
    assert entry["winner"] == {"backend": "torch", "config": {"block": 16}}
    assert np.isfinite(entry["candidates"][0]["p20_s"])


def test_real_compile_of_one_config_for_sm80():
    # Spawned workers compile rotary's three dtype variants of the default config with
    # triton.compile for GPUTarget("cuda", 80, 32): they fit and do not spill.
    assert aot.config_problems("rotary", ROTARY_DEFAULT, 80) == []
