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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "bench"], choices=["tiny", "bench"])
    ap.add_argument("--points", type=int, nargs="+", default=[1, 1000, 10000, 100000])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--piece", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
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


if __name__ == "__main__":
    main()
