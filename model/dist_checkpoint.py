"""Distributed training checkpoints of a :func:`~.distributed.parallelize`'d model with
``torch.distributed.checkpoint`` (DCP): model, optimizer, data position and RNG.

A checkpoint is a directory:

* DCP's files (one per rank, plus ``.metadata``): the model's sharded parameters (upstream
  state_dict names, no wrapper prefix), the optimizer's sharded state, and ``train``: the step,
  every rank's data position (any picklable object the caller passes) and RNG states (torch CPU,
  and CUDA where present), gathered so any rank can read them;
* ``megalodon.json``: the model config, the step and the mesh it was saved on, written by rank 0
  after DCP has finished (so a directory without it is an unfinished save).

DCP reshards on load, so a checkpoint saved on one mesh loads on another (2 x 2 -> 4 x 1 -> 1 x 1).
On the same mesh every rank gets its own RNG state and data position back and training continues
bit for bit; on another world size rank r takes saved rank r's (rank 0's where r is beyond the
saved world), so a data position that differs per rank should be derivable from the step there.

:func:`load_checkpoint` checks everything before it writes anything: the config (every field but the
backend choice and the checkpointing switch), then every model and optimizer tensor's presence and
shape against DCP's metadata; a mismatch raises ValueError naming the fields or keys, and the model
and optimizer are left untouched.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from .distributed import DistributedMegalodon

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_info", "CONFIG_FILE"]

CONFIG_FILE = "megalodon.json"
# fields that do not change what the parameters mean: a checkpoint loads across them
_RUNTIME_FIELDS = ("backend", "layerwise_ckpt")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_dicts(model: DistributedMegalodon, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # the inner Megalodon: its parameters are the optimizer's, its names upstream's
    return get_state_dict(model.module, optimizer)


def save_checkpoint(path: str, model: DistributedMegalodon, optimizer: torch.optim.Optimizer, *, step: int,
                    data_state: Any = None) -> None:
    """Save on every rank (a collective): model, optimizer, ``step``, this rank's ``data_state`` (its
    data position: picklable) and its RNG states."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(model, DistributedMegalodon):
        raise TypeError(f"model must come from parallelize(), got {type(model).__name__}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    os.makedirs(path, exist_ok=True)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(path, CONFIG_FILE)):
        os.remove(os.path.join(path, CONFIG_FILE))  # overwriting: unfinished until the new one is written
    dist.barrier()
    model_sd, optim_sd = _state_dicts(model, optimizer)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (_rng_state(), data_state))
    train = pickle.dumps({"step": step, "data": [d for _, d in per_rank], "rng": [r for r, _ in per_rank]})
    dcp.save({"model": model_sd, "optim": optim_sd, "train": train},
             storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    dist.barrier()
    if dist.get_rank() == 0:
        info = {"config": dataclasses.asdict(model.module.config), "step": step,
                "mesh": dict(zip(model.mesh.mesh_dim_names, model.mesh.shape)), "world_size": dist.get_world_size()}
        tmp = os.path.join(path, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(info, f, indent=1, default=str)
        os.replace(tmp, os.path.join(path, CONFIG_FILE))
    dist.barrier()


def read_checkpoint_info(path: str) -> dict:
    """The checkpoint's ``megalodon.json`` (config, step, mesh); ValueError naming ``path`` if absent."""
    f = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(f):
        raise ValueError(f"path={path!r} holds no finished checkpoint ({CONFIG_FILE} missing: not saved by "
                         f"save_checkpoint, or the save did not finish)")
    with open(f) as fh:
        return json.load(fh)


def _check_config(path: str, model: DistributedMegalodon, info: dict) -> None:
    mine = dataclasses.asdict(model.module.config)
    saved = info["config"]
    diff = [k for k in sorted(set(mine) | set(saved)) if k not in _RUNTIME_FIELDS
            and json.loads(json.dumps(mine.get(k), default=str)) != saved.get(k)]
    if diff:
        shown = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs model {mine.get(k)!r}" for k in diff[:6])
        raise ValueError(f"the checkpoint at path={path!r} is of another model config ({shown}); build the model "
                         f"with the checkpoint's config (read_checkpoint_info(path)['config'])")


def _check_tensors(path: str, metadata, flat: dict) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    missing, wrong = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = metadata.state_dict_metadata.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            missing.append(key)
        elif tuple(meta.size) != tuple(value.shape):
            wrong.append(f"{key}: checkpoint {tuple(meta.size)} vs here {tuple(value.shape)}")
    if missing or wrong:
        raise ValueError(f"the checkpoint at path={path!r} does not fit this model / optimizer: "
                         + "; ".join([f"missing {missing[:5]}" if missing else "", *wrong[:5]]).strip("; "))


def load_checkpoint(path: str, model: DistributedMegalodon, optimizer: torch.optim.Optimizer) -> dict:
    """Load on every rank (a collective) into a model from :func:`~.distributed.parallelize` (any mesh) and
    its optimizer; restores this rank's RNG state. Returns ``{"step": ..., "data": ...}``: the step and
    this rank's data position as saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not isinstance(model, DistributedMegalodon):
        raise TypeError(f"model must come from parallelize(), got {type(model).__name__}")
    info = read_checkpoint_info(path)
    _check_config(path, model, info)
    fresh = not optimizer.state  # get_state_dict creates a fresh optimizer's (zero) state: undone on failure
    try:
        model_sd, optim_sd = _state_dicts(model, optimizer)
        # loaded into copies, then set: a failure on the way leaves the live model and optimizer as they were
        target = {"model": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model_sd.items()},
                  "optim": _clone(optim_sd), "train": b""}
        flat, _ = flatten_state_dict(target)
        _check_tensors(path, dcp.FileSystemReader(path).read_metadata(), flat)
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    except BaseException:
        if fresh:
            optimizer.state.clear()
        raise
    set_state_dict(model.module, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    train = pickle.loads(target["train"]) if isinstance(target["train"], (bytes, bytearray)) else target["train"]
    r = dist.get_rank() if dist.get_rank() < len(train["rng"]) else 0
    mine = train["rng"][r]
    torch.set_rng_state(mine["torch"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    return {"step": train["step"], "data": train["data"][r]}


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree
