"""FSDP2 x chunk parallelism on CPU (gloo): memory per rank and step time for 1, 2 and 4 processes.

    python bench/distributed.py                  # writes bench/results/distributed_cpu.txt
    python bench/distributed.py --quick          # a smaller model and fewer steps

For each layout (dp x cp) one set of processes (file rendezvous, one thread each) builds the same
model, calls ``parallelize`` and runs the same global batch (``--rows`` rows of ``--length`` tokens):

* parameters + gradients + AdamW state per rank: the bytes of this rank's shards (DTensor local
  tensors and replicated tensors), counted exactly after a step; one process holds it all, so the
  ratio to the 1-process figure should be ~1/world;
* activation memory per rank: the growth of the process's peak resident memory (``ru_maxrss``)
  over the first forward + backward (gradients and AdamW state allocated before), first with
  activation checkpointing, then without (the peak only grows, so that order measures both
  against the same baseline; the second also holds the first model's freed memory for reuse);
  it includes first-call overheads and allocator noise of a few MiB, so the rows are long enough
  for activations to dominate;
* step time: the median over ``--steps`` steps (forward, backward, AdamW) after one warm-up.

Ratios are within one run. The machine running it is named in the output: a shared CPU with fewer
cores than processes runs the ranks in turn, so step time there shows communication and framework
overhead, not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

LAYOUTS = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]


def _config(quick: bool):
    from megalodon_kernels.model import get_config

    if quick:
        return get_config("tiny", vocab_size=256, num_layers=2, model_dim=64, z_dim=32, value_dim=64,
                          ffn_hidden_dim=128, cema_ndim=8, chunk_size=64, norm_num_groups=4, backend="torch")
    return get_config("tiny", vocab_size=256, num_layers=4, model_dim=128, z_dim=64, value_dim=128,
                      ffn_hidden_dim=256, cema_ndim=16, chunk_size=128, norm_num_groups=4, backend="torch")


def _bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(rank: int, dp: int, cp: int, tmpdir: str, args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megalodon_kernels.model import Megalodon
    from megalodon_kernels.model.distributed import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv", rank=rank, world_size=dp * cp)
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cfg = _config(args.quick)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.rows, args.length + 1), generator=g)
    inp, lab = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    out = {}

    def step(dm, opt):
        tok, y = dm.local_batch(inp, lab)
        opt.zero_grad(set_to_none=True)
        dm.loss(tok, y).backward()
        opt.step()

    # activation memory: checkpointing first (ru_maxrss only grows)
    for ckpt in (True, False):
        torch.manual_seed(0)
        dm = parallelize(Megalodon(cfg), mesh, checkpoint_layers=ckpt)
        opt = torch.optim.AdamW(dm.parameters(), lr=1e-3)
        for p in dm.parameters():  # gradients and AdamW state allocated before the baseline
            p.grad = torch.zeros_like(p)
        opt.step()
        dist.barrier()
        if ckpt:
            base = _rss_mib()
        tok, y = dm.local_batch(inp, lab)
        dm.loss(tok, y).backward()
        out[f"act_mib_ckpt={ckpt}"] = _rss_mib() - base
        if not ckpt:
            out["state_bytes"] = {
                "params": sum(_bytes(p) for p in dm.parameters()),
                "grads": sum(_bytes(p.grad) for p in dm.parameters() if p.grad is not None),
                "optimizer": sum(_bytes(v) for s in opt.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)}
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(dm, opt)
                times.append(time.perf_counter() - t0)
            out["step_s"] = statistics.median(times)
        del dm, opt
    with open(os.path.join(tmpdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def run_layout(dp: int, cp: int, args) -> list:
    with tempfile.TemporaryDirectory() as tmpdir:
        cmd = [sys.executable, __file__, "--worker", str(dp), str(cp), tmpdir, "--rows", str(args.rows),
               "--length", str(args.length), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env) for r in range(dp * cp)]
        for p in procs:
            if p.wait(timeout=1800):
                raise RuntimeError(f"layout {dp}x{cp}: a rank failed")
        return [json.load(open(os.path.join(tmpdir, f"rank{r}.json"))) for r in range(dp * cp)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "distributed_cpu.txt"))
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        dp, cp, tmpdir = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        worker(args.rank, dp, cp, tmpdir, args)
        return
    if args.quick:
        args.rows, args.length, args.steps = 4, 512, 2
    lines = [f"# python bench/distributed.py{' --quick' if args.quick else ''} (rows {args.rows} x {args.length} "
             f"tokens per step, global), torch {torch.__version__}, gloo, one thread per rank",
             f"# {os.cpu_count()} CPU cores, shared with other jobs (load average "
             f"{os.getloadavg()[0]:.1f} at the start): ranks beyond the free cores run in turn",
             f"# date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "# layout   world  params+grads+AdamW per rank (MiB, ratio to 1 process)   "
             "activation growth per rank (MiB) ckpt / no ckpt   step (s, ratio to 1 process)"]
    base_state = base_step = None
    for dp, cp in LAYOUTS:
        res = run_layout(dp, cp, args)
        state = max(sum(r["state_bytes"].values()) for r in res) / 2**20
        act_c = max(r["act_mib_ckpt=True"] for r in res)
        act_n = max(r["act_mib_ckpt=False"] for r in res)
        stp = max(r["step_s"] for r in res)
        if base_state is None:
            base_state, base_step = state, stp
        lines.append(f"  {dp}x{cp}      {dp * cp}     {state:8.3f} ({state / base_state:.2f})"
                     f"                                {act_c:7.1f} / {act_n:7.1f}"
                     f"                          {stp:6.3f} ({stp / base_step:.2f})")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
