"""CPU training step of the bench model, eager or compiled: wall time and the profiler's non-GEMM share.

The bench model: vocab 1000, model_dim 256, 2 layers, 1 head, z_dim 64, value_dim 512, FFN 640,
cema_ndim 16, chunk 256, 32 TimestepNorm groups, fp32, no dropout; one step = forward,
cross-entropy, backward over B=2 sequences of L=4096 tokens (the optimizer is left out).

    python bench/cpu_step.py [--B 2 --L 4096] [--steps 3] [--threads N] [--top 25] [--compile]
                             [--loss fused|naive] [--out bench/results/cpu_step.md]

``--loss fused`` (the default) takes the loss from ``model(tokens, labels=targets)``: the output
projection and the cross-entropy fused block by block (model/loss.py), so the (B L, V) logits,
their log-softmax and the zero-filled logits gradient are never formed. ``--loss naive`` is the
unfused path, ``F.cross_entropy(model(tokens), targets)``, for comparison; both give the same
loss and gradients.

``--compile`` runs the step through ``torch.compile(model, fullgraph=True)`` (inductor; the
library's ops stay opaque custom-op nodes, the elementwise glue around them is fused); the first
warm-up step compiles and its time is reported apart.

Measures, after two warm-up steps:

* wall time: median (min-max) of ``--timed`` unprofiled steps, and their CPU time (user, system)
  and minor page faults (getrusage), which a busy shared machine disturbs less than wall time;
* the torch profiler's SELF CPU time of every op in each of ``--steps`` profiled steps. The
  GEMM share is the self time of the dense-matmul ops in ``GEMM_OPS`` (the BLAS kernels
  ``aten::mm``/``bmm``/``addmm``/``baddbmm``/``addbmm`` and their in-place forms, and the
  ``matmul``/``linear`` wrappers around them, whose own self time is their dispatch); everything else (elementwise ops,
  reductions, copies, fills, FFTs, custom-op bodies, autograd bookkeeping) is non-GEMM.
  non-GEMM share = (total self time - GEMM self time) / total self time, per step; the
  reported value is the median over the profiled steps. Python time between ops is in no op's
  self time, so the profile's total is below the wall time (both are printed).

The table lists the non-GEMM ops with the largest self time (median step), with call counts.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megalodon_kernels.autotune.device import cpu_model
from megalodon_kernels.model import Megalodon, MegalodonConfig

#: Ops whose self time counts as dense matrix multiplication (the in-place forms too: the fused
#: loss accumulates its weight gradient with ``addmm_``).
GEMM_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
                      "aten::addmm_", "aten::baddbmm_", "aten::addbmm_", "aten::matmul", "aten::linear"})

VOCAB = 1000


def bench_config() -> MegalodonConfig:
    return MegalodonConfig(num_layers=2, model_dim=256, num_heads=1, z_dim=64, value_dim=512,
                           ffn_hidden_dim=640, cema_ndim=16, chunk_size=256, norm_num_groups=32,
                           vocab_size=VOCAB, dropout=0.0, hidden_dropout=0.0, attention_dropout=0.0)


LOSSES = ("fused", "naive")


def train_step(model, tokens, loss: str = "fused"):
    model.zero_grad(set_to_none=True)
    if loss == "fused":
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    else:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def owner(event) -> str:
    """The library op an event runs under (its nearest ``megalodon_kernels`` ancestor: the op's
    custom op or its autograd node), as "<op> fwd" / "<op> bwd", or "model glue" (linears, norms,
    gates, loss, autograd bookkeeping)."""
    e = event
    while e is not None:
        m = re.search(r"megalodon_kernels(?:::|_)(\w+?)(?:_default)?(Backward)?$", e.name)
        if m:
            op = m.group(1)
            bwd = m.group(2) is not None or op.endswith("_bwd")
            return f"{op.removesuffix('_bwd')} {'bwd' if bwd else 'fwd'}"
        e = e.cpu_parent
    return "model glue"


def profiled_step(model, tokens, loss: str = "fused"):
    """(op name -> (self CPU seconds, calls), owner -> (self seconds, GEMM self seconds)) of one step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, tokens, loss)
    by_owner = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        row = by_owner[owner(e)]
        row[0] += e.self_cpu_time_total * 1e-6
        if e.name in GEMM_OPS:
            row[1] += e.self_cpu_time_total * 1e-6
    return {e.key: (e.self_cpu_time_total * 1e-6, e.count) for e in prof.key_averages()}, dict(by_owner)


def split(ops: dict[str, tuple[float, int]]) -> tuple[float, float]:
    """(total self seconds, GEMM self seconds)."""
    total = sum(t for t, _ in ops.values())
    gemm = sum(t for name, (t, _) in ops.items() if name in GEMM_OPS)
    return total, gemm


def machine_load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average %.2f, %.2f, %.2f" % os.getloadavg()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--timed", type=int, default=3, help="unprofiled timed steps")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    ap.add_argument("--loss", choices=LOSSES, default="fused",
                    help="fused: model(tokens, labels=...) (model/loss.py); naive: F.cross_entropy of the logits")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = machine_load()
    torch.manual_seed(0)
    model = Megalodon(bench_config()).train()
    if args.compile:
        model = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, VOCAB, (args.B, args.L + 1))
    t0 = time.perf_counter()
    train_step(model, tokens, args.loss)
    first_step = time.perf_counter() - t0
    train_step(model, tokens, args.loss)
    profiled_step(model, tokens, args.loss)  # the profiler's own first-use cost stays out of the measured steps

    walls, cpus, faults = [], [], []
    for _ in range(args.timed):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        train_step(model, tokens, args.loss)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        walls.append(t1 - t0)
        cpus.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
        faults.append(r1.ru_minflt - r0.ru_minflt)
    profiles = [profiled_step(model, tokens, args.loss) for _ in range(args.steps)]
    load_after = machine_load()

    shares = []
    for ops, _ in profiles:
        total, gemm = split(ops)
        shares.append(((total - gemm) / total, total, gemm))
    median_share = statistics.median(s for s, _, _ in shares)
    mid = sorted(range(len(shares)), key=lambda i: shares[i][0])[len(shares) // 2]
    (ops, by_owner), (share, total, gemm) = profiles[mid], shares[mid]

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    cmd = (f"python bench/cpu_step.py --B {args.B} --L {args.L} --steps {args.steps} --timed {args.timed} "
           f"--threads {args.threads} --loss {args.loss}" + (" --compile" if args.compile else ""))
    mode = "Compiled (torch.compile, fullgraph)" if args.compile else "Eager"
    lines = [
        f"# {mode} CPU training step: time and non-GEMM share",
        "",
        f"`{cmd}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
        f"torch {torch.__version__}, {platform.machine()} {cpu_model()}, {args.threads} threads.",
        "",
        f"- `uptime` before: `{load_before}`",
        f"- `uptime` after: `{load_after}`",
        "",
        "Model: vocab 1000, model_dim 256, 2 layers, 1 head, z_dim 64, value_dim 512, FFN 640, cema_ndim 16, "
        f"chunk 256, 32 norm groups, fp32, no dropout; B={args.B}, L={args.L}; step = forward + "
        + ("fused output projection and cross-entropy (`model(tokens, labels=targets)`, model/loss.py)"
           if args.loss == "fused" else "`F.cross_entropy` of the logits")
        + " + backward. non-GEMM share = 1 - (self CPU time of "
        + ", ".join(f"`{n}`" for n in sorted(GEMM_OPS)) + ") / (self CPU time of all ops), torch profiler.",
        "",
        f"- first step (warm-up{', includes compiling' if args.compile else ''}): {first_step:.1f} s",
        f"- wall time per step (unprofiled): median {statistics.median(walls) * 1e3:.0f} ms "
        f"(min {min(walls) * 1e3:.0f}, max {max(walls) * 1e3:.0f}) over {len(walls)} steps",
        f"- CPU time per step of this process (median): user {statistics.median(u for u, _ in cpus) * 1e3:.0f} ms, "
        f"system {statistics.median(t for _, t in cpus) * 1e3:.0f} ms; minor page faults per step "
        f"{statistics.median(faults):.0f} (fresh pages of large temporaries: glibc returns freed large "
        "blocks to the kernel, so the next allocation faults them in again)",
        f"- **non-GEMM share: {median_share:.3f}** (median of {len(shares)} profiled steps: "
        + ", ".join(f"{s:.3f}" for s, _, _ in shares) + ")",
        f"- median step: profiled self time {total * 1e3:.0f} ms, of which GEMM {gemm * 1e3:.0f} ms, "
        f"non-GEMM {(total - gemm) * 1e3:.0f} ms",
        "",
        "Self CPU time of the median step by where it runs (a library op's forward or backward, "
        "or the model glue around the ops):",
        "",
        "| where | self ms | share of step | of which GEMM ms | non-GEMM ms |",
        "|---|---|---|---|---|",
    ]
    for name, (t, g) in sorted(by_owner.items(), key=lambda kv: -kv[1][0]):
        if t >= 0.001 * total:
            lines.append(f"| {name} | {t * 1e3:.1f} | {t / total:.3f} | {g * 1e3:.1f} | {(t - g) * 1e3:.1f} |")
    lines += [
        "",
        "Top non-GEMM ops of the median step (self CPU time):",
        "",
        "| op | self ms | share of step | calls |",
        "|---|---|---|---|",
    ]
    rest = sorted(((t, c, name) for name, (t, c) in ops.items() if name not in GEMM_OPS), reverse=True)
    for t, c, name in rest[:args.top]:
        lines.append(f"| `{name}` | {t * 1e3:.1f} | {t / total:.3f} | {c} |")
    lines += ["", "GEMM ops of the median step:", "", "| op | self ms | share of step | calls |", "|---|---|---|---|"]
    for name in sorted(GEMM_OPS & ops.keys(), key=lambda n: -ops[n][0]):
        t, c = ops[name]
        lines.append(f"| `{name}` | {t * 1e3:.1f} | {t / total:.3f} | {c} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
