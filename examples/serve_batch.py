"""Continuous batching: a queue of prompts of random lengths served by one decode batch, rows
joining as others finish.

    python examples/serve_batch.py [--requests 64] [--max-batch 16] [--min-len 4] [--max-len 200]
                                   [--max-new 48] [--eos 0] [--threads 1] [--check]

The model is the ``tiny`` preset with random weights (the point is the serving loop, not the
text). Each request is a prompt and a token budget; the loop keeps up to ``--max-batch`` rows
decoding together: finished rows (eos or budget) leave the batch (``MegalodonCache.select``) and
waiting prompts join it, prefilled together as one packed row (``model.prefill``) and appended
(``MegalodonCache.cat``). ``--check`` regenerates every request alone and confirms the tokens
are identical. Prints tokens/s. See docs/serving.md.
"""
from __future__ import annotations

import argparse
import time
from collections import deque

import torch

from megalodon_kernels.model import Megalodon, MegalodonCache, get_config


def serve(model, requests, max_batch: int, eos: int | None):
    """requests: list of (prompt 1-D tensor, max_new_tokens). Returns the new tokens per request,
    and the number of decode steps taken."""
    waiting = deque(range(len(requests)))
    out = {i: [] for i in range(len(requests))}
    rows: list[int] = []  # request id of each cache row
    cache, logits = None, None
    steps = 0
    while waiting or rows:
        # 1. admit waiting requests into free rows: one packed prefill for all of them
        free = max_batch - len(rows)
        if waiting and free > 0:
            joining = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            new_cache, new_logits = model.prefill([requests[i][0] for i in joining])
            cache = new_cache if cache is None else MegalodonCache.cat([cache, new_cache])
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
            rows += joining
        # 2. one token for every row (greedy), taken from its last logits
        tokens = logits.argmax(-1)
        keep = []
        for r, (req, tok) in enumerate(zip(rows, tokens.tolist())):
            out[req].append(tok)
            if len(out[req]) < requests[req][1] and tok != eos:
                keep.append(r)
        # 3. finished rows leave the batch
        if len(keep) < len(rows):
            rows = [rows[r] for r in keep]
            cache, tokens = (cache.select(keep), tokens[keep]) if keep else (None, None)
        # 4. the remaining rows decode their token together (rows at any lengths)
        if rows:
            logits = model.decode(tokens, cache)
            steps += 1
        else:
            logits = None
    return out, steps


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--eos", type=int, default=0, help="eos token id (-1: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="regenerate each request alone and compare")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Megalodon(get_config("tiny")).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    requests = []
    for _ in range(args.requests):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        budget = int(torch.randint(1, args.max_new + 1, (1,), generator=g))
        requests.append((torch.randint(1, vocab, (n,), generator=g), budget))
    eos = None if args.eos < 0 else args.eos

    t0 = time.perf_counter()
    out, steps = serve(model, requests, args.max_batch, eos)
    dt = time.perf_counter() - t0
    produced = sum(len(t) for t in out.values())
    prompt_tokens = sum(p.shape[0] for p, _ in requests)
    print(f"{args.requests} requests (prompts {args.min_len}-{args.max_len} tokens, {prompt_tokens} in all), "
          f"batch of at most {args.max_batch}: {produced} new tokens in {steps} decode steps, {dt:.2f} s, "
          f"{produced / dt:.0f} new tokens/s (prefill included)")

    if args.check:
        t0 = time.perf_counter()
        for i, (prompt, budget) in enumerate(requests):
            alone = model.generate(prompt[None], budget, greedy=True, eos_token_id=eos)[0, prompt.shape[0]:]
            if alone.tolist() != out[i]:
                raise SystemExit(f"request {i}: served {out[i]} but alone {alone.tolist()}")
        dt1 = time.perf_counter() - t0
        print(f"check: every request's tokens equal generating it alone ({produced / dt1:.0f} new tokens/s one by one)")


if __name__ == "__main__":
    main()
