"""Compiled vs eager CPU training step of a Megalodon model at the bench ``cpu`` shape.

The model takes the widths of the ``cpu`` shape set (autotune/shapes.py: D=128, N=16, G=2, H=2,
dz=32, dv=64, chunk 256; 2048 tokens per step), 2 layers, vocabulary 256, fp32. One step =
forward, cross-entropy, backward (the optimizer is left out: it is the same for both). The
compiled model is ``torch.compile(model, fullgraph=True)`` (inductor): our ops stay opaque custom
op nodes, and the inductor fuses the elementwise glue around them (gates, norms, residuals).

    python bench/compile_step.py [--lengths 256 2048] [--steps 10] [--threads N] [--out bench/results/compile_step.md]

Reports per length the compile time (first compiled step) and the median, p20 and p80 of the
steady-state step times; eager and compiled steps alternate.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megalodon_kernels.autotune.shapes import SHAPE_SETS
from megalodon_kernels.model import Megalodon, MegalodonConfig


def cpu_config() -> MegalodonConfig:
    s = SHAPE_SETS["cpu"]
    return MegalodonConfig(num_layers=2, model_dim=s.D, num_heads=s.H, z_dim=s.H * s.dz, value_dim=s.H * s.dv,
                           ffn_hidden_dim=2 * s.D, cema_ndim=s.N, chunk_size=s.chunk, norm_num_groups=s.G,
                           vocab_size=256, dropout=0.0, hidden_dropout=0.0, attention_dropout=0.0)


def step(run, model, tokens):
    model.zero_grad(set_to_none=True)
    logits = run(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def measure(model, compiled, tokens, steps: int) -> tuple[float, list[float], list[float]]:
    """(first compiled step, eager step times, compiled step times); the steps alternate, so a
    change of load on a shared machine hits both sides alike."""
    t0 = time.perf_counter()
    step(compiled, model, tokens)  # compiles
    first = time.perf_counter() - t0
    step(model, model, tokens)
    step(compiled, model, tokens)
    eager, comp = [], []
    for _ in range(steps):
        for run, times in ((model, eager), (compiled, comp)):
            t0 = time.perf_counter()
            step(run, model, tokens)
            times.append(time.perf_counter() - t0)
    return first, eager, comp


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--tokens", type=int, default=SHAPE_SETS["cpu"].tokens)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Megalodon(cpu_config()).train()
    compiled = torch.compile(model, fullgraph=True)
    rows = []
    for L in args.lengths:
        B = max(1, args.tokens // L)
        tokens = torch.randint(0, 256, (B, L + 1))
        torch._dynamo.reset()
        first, eager, comp = measure(model, compiled, tokens, args.steps)
        e, c = statistics.median(eager), statistics.median(comp)
        rows.append((B, L, first, e, pct(eager, 0.2), pct(eager, 0.8), c, pct(comp, 0.2), pct(comp, 0.8), e / c))
        print(f"B={B} L={L}: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms (x{e / c:.2f}), "
              f"first compiled step {first:.1f} s", flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    lines = [
        "# Compiled vs eager training step (CPU)",
        "",
        f"`python bench/compile_step.py --lengths {' '.join(map(str, args.lengths))} --steps {args.steps} "
        f"--threads {args.threads}`, {datetime.date.today()}, commit {commit}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {args.threads} threads (a shared 2-core machine: "
        f"another job may have been running: 1-minute load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after).",
        "",
        "Model: the bench `cpu` shape (D=128, N=16, G=2, H=2, z_dim=64, value_dim=128, chunk 256, FFN 256), "
        "2 layers, vocab 256, fp32; one step = forward + cross-entropy + backward over "
        f"{args.tokens} tokens. Compiled: `torch.compile(model, fullgraph=True)` (inductor). "
        "Times in ms: median (p20-p80) of the steady-state steps, eager and compiled alternating.",
        "",
        "| B | L | eager | compiled | speedup | first compiled step (compile) |",
        "|---|---|---|---|---|---|",
    ]
    for B, L, first, e, e20, e80, c, c20, c80, sp in rows:
        lines.append(f"| {B} | {L} | {e * 1e3:.1f} ({e20 * 1e3:.1f}-{e80 * 1e3:.1f}) | "
                     f"{c * 1e3:.1f} ({c20 * 1e3:.1f}-{c80 * 1e3:.1f}) | x{sp:.2f} | {first:.1f} s |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
