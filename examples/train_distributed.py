"""Train a byte-level Megalodon across processes: FSDP2 x chunk parallelism on a dp x cp DeviceMesh,
packed rows of real text (the Python standard library's sources, as examples/train_packed.py),
distributed checkpoints and resume.

    torchrun --standalone --nproc_per_node 4 examples/train_distributed.py --cp 2 --steps 60 --ckpt /tmp/run
    # stop it any time after a save; then continue from the latest checkpoint, on this mesh or another
    torchrun --standalone --nproc_per_node 4 examples/train_distributed.py --cp 2 --steps 60 --ckpt /tmp/run --resume
    torchrun --standalone --nproc_per_node 4 examples/train_distributed.py --cp 1 --steps 60 --ckpt /tmp/run --resume

Checkpoints go to ``--ckpt``/step<N> every ``--save-every`` steps (model, AdamW state, step, RNG:
``megalodon_kernels.model.dist_checkpoint``); ``--resume`` continues from the latest finished one
(``--resume-step N``: that one).

Layout. The world of W ranks is a mesh of dp = W / cp data ranks x cp chunk ranks
(``megalodon_kernels.model.distributed.parallelize``). Each step every data rank draws its own
packed row of ``--row-tokens`` bytes (documents laid end to end, ``pack``); the cp chunk ranks of
that data rank hold equal consecutive slices of it, and per layer only the CEMA state and the
TimestepNorm statistics cross from slice to slice. A document may cross a slice boundary only a
multiple of chunk_size after its own start (attention chunks count from each document's start):
one that would cross elsewhere is cut there into two documents. Parameters, gradients and AdamW
state are sharded over all W ranks. The loss is the mean over every predicted byte of the global
batch (each document's last byte predicts nothing).

Data position: the row of data rank d at step s is drawn from a generator seeded by (seed, s, d),
so the step alone is the position and a resume on any mesh continues the same stream.

Logged every ``--log-every`` steps: the loss (bits per byte), tokens per second (the global batch's
bytes over the step's wall time), and per rank the peak resident memory of the process
(``ru_maxrss``; on GPUs also ``torch.cuda.max_memory_allocated``). ``--bf16`` computes with bf16
parameters, CEMA and norms in fp32. ``--checkpoint-layers`` recomputes each block in the backward.
Uses gloo on CPU (nccl and one GPU per rank where CUDA is present).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_packed import documents, is_held_out, stdlib_files, targets_of  # noqa: E402

from megalodon_kernels.model import Megalodon, get_config, pack  # noqa: E402
from megalodon_kernels.model.dist_checkpoint import (CONFIG_FILE, load_checkpoint, read_checkpoint_info,  # noqa: E402
                                                     save_checkpoint)
from megalodon_kernels.model.distributed import parallelize  # noqa: E402


def fit_to_slices(docs: list[torch.Tensor], slice_len: int, chunk: int) -> list[torch.Tensor]:
    """The documents with any that would cross a slice boundary at a position that is not a multiple
    of ``chunk`` after its own start cut at that boundary (the piece after it a document of its own)."""
    out, pos = [], 0
    for doc in docs:
        while doc.numel():
            boundary = (pos // slice_len + 1) * slice_len
            n = doc.numel()
            if pos + n > boundary and (boundary - pos) % chunk:
                out.append(doc[:boundary - pos])
                pos, doc = boundary, doc[boundary - pos:]
            else:
                out.append(doc)
                pos += n
                break
    return out


def draw_row(docs, row_tokens: int, slice_len: int, chunk: int, seed: int, step: int, data_rank: int):
    rng = random.Random(f"{seed}/{step}/{data_rank}")
    picked, total = [], 0
    while total < row_tokens:
        doc = docs[rng.randrange(len(docs))][:row_tokens - total]
        picked.append(doc)
        total += doc.numel()
    return pack(fit_to_slices(picked, slice_len, chunk))


def model_config(args):
    return get_config("tiny", vocab_size=256, num_layers=args.layers, model_dim=args.dim, z_dim=args.dim // 2,
                      value_dim=args.dim, num_heads=1, ffn_hidden_dim=2 * args.dim, cema_ndim=8,
                      chunk_size=args.chunk, norm_num_groups=4, backend="torch")


def checkpoint_path(root: str, step=None) -> str:
    """root/step<N> for ``step``, or the latest finished checkpoint under root."""
    if step is not None:
        return os.path.join(root, f"step{step:06d}")
    done = sorted(d for d in os.listdir(root)
                  if d.startswith("step") and os.path.isfile(os.path.join(root, d, CONFIG_FILE)))
    if not done:
        raise SystemExit(f"no finished checkpoint under {root}")
    return os.path.join(root, done[-1])


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--cp", type=int, default=2, help="chunk-parallel ranks per row (dp = world / cp)")
    ap.add_argument("--steps", type=int, default=60, help="train until this step (counted from 0, resume included)")
    ap.add_argument("--row-tokens", type=int, default=512, help="bytes per data rank's packed row")
    ap.add_argument("--chunk", type=int, default=64, help="attention chunk_size")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-doc", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory")
    ap.add_argument("--save-every", type=int, default=30)
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt")
    ap.add_argument("--resume-step", type=int, default=None, help="with --resume: from this step's checkpoint")
    args = ap.parse_args(argv)
    if args.resume and not args.ckpt:
        ap.error("--resume needs --ckpt")
    return args


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # the ranks share the cores
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} does not divide the world size {world}")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
    slice_len = args.row_tokens // args.cp
    if args.row_tokens % args.cp:
        raise SystemExit(f"--row-tokens {args.row_tokens} does not split into --cp {args.cp} equal slices")

    files = stdlib_files()
    docs = documents([f for f in files if not is_held_out(f[0])], args.max_doc)
    cfg = model_config(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Megalodon(cfg)
    if cuda:
        model = model.cuda()
    n_params = sum(p.numel() for p in model.parameters())
    dm = parallelize(model, mesh, param_dtype=torch.bfloat16 if args.bf16 else None,
                     checkpoint_layers=args.checkpoint_layers)
    opt = torch.optim.AdamW(dm.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step = 0
    if args.resume:
        path = checkpoint_path(args.ckpt, args.resume_step)
        info = read_checkpoint_info(path)
        step = load_checkpoint(path, dm, opt)["step"]
        if rank == 0:
            print(f"resumed from {path} at step {step} (saved on mesh {info['mesh']}, now dp={dm.dp_size} "
                  f"x cp={dm.cp_size})", flush=True)
    elif rank == 0:
        print(f"{world} ranks: mesh dp={dm.dp_size} x cp={dm.cp_size}; {n_params / 1e3:.0f}k parameters, "
              f"{cfg.num_layers} layers, D={cfg.model_dim}, chunk {cfg.chunk_size}; rows of {args.row_tokens} bytes "
              f"({slice_len} per chunk rank); {len(docs)} training documents; "
              f"{'bf16 (CEMA, norms fp32)' if args.bf16 else 'fp32'}", flush=True)

    t_log, tokens_since, window = time.perf_counter(), 0, []
    while step < args.steps:
        lr = args.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / max(args.steps, 1)))
        for group in opt.param_groups:
            group["lr"] = lr
        tokens, cu = draw_row(docs, args.row_tokens, slice_len, cfg.chunk_size, args.seed, step, dm.dp_rank)
        labels = targets_of(tokens, cu)
        c = dm.cp_rank
        tok = tokens[:, c * slice_len:(c + 1) * slice_len]
        lab = labels[:, c * slice_len:(c + 1) * slice_len]
        if cuda:
            tok, lab, cu = tok.cuda(), lab.cuda(), cu.cuda()
        share = dm.loss(tok, lab, cu_seqlens=cu)
        opt.zero_grad(set_to_none=True)
        share.backward()
        dm.clip_grad_norm_(1.0)  # sharded and (under --bf16) replicated fp32 gradients together
        opt.step()
        step += 1
        tokens_since += args.row_tokens * dm.dp_size
        window.append(dm.global_loss(share) / math.log(2))
        if step % args.log_every == 0 or step == args.steps:
            dt = time.perf_counter() - t_log
            mem = [None] * world
            dist.all_gather_object(mem, round(peak_memory_mib()))
            if rank == 0:
                print(f"step {step:4d}  loss {sum(window) / len(window):.3f} bits/byte (mean of {len(window)}; last "
                      f"{window[-1]:.6f})  {tokens_since / dt:6.0f} tokens/s  peak MiB per rank {mem}", flush=True)
            t_log, tokens_since, window = time.perf_counter(), 0, []
        if args.ckpt and (step % args.save_every == 0 or step == args.steps):
            path = checkpoint_path(args.ckpt, step)
            save_checkpoint(path, dm, opt, step=step, data_state={"step": step})
            if rank == 0:
                print(f"saved step {step} to {path}", flush=True)
            t_log = time.perf_counter()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
