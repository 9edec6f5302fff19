"""Chunk parallelism (model/parallel.py) against one process running the whole sequence.

Worker processes are launched as ``python tests/test_chunk_parallel.py --worker ...`` with the gloo
backend and a file rendezvous (no network beyond loopback). A single launch of 4 processes runs
every case: 2-rank chunk parallelism (two independent pairs), 4-rank chunk parallelism, and
2 data replicas x 2 chunk ranks through ``allreduce_gradients``. The parent computes the single-process reference and
compares logits, loss and every parameter gradient, in float64 and float32.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from support import ranks_finished, start_ranks

B, CHUNK = 2, 8
CHUNKS_PER_RANK = 3


def _config(prior_count=0):
    from megalodon_kernels.model import get_config

    return get_config("tiny", num_layers=2, model_dim=32, z_dim=16, value_dim=32, ffn_hidden_dim=48, cema_ndim=4,
                      chunk_size=CHUNK, norm_num_groups=4, vocab_size=48, norm_prior_count=prior_count)


WORLD = 4  # one launch of 4 processes runs every case (process start-up dominates on this machine)
# name -> (dtype, layout, prior_count). Layouts: "chunk4" = one chunk group of 4 ranks;
# "pairs" = two independent 2-rank chunk groups {0,1} and {2,3}, each on its own sequences
# ("pairs_uneven": slices of 1/3 and 2/3 of the sequence);
# "dp_helper" = 2 data replicas x 2 chunk ranks (gradients averaged over replicas). The DDP variant
# (examples/train_chunk_parallel.py --ddp --check) is not run here: constructing DDP alone takes
# ~10 s on this machine, which would break the test file's time budget.
CASES = {
    "p2_f64": (torch.float64, "pairs", 0),
    "p2_f32": (torch.float32, "pairs", 0),
    "p2_f64_prior": (torch.float64, "pairs", 3),
    "p2_f64_uneven": (torch.float64, "pairs_uneven", 0),
    "p4_f64": (torch.float64, "chunk4", 0),
    "p4_f32": (torch.float32, "chunk4", 0),
    "d2c2_f64": (torch.float64, "dp_helper", 0),
}
TIMED_CASES = ("p2_f32", "p4_f32")
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def _chunk_world(layout):
    return WORLD if layout == "chunk4" else 2


def _slice(layout, c, P, length):
    if layout == "pairs_uneven":
        cut = length // 3
        return slice(0, cut) if c == 0 else slice(cut, length)
    return slice(c * length // P, (c + 1) * length // P)


def _make_case(name, tmpdir):
    """Model, tokens (R replicas, B, L + 1) and the single-process reference, saved for the workers."""
    from megalodon_kernels.model import Megalodon

    dtype, layout, prior = CASES[name]
    P = _chunk_world(layout)
    R = WORLD // P
    L = P * CHUNKS_PER_RANK * CHUNK
    torch.manual_seed(1234)
    cfg = _config(prior)
    model = Megalodon(cfg).to(dtype)
    with torch.no_grad():  # move the zero-initialised parameters (norm scales, biases, priors) off zero
        for p in model.parameters():
            if not p.any():
                p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, cfg.vocab_size, (R, B, L + 1))
    logits_ref, grads_ref, loss_ref = [], [], []
    for d in range(R):
        model.zero_grad()
        logits = model(tokens[d, :, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[d, :, 1:].reshape(-1))
        loss.backward()
        logits_ref.append(logits.detach())
        loss_ref.append(loss.item())
        grads_ref.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.save({"cfg": cfg, "state": model.state_dict(), "dtype": dtype, "tokens": tokens},
               os.path.join(tmpdir, f"{name}.pt"))
    return {"logits": logits_ref, "loss": loss_ref, "grads": grads_ref}


def _run_world(world, tmpdir):
    names = list(CASES)
    t0 = time.perf_counter()
    # start the workers first: their start-up overlaps the reference runs; they wait for "ready"
    procs = start_ranks([[__file__, "--worker", str(r), str(world), tmpdir, ",".join(names)] for r in range(world)])
    with ranks_finished(procs):
        refs = {n: _make_case(n, tmpdir) for n in names}
        open(os.path.join(tmpdir, "ready"), "w").close()
    results = {n: [torch.load(os.path.join(tmpdir, f"{n}.rank{r}.pt"), weights_only=False) for r in range(world)]
               for n in names}
    return refs, results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run_world(WORLD, str(tmp_path_factory.mktemp("cp")))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(runs, name):
    dtype, layout, _ = CASES[name]
    refs, results, _ = runs
    ref, res = refs[name], results[name]
    P = _chunk_world(layout)
    tol = TOL[dtype]
    for rank, out in enumerate(res):
        d, c = divmod(rank, P)
        sl = _slice(layout, c, P, ref["logits"][d].shape[1])
        torch.testing.assert_close(out["logits"], ref["logits"][d][:, sl], **tol,
                                   msg=lambda m: f"{name} rank {rank} logits: {m}")
        if layout.startswith("dp"):  # data parallel: the mean over replicas
            loss = sum(ref["loss"]) / len(ref["loss"])
            grads = {n: sum(g[n] for g in ref["grads"]) / len(ref["grads"]) for n in ref["grads"][0]}
        else:
            loss, grads = ref["loss"][d], ref["grads"][d]
        assert out["loss"] == pytest.approx(loss, rel=tol["rtol"], abs=tol["atol"])
        assert set(out["grads"]) == set(grads)
        for n, g in grads.items():
            torch.testing.assert_close(out["grads"][n], g, **tol, msg=lambda m: f"{name} rank {rank} grad {n}: {m}")


def test_communication_share_reported(runs):
    """Measures (and prints) the share of a training step spent inside send / recv / wait."""
    lines = []
    _, results, wall = runs
    for name in TIMED_CASES:
        t = [r["timing"] for r in results[name]]
        step = sum(x["step"] for x in t) / len(t)
        p2p = sum(x["p2p"] for x in t) / len(t)
        ar = sum(x["allreduce"] for x in t) / len(t)
        share = [round(x["p2p"] / x["step"], 3) for x in t]
        assert all(0 <= s < 1 for s in share)
        lines.append(f"{name}: step {1e3 * step:.1f} ms (fwd+bwd), p2p {1e3 * p2p:.1f} ms = {p2p / step:.1%} "
                     f"(per rank {share}), grad all-reduce {1e3 * ar:.1f} ms; "
                     f"{t[0]['messages']} msgs {t[0]['bytes']} B per step on rank 0; one-way latency of a "
                     f"state message {1e3 * sum(x['latency'] for x in t) / len(t):.2f} ms; launch wall {wall:.1f} s")
    print("\n" + "\n".join(lines))


def test_rejects_slice_not_multiple_of_chunk(tmp_path):
    import torch.distributed as dist

    from megalodon_kernels.model import Megalodon
    from megalodon_kernels.model.parallel import ChunkParallelMegalodon

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        cp = ChunkParallelMegalodon(Megalodon(_config()))
        with pytest.raises(ValueError, match="multiple of chunk_size"):
            cp(torch.zeros(1, CHUNK + 1, dtype=torch.long))
        # a single rank is the plain model
        tokens = torch.randint(0, 48, (1, 2 * CHUNK))
        torch.testing.assert_close(cp(tokens), cp.module(tokens))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# worker


def _ping_pong(cp, model, batch, reps=20):
    """One-way time of one layer's state message between chunk neighbours (2k, 2k + 1): the pure
    transfer cost, without the waiting for the peer's computation that the p2p time includes."""
    import torch.distributed as dist

    cfg = model.config
    dt = next(model.parameters()).dtype
    buf = torch.zeros(batch * (2 * cfg.norm_num_groups + 2 * cfg.model_dim * cfg.cema_ndim), dtype=dt)
    peer = cp.rank ^ 1
    dist.barrier(group=cp.group)
    t0 = time.perf_counter()
    for _ in range(reps):
        if cp.rank % 2 == 0:
            dist.send(buf, cp._global(peer), group=cp.group)
            dist.recv(buf, cp._global(peer), group=cp.group)
        else:
            dist.recv(buf, cp._global(peer), group=cp.group)
            dist.send(buf, cp._global(peer), group=cp.group)
    return (time.perf_counter() - t0) / (2 * reps)


def _worker(rank, world, tmpdir, names):
    import torch.distributed as dist

    from megalodon_kernels.model import Megalodon
    from megalodon_kernels.model.parallel import ChunkParallelMegalodon, CommStats, allreduce_gradients, chunk_bounds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv", rank=rank, world_size=world)
    # 2 x 2: chunk groups {0,1}, {2,3}; data groups {0,2}, {1,3}
    cg = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dg = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {"chunk": cg[rank // 2], "data": dg[rank % 2]}
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(tmpdir, "ready")):  # the parent is saving the cases
        if time.monotonic() > deadline:
            raise TimeoutError("the test process never wrote the cases")
        time.sleep(0.02)
    for name in names:
        _, layout, _ = CASES[name]
        saved = torch.load(os.path.join(tmpdir, f"{name}.pt"), weights_only=False)
        model = Megalodon(saved["cfg"]).to(saved["dtype"])
        model.load_state_dict(saved["state"])
        tokens = saved["tokens"]
        if layout == "chunk4":
            chunk_group, data_group, d = None, None, 0
        elif layout.startswith("pairs"):
            chunk_group, data_group, d = groups["chunk"], None, rank // 2
        else:
            chunk_group, data_group, d = groups["chunk"], groups["data"], rank // 2
        cp = ChunkParallelMegalodon(model, chunk_group)
        P, c = cp.world, cp.rank
        Ltot = tokens.shape[-1] - 1
        sl = chunk_bounds(Ltot, c, P) if layout != "pairs_uneven" else _slice(layout, c, P, Ltot)
        inp, tgt = tokens[d, :, :-1][:, sl], tokens[d, :, 1:][:, sl]
        ar_stats = CommStats()
        steps = 3 if name in TIMED_CASES else 1
        step_time = p2p = 0.0
        for s in range(steps):
            model.zero_grad(set_to_none=True)
            cp.comm.reset()
            t0 = time.perf_counter()
            logits = cp(inp)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum")
            loss = ce / (B * Ltot)  # summed over the chunk group by allreduce_gradients: the global mean
            loss.backward()
            t1 = time.perf_counter()
            ar_stats.reset()
            allreduce_gradients(model, chunk_group, data_group, stats=ar_stats)
            if s > 0 or steps == 1:  # the first of several steps is a warm-up
                step_time += t1 - t0
                p2p += cp.comm.seconds
        total = (ce / (B * Ltot)).detach().clone()
        dist.all_reduce(total, group=chunk_group)
        if data_group is not None:
            dist.all_reduce(total, group=data_group)
            total /= 2
        n = max(steps - 1, 1)
        latency = _ping_pong(cp, model, B) if name in TIMED_CASES else 0.0
        torch.save({"logits": logits.detach(), "loss": total.item(),
                    "grads": {k: p.grad.detach().clone() for k, p in model.named_parameters()},
                    "timing": {"step": step_time / n, "p2p": p2p / n, "allreduce": ar_stats.seconds,
                               "messages": cp.comm.messages, "bytes": cp.comm.bytes, "latency": latency}},
                   os.path.join(tmpdir, f"{name}.rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds under load); results are on disk


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split(","))
