"""Train a byte-level Megalodon on CPU on packed rows of real text: the Python standard library's sources.

Data. Every ``.py`` file of the standard library this Python runs from (the directory of the
``os`` module, walked recursively; third-party ``site-packages`` and the test suites, which some
distributions leave out, are skipped) is one document of raw bytes (vocabulary 256). A file longer
than ``--max-doc`` bytes is cut into consecutive pieces of ``--max-doc`` bytes, each a document of its
own (the longest sequence a training run would take). The split is by file and deterministic:
a file is held out when the CRC32 of its path relative to the library directory is 0 mod 10,
so the held-out files are never seen in training.

Training. Each step draws random training documents until the row holds ``--row-tokens`` bytes
(the last document cut to fit), lays them end to end with ``megalodon_kernels.model.pack`` and
runs ``model(tokens, cu_seqlens=cu)``: every document restarts the CEMA state, the TimestepNorm
statistics, the attention chunks and the rotary positions, exactly as if it were run alone, with
no padding. The loss predicts each byte from the bytes before it in its own document (never the
first byte of the next document).

Evaluation. Every ``--eval-every`` steps: bits per byte (cross-entropy in bits, averaged over every
predicted byte) on a fixed sample of held-out documents of ``--eval-bytes`` bytes, also packed.
Uniform guessing is 8 bits per byte.

    python examples/train_packed.py                      # about 4 minutes on one CPU core
    python examples/train_packed.py --minutes 10 --seed 1
    python examples/train_packed.py --steps 200          # a fixed number of steps (the same curve on every run)
    python examples/train_packed.py --smoke              # a few seconds: a tiny model, a few steps
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time
import zlib

import torch
import torch.nn.functional as F

from megalodon_kernels.model import Megalodon, get_config, pack

SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
IGNORE = -100


def stdlib_files(root: str | None = None) -> list[tuple[str, bytes]]:
    """(path relative to the library directory, file bytes) of every standard-library .py file, sorted."""
    root = root or os.path.dirname(os.__file__)
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    data = f.read()
                if data:
                    files.append((os.path.relpath(path, root).replace(os.sep, "/"), data))
    return sorted(files)


def is_held_out(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 10 == 0


def documents(files, max_doc: int) -> list[torch.Tensor]:
    """The files as byte-token documents, each cut into pieces of at most ``max_doc`` bytes."""
    docs = []
    for _, data in files:
        for start in range(0, len(data), max_doc):
            docs.append(torch.frombuffer(bytearray(data[start:start + max_doc]), dtype=torch.uint8).long())
    return docs


def targets_of(tokens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Next-byte targets (1, T) of a packed row: IGNORE at each document's last byte, whose next
    byte belongs to the following document."""
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, cu[1:] - 1] = IGNORE
    return targets


def draw_row(docs, row_tokens: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Random documents packed into one row of exactly ``row_tokens`` bytes (the last one cut to fit)."""
    picked, total = [], 0
    while total < row_tokens:
        doc = docs[rng.randrange(len(docs))][:row_tokens - total]
        picked.append(doc)
        total += doc.numel()
    return pack(picked)


def eval_rows(docs, eval_bytes: int, row_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed sample of held-out documents (the same whatever --seed), about ``eval_bytes`` bytes, as packed rows."""
    order = list(range(len(docs)))
    random.Random(1234).shuffle(order)
    rows, row, used, total = [], [], 0, 0
    for i in order:
        doc = docs[i]
        if total + doc.numel() > eval_bytes:
            break
        if row and used + doc.numel() > row_tokens:
            rows.append(pack(row))
            row, used = [], 0
        row.append(doc)
        used += doc.numel()
        total += doc.numel()
    if row:
        rows.append(pack(row))
    return rows


@torch.no_grad()
def bits_per_byte(model, rows) -> float:
    model.eval()
    nats, count = 0.0, 0
    for tokens, cu in rows:
        logits = model(tokens, cu_seqlens=cu)
        targets = targets_of(tokens, cu)
        nats += F.cross_entropy(logits[0], targets[0], ignore_index=IGNORE, reduction="sum").item()
        count += int((targets != IGNORE).sum())
    model.train()
    return nats / count / math.log(2)


def model_config(smoke: bool):
    if smoke:
        return get_config("tiny", vocab_size=256, num_layers=1, model_dim=32, z_dim=16, value_dim=32, num_heads=1,
                          ffn_hidden_dim=64, cema_ndim=4, chunk_size=64, norm_num_groups=4, backend="torch")
    return get_config("tiny", vocab_size=256, num_layers=2, model_dim=128, z_dim=64, value_dim=128, num_heads=2,
                      ffn_hidden_dim=256, cema_ndim=16, chunk_size=256, norm_num_groups=4, backend="torch")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=None,
                    help="training time budget, evaluations included (default: 4 without --steps, else none)")
    ap.add_argument("--steps", type=int, default=0,
                    help="number of steps (0: until the time budget); with both, whichever ends first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-tokens", type=int, default=8192, help="bytes per packed training row")
    ap.add_argument("--max-doc", type=int, default=4096, help="longer files are cut into documents of this many bytes")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-bytes", type=int, default=65536, help="held-out bytes evaluated each time")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default); these tensors are small, and on a shared CPU more "
                         "threads than free cores make every step many times slower")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: a tiny model, 40 steps of 1024-byte rows, 8 KiB held out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.minutes, args.steps, args.row_tokens, args.max_doc = 0.0, 40, 1024, 512
        args.eval_every, args.eval_bytes, args.lr = 20, 8192, 1e-2
    if args.minutes is None:
        args.minutes = 0.0 if args.steps > 0 else 4.0
    if args.steps <= 0 and args.minutes <= 0:
        ap.error("give a number of --steps or a time budget in --minutes")
    for name in ("row_tokens", "max_doc", "eval_every", "eval_bytes"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv=None) -> list[tuple[int, float]]:
    """Train; returns the held-out curve [(step, bits per byte)]."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    files = stdlib_files()
    train_files = [f for f in files if not is_held_out(f[0])]
    held_files = [f for f in files if is_held_out(f[0])]
    train_docs = documents(train_files, args.max_doc)
    held_rows = eval_rows(documents(held_files, args.max_doc), args.eval_bytes, args.row_tokens)
    print(f"standard library at {os.path.dirname(os.__file__)}: {len(train_files)} training files "
          f"({sum(len(d) for _, d in train_files) / 1e6:.1f} MB, {len(train_docs)} documents), {len(held_files)} "
          f"held-out files ({sum(int(cu[-1]) for _, cu in held_rows)} bytes in "
          f"{sum(cu.numel() - 1 for _, cu in held_rows)} documents evaluated)")

    cfg = model_config(args.smoke)
    model = Megalodon(cfg)
    print(f"byte-level Megalodon: {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
          f"{cfg.num_layers} layers, D={cfg.model_dim}, chunk_size={cfg.chunk_size}; rows of {args.row_tokens} bytes; "
          f"{torch.get_num_threads()} threads")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    budget = args.minutes * 60

    def progress(step, elapsed):
        """Fraction of the run done, by steps or by time, whichever is nearer the end."""
        return max(step / args.steps if args.steps > 0 else 0.0, elapsed / budget if budget > 0 else 0.0)

    curve = [(0, bits_per_byte(model, held_rows))]
    print(f"step {0:5d}  held-out {curve[-1][1]:.3f} bits/byte")
    t0 = time.time()
    step, running = 0, None
    while progress(step, time.time() - t0) < 1.0:
        frac = progress(step, time.time() - t0)
        lr = args.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr
        tokens, cu = draw_row(train_docs, args.row_tokens, rng)
        logits = model(tokens, cu_seqlens=cu)
        loss = F.cross_entropy(logits[0], targets_of(tokens, cu)[0], ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bits = loss.item() / math.log(2)
        running = bits if running is None else 0.9 * running + 0.1 * bits
        done = progress(step, time.time() - t0) >= 1.0
        if step % args.eval_every == 0 or done:
            curve.append((step, bits_per_byte(model, held_rows)))
            print(f"step {step:5d}  held-out {curve[-1][1]:.3f} bits/byte  train {running:.3f} bits/byte  "
                  f"({time.time() - t0:.0f}s, {cu.numel() - 1} documents in the last row)")
    print(f"done: {step} steps in {time.time() - t0:.0f}s; held-out bits/byte (step, bits): "
          + ", ".join(f"({s}, {b:.3f})" for s, b in curve))
    return curve


if __name__ == "__main__":
    main()
