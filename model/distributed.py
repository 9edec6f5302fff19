"""FSDP2 x chunk parallelism on a 2-D DeviceMesh: :func:`parallelize` in one call.

The world is a mesh of D data ranks x P chunk ranks (named dims ``dp`` or ``fsdp``, and ``cp``; either
may have size 1). Data rank d holds its own rows of the global batch; the P chunk ranks of one data
rank hold consecutive slices of those rows (model/parallel.py: per layer, the CEMA state and the
TimestepNorm statistics go from chunk rank c to c + 1 in the forward, their gradients back).
Parameters, gradients and optimizer state are sharded by FSDP2 (``fully_shard``) over *all* D x P
ranks (the two dims flattened), since every rank holds the same parameters: each block is one
FSDP group (all-gathered before its forward and, if resharded, again before its backward;
its gradients reduce-scattered after its backward), the embedding, final norm and head form the
root group.

Gradient reduction is a sum over the D x P ranks (FSDP's divide factor set to 1), and
:meth:`DistributedMegalodon.loss` divides each rank's token-loss sum by the number of predicted
tokens of the whole global batch: so the reduced gradient is exactly the gradient of the global
mean loss that one process running the whole batch would get.

Mixed precision (``param_dtype=torch.bfloat16``): blocks and root compute with bf16 parameters
(gathered in bf16, gradients reduce-scattered in ``reduce_dtype``, fp32 by default), while the
parameters of every ComplexEMA, TimestepNorm, RMSNorm and LayerNorm stay fp32 throughout: they are
left out of FSDP's groups (``ignored_params``), replicated on every rank, their modules compute in
fp32 (inputs cast up, the main output cast back to bf16 for the bf16 matmuls that follow;
TimestepNorm's statistics, which cross ranks, stay fp32), and their gradients are summed over the
mesh in fp32 by one all-reduce at the end of the backward. (They are not FSDP groups of their own:
a group's reduce-scatter inside a block's backward would be a collective that a chunk rank joins
only after its successor's state gradient arrived, while the successor joins it before sending
that gradient, a deadlock.) They are small (per block D (3 N + 2) + 5 D + G values for model dim D,
CEMA dim N and G norm groups), so replicating them costs little memory.
The sharded parameters and the optimizer state stay in the model's dtype (fp32).

Activation checkpointing (``checkpoint_layers=True``) recomputes each block in the backward
without repeating the state exchange (model/parallel.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .layers import ComplexEMA, LayerNorm, RMSNorm, TimestepNorm
from .megalodon import Megalodon
from .parallel import ChunkParallelMegalodon

__all__ = ["parallelize", "DistributedMegalodon", "FP32_MODULES", "DATA_DIMS"]

#: the module types whose parameters (and gradient reductions) stay fp32 under a low-precision policy
FP32_MODULES = (ComplexEMA, TimestepNorm, RMSNorm, LayerNorm)
#: accepted names of the data-parallel mesh dim
DATA_DIMS = ("dp", "fsdp")


class DistributedMegalodon(ChunkParallelMegalodon):
    """A :class:`~.parallel.ChunkParallelMegalodon` over the mesh's ``cp`` dim, made by :func:`parallelize`
    (and then itself the root FSDP module). ``forward`` takes this rank's piece of the batch
    (:meth:`local_batch` cuts it); :meth:`loss` is the training loss to call ``backward`` on."""

    def __init__(self, model: Megalodon, mesh, data_dim: str, cp_dim: Optional[str], checkpoint_layers: bool):
        # without a cp dim every rank is a chunk group of its own (new_subgroups: one collective call)
        group = mesh.get_group(cp_dim) if cp_dim is not None else dist.new_subgroups(1)[0]
        super().__init__(model, group, checkpoint_layers=checkpoint_layers)
        self.mesh, self.data_dim, self.cp_dim = mesh, data_dim, cp_dim
        self.dp_rank, self.dp_size = mesh.get_local_rank(data_dim), mesh.size(mesh.mesh_dim_names.index(data_dim))
        self.cp_rank, self.cp_size = self.rank, self.world
        self.world_group = None  # the group of every rank of the mesh (set by parallelize)
        self.replicated = []  # fp32 parameters outside FSDP under a low-precision policy (summed here)
        self._reduce_queued = False

    def _trunk(self, tokens, cu_seqlens, start):
        x = super()._trunk(tokens, cu_seqlens, start)
        if self.replicated and torch.is_grad_enabled():
            x = _ReduceReplicated.apply(x, self)
        return x

    def _reduce_replicated(self):
        """Sum the replicated fp32 parameters' gradients over the mesh: one flat fp32 all-reduce."""
        self._reduce_queued = False
        params = [p for p in self.replicated if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        dist.all_reduce(flat, group=self.world_group)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()

    def local_batch(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None, *, packed: bool = False):
        """This rank's piece of a global batch (B, L) (and of ``labels``): rows [d B/D, (d+1) B/D) of data
        rank d, columns [c L/P, (c+1) L/P) of chunk rank c. Unpacked rows must split into whole
        attention chunks (L a multiple of P x chunk_size); packed rows (``packed=True``, give the
        whole row's cu_seqlens to forward) only into equal slices."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise TypeError(f"tokens must be a tensor (B, L), got {tuple(getattr(tokens, 'shape', ()))}")
        B, L = tokens.shape
        D, P, C = self.dp_size, self.cp_size, self.module.config.chunk_size
        if B % D:
            raise ValueError(f"the batch of {B} rows does not split over the {D} ranks of mesh dim "
                             f"'{self.data_dim}' (B must be a multiple of the {self.data_dim} size)")
        if packed:
            if L % P:
                raise ValueError(f"a packed row of {L} tokens does not split into {P} equal slices for mesh dim "
                                 f"'{self.cp_dim}' (cp size {P}); pad the row or pass unequal slices with start=")
        elif L % (P * C):
            raise ValueError(f"cp size {P} (mesh dim '{self.cp_dim}') does not divide rows of {L} tokens into whole "
                             f"attention chunks of chunk_size={C}: L must be a multiple of cp * chunk_size = {P * C}")
        rows = slice(self.dp_rank * (B // D), (self.dp_rank + 1) * (B // D))
        cols = slice(self.cp_rank * (L // P), (self.cp_rank + 1) * (L // P))
        if labels is None:
            return tokens[rows, cols]
        if labels.shape != tokens.shape:
            raise ValueError(f"labels must have the tokens' shape {tuple(tokens.shape)}, got {tuple(labels.shape)}")
        return tokens[rows, cols], labels[rows, cols]

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
             **kwargs) -> torch.Tensor:
        """This rank's share of the global mean token cross-entropy: its token-loss sum divided by the
        number of predicted tokens of the whole global batch (one small all-reduce). The shares sum to
        the global mean, and FSDP's summed gradients are its gradient. ``kwargs``: cu_seqlens, start,
        segment_ids, as for forward. :meth:`global_loss` gives the sum for logging."""
        count = (labels != ignore_index).sum().to(torch.float64).reshape(1)
        dist.all_reduce(count, group=self.world_group)
        total = self(tokens, labels=labels, ignore_index=ignore_index, **kwargs)
        return total / count.to(total.dtype).clamp_min(1)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / total norm) and return the total norm (fp32):
        the norm of the whole model's gradient, from the sharded ones (summed over the mesh) and the
        replicated fp32 ones of a low-precision policy (the same on every rank), which
        ``torch.nn.utils.clip_grad_norm_`` cannot mix."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.parameters() if p.grad is not None]
        sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        dev = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in sharded:
            sq += g.double().pow(2).sum()
        dist.all_reduce(sq, group=self.world_group)
        for g in plain:
            sq += g.double().pow(2).sum()
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in sharded + plain:
            g.mul_(coef.to(g.dtype))
        return norm.float().reshape(())

    def global_loss(self, share: torch.Tensor) -> float:
        """The global mean loss from every rank's :meth:`loss` share (an all-reduce; for logging)."""
        t = share.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(t, group=self.world_group)
        return float(t)


class _ReduceReplicated(torch.autograd.Function):
    """Identity whose backward queues the replicated parameters' gradient all-reduce for the end of
    the backward pass (after every block's backward, the same point on every rank)."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        owner = ctx.owner
        if not owner._reduce_queued:
            owner._reduce_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(owner._reduce_replicated)
        return g, None


def _mesh_dims(mesh, data_dim: Optional[str], cp_dim: Optional[str]) -> Tuple[str, Optional[str]]:
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError("mesh must be a DeviceMesh with named dims, e.g. init_device_mesh('cpu', (2, 2), "
                         "mesh_dim_names=('dp', 'cp')); got one without names")
    if data_dim is None:
        found = [n for n in DATA_DIMS if n in names]
        if len(found) != 1:
            raise ValueError(f"mesh needs exactly one data-parallel dim named one of {DATA_DIMS} (or pass "
                             f"data_dim=); its dims are {names}")
        data_dim = found[0]
    elif data_dim not in names:
        raise ValueError(f"data_dim={data_dim!r} is not a dim of mesh, whose dims are {names}")
    if cp_dim is not None and cp_dim not in names:
        raise ValueError(f"cp_dim={cp_dim!r} is not a dim of mesh, whose dims are {names} (name the chunk-parallel "
                         f"dim 'cp', give its name as cp_dim=, or pass cp_dim=None for no chunk parallelism)")
    extra = [n for n in names if n not in (data_dim, cp_dim)]
    if extra:
        raise ValueError(f"mesh has dims {extra} that are neither data_dim={data_dim!r} nor cp_dim={cp_dim!r}; "
                         f"pass the sub-mesh mesh[({data_dim!r}, {cp_dim!r})]")
    return data_dim, cp_dim


def _cast_inputs_hook(dtype: torch.dtype):
    """Forward pre-hook: floating tensor arguments cast to ``dtype`` (complex states and integer
    counts left alone)."""
    def cast(v):
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


def _cast_output_hook(dtype: torch.dtype):
    """Forward hook: the module's main output (a tensor, or a tuple's first) cast to ``dtype``; the rest
    of a tuple (TimestepNorm's statistics, CEMA's complex state) left as computed."""
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return output.to(dtype) if output.is_floating_point() else output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) \
                and output[0].is_floating_point():
            return (output[0].to(dtype), *output[1:])
        return output
    return hook


def parallelize(model: Megalodon, mesh, *, data_dim: Optional[str] = None, cp_dim: Optional[str] = "cp",
                param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = torch.float32,
                checkpoint_layers: bool = False, reshard_after_forward: bool = True) -> DistributedMegalodon:
    """Shard ``model`` with FSDP2 over every rank of ``mesh`` and run it chunk-parallel over ``cp_dim``.

    mesh: a DeviceMesh with a data dim (``data_dim``, default whichever of ``dp`` / ``fsdp`` it has) and
    a chunk dim (``cp_dim``, default ``cp``; None for none), any of them of size 1. Every rank calls
    this with an identical model (same initialisation or the same loaded weights).
    param_dtype: None (compute in the parameters' dtype) or a low precision (torch.bfloat16): blocks and
    root compute in it, the CEMA and norm modules in fp32 (module docstring). reduce_dtype: the dtype
    of the other gradients' reduce-scatter (fp32 by default). checkpoint_layers: recompute each block in
    the backward. reshard_after_forward: free each block's gathered parameters after its forward
    (gather again for the backward: less memory, more communication).

    Returns the root module (it holds ``model`` as ``.module``); ``model`` itself is sharded in place,
    so build the optimizer on ``returned.parameters()`` after this call.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not isinstance(model, Megalodon):
        raise TypeError(f"model must be a Megalodon, got {type(model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised (dist.init_process_group) first")
    if param_dtype is not None and param_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"param_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got {param_dtype}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise ValueError(f"reduce_dtype must be None or a floating dtype, got {reduce_dtype!r}")
    data_dim, cp_dim = _mesh_dims(mesh, data_dim, cp_dim)
    if any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        raise ValueError("model is already sharded (its parameters are DTensors): call parallelize once, on the "
                         "plain model")
    # every rank holds the same parameters, so they are sharded over the whole mesh
    shard_mesh = mesh._flatten(f"{data_dim}_{cp_dim}") if mesh.ndim > 1 else mesh
    low = param_dtype is not None and param_dtype != torch.float32
    main = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    replicated = []
    if low:
        for sub in model.modules():
            if isinstance(sub, FP32_MODULES):
                own = list(sub.parameters(recurse=False))
                if own:
                    replicated += own
                    sub.register_forward_pre_hook(_cast_inputs_hook(torch.float32), with_kwargs=True)
                    sub.register_forward_hook(_cast_output_hook(param_dtype))
    ignored = set(replicated) or None
    groups = []
    for block in model.layers:
        groups.append(fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard_after_forward, mp_policy=main,
                                  ignored_params=ignored))
    root = DistributedMegalodon(model, mesh, data_dim, cp_dim, checkpoint_layers)
    root.world_group = shard_mesh.get_group()
    root.replicated = replicated
    groups.append(fully_shard(root, mesh=shard_mesh, mp_policy=main, ignored_params=ignored))
    for g in groups:  # sum over ranks: the loss is already normalised by the global token count
        g.set_gradient_divide_factor(1.0)
        g.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    root.param_dtype = param_dtype
    return root
