"""Train a tiny Megalodon with chunk (sequence) parallelism, optionally combined with data parallelism.

Each sequence of L tokens is split over ``--chunk`` ranks (rank c holds positions
[c L/P, (c+1) L/P), a whole number of attention chunks each); per layer only the CEMA hidden state
and the TimestepNorm (mean, var) cross ranks, forward and (as gradients) backward. The world of
W = data x chunk ranks is a grid: ranks [d*P, (d+1)*P) form replica d's chunk group; the ranks with
the same chunk index form a data group. Gradients: sum over the chunk group, mean over the data
group (``allreduce_gradients``), or ``--ddp`` to wrap the chunk-parallel model in
DistributedDataParallel over the whole world with a per-rank mean loss (equivalent).

    torchrun --standalone --nproc-per-node 2 examples/train_chunk_parallel.py
    torchrun --standalone --nproc-per-node 4 examples/train_chunk_parallel.py --chunk 2 --ddp
    torchrun --standalone --nproc-per-node 2 examples/train_chunk_parallel.py --check   # vs one process

With ``--check``, every rank also runs the whole sequence on one process and the script asserts the
chunk-parallel gradients equal it. Uses gloo (CPU); on GPUs pass --backend nccl (and move the model).
examples/train_distributed.py shards the parameters too (FSDP2 x chunk parallelism, checkpoints).
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from megalodon_kernels.model import Megalodon, get_config
from megalodon_kernels.model.parallel import ChunkParallelMegalodon, allreduce_gradients, chunk_bounds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=None, help="ranks per sequence (default: the whole world)")
    ap.add_argument("--chunks-per-rank", type=int, default=2, help="attention chunks per rank's slice")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ddp", action="store_true", help="reduce gradients with DDP over the world")
    ap.add_argument("--check", action="store_true", help="compare the first step's gradients with one process")
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    P = args.chunk or world
    if world % P:
        raise SystemExit(f"world size {world} is not a multiple of --chunk {P}")
    R = world // P
    d, c = divmod(rank, P)
    # every rank creates every group, in the same order
    chunk_groups = [dist.new_group(list(range(i * P, (i + 1) * P))) for i in range(R)]
    data_groups = [dist.new_group(list(range(j, world, P))) for j in range(P)]
    chunk_group, data_group = chunk_groups[d], (data_groups[c] if R > 1 else None)

    torch.set_num_threads(1)
    torch.manual_seed(0)  # same initial weights everywhere
    cfg = get_config("tiny")
    model = Megalodon(cfg)
    cp = ChunkParallelMegalodon(model, chunk_group)
    net = DDP(cp) if args.ddp else cp
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    L = P * args.chunks_per_rank * cfg.chunk_size
    sl = chunk_bounds(L, c, P)
    data = torch.Generator().manual_seed(1)
    if rank == 0:
        print(f"world {world} = {R} data x {P} chunk; L = {L} ({L // P} per rank, chunk_size {cfg.chunk_size}); "
              f"{'DDP' if args.ddp else 'allreduce_gradients'}")
    for step in range(args.steps):
        # the same stream of batches on every rank; replica d takes its own sequences
        seqs = torch.randint(0, cfg.vocab_size, (R, args.batch, L + 1), generator=data)
        seqs[..., 1::2] = seqs[..., 0:-1:2]  # learnable: every odd position repeats its predecessor
        inp, tgt = seqs[d, :, :-1][:, sl], seqs[d, :, 1:][:, sl]
        t0 = time.perf_counter()
        cp.comm.reset()
        logits = net(inp)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum")
        loss = ce / tgt.numel() if args.ddp else ce / (args.batch * L)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not args.ddp:
            allreduce_gradients(model, chunk_group, data_group)
        dt = time.perf_counter() - t0
        if args.check and step == 0:
            check(model, seqs, R)
        opt.step()
        total = (ce / (args.batch * L)).detach()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total.item() / R:.4f}  step {1e3 * dt:.0f} ms, "
                  f"state exchange {1e3 * cp.comm.seconds:.0f} ms on rank 0")
    dist.destroy_process_group()


def check(model, seqs, R):
    """One process on the whole sequences (mean over replicas) must give the same gradients."""
    ref = Megalodon(model.config)
    ref.load_state_dict(model.state_dict())
    for i in range(R):
        out = ref(seqs[i, :, :-1])
        (F.cross_entropy(out.reshape(-1, out.shape[-1]), seqs[i, :, 1:].reshape(-1)) / R).backward()
    worst = max(((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    assert worst < 1e-3, f"chunk-parallel gradients differ from one process: max relative error {worst:.2e}"
    if dist.get_rank() == 0:
        print(f"check: gradients equal the single-process run (max relative error {worst:.1e})")


if __name__ == "__main__":
    main()
