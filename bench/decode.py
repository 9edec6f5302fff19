"""CPU decoding speed of ``Megalodon.generate``: prefill and per-token, from token 1 to token 100k.

    python bench/decode.py [--models tiny bench] [--points 1 1000 10000 100000] [--threads N] [--out bench/results/decode.md]

Models: the ``tiny`` preset (vocab 256) and the bench model of bench/cpu_step.py (vocab 1000,
model_dim 256, 2 layers, 1 head, z_dim 64, value_dim 512, FFN 640, cema_ndim 16, chunk 256,
32 norm groups), fp32, eval mode, batch 1, greedy.

* ``generate``: one call with a ``--prompt``-token prompt and ``--new`` new tokens; tokens/s of
  the prefill (the prompt through the cache) and of the new tokens (the rest of the call).
* per-token latency at position p: ONE real stream is run to each point in turn. It is advanced
  to p by prefilling in pieces of ``--piece`` tokens (the model streams with a constant-size
  cache, so reaching 100k tokens costs a prefill, not 100k decode steps; the pieces' tokens/s is
  the "prefill" column), then a window of one attention chunk of tokens is decoded one at a time
  exactly as ``generate`` does (forward of the last token with the cache, argmax). A full chunk
  covers every number of cached keys once, so windows at different points are comparable. The
  largest cache size in the window (bytes) shows that it does not grow with the position.

``--serving`` measures instead (bench/results/decode_serving.md): tokens/s of ragged batches of
``--batches`` prompts (random lengths in ``--prompt-range``) decoded together against the same
prompts one by one; and at batch 1 the per-token latency (wall and thread CPU time) and ATen calls
of the general streaming path (the ops per layer), the fixed-shape step eager (``model.decode``)
and the same step compiled (``StaticDecoder(..., compile={"backend": --compile})``, fullgraph).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from megalodon_kernels.autotune.device import cpu_model
from megalodon_kernels.model import Megalodon, get_config
from megalodon_kernels.model.decode import StaticDecoder

sys.path.insert(0, str(Path(__file__).parent))
from cpu_step import VOCAB, bench_config, machine_load  # noqa: E402


def build(name: str) -> Megalodon:
    cfg = get_config("tiny") if name == "tiny" else bench_config()
    torch.manual_seed(0)
    return Megalodon(cfg).eval()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@torch.no_grad()
def generate_speed(model, prompt_len: int, new: int):
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len))
    model.generate(prompt[:, :8], 4, greedy=True)  # warm-up
    cache = model.init_cache(1)
    t0 = time.perf_counter()
    model(prompt, cache=cache)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(prompt, new, greedy=True)
    total = time.perf_counter() - t0
    assert out.shape == (1, prompt_len + new)
    return prompt_len / prefill, new / max(total - prefill, 1e-9), total


@torch.no_grad()
def latency_points(model, points: list[int], piece: int):
    """[(position, prefill tokens/s to get there, per-token ms list, cache bytes)] along one stream."""
    vocab, C = model.config.vocab_size, model.config.chunk_size
    gen = torch.Generator().manual_seed(1)
    cache = model.init_cache(1)
    logits = model(torch.randint(0, vocab, (1, 1), generator=gen), cache=cache)[:, -1]
    rows = []
    for p in points:
        todo = p - cache.num_tokens
        t0 = time.perf_counter()
        while todo > 0:
            n = min(piece, todo)
            logits = model(torch.randint(0, vocab, (1, n), generator=gen), cache=cache)[:, -1]
            todo -= n
        prefill_rate = (p - 1 if not rows else p - rows[-1][0] - C) / max(time.perf_counter() - t0, 1e-9)
        start = cache.num_tokens
        lat, nbytes = [], 0
        for _ in range(C):
            t0 = time.perf_counter()
            nxt = logits.argmax(-1)
            logits = model(nxt[:, None], cache=cache)[:, -1]
            lat.append(time.perf_counter() - t0)
            nbytes = max(nbytes, cache.nbytes())
        rows.append((start, prefill_rate, lat, nbytes))
    return rows


# ---- serving: ragged batches, the static step, ATen calls ------------------------------------
def ragged_prompts(n: int, vocab: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
            for _ in range(n)]


@torch.no_grad()
def batched_tokens_per_s(model, prompts, new: int):
    """(decode tokens/s, end-to-end tokens/s incl. the packed prefill) of all prompts together."""
    t0 = time.perf_counter()
    cache, logits = model.prefill(prompts)
    t1 = time.perf_counter()
    for _ in range(new - 1):
        logits = model.decode(logits.argmax(-1), cache)
    t2 = time.perf_counter()
    B = len(prompts)
    return B * (new - 1) / (t2 - t1), B * new / (t2 - t0)


@torch.no_grad()
def one_by_one_tokens_per_s(model, prompts, new: int):
    dec = total = 0.0
    for p in prompts:
        t0 = time.perf_counter()
        cache, logits = model.prefill([p])
        t1 = time.perf_counter()
        for _ in range(new - 1):
            logits = model.decode(logits.argmax(-1), cache)
        t2 = time.perf_counter()
        dec += t2 - t1
        total += t2 - t0
    return len(prompts) * (new - 1) / dec, len(prompts) * new / total


@torch.no_grad()
def general_step(model, cache, tokens):
    """One token through the general streaming path (the ``megalodon_kernels.ops`` custom ops per
    layer, the path every streamed token took before the fixed-shape step): the reference for
    'before'. All rows must share their chunk position."""
    x = model.embed(tokens[:, None])
    if model.emb_scale is not None:
        x = x * model.emb_scale
    offset = cache.chunk_offset
    for layer, state in zip(model.layers, cache.layers):
        x = layer.nffn(layer.mega._continue(x, state, offset, None), x)
    x, count, mean, var = model.output.final_norm(x, cache.norm_count, cache.norm_mean, cache.norm_var)
    cache.norm_count.copy_(count)
    cache.norm_mean.copy_(mean)
    cache.norm_var.copy_(var)
    cache.lengths.add_(1)
    return model.output.output(x)[:, -1].float()


def aten_calls(fn, steps: int = 4) -> float:
    """ATen operator calls per call of fn (every aten:: event the profiler records, nested ones
    included: the same rule before and after)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")) / steps


@torch.no_grad()
def step_latencies(model, prompt_len: int, steps: int, rounds: int, compile_backend: str):
    """Per-token latency at batch 1 of the general path, the eager static step and the compiled
    static step, interleaved round by round (the machine's load hits all three alike)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(5))
    caches = {}
    for name in ("general", "eager", "compiled"):
        caches[name], logits = model.prefill([prompt])
    tok = logits.argmax(-1)
    eager = StaticDecoder(model, caches["eager"])
    t0 = time.perf_counter()
    compiled = StaticDecoder(model, caches["compiled"], compile={"backend": compile_backend})
    compiled.step(tok)  # compiles
    compile_s = time.perf_counter() - t0
    runs = {"general": lambda: general_step(model, caches["general"], tok),
            "eager": lambda: eager.step(tok), "compiled": lambda: compiled.step(tok)}
    for fn in runs.values():  # warm-up
        fn()
    lat = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(steps):
                t, c = time.perf_counter(), time.thread_time()
                fn()
                lat[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
    calls = {name: aten_calls(fn) for name, fn in runs.items()}
    return lat, cpu, calls, compile_s


def serving(args) -> list:
    lines = []
    for name in args.models:
        model = build(name)
        vocab, C = model.config.vocab_size, model.config.chunk_size
        lo, hi = args.prompt_range
        lines += [f"## {name} model (chunk {C})", "",
                  f"Ragged prompts of {lo}-{hi} tokens (uniform), {args.serve_new} new tokens per prompt, greedy. "
                  "Batched: `model.prefill(prompts)` (one packed row) then `model.decode` for all rows together. "
                  f"One by one: the first {args.alone_max} of the same prompts, each prefilled and decoded alone "
                  "(batch 1). Decode tokens/s counts the tokens after the first (which comes from the prefill); "
                  f"end-to-end includes the prefill. Medians of {args.reps} alternating repetitions of both.", "",
                  "| batch | batched decode tok/s | one-by-one (batch 1) decode tok/s | speed-up | "
                  "batched end-to-end tok/s | one-by-one end-to-end tok/s | speed-up end-to-end |",
                  "|---|---|---|---|---|---|---|"]
        for B in args.batches:
            prompts = ragged_prompts(B, vocab, lo, hi, seed=B)
            alone = prompts[:max(1, min(B, args.alone_max))]
            batched_tokens_per_s(model, prompts[:2], 3)  # warm-up
            runs, runs1 = [], []
            for _ in range(args.reps):
                runs.append(batched_tokens_per_s(model, prompts, args.serve_new))
                runs1.append(one_by_one_tokens_per_s(model, alone, args.serve_new))
            dec, e2e = (statistics.median(r[i] for r in runs) for i in (0, 1))
            dec1, e2e1 = (statistics.median(r[i] for r in runs1) for i in (0, 1))
            lines.append(f"| {B} | {dec:.0f} | {dec1:.0f} | {dec / dec1:.1f}x | {e2e:.0f} | {e2e1:.0f} | "
                         f"{e2e / e2e1:.1f}x |")
            print(lines[-1], flush=True)
        lines.append("")
        lat, cpu, calls, compile_s = step_latencies(model, args.prompt_range[1], args.steps, args.rounds,
                                                    args.compile)
        med = {k: statistics.median(v) for k, v in lat.items()}
        mcpu = {k: statistics.median(v) for k, v in cpu.items()}
        lines += [f"Per-token latency at batch 1 ({args.rounds} interleaved rounds of {args.steps} tokens each; "
                  f"compiled = `StaticDecoder(model, cache, compile={{'backend': '{args.compile}'}})`, "
                  f"fullgraph, compiled in {compile_s:.0f} s). Wall clock, and the thread's CPU time (what the "
                  "step itself used: less sensitive to the other jobs taking the cores):", "",
                  "| step | median ms/token (wall) | p10-p90 (wall) | median CPU ms/token | ATen calls per token | "
                  "wall vs general | CPU vs general |",
                  "|---|---|---|---|---|---|---|"]
        labels = {"general": "general path (ops custom ops per layer: the path before)",
                  "eager": "static step, eager (`model.decode`)", "compiled": "static step, compiled"}
        for k in ("general", "eager", "compiled"):
            lines.append(f"| {labels[k]} | {med[k] * 1e3:.3f} | {pct(lat[k], 0.1) * 1e3:.3f}-"
                         f"{pct(lat[k], 0.9) * 1e3:.3f} | {mcpu[k] * 1e3:.3f} | {calls[k]:.0f} | "
                         f"{med[k] / med['general']:.2f} | {mcpu[k] / mcpu['general']:.2f} |")
            print(lines[-1], flush=True)
        lines += ["", f"Compiled vs eager static step: {med['eager'] / med['compiled']:.1f}x faster per token "
                  f"(CPU time {mcpu['eager'] / mcpu['compiled']:.1f}x); vs the general path: "
                  f"{med['general'] / med['compiled']:.1f}x (CPU time {mcpu['general'] / mcpu['compiled']:.1f}x).", ""]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "bench"], choices=["tiny", "bench"])
    ap.add_argument("--points", type=int, nargs="+", default=[1, 1000, 10000, 100000])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--piece", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serving", action="store_true",
                    help="instead: ragged batches vs one by one, and the static step eager vs compiled")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--serve-new", type=int, default=32)
    ap.add_argument("--alone-max", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", default="inductor", help="torch.compile backend of the static step")
    args = ap.parse_args()
    if sorted(args.points) != args.points or args.points[0] < 1:
        ap.error("--points must be ascending positions >= 1")
    torch.set_num_threads(args.threads)
    load_before = machine_load()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    if args.serving:
        return main_serving(args, load_before, commit)
    cmd = (f"python bench/decode.py --models {' '.join(args.models)} --points {' '.join(map(str, args.points))} "
           f"--prompt {args.prompt} --new {args.new} --piece {args.piece} --threads {args.threads}")
    lines = [
        "# CPU decoding: `generate` tokens/s and per-token latency up to 100k tokens",
        "",
        f"`{cmd}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
        f"torch {torch.__version__}, {platform.machine()} {cpu_model()}, {args.threads} threads, "
        "batch 1, fp32, greedy.",
        "",
        f"- `uptime` before: `{load_before}`",
    ]
    tables = []
    for name in args.models:
        model = build(name)
        pre, dec, total = generate_speed(model, args.prompt, args.new)
        print(f"{name}: generate prefill {pre:.0f} tok/s, decode {dec:.1f} tok/s", flush=True)
        rows = latency_points(model, args.points, args.piece)
        C = model.config.chunk_size
        t = [f"## {name} model (chunk {C})", "",
             f"`generate(prompt of {args.prompt}, max_new_tokens={args.new})`: prefill **{pre:.0f} tokens/s**, "
             f"new tokens **{dec:.1f} tokens/s** ({total:.2f} s for the call).", "",
             f"Per-token latency over a window of {C} decoded tokens (one chunk) starting at each position; "
             f"prefill = tokens/s of the {args.piece}-token pieces that advanced the stream to it.", "",
             "| position | median ms/token | p10-p90 | tokens/s | largest cache in the window (bytes) | prefill tokens/s |",
             "|---|---|---|---|---|---|"]
        for start, rate, lat, nbytes in rows:
            med = statistics.median(lat)
            t.append(f"| {start} | {med * 1e3:.2f} | {pct(lat, 0.1) * 1e3:.2f}-{pct(lat, 0.9) * 1e3:.2f} | "
                     f"{1 / med:.0f} | {nbytes} | {'-' if start <= 1 else f'{rate:.0f}'} |")
            print(t[-1], flush=True)
        tables += t + [""]
    lines += [f"- `uptime` after: `{machine_load()}`", ""] + tables
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)



def main_serving(args, load_before, commit):
    cmd = (f"python bench/decode.py --serving --models {' '.join(args.models)} --batches "
           f"{' '.join(map(str, args.batches))} --prompt-range {args.prompt_range[0]} {args.prompt_range[1]} "
           f"--serve-new {args.serve_new} --alone-max {args.alone_max} --reps {args.reps} --steps {args.steps} --rounds {args.rounds} "
           f"--compile {args.compile} --threads {args.threads}")
    body = serving(args)
    lines = ["# CPU serving: ragged batches, the static decode step, ATen calls per token", "",
             f"`{cmd}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
             f"torch {torch.__version__}, {platform.machine()} {cpu_model()}, {args.threads} threads, fp32.", "",
             "The machine was shared with other jobs (load below): absolute figures are noisy; the ratios within "
             "a table were measured in the same run (latencies interleaved round by round).", "",
             f"- `uptime` before: `{load_before}`", f"- `uptime` after: `{machine_load()}`", ""] + body
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
