"""Train a tiny Megalodon on CPU on a long-range recall task that chunk-local attention cannot solve.

Task. Each sequence of T = 6 chunks of 16 tokens holds a KEY token (one of 8) at a random position
of its first chunk, random FILLER tokens everywhere else, and a QUERY token at the last position of
chunks 2..6, after which the model must predict the key. The key is 16..95 positions back, always
in an earlier attention chunk (chunk_size = 16): Megalodon's attention is block-diagonal, so it
never sees the key; the answer has to travel across chunk boundaries through the CEMA state and
the cumulative TimestepNorm.
A model that only sees the query's chunk - any chunk-local model - is at chance (1/8); the script
checks that for the trained model too, by feeding it only the last chunk.

Every sequence-mixing step (TimestepNorm, CEMA, RoPE, attention) runs through the
megalodon_kernels.ops autograd functions, forward and backward.

    python examples/train_tiny.py                 # a few minutes on one CPU core
    python examples/train_tiny.py --steps 100     # quicker look
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F

from megalodon_kernels.model import Megalodon, get_config

NUM_KEYS, NUM_FILLERS = 8, 16
QUERY = NUM_KEYS + NUM_FILLERS  # token ids: keys 0..7, fillers 8..23, query 24
VOCAB = QUERY + 1


def make_batch(batch: int, seq_len: int, chunk: int, gen: torch.Generator):
    """tokens (B, T), targets (B, T) with -100 except at the query positions, and those positions."""
    keys = torch.randint(0, NUM_KEYS, (batch,), generator=gen)
    tokens = torch.randint(NUM_KEYS, NUM_KEYS + NUM_FILLERS, (batch, seq_len), generator=gen)
    key_pos = torch.randint(0, chunk, (batch,), generator=gen)  # anywhere in the first chunk
    tokens[torch.arange(batch), key_pos] = keys
    query_pos = torch.arange(2 * chunk - 1, seq_len, chunk)  # ends of chunks 2, 3, ...: > chunk back
    tokens[:, query_pos] = QUERY
    targets = torch.full((batch, seq_len), -100)
    targets[:, query_pos] = keys[:, None]
    return tokens, targets, query_pos


@torch.no_grad()
def evaluate(model, tokens, targets, query_pos, chunk):
    model.eval()
    logits = model(tokens)
    mask = targets != -100
    loss = F.cross_entropy(logits[mask], targets[mask]).item()
    acc = (logits[mask].argmax(-1) == targets[mask]).float().mean().item()
    # What a chunk-local model sees: only the last chunk (which ends with the last query).
    local = model(tokens[:, -chunk:])[:, -1]
    local_acc = (local.argmax(-1) == targets[:, -1]).float().mean().item()
    model.train()
    return loss, acc, local_acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=6, help="sequence length in chunks (>= 3)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default); these tensors are small, so 1 is usually fastest")
    args = ap.parse_args()
    if args.chunks < 3:
        ap.error("--chunks must be >= 3")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    C, T = args.chunk_size, args.chunk_size * args.chunks
    cfg = get_config("tiny", vocab_size=VOCAB, chunk_size=C, model_dim=64, z_dim=32, value_dim=64,
                     ffn_hidden_dim=128, num_heads=2, cema_ndim=8, norm_num_groups=8, num_layers=2)
    model = Megalodon(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Megalodon: {n_params / 1e3:.0f}k parameters, {cfg.num_layers} layers, D={cfg.model_dim}, "
          f"chunk_size={C}, sequence length {T} ({args.chunks} chunks)")
    print(f"task: recall a key {C}..{T - 1} tokens back, always in an earlier attention chunk; "
          f"chance = {1 / NUM_KEYS:.3f}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batch = make_batch(256, T, C, torch.Generator().manual_seed(12345))

    t0 = time.time()
    loss0, acc0, local0 = evaluate(model, *eval_batch, C)
    print(f"step {0:5d}  eval loss {loss0:.3f}  recall acc {acc0:.3f}  last-chunk-only acc {local0:.3f}")
    history = [(0, loss0, acc0)]
    running = None
    for step in range(1, args.steps + 1):
        tokens, targets, _ = make_batch(args.batch, T, C, gen)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % args.eval_every == 0 or step == args.steps:
            ev_loss, ev_acc, local_acc = evaluate(model, *eval_batch, C)
            history.append((step, ev_loss, ev_acc))
            print(f"step {step:5d}  train loss {running:.3f}  eval loss {ev_loss:.3f}  recall acc {ev_acc:.3f}  "
                  f"last-chunk-only acc {local_acc:.3f}  ({time.time() - t0:.0f}s)")
    elapsed = time.time() - t0
    print(f"done in {elapsed:.0f}s; final recall accuracy {history[-1][2]:.3f} "
          f"(chance {1 / NUM_KEYS:.3f}); curve (step, eval loss, acc): "
          + ", ".join(f"({s}, {lo:.2f}, {a:.2f})" for s, lo, a in history))


if __name__ == "__main__":
    main()
