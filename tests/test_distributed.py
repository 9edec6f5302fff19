"""FSDP2 x chunk parallelism (model/distributed.py, model/dist_checkpoint.py) against one process.

One launch of 4 worker processes (gloo, file rendezvous, loopback only; ``python
tests/test_distributed.py --worker RANK DIR``) runs every multi-rank case on a 2 x 2 mesh
(dp x cp) and a 4 x 1 one, while the parent computes the single-process references:

* ``packed``: one packed row per data rank, documents crossing the chunk-rank boundary (a state
  carried over) and starting on chunk rank 1; ``cu_seqlens`` given. fp32: loss and every gradient
  within 1e-5 of one process running the global batch (the mean over all its predicted tokens).
* ``segments_ckpt``: the same rows given as ``segment_ids`` (each rank its own slice), every block
  under activation checkpointing (recomputed in the backward without a second exchange: the
  receive / send counts per step are those of the case without checkpointing).
* ``unpacked_ckpt``: 2 unpacked rows per data rank, checkpointing on.
* ``bf16``: ``param_dtype=torch.bfloat16`` on the packed rows: the CEMA / norm parameters are fp32
  inside their forward, the linear ones bf16, every sharded parameter and gradient fp32; loss and
  gradients within the bf16 budget (BF16_TOL) of the fp32 reference.
* checkpoints: 4 AdamW steps on 2 x 2 saving after step 2; a fresh model loading it on 2 x 2
  repeats steps 3-4 bit for bit (and gets its RNG state back); one on 4 x 1 within fp32 tolerance;
  the parent (1 x 1) too. On every mesh the loaded parameters equal the saved ones bit for bit and
  each rank gets its data position (JSON and a tensor) back. (Refusing planted payloads:
  tests/test_checkpoint_safety.py.) Loading into a model of another config raises and changes nothing.
* bad input: a mesh without the dims asked for, a cp size that does not cut rows into whole chunks.

With ``--stress`` the same launch also runs unpacked rows on a 1 x 4 mesh (the state passed through
three chunk-rank boundaries), with and without checkpointing.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from support import ranks_finished, start_ranks

WORLD = 4
CHUNK, VOCAB = 8, 48
IGNORE = -100
# two packed rows of 32 tokens (one per data rank); with cp = 2 the chunk-rank boundary is at 16:
# row 0's third document (from 8) crosses it 8 = C after its start; row 1's second (from 8) too,
# and a document starts on chunk rank 1 (at 20)
DOCS = ([8, 20, 4], [5, 3, 12, 12])
ROW = 32
B_UNPACKED = 4  # unpacked global batch: 4 rows of ROW tokens
FP32_TOL = 1e-5  # relative to the largest |value| of the reference (loss: relative)
# bf16 compute (fp32 CEMA / norms / reductions) against the fp32 reference: measured loss 2.5e-4
# relative, gradients 5.0e-2 of the largest |gradient| per parameter (layers.1.mega.wr.weight:
# bf16's 2**-8 rounding through two blocks); the budgets are 4x and 2x that
BF16_TOL = {"loss": 1e-3, "grad": 1e-1}
CKPT_STEPS, CKPT_AT = 4, 2


def _config(**kw):
    from megalodon_kernels.model import get_config

    base = dict(num_layers=2, model_dim=32, z_dim=16, value_dim=32, ffn_hidden_dim=48, cema_ndim=4, chunk_size=CHUNK,
                norm_num_groups=4, vocab_size=VOCAB, backend="torch")
    return get_config("tiny", **{**base, **kw})


def _model(**kw):
    from megalodon_kernels.model import Megalodon

    torch.manual_seed(1234)
    model = Megalodon(_config(**kw))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # move the zero-initialised parameters (norm scales, biases) off zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _packed_rows():
    """tokens (2, ROW), labels (2, ROW) (IGNORE at each document's last position), cu_seqlens per row,
    segment ids (2, ROW)."""
    from megalodon_kernels.model import pack

    g = torch.Generator().manual_seed(3)
    toks, labs, cus, segs = [], [], [], []
    for lengths in DOCS:
        t, cu = pack([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
        lab = torch.roll(t, -1, dims=1)
        lab[0, cu[1:] - 1] = IGNORE
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        toks.append(t), labs.append(lab), cus.append(cu), segs.append(seg)
    return torch.cat(toks), torch.cat(labs), cus, torch.cat(segs)


def _unpacked_batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, VOCAB, (B_UNPACKED, ROW + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _reference(model, case):
    """(loss, {name: grad}) of one process over the global batch: the mean over its predicted tokens."""
    model.zero_grad(set_to_none=True)
    if case.startswith("unpacked"):
        tokens, labels = _unpacked_batch()
        logits = model(tokens)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        n = labels.numel()
    else:
        tokens, labels, cus, _ = _packed_rows()
        total, n = 0.0, 0
        for d in range(len(DOCS)):
            logits = model(tokens[d:d + 1], cu_seqlens=cus[d])
            total = total + F.cross_entropy(logits.flatten(0, 1), labels[d], reduction="sum", ignore_index=IGNORE)
            n += int((labels[d] != IGNORE).sum())
    loss = total / n
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


CASES = ("packed", "segments_ckpt", "unpacked_ckpt", "bf16")
# with --stress also: 4 chunk ranks of one data rank (1 x 4: each slice one attention chunk, the
# state passed through three ranks), with and without checkpointing
STRESS_CASES = ("unpacked_1x4", "unpacked_1x4_ckpt")


def _data_state(rank):
    """A data position per rank, JSON and a tensor (saved without pickle)."""
    return {"next_step": CKPT_AT + 1, "rank": rank, "order": torch.arange(4) + 10 * rank}


def _same_data(got, want):
    return got.keys() == want.keys() and all(torch.equal(v, want[k]) if isinstance(v, torch.Tensor) else v == want[k]
                                            for k, v in got.items())


def _full_state(dm):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in dm.module.state_dict().items()}


def _train_losses(dm, opt, steps, first=1):
    losses = []
    for step in range(first, steps + 1):
        tokens, labels = _unpacked_batch(step)
        tok, lab = dm.local_batch(tokens, labels)
        opt.zero_grad(set_to_none=True)
        share = dm.loss(tok, lab)
        share.backward()
        opt.step()
        losses.append(dm.global_loss(share))
    return losses


# ---------------------------------------------------------------------------------------------
# parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    tmpdir = str(tmp_path_factory.mktemp("dist"))
    t0 = time.perf_counter()
    stress = request.config.getoption("--stress")
    procs = start_ranks([[__file__, "--worker", str(r), tmpdir] + (["--stress"] if stress else [])
                         for r in range(WORLD)])
    with ranks_finished(procs, timeout=480 if stress else 240):
        refs = {c: _reference(_model(), c) for c in ("packed", "unpacked_ckpt")}  # unpacked: every unpacked case
    res = [torch.load(os.path.join(tmpdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    print(f"\n4-rank launch: {time.perf_counter() - t0:.1f} s wall; rank 0 after start-up, cumulative: "
          f"{res[0]['timing']}")
    return tmpdir, refs, res


def _rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.mark.parametrize("case", CASES + STRESS_CASES)
def test_matches_one_process(runs, case):
    _, refs, res = runs
    if case not in res[0]:
        pytest.skip(f"{case}: run with --stress")
    ref_loss, ref_grads = refs["unpacked_ckpt" if case.startswith("unpacked") else "packed"]
    tol_loss, tol_grad = (BF16_TOL["loss"], BF16_TOL["grad"]) if case == "bf16" else (FP32_TOL, FP32_TOL)
    worst, where = 0.0, ""
    for r, out in enumerate(res):
        got = out[case]
        assert got["loss"] == pytest.approx(ref_loss, rel=tol_loss), (case, r)
        assert set(got["grads"]) == set(ref_grads)
        for k, g in ref_grads.items():
            e = _rel(got["grads"][k], g)
            worst, where = max((worst, where), (e, k))
            assert e <= tol_grad, f"{case} rank {r} grad {k}: relative error {e:.3g} > {tol_grad}"
    # clip_grad_norm_'s total norm over sharded (and, in bf16, replicated) gradients: the gathered ones'
    for r, out in enumerate(res):
        full = torch.cat([g.double().flatten() for g in out[case]["grads"].values()]).norm().item()
        assert out[case]["norm"] == pytest.approx(full, rel=1e-6), (case, r)
    print(f"{case}: loss {res[0][case]['loss']:.6f} vs {ref_loss:.6f}, worst gradient error {worst:.2e} ({where})")


def test_checkpointing_does_not_resend(runs):
    _, _, res = runs
    for r, out in enumerate(res):
        plain, ckpt = out["packed"]["messages"], out["segments_ckpt"]["messages"]
        # segment_ids add one all-gather (counted by time, not as messages); the p2p traffic is the same
        assert plain == ckpt and plain > 0, (r, plain, ckpt)
        if "unpacked_1x4" in out:  # --stress: middle chunk ranks receive and send
            assert out["unpacked_1x4"]["messages"] == out["unpacked_1x4_ckpt"]["messages"] > 0, r


def test_bf16_keeps_cema_and_norms_fp32(runs):
    _, _, res = runs
    for r, out in enumerate(res):
        seen = out["bf16"]["dtypes"]
        fp32 = {k for k, v in seen.items() if v == torch.float32}
        low = {k for k, v in seen.items() if v == torch.bfloat16}
        assert {"mega.cema.alpha", "mega.cema.gamma", "mega.timenorm.weight", "mega.rmsnorm.weight",
                "nffn.norm.weight", "final_norm.weight"} <= fp32, seen
        # (the head runs fused with the loss, not as a module call: its dtype shows in the loss' gradient)
        assert {"mega.wv.weight", "mega.gamma", "nffn.fc1.weight", "embed.weight"} <= low, seen
        # the fp32 ones are exactly the CEMA and norm parameters, replicated (not FSDP-sharded)
        assert fp32 == {k for k in seen if k.split(".")[-2] in ("cema", "timenorm", "rmsnorm", "norm", "final_norm")}
        assert out["bf16"]["replicated_dtypes"] == {torch.float32}
        assert out["bf16"]["sharded_dtypes"] == {torch.float32}, out["bf16"]["sharded_dtypes"]
        assert out["bf16"]["grad_dtypes"] == {torch.float32}, out["bf16"]["grad_dtypes"]


def test_resume_same_mesh_bit_for_bit(runs):
    _, _, res = runs
    for r, out in enumerate(res):
        ck = out["ckpt"]
        assert ck["resumed_22"] == ck["full"][CKPT_AT:], (r, ck)
        assert ck["rng_restored"], r
        assert ck["step_loaded"] == CKPT_AT
        assert ck["params_equal_22"] and ck["params_equal_41"], r
        assert _same_data(ck["data_22"], _data_state(r)) and _same_data(ck["data_41"], _data_state(r)), (r, ck)


def test_resume_other_meshes(runs):
    tmpdir, _, res = runs
    full = res[0]["ckpt"]["full"]
    for r, out in enumerate(res):
        assert out["ckpt"]["resumed_41"] == pytest.approx(full[CKPT_AT:], rel=FP32_TOL), r
    # 1 x 1: this process alone
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megalodon_kernels.model.dist_checkpoint import load_checkpoint
    from megalodon_kernels.model.distributed import parallelize

    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv1", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
        dm = parallelize(_model(), mesh)
        opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
        loaded = load_checkpoint(os.path.join(tmpdir, "ckpt"), dm, opt)
        assert loaded["step"] == CKPT_AT and _same_data(loaded["data"], _data_state(0))  # rank 0's
        assert all(torch.equal(v, res[0]["ckpt"]["params"][k]) for k, v in _full_state(dm).items())
        losses = _train_losses(dm, opt, CKPT_STEPS, first=CKPT_AT + 1)
        assert losses == pytest.approx(full[CKPT_AT:], rel=FP32_TOL)

        # another config: a clear error, nothing loaded
        from megalodon_kernels.model import Megalodon

        torch.manual_seed(5)
        other = parallelize(Megalodon(_config(cema_ndim=2)), mesh)
        opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
        before = {k: v.full_tensor().clone() for k, v in other.module.state_dict().items() if hasattr(v, "full_tensor")}
        with pytest.raises(ValueError, match=r"path=.*another model config \(cema_ndim: checkpoint 4 vs model 2"):
            load_checkpoint(os.path.join(tmpdir, "ckpt"), other, opt2)
        after = other.module.state_dict()
        assert all(torch.equal(after[k].full_tensor(), v) for k, v in before.items())
        assert not opt2.state
        # the same model with another optimizer (SGD's momentum buffers are not in the checkpoint)
        same = parallelize(_model(), mesh)
        sgd = torch.optim.SGD(same.parameters(), lr=0.1, momentum=0.9)
        before = {k: v.full_tensor().clone() for k, v in same.module.state_dict().items() if hasattr(v, "full_tensor")}
        with pytest.raises(ValueError, match=r"does not fit this model / optimizer: missing \['optim.state.*momentum"):
            load_checkpoint(os.path.join(tmpdir, "ckpt"), same, sgd)
        after = same.module.state_dict()
        assert all(torch.equal(after[k].full_tensor(), v) for k, v in before.items())
        assert not sgd.state  # the zero state get_state_dict made for the comparison is gone again
    finally:
        dist.destroy_process_group()


def test_mesh_dims_and_cp_size(runs, tmp_path):
    _, _, res = runs
    for r, out in enumerate(res):
        msg = out["bad"]["cp_whole_chunks"]
        assert "cp size 2" in msg and "whole attention chunks" in msg, msg
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megalodon_kernels.model import Megalodon
    from megalodon_kernels.model.distributed import parallelize

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="cp_dim='cp' is not a dim of mesh"):
            parallelize(Megalodon(_config()), init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
        with pytest.raises(ValueError, match="exactly one data-parallel dim"):
            parallelize(Megalodon(_config()), init_device_mesh("cpu", (1, 1), mesh_dim_names=("x", "cp")))
        with pytest.raises(ValueError, match="named dims"):
            parallelize(Megalodon(_config()), init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match="neither data_dim='dp' nor cp_dim='cp'"):
            parallelize(Megalodon(_config()), init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp")))
        # an fsdp-only mesh without chunk parallelism: one process, the plain model's loss and gradients
        ref = _model()
        tokens, labels = _unpacked_batch()
        loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        dm = parallelize(_model(), init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)), cp_dim=None)
        share = dm.loss(*dm.local_batch(tokens, labels))
        share.backward()
        assert dm.cp_size == 1 and share.item() == pytest.approx(loss.item(), rel=FP32_TOL)
        for (k, p), q in zip(dm.module.named_parameters(), ref.parameters()):
            assert _rel(p.grad.full_tensor(), q.grad) <= FP32_TOL, k
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# worker


def _worker(rank, tmpdir, stress=False):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from megalodon_kernels.model.dist_checkpoint import load_checkpoint, save_checkpoint
    from megalodon_kernels.model.distributed import parallelize

    import faulthandler

    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where every rank waits
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv", rank=rank, world_size=WORLD)
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    mesh41 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "cp"))
    out = {}
    tokens, labels, cus, segs = _packed_rows()
    t0 = time.perf_counter()
    timing = {"start": t0}
    cases = [(c, mesh22) for c in CASES]
    if stress:
        mesh14 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "cp"))
        cases += [(c, mesh14) for c in STRESS_CASES]
    for case, mesh in cases:
        dm = parallelize(_model(), mesh, checkpoint_layers=case.endswith("ckpt"),
                         param_dtype=torch.bfloat16 if case == "bf16" else None)
        res = {}
        if case == "bf16":  # the parameters' dtypes inside their forward
            dtypes = {}
            for name, mod in dm.module.named_modules():
                def hook(m, args, name=name):
                    for pn, p in m.named_parameters(recurse=False):
                        dtypes[(name.split(".", 2)[-1] if name.startswith("layers.") else name.split(".")[-1])
                               + "." + pn] = p.dtype
                mod.register_forward_pre_hook(hook)
            res["dtypes"] = dtypes
        if case.startswith("unpacked"):
            tb, lb = _unpacked_batch()
            tok, lab = dm.local_batch(tb, lb)
            share = dm.loss(tok, lab)
        else:
            d = dm.dp_rank
            tok, lab = dm.local_batch(tokens, labels, packed=True)  # data rank d: row d
            if case == "segments_ckpt":
                seg = dm.local_batch(segs, packed=True)
                share = dm.loss(tok, lab, segment_ids=seg)
            else:
                share = dm.loss(tok, lab, cu_seqlens=cus[d])
        share.backward()
        res["loss"] = dm.global_loss(share)
        res["messages"] = dm.comm.messages
        res["grads"] = {k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                        for k, p in dm.module.named_parameters()}
        res["norm"] = float(dm.clip_grad_norm_(1e30))  # no clipping: the total norm
        res["replicated"] = {k for k, p in dm.module.named_parameters() if not isinstance(p, DTensor)}
        res["replicated_dtypes"] = {p.dtype for p in dm.parameters() if not isinstance(p, DTensor)}
        res["sharded_dtypes"] = {p.dtype for p in dm.parameters() if isinstance(p, DTensor)}
        res["grad_dtypes"] = {p.grad.dtype for p in dm.parameters()}
        out[case] = res
        timing[case] = time.perf_counter() - t0

    # checkpoints: 4 steps uninterrupted, saving after step 2
    ckdir = os.path.join(tmpdir, "ckpt")
    dm = dm22 = parallelize(_model(), mesh22)
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    full = _train_losses(dm, opt, CKPT_AT)
    save_checkpoint(ckdir, dm, opt, step=CKPT_AT, data_state=_data_state(rank))
    rng_at_save = torch.get_rng_state()
    ck = {"full": full, "params": _full_state(dm)}
    torch.manual_seed(999 + rank)  # the resumed runs must get the saved state back
    full += _train_losses(dm, opt, CKPT_STEPS, first=CKPT_AT + 1)
    for name, mesh in (("22", mesh22), ("41", mesh41)):
        dm = parallelize(_model(), mesh)
        opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
        loaded = load_checkpoint(ckdir, dm, opt)
        # the loaded parameters equal the saved ones bit for bit on any mesh (DCP reshards, nothing rounds)
        ck[f"params_equal_{name}"] = all(torch.equal(v, ck["params"][k]) for k, v in _full_state(dm).items())
        ck[f"data_{name}"] = loaded["data"]
        if name == "22":
            ck["rng_restored"] = torch.equal(torch.get_rng_state(), rng_at_save)
            ck["step_loaded"] = loaded["step"]
        ck[f"resumed_{name}"] = _train_losses(dm, opt, CKPT_STEPS, first=loaded["step"] + 1)
    out["ckpt"] = ck
    timing["ckpt"] = time.perf_counter() - t0

    bad = {}
    dm.local_batch(torch.zeros(4, 3 * CHUNK, dtype=torch.long))  # mesh41: cp = 1 fits any whole chunks
    try:
        dm22.local_batch(torch.zeros(2, 3 * CHUNK, dtype=torch.long))  # 24 tokens: 12 per cp rank
        bad["cp_whole_chunks"] = "no error"
    except ValueError as e:
        bad["cp_whole_chunks"] = str(e)
    out["bad"] = bad
    out["timing"] = {k: round(v, 2) for k, v in timing.items() if k != "start"}
    torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds under load); results are on disk


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), sys.argv[3], stress="--stress" in sys.argv[4:])
