"""``python -m megalodon_kernels.bench gpu`` (bench/gpu_run.py): its dry run on the CPU runs every step
and writes every file; the budget skips steps with a note; a failing step is reported and the run goes
on; the matched Transformer of bench/vs_transformer.py (parameter count, cached decoding)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalodon_kernels.bench import gpu_run, gpu_steps, vs_transformer

ROOT = Path(gpu_run.__file__).resolve().parent.parent


def test_dry_run_runs_every_step_and_writes_its_files(tmp_path):
    """The whole pipeline on the CPU (Triton interpreter, emulator, tiny shapes); the budget is large so
    that a loaded machine does not turn a step into a budget skip: each step must end "ok"."""
    out = tmp_path / "run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "megalodon_kernels.bench", "gpu", "--dry", "--out", str(out),
                        "--budget-s", "1200"], cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    print(r.stdout[-6000:], r.stderr[-3000:])
    report = json.loads((out / "gpu_run.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {name: "ok" for name in gpu_run.STEP_NAMES}, status
    assert r.returncode == 0
    for s in report["steps"]:
        assert s["files"], s["name"]
        for f in s["files"]:
            assert (out / f).stat().st_size > 0, f
    ops = report["data"]["ops"]
    timed = {(row["op"], row["provider"]) for row in ops["rows"]}
    assert {op for op, _ in timed} == set(gpu_steps.OPS)
    assert {p for _, p in timed} >= {"torch", "triton"}
    assert all(row["median"] > 0 and row["ideal_bytes"] > 0 for row in ops["rows"])
    model = report["data"]["model"]
    assert {r["kind"] for r in model["train"]} == {"megalodon", "transformer"}
    assert {r["kind"] for r in model["decode"]} == {"megalodon", "transformer"}
    assert report["data"]["tests"]["counts"].get("skipped", 0) > 0  # no CUDA here: the gpu tests skip
    md = (out / "gpu_run.md").read_text()
    for name in gpu_run.STEP_NAMES:
        assert f"| {name} | ok |" in md
    try:
        import matplotlib  # noqa: F401  (only whether it imports)
    except ImportError:
        assert not report["plots"]
    else:
        assert set(report["plots"]) == {"gpu_ops.png", "gpu_roofline.png", "gpu_model.png"}
    assert "=" * 100 in r.stdout  # the one-screen summary


def test_a_short_budget_skips_steps_with_a_note(tmp_path):
    report = gpu_run.run_steps(tmp_path, budget_s=gpu_run.REPORT_RESERVE_S + 1, dry=True)
    for s in report["steps"]:
        assert s["status"] == "skipped" and "of the budget left" in s["summary"][0], s
    assert (tmp_path / "gpu_run.md").exists() and (tmp_path / "gpu_run.json").exists()


def test_started_in_the_checkout_root_it_moves_away_and_cupy_loads(tmp_path):
    """The GPU sessions' script runs the command in the checkout root, whose cuda/ folder shadows
    the cuda package CuPy imports: the command leaves that folder (and sys.path) and its NVRTC step,
    which imports CuPy in a subprocess, runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "megalodon_kernels.bench", "gpu", "--dry", "--steps", "nvrtc",
                        "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert f"started in the checkout root {ROOT}" in r.stderr, r.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "gpu_run.json").read_text())
    nvrtc = next(s for s in report["steps"] if s["name"] == "nvrtc")
    assert nvrtc["status"] == "ok" and " 0 failed" in nvrtc["summary"][0], nvrtc
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_failing_step_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(run, limit_s):
        raise RuntimeError("device lost")

    monkeypatch.setattr(gpu_steps, "step_env", broken)
    monkeypatch.setattr(gpu_steps, "step_nvrtc", lambda run, limit_s: dict(summary=["fine"], files=[]))
    report = gpu_run.run_steps(tmp_path, budget_s=300, dry=True, only=("env", "nvrtc"))
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["env"]["status"] == "failed" and "device lost" in steps["env"]["summary"][0]
    assert steps["nvrtc"]["status"] == "ok"
    assert "device lost" in (tmp_path / "gpu_run.md").read_text()


def test_the_asked_steps_share_the_whole_budget(tmp_path, monkeypatch):
    limits = {}
    for name in ("step_tests", "step_ops"):
        monkeypatch.setattr(gpu_steps, name, lambda run, limit_s, _n=name: (limits.__setitem__(_n, limit_s),
                                                                           dict(summary=["fine"], files=[]))[1])
    gpu_run.run_steps(tmp_path, budget_s=300, dry=True, only=("tests", "ops"))
    shares = {n: sh for n, _f, sh, _m in gpu_run.STEPS}
    total = sum(shares.values())
    # tests and ops hold 0.5 of the shares' 1.3: scaled by 2.6, as if they were all there was
    assert limits["step_tests"] == pytest.approx(300 * shares["tests"] * total / (shares["tests"] + shares["ops"]))
    assert limits["step_ops"] > 300 * shares["ops"]


def test_without_a_gpu_the_real_run_refuses_with_a_reason(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    # main() sets TRITON_INTERPRET for its own process; monkeypatch puts this process's value back
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    assert gpu_run.main(["--out", str(tmp_path)]) == 2
    assert "--dry" in capsys.readouterr().err


def test_the_transformer_matches_the_parameter_count():
    m, t = vs_transformer.build("megalodon"), vs_transformer.build("transformer")
    assert abs(vs_transformer.n_params(t) - vs_transformer.n_params(m)) <= 1e-3 * vs_transformer.n_params(m)
    assert len(t.layers) == m.config.num_layers and t.embed.weight.shape == m.embed.weight.shape


def test_the_transformer_decodes_with_its_cache_as_its_full_forward():
    model = vs_transformer.build("transformer").eval()
    tokens = torch.randint(0, vs_transformer.VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.init_cache()
        parts = [model(tokens[:, :30], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(30, 40)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4 * full.abs().max().item()
    with pytest.raises(ValueError, match="one token"):
        model(tokens[:, :2], cache=cache)


def test_the_transformer_loss_is_the_fused_cross_entropy():
    model = vs_transformer.build("transformer")
    tokens = torch.randint(0, vs_transformer.VOCAB, (2, 65), generator=torch.Generator().manual_seed(1))
    fused = model(tokens[:, :-1], labels=tokens[:, 1:])
    naive = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(fused.item() - naive.item()) <= 1e-5 * naive.item()
