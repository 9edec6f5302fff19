"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the model: its modules return no views.

FSDP2 hooks a wrapped module's output for its pre-backward all-gather; an in-place op on an output
that is a view (``out += y``) drops that hook, so FSDP2 warns when a module returns one. The model's
fused residual sums reshape a 2-D GEMM output back to (B, L, D) (model/layers.py, ``fresh_view``).

* ``test_modules_return_no_views``: every module of ours, in every block variant, returns tensors
  with ``_base is None`` whenever autograd records (without autograd a view is harmless, FSDP2 hooks
  nothing then, and decoding keeps the cheaper ``view``).
* ``test_fully_shard_two_gloo_ranks_equals_one_process``: two CPU processes (gloo, file rendezvous),
  every block and the root wrapped in ``fully_shard`` on a 1-D mesh; forward + loss + backward on
  half of the global batch each: no view warning (the workers first check that FSDP2 on this torch
  does warn for a module returning a view), and the gradients equal one process running the whole
  batch. FSDP2 averages the gradients over the mesh (reduce-scatter, divide factor = world size),
  and each rank's loss is the mean over an equal share of tokens, so the average is the gradient of
  the global mean loss. Workers are launched as ``python tests/test_fsdp.py --worker RANK DIR``.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import ranks_finished, start_ranks

WORLD = 2
B, L = 4, 32  # global batch (B sequences of L + 1 tokens); each rank takes B / WORLD
VIEW_WARNING = "returned a view tensor"
#: whether this torch's FSDP2 checks for a module that returns a view (torch 2.11's has no such check: the
#: control below cannot be made there; the numbers are still compared)
FSDP_WARNS_ON_VIEWS = VIEW_WARNING in inspect.getsource(
    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state"))


def _model(**overrides):
    from megalodon_kernels.model import Megalodon, get_config

    torch.manual_seed(1234)
    model = Megalodon(get_config("tiny", **overrides))
    with torch.no_grad():  # move the zero-initialised parameters (norm scales, biases, gamma/beta) off zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _loss(model, tokens, **kwargs):
    logits = model(tokens[:, :-1], **kwargs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------
# single process: no module of ours returns a view


def _our_modules(model):
    import megalodon_kernels.model as pkg

    ours = pkg.__name__ + "."
    return [(n, m) for n, m in model.named_modules() if type(m).__module__.startswith(ours)]


VARIANTS = {
    "plain": ({}, {}),
    "swiglu": ({"swiglu": True}, {}),
    "rescale_nffn": ({"rescale_nffn": True}, {}),
    "dropout": ({"dropout": 0.1, "hidden_dropout": 0.1}, {}),  # the unfused residual path
    "layerwise_ckpt": ({"layerwise_ckpt": True}, {}),
    "prior_count": ({"norm_prior_count": 2}, {}),
    "segment_ids": ({}, {"segment_ids": torch.tensor([[0] * 10 + [1] * (L - 10)] * 2)}),
    "cu_seqlens": ({}, {"cu_seqlens": torch.tensor([0, 7, 2 * L])}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_modules_return_no_views(variant):
    overrides, kwargs = VARIANTS[variant]
    model = _model(num_layers=1, **overrides)  # one block: the variants differ inside a block
    tokens = torch.randint(0, 256, (2, L + 1), generator=torch.Generator().manual_seed(1))
    if "cu_seqlens" in kwargs:
        tokens = tokens.reshape(1, -1)[:, : 2 * L + 1]
    seen, views = set(), []

    def check(name, module, output):
        outs = [output] if isinstance(output, torch.Tensor) else list(output) if isinstance(output, tuple) else []
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                seen.add(type(module).__name__)
                if t._base is not None:
                    views.append(f"{name or 'root'} ({type(module).__name__}) output {i} {tuple(t.shape)}")

    modules = _our_modules(model)
    for name, module in modules:
        module.register_forward_hook(lambda mod, args, out, name=name: check(name, mod, out))
    for mode in ("train", "eval"):
        getattr(model, mode)()
        _loss(model, tokens, **kwargs).backward()
    if variant == "plain":  # a stream with autograd on (the cache path of MegalodonAttention)
        cache = model.init_cache(2)
        model(tokens[:, :5], cache=cache)
        model(tokens[:, 5:9], cache=cache).sum().backward()
    # the hooks saw every kind of block-level module of ours (a rule over nothing would pass)
    assert {"Megalodon", "MegalodonBlock", "MegalodonAttention", "NormalizedFFN", "TimestepNorm",
            "ComplexEMA", "RMSNorm", "LayerNorm"} <= seen, seen
    assert not views, "modules returned views:\n" + "\n".join(sorted(set(views)))


def test_fresh_view_keeps_values_and_gradients_and_is_no_view():
    from megalodon_kernels.model.layers import fresh_view

    x = torch.randn(6, 4, requires_grad=True)
    y = fresh_view(x * 2, (2, 3, 4))
    assert y._base is None and y.shape == (2, 3, 4)
    y += 1  # an in-place op on the output: autograd still sees the whole chain
    (y * y).sum().backward()
    torch.testing.assert_close(x.grad, (4 * (2 * x + 1)).detach(), rtol=0, atol=0)
    with torch.no_grad():  # without autograd: a plain view (cheaper; nothing to hook)
        assert fresh_view(x * 2, (2, 3, 4))._base is not None


# ---------------------------------------------------------------------------------------------
# two gloo ranks under fully_shard against one process


def _reference(tmpdir):
    model = _model()
    tokens = torch.randint(0, 256, (B, L + 1), generator=torch.Generator().manual_seed(2))
    torch.save({"state": model.state_dict(), "tokens": tokens}, os.path.join(tmpdir, "case.pt"))
    open(os.path.join(tmpdir, "ready"), "w").close()
    loss = _loss(model, tokens)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fully_shard_two_gloo_ranks_equals_one_process(tmp_path):
    tmpdir = str(tmp_path)
    t0 = time.perf_counter()
    # the workers start first: their imports overlap the reference run; they wait for "ready"
    procs = start_ranks([[__file__, "--worker", str(r), tmpdir] for r in range(WORLD)])
    with ranks_finished(procs):
        ref_loss, ref_grads = _reference(tmpdir)
    print(f"\n2-rank FSDP2 launch: {time.perf_counter() - t0:.1f} s wall")
    results = [torch.load(os.path.join(tmpdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        # the control: FSDP2 on this torch warns about a module that returns a view
        if FSDP_WARNS_ON_VIEWS:
            assert any(VIEW_WARNING in w for w in res["control_warnings"]), (r, res["control_warnings"])
        assert not [w for w in res["warnings"] if VIEW_WARNING in w], (r, res["warnings"])
        assert res["sharded"], f"rank {r}: the parameters are not DTensors sharded over the mesh"
    assert sum(res["loss"] for res in results) / WORLD == pytest.approx(ref_loss, rel=1e-6)
    for r, res in enumerate(results):
        assert set(res["grads"]) == set(ref_grads)
        for n, g in ref_grads.items():
            got = res["grads"][n]
            # fp32 with another summation order (two halves, then the average): measured <= 5e-7
            # relative to the parameter's largest gradient
            scale = float(g.abs().max())
            assert scale > 0, n
            err = float((got - g).abs().max())
            assert err <= 1e-5 * scale, f"rank {r} grad {n}: max error {err:.3g}, largest gradient {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# worker


def _worker(rank, tmpdir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rdzv", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))

        # control: a wrapped module that returns a view makes FSDP2 warn here
        toy = torch.nn.Linear(4, 4)
        fully_shard(toy, mesh=mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            toy(torch.randn(3, 4)).t().sum().backward()  # output not a view: no warning expected
            toy.forward = (lambda f: (lambda x: f(x).t()))(toy.forward)  # now it returns a view
            toy(torch.randn(3, 4)).sum().backward()
        control = [str(w.message) for w in caught]

        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(tmpdir, "ready")):  # the parent is saving the case
            if time.monotonic() > deadline:
                raise TimeoutError("the test process never wrote the case")
            time.sleep(0.02)
        saved = torch.load(os.path.join(tmpdir, "case.pt"), weights_only=False)
        model = _model()
        model.load_state_dict(saved["state"])
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        share = B // WORLD
        tokens = saved["tokens"][rank * share:(rank + 1) * share]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = _loss(model, tokens)
            loss.backward()
        sharded = all(isinstance(p, DTensor) and p.device_mesh == mesh for p in model.parameters())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        torch.save({"loss": loss.item(), "grads": grads, "warnings": [str(w.message) for w in caught],
                    "control_warnings": control, "sharded": sharded}, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: python tests/test_fsdp.py --worker RANK DIR (the test launches it)")
