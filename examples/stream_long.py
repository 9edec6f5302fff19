"""Stream a long input through a Megalodon cache: constant memory per token, exact logits.

The cache holds, per layer, the TimestepNorm statistics, the CEMA hidden state and the keys and
values of the current (unfinished) attention chunk only: its size is bounded by chunk_size, not
by how many tokens went through. This script

1. checks exactness: a prefix streamed in random-sized pieces gives the logits of one full forward;
2. streams a long input (default 20k tokens) in random pieces of 1..3*chunk_size tokens, then
   decodes token by token, printing cache bytes and the process RSS as it goes: both stay flat.

    python examples/stream_long.py
    python examples/stream_long.py --tokens 100000 --preset tiny
"""
import argparse
import os
import time

import torch

from megalodon_kernels.model import Megalodon, get_config


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux), or nan elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=20000, help="tokens to prefill in random pieces")
    ap.add_argument("--decode", type=int, default=200, help="tokens to decode one by one afterwards")
    ap.add_argument("--check", type=int, default=400, help="prefix length for the exactness check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Megalodon(get_config(args.preset)).eval()
    cfg = model.config
    C, V = cfg.chunk_size, cfg.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{args.preset}: {cfg.num_layers} layers, D={cfg.model_dim}, chunk_size={C}, vocab {V}")

    with torch.no_grad():
        # 1. exactness on a prefix
        tokens = torch.randint(0, V, (1, args.check), generator=gen)
        full = model(tokens)
        cache = model.init_cache(1)
        pieces, pos = [], 0
        while pos < args.check:
            n = int(torch.randint(1, 3 * C + 1, (1,), generator=gen))
            pieces.append(model(tokens[:, pos:pos + n], cache=cache))
            pos += n
        err = float((torch.cat(pieces, 1) - full).abs().max() / full.abs().max())
        print(f"exactness: {args.check} tokens in {len(pieces)} random pieces vs one forward: "
              f"max relative error {err:.1e}")

        # 2. a long stream: random-sized pieces, then token-by-token decoding
        cache = model.init_cache(1)
        report_every = max(args.tokens // 8, 1)
        next_report, done, t0 = report_every, 0, time.time()
        cache_sizes = []
        while done < args.tokens:
            n = min(int(torch.randint(1, 3 * C + 1, (1,), generator=gen)), args.tokens - done)
            logits = model(torch.randint(0, V, (1, n), generator=gen), cache=cache)
            done += n
            cache_sizes.append(cache.nbytes())
            if done >= next_report:
                print(f"  prefilled {done:7d} tokens  cache {cache.nbytes() / 1024:6.1f} KiB  "
                      f"RSS {rss_mb():7.1f} MiB  {done / (time.time() - t0):7.0f} tok/s")
                next_report += report_every
        tok = logits[:, -1:].argmax(-1)
        t1 = time.time()
        for i in range(args.decode):
            logits = model(tok, cache=cache)
            tok = logits[:, -1:].argmax(-1)
            cache_sizes.append(cache.nbytes())
        dt = time.time() - t1
        print(f"  decoded {args.decode} tokens one by one: {1e3 * dt / max(args.decode, 1):.1f} ms/token, "
              f"cache {cache.nbytes() / 1024:.1f} KiB, RSS {rss_mb():.1f} MiB")
        print(f"cache size over the whole stream of {cache.num_tokens} tokens: min {min(cache_sizes) / 1024:.1f} KiB, "
              f"max {max(cache_sizes) / 1024:.1f} KiB (bounded by chunk_size={C}, independent of length)")


if __name__ == "__main__":
    main()
