"""Chunk parallelism (model/parallel.py) on packed rows against one process running the whole row.

Two worker processes (gloo, file rendezvous, loopback only) are launched once as
``python tests/test_packed_parallel.py --worker ...`` and run every case; the parent computes the
single-process reference ``model(row, cu_seqlens=cu)`` and compares logits and every parameter
gradient (each rank's share summed by ``allreduce_gradients``). The cases put a document across the
rank boundary (its state passed on), documents starting on rank 1 (fresh state, the received one
unused), a rank boundary on a document start, unequal slices, learnable priors, fp64 and fp32.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from support import ranks_finished, start_ranks

CHUNK = 8
VOCAB = 40
WORLD = 2

# name -> (dtype, document lengths, rank 1's first position (None: equal slices), prior_count)
CASES = {
    # rank boundary 20 inside the second document, 16 = 2 C after its start; two documents start on rank 1
    "crossing_f64": (torch.float64, [4, 24, 5, 0, 7], None, 0),
    "crossing_f32": (torch.float32, [4, 24, 5, 0, 7], None, 0),
    # rank boundary 20 on a document start: rank 1 starts fresh; learnable priors on both ranks
    "boundary_start_f64_prior": (torch.float64, [3, 17, 9, 0, 11], None, 2),
    # unequal slices [0, 26) and [26, 40); the document from 10 crosses 16 = 2 C after its start
    "uneven_f64": (torch.float64, [10, 21, 9], 26, 0),
    # one document over both ranks (a boundary 3 C after its start)
    "one_document_f64": (torch.float64, [48], None, 0),
}
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def _config(prior_count=0):
    from megalodon_kernels.model import get_config

    return get_config("tiny", num_layers=2, model_dim=32, z_dim=16, value_dim=32, ffn_hidden_dim=48, cema_ndim=4,
                      chunk_size=CHUNK, norm_num_groups=4, vocab_size=VOCAB, norm_prior_count=prior_count,
                      backend="torch")


def _row(name):
    """The packed row of a case: tokens (1, T), cu_seqlens, loss weights (1, T, V), rank 1's start."""
    from megalodon_kernels.model import pack

    dtype, lengths, start, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(lengths))
    tokens, cu = pack([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
    weights = torch.randn(1, tokens.shape[1], VOCAB, generator=g, dtype=torch.float64).to(dtype)
    return tokens, cu, weights, tokens.shape[1] // WORLD if start is None else start


def _make_case(name, tmpdir):
    from megalodon_kernels.model import Megalodon

    dtype, _, _, prior = CASES[name]
    torch.manual_seed(1234)
    model = Megalodon(_config(prior)).to(dtype)
    with torch.no_grad():  # move the zero-initialised parameters (norm scales, biases, priors) off zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens, cu, weights, _ = _row(name)
    logits = model(tokens, cu_seqlens=cu)
    (logits * weights).sum().backward()
    torch.save({"cfg": model.config, "state": model.state_dict(), "dtype": dtype},
               os.path.join(tmpdir, f"{name}.pt"))
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("packed_cp"))
    names = list(CASES)
    # start the workers first: their start-up overlaps the reference runs; they wait for "ready"
    procs = start_ranks([[__file__, "--worker", str(r), tmpdir, ",".join(names)] for r in range(WORLD)])
    with ranks_finished(procs):
        refs = {n: _make_case(n, tmpdir) for n in names}
        open(os.path.join(tmpdir, "ready"), "w").close()
    results = {n: [torch.load(os.path.join(tmpdir, f"{n}.rank{r}.pt"), weights_only=False) for r in range(WORLD)]
               for n in names}
    return refs, results


@pytest.mark.parametrize("name", list(CASES))
def test_packed_chunk_parallel_matches_one_process(runs, name):
    refs, results = runs
    ref, res = refs[name], results[name]
    tol = TOL[CASES[name][0]]
    tokens, _, _, start = _row(name)
    slices = [slice(0, start), slice(start, tokens.shape[1])]
    for rank, out in enumerate(res):
        torch.testing.assert_close(out["logits"], ref["logits"][:, slices[rank]], **tol,
                                   msg=lambda m: f"{name} rank {rank} logits: {m}")
        assert set(out["grads"]) == set(ref["grads"])
        for n, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][n], g, **tol, msg=lambda m: f"{name} rank {rank} grad {n}: {m}")


def test_packed_chunk_parallel_refuses_bad_slices(tmp_path):
    """On a one-rank group (the checks run before any message is exchanged)."""
    import torch.distributed as dist

    from megalodon_kernels.model import Megalodon, pack
    from megalodon_kernels.model.parallel import ChunkParallelMegalodon

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = Megalodon(_config())
        cp = ChunkParallelMegalodon(model)
        tokens, cu = pack([torch.randint(0, VOCAB, (n,)) for n in (5, 22, 3)])  # documents at 0, 5, 27
        # a single rank holding the whole row is the packed model, whatever the slice length
        torch.testing.assert_close(cp(tokens, cu), model(tokens, cu_seqlens=cu))
        # the document from 5 would cross the boundary 20 after 15 tokens, not a multiple of 8
        with pytest.raises(ValueError, match="crosses a rank boundary at 20, 15 tokens after its start"):
            cp(tokens[:, :20], cu, start=0)
        with pytest.raises(ValueError, match="crosses a rank boundary at 20"):
            cp(tokens[:, 20:], cu, start=20)
        with pytest.raises(ValueError, match="start must be 0"):  # boundaries 8 and 16 after a start: no crossing error
            cp(tokens[:, 13:21], cu, start=13)
        with pytest.raises(ValueError, match="holds the end of the packed row"):
            cp(tokens[:, :13], cu, start=0)
        with pytest.raises(ValueError, match="start is needed"):
            cp(tokens[:, :20], cu)
        with pytest.raises(ValueError, match="outside the packed row"):
            cp(tokens[:, :20], cu, start=20)
        with pytest.raises(TypeError, match="start must be an int"):
            cp(tokens, cu, start=0.0)
        with pytest.raises(ValueError, match="start locates a slice"):
            cp(tokens[:, :16], start=0)
        with pytest.raises(ValueError, match="batch size 1"):
            cp(tokens.reshape(2, 15), cu)
        with pytest.raises(TypeError, match="cu_seqlens"):
            cp(tokens, cu.float())
        with pytest.raises(ValueError, match="non-decreasing"):
            cp(tokens, torch.tensor([0, 20, 5, 30]))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# worker


def _worker(rank, tmpdir, names):
    import torch.distributed as dist

    from megalodon_kernels.model import Megalodon
    from megalodon_kernels.model.parallel import ChunkParallelMegalodon, allreduce_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv", rank=rank, world_size=WORLD)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(tmpdir, "ready")):  # the parent is saving the cases
        if time.monotonic() > deadline:
            raise TimeoutError("the test process never wrote the cases")
        time.sleep(0.02)
    for name in names:
        saved = torch.load(os.path.join(tmpdir, f"{name}.pt"), weights_only=False)
        model = Megalodon(saved["cfg"]).to(saved["dtype"])
        model.load_state_dict(saved["state"])
        cp = ChunkParallelMegalodon(model)
        tokens, cu, weights, start = _row(name)
        sl = slice(0, start) if rank == 0 else slice(start, tokens.shape[1])
        equal = CASES[name][2] is None  # equal slices: the default start (rank * L_local)
        logits = cp(tokens[:, sl], cu) if equal else cp(tokens[:, sl], cu, start=sl.start)
        (logits * weights[:, sl]).sum().backward()
        allreduce_gradients(model)
        torch.save({"logits": logits.detach(), "grads": {k: p.grad.clone() for k, p in model.named_parameters()}},
                   os.path.join(tmpdir, f"{name}.rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds under load); results are on disk


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), sys.argv[3], sys.argv[4].split(","))
