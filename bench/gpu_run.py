"""``python -m megalodon_kernels.bench gpu --out DIR [--budget-s 480] [--dry]``: the GPU acceptance run.

On a machine with an NVIDIA GPU and no network, within the budget and in this order (each step
timed; skipped with a note when the budget left is below the step's minimum; a failing step is
reported and the run goes on):

  env        versions, device, clocks, measured device-to-device copy bandwidth, fp32/bf16 matmul TFLOP/s
  nvrtc      every CUDA kernel compiled for the device in parallel, into the NVRTC disk cache
  selfcheck  ``python -m megalodon_kernels``: every op x backend x dtype against its reference
  tests      the ``gpu``-marked tests (tests/test_gpu.py)
  ops        forward / backward / forward+backward of the cuda, triton and torch backends at the
             device's paper-7B shapes: time, achieved bandwidth of the ideal bytes vs the measured copy peak
  model      training step (tokens/s, peak memory, non-GEMM share) and decode tokens/s of the bench
             Megalodon and of the matched Transformer (bench/vs_transformer.py) at 4K / 16K / 64K tokens
  upstream   upstream Megalodon's CUDA extension vs the cuda / triton / torch backends at the 7B and
             probe shapes (bench/vs_upstream.py), and the 7B-width training step of Megalodon vs the
             matched Transformer at 4K / 32K tokens beside the paper's ratios (bench/gpu_upstream_step.py;
             upstream rows skipped with the reason when $MEGALODON_UPSTREAM / .upstream has no loadable module)
  autotune   ``autotune regenerate`` with a reduced budget, the table written into DIR/autotune/

then writes DIR/gpu_run.json, DIR/gpu_run.md, the PNG plots (matplotlib: the ``bench`` extra) and
prints a one-screen summary. ``--dry`` runs the same pipeline on the CPU (Triton interpreter, CUDA
emulator, tiny shapes, a few kernels compiled for sm_90) so that CI keeps it working. Exit status:
0 when every step ran and none failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

#: (name, function name in gpu_steps or "module:function" of a bench module, share of the budget it may
#: take, minimum seconds to start it)
STEPS = (
    ("env", "step_env", 0.05, 5),
    ("nvrtc", "step_nvrtc", 0.10, 10),
    ("selfcheck", "step_selfcheck", 0.15, 20),
    ("tests", "step_tests", 0.30, 20),
    ("ops", "step_ops", 0.20, 15),
    ("model", "step_model", 0.15, 15),
    ("upstream", "gpu_upstream_step:step_upstream", 0.20, 20),
    ("autotune", "step_autotune", 0.15, 15),
)
STEP_NAMES = tuple(s[0] for s in STEPS)
#: seconds kept for writing the report at the end
REPORT_RESERVE_S = 5.0


def _leave_checkout_root() -> str | None:
    """The checkout root is the package; a process started there has it on sys.path, where its
    ``cuda/`` folder shadows the ``cuda`` package CuPy imports (in this process and in the steps'
    subprocesses, which inherit the folder). Started there, move to a fresh folder and drop the
    root from sys.path (the package itself is imported through its parent or an install, never
    through the root). Returns a note to print, or None when started elsewhere."""
    here = Path.cwd().resolve()
    if not ((here / "cuda" / "nvrtc.py").exists() and (here / "ops").is_dir()):
        return None
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    work = tempfile.mkdtemp(prefix="megalodon-gpu-run-")
    os.chdir(work)
    return (f"started in the checkout root {here}, whose cuda/ folder shadows the cuda package CuPy needs: "
            f"running from {work} instead")


def run_steps(out: Path, budget_s: float, dry: bool, only=None) -> dict:
    import torch

    from . import gpu_steps

    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if dry:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    run = gpu_steps.Run(out=out, dry=dry, deadline=t_start + budget_s - REPORT_RESERVE_S, device=device)
    # the asked steps share the whole budget: their shares scaled by the part of all shares they hold
    scale = (sum(s[2] for s in STEPS) / sum(s[2] for s in STEPS if s[0] in only)) if only else 1.0
    for name, fn_name, share, min_s in STEPS:
        share *= scale
        rec = dict(name=name, status="skipped", seconds=0.0, summary=[], files=[])
        run.results[name] = rec
        if only and name not in only:
            rec["summary"] = ["not asked for (--steps)"]
            continue
        left = run.left()
        if left < min_s:
            rec["summary"] = [f"skipped: {left:.0f} s of the budget left, the step needs {min_s} s to start"]
            print(f"[{name}] {rec['summary'][0]}", flush=True)
            continue
        limit = min(left, max(min_s, share * budget_s))
        print(f"[{name}] running (limit {limit:.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            mod_name, _, func = fn_name.rpartition(":")
            module = importlib.import_module(f"{__package__}.{mod_name}") if mod_name else gpu_steps
            res = getattr(module, func)(run, limit)
            rec.update({k: v for k, v in res.items() if k not in ("failed", "skipped")})
            rec["status"] = "failed" if res.get("failed") else ("skipped" if res.get("skipped") else "ok")
        except Exception as exc:
            rec["status"] = "failed"
            rec["summary"] = [f"{type(exc).__name__}: {str(exc)[:300]}"]
            rec["traceback"] = traceback.format_exc()[-4000:]
        rec["seconds"] = time.perf_counter() - t0
        rec["limit_s"] = limit
        for line in rec["summary"]:
            print(f"  {line}", flush=True)
    report = dict(command=" ".join(["python -m megalodon_kernels.bench gpu", "--out", str(out),
                                    "--budget-s", f"{budget_s:g}"] + (["--dry"] if dry else [])),
                  out=str(out), dry=dry, budget_s=budget_s, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  steps=[{k: v for k, v in r.items() if k != "data"} for r in run.results.values()],
                  data={k: r.get("data") for k, r in run.results.items()})
    from . import gpu_report

    report["plots"], plot_note = gpu_report.plots(report, out)
    report["total_s"] = time.perf_counter() - t_start
    (out / "gpu_run.json").write_text(json.dumps(report, indent=1, default=str))
    # a step may bring its own report section (data["markdown"]), appended after the common ones
    sections = [d["markdown"] for d in report["data"].values() if isinstance(d, dict) and d.get("markdown")]
    (out / "gpu_run.md").write_text("\n".join([gpu_report.markdown(report, plot_note)] + sections))
    print("\n".join(gpu_report.summary(report, plot_note)))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megalodon_kernels.bench gpu",
                                 description=__doc__.splitlines()[0].split(": ", 1)[-1])
    ap.add_argument("--out", required=True, type=Path, help="folder for the report, the plots and the logs")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget in seconds (default 480; 120 with --dry)")
    ap.add_argument("--dry", action="store_true",
                    help="on the CPU: Triton interpreter, CUDA emulator, tiny shapes (CI)")
    ap.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=None, help="run only these steps")
    a = ap.parse_args(argv)
    budget = a.budget_s if a.budget_s is not None else (120.0 if a.dry else 480.0)
    if budget <= REPORT_RESERVE_S:
        ap.error(f"--budget-s must be more than {REPORT_RESERVE_S:g} s")
    # before Triton is imported anywhere in this process: the dry run interprets, the real one compiles
    os.environ["TRITON_INTERPRET"] = "1" if a.dry else "0"
    if not a.dry:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible to torch (torch " + torch.__version__ + ", CUDA build: "
                  + str(torch.version.cuda) + "): run it on a GPU machine, or --dry for the CPU rehearsal",
                  file=sys.stderr)
            return 2
    a.out = a.out.resolve()  # before leaving the checkout root: --out is relative to where it was started
    note = _leave_checkout_root()
    if note:
        print(note, file=sys.stderr)
    report = run_steps(a.out, budget, a.dry, a.steps)
    return 0 if all(s["status"] == "ok" or (a.steps and s["name"] not in a.steps) for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
