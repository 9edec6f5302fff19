"""Distributed training checkpoints of a :func:`~.distributed.parallelize`'d model with
``torch.distributed.checkpoint`` (DCP): model, optimizer, data position and RNG.

A checkpoint is a directory:

* DCP's files (one per rank, plus ``.metadata``): the model's sharded parameters (upstream
  state_dict names, no wrapper prefix), the optimizer's sharded state, and ``train``: the step,
  every rank's data position and RNG states (torch CPU, and CUDA where present), gathered so any
  rank can read them, stored as tensors plus one JSON document (``train.json``, UTF-8 bytes in a
  uint8 tensor): nothing in it is a pickle;
* ``megalodon.json``: the model config, the step and the mesh it was saved on, written by rank 0
  after DCP has finished (so a directory without it is an unfinished save).

Loading runs no code from the checkpoint (:mod:`.safe_dcp`): DCP's ``.metadata`` is unpickled
admitting only DCP's own metadata types, non-tensor items (the optimizer's hyperparameters) load
with ``torch.load(weights_only=True)``, tensors as DCP loads them (``weights_only=True``), and the
train state is JSON. Anything else raises :class:`~.safe_dcp.UnsafeCheckpointError` naming what was
refused. Checkpoints of the earlier format (the train state one pickle) are refused too;
:func:`resave_legacy_checkpoint` converts one whose source you trust.

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
from typing import Any

import torch
import torch.distributed as dist

from .distributed import DistributedMegalodon

# .safe_dcp imports torch.distributed.checkpoint (0.8 s): loaded where a checkpoint is read, so a
# script that imports this module answers --help without it

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_info", "resave_legacy_checkpoint",
           "UnsafeCheckpointError", "CONFIG_FILE"]

CONFIG_FILE = "megalodon.json"


def __getattr__(name: str):
    if name == "UnsafeCheckpointError":   # re-exported from .safe_dcp, imported on first use
        from .safe_dcp import UnsafeCheckpointError
        return UnsafeCheckpointError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
# fields that do not change what the parameters mean: a checkpoint loads across them
_RUNTIME_FIELDS = ("backend", "layerwise_ckpt")
# the train state's layout (train.json's "format"); the earlier one was a pickled "train" item
_TRAIN_FORMAT = 2
_JSON_SCALARS = (type(None), bool, int, float, str)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_dicts(model: DistributedMegalodon, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # the inner Megalodon: its parameters are the optimizer's, its names upstream's
    return get_state_dict(model.module, optimizer)


def _split_data(value, where: str, tensors: list, path: list):
    """``value`` as JSON with ``None`` where its tensors were; the tensors (on the CPU) with their
    paths go to ``tensors``. Exact types only: a tuple, an int subclass or a NumPy number would
    come back as something else, so they are refused with the place they were found."""
    if type(value) is torch.Tensor:
        if value.layout != torch.strided:
            raise TypeError(f"{where} is a {value.layout} tensor; only dense (strided) tensors are saved")
        tensors.append((list(path), value.detach().cpu().contiguous()))
        return None
    if type(value) in _JSON_SCALARS:
        return value
    if type(value) is list:
        return [_split_data(v, f"{where}[{i}]", tensors, path + [i]) for i, v in enumerate(value)]
    if type(value) is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise TypeError(f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are str: convert it")
            out[k] = _split_data(v, f"{where}[{k!r}]", tensors, path + [k])
        return out
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a data position must be "
                    f"JSON (None, bool, int, float, str, list, dict with str keys) or torch tensors, nested in "
                    f"lists and dicts; convert it (a tuple to a list, a NumPy number with .item())")


def _join_data(skeleton, tensors: list):
    for path, t in tensors:
        if not path:
            return t
        node = skeleton
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = t
    return skeleton


def _train_state(step: int, data: list, rng: list) -> dict:
    """The ``train`` item: tensors and one JSON document. ``data[r]`` is rank r's data position split
    by :func:`_split_data` (JSON skeleton, [(path, tensor)]), ``rng[r]`` its RNG states."""
    train, ranks = {}, []
    for r, ((skeleton, tensors), states) in enumerate(zip(data, rng)):
        for i, (_, t) in enumerate(tensors):
            train[f"data.{r}.{i}"] = t
        for kind, t in states.items():
            train[f"rng.{kind}.{r}"] = t
        ranks.append({"data": skeleton, "tensor_paths": [p for p, _ in tensors], "rng": sorted(states)})
    doc = json.dumps({"format": _TRAIN_FORMAT, "step": step, "ranks": ranks}).encode()
    train["json"] = torch.frombuffer(bytearray(doc), dtype=torch.uint8)
    return train


def _write(path: str, model: DistributedMegalodon, optimizer, step: int, data: list, rng: list) -> None:
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(path, CONFIG_FILE)):
        os.remove(os.path.join(path, CONFIG_FILE))  # overwriting: unfinished until the new one is written
    dist.barrier()
    model_sd, optim_sd = _state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "train": _train_state(step, data, rng)},
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


def save_checkpoint(path: str, model: DistributedMegalodon, optimizer: torch.optim.Optimizer, *, step: int,
                    data_state: Any = None) -> None:
    """Save on every rank (a collective): model, optimizer, ``step``, this rank's ``data_state`` and its
    RNG states. ``data_state`` (the rank's data position) is JSON (None, bool, int, float, str, lists,
    dicts with str keys) and torch tensors nested in it, saved without pickle; anything else raises
    TypeError naming where in ``data_state`` it is, on every rank, before anything is written.
    Tensors come back on the CPU."""
    if not isinstance(model, DistributedMegalodon):
        raise TypeError(f"model must come from parallelize(), got {type(model).__name__}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    error, split = None, None
    try:
        tensors: list = []
        split = (_split_data(data_state, "data_state", tensors, []), tensors)
    except TypeError as e:
        error = str(e)
    # every rank learns of any rank's refusal, so none is left waiting in a collective (this gather
    # pickles between our own processes only; nothing pickled reaches the files)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (error, step, _rng_state(), split))
    if error is not None:
        raise TypeError(error)
    for r, (e, _, _, _) in enumerate(per_rank):
        if e is not None:
            raise TypeError(f"rank {r}'s {e}")
    steps = sorted({s for _, s, _, _ in per_rank})
    if len(steps) > 1:  # the train state is one item, the same on every rank
        raise ValueError(f"step differs between ranks ({steps}): every rank saves the same step")
    _write(path, model, optimizer, step, [d for _, _, _, d in per_rank], [g for _, _, g, _ in per_rank])


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


def _legacy_message(path: str) -> str:
    return (f"the checkpoint at path={path!r} is of the earlier format, whose train state (step, data positions, "
            f"RNG) is a pickle: unpickling it can run any code, so it is not loaded. If you trust whoever wrote it, "
            f"resave it once in the current format (a collective, the model built with its config): "
            f"resave_legacy_checkpoint(path, new_path, model, optimizer), then load_checkpoint(new_path, ...)")


def _train_target(path: str, metadata, legacy: bool) -> Any:
    """What DCP loads the train state into: empty tensors shaped from the (checked) metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from .safe_dcp import UnsafeCheckpointError

    items = metadata.state_dict_metadata
    if isinstance(items.get("train"), BytesStorageMetadata):
        if not legacy:
            raise UnsafeCheckpointError(_legacy_message(path))
        return b""
    if legacy:
        raise ValueError(f"the checkpoint at path={path!r} is of the current format already: load_checkpoint it")
    target = {k[len("train."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in items.items()
              if k.startswith("train.") and isinstance(m, TensorStorageMetadata)}
    if "json" not in target:
        raise ValueError(f"the checkpoint at path={path!r} has no train state (train.json): not written by "
                         f"save_checkpoint")
    return target


def _decode_train(path: str, train: dict) -> tuple[int, list, list]:
    """(step, every rank's data position, every rank's RNG states) from the loaded train tensors."""
    try:
        doc = json.loads(train["json"].numpy().tobytes().decode("utf-8"))
        if doc.get("format") != _TRAIN_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {_TRAIN_FORMAT}")
        data, rng = [], []
        for r, rank in enumerate(doc["ranks"]):
            tensors = [(p, train[f"data.{r}.{i}"]) for i, p in enumerate(rank["tensor_paths"])]
            data.append(_join_data(rank["data"], tensors))
            rng.append({kind: train[f"rng.{kind}.{r}"] for kind in rank["rng"]})
        step = doc["step"]
        if type(step) is not int or not rng:
            raise ValueError(f"step {step!r}, {len(rng)} ranks")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"the checkpoint at path={path!r} has a malformed train state "
                         f"({type(e).__name__}: {e})") from e
    return step, data, rng


def _read(path: str, model: DistributedMegalodon, optimizer, legacy: bool = False) -> tuple[int, list, list]:
    """Loads the model and optimizer state; returns (step, data positions, RNG states) of every saved rank."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from .safe_dcp import SafeReader, UnsafeCheckpointError, WeightsOnlyLoadPlanner

    if not isinstance(model, DistributedMegalodon):
        raise TypeError(f"model must come from parallelize(), got {type(model).__name__}")
    info = read_checkpoint_info(path)
    _check_config(path, model, info)
    reader = SafeReader(path)
    metadata = reader.read_metadata()  # refuses anything but DCP's metadata types before DCP reads it
    train_target = _train_target(path, metadata, legacy)
    fresh = not optimizer.state  # get_state_dict creates a fresh optimizer's (zero) state: undone on failure
    try:
        model_sd, optim_sd = _state_dicts(model, optimizer)
        # loaded into copies, then set: a failure on the way leaves the live model and optimizer as they were
        target = {"model": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model_sd.items()},
                  "optim": _clone(optim_sd)}
        _check_tensors(path, metadata, flatten_state_dict(target)[0])
        target["train"] = train_target
        try:
            dcp.load(target, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        except CheckpointException as e:
            # DCP gathers every rank's failure: a refusal surfaces as itself, not inside DCP's summary
            refused = [f[0] for f in e.failures.values() if isinstance(f[0], UnsafeCheckpointError)]
            if refused:
                raise refused[0] from None
            raise
        if legacy:  # the caller vouched for this checkpoint (resave_legacy_checkpoint)
            train = pickle.loads(target["train"])
            step, data, rng = train["step"], train["data"], train["rng"]
        else:
            step, data, rng = _decode_train(path, target["train"])
    except BaseException:
        if fresh:
            optimizer.state.clear()
        raise
    set_state_dict(model.module, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    return step, data, rng


def load_checkpoint(path: str, model: DistributedMegalodon, optimizer: torch.optim.Optimizer) -> dict:
    """Load on every rank (a collective) into a model from :func:`~.distributed.parallelize` (any mesh) and
    its optimizer; restores this rank's RNG state. Returns ``{"step": ..., "data": ...}``: the step and
    this rank's data position as saved. Runs no code from the checkpoint: anything that could
    (a pickled object where DCP metadata, plain data or the train state belongs; a checkpoint of the
    earlier, pickled format) raises :class:`UnsafeCheckpointError` naming it."""
    step, data, rng = _read(path, model, optimizer)
    r = dist.get_rank() if dist.get_rank() < len(rng) else 0
    mine = rng[r]
    torch.set_rng_state(mine["torch"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    return {"step": step, "data": data[r]}


def resave_legacy_checkpoint(path: str, new_path: str, model: DistributedMegalodon,
                             optimizer: torch.optim.Optimizer) -> None:
    """Convert a checkpoint of the earlier format (its train state pickled) to the current one at
    ``new_path``, on every rank (a collective). It UNPICKLES the old train state, which runs whatever
    code that holds: only for a checkpoint whose source you trust. Loads the model and optimizer
    (built as for :func:`load_checkpoint`) as a side effect; every rank's data position and RNG state
    are carried over as saved (the data positions must be JSON and tensors, else TypeError)."""
    if os.path.abspath(new_path) == os.path.abspath(path):
        raise ValueError(f"new_path={new_path!r} is path: resave to another directory (a failed write would "
                         f"leave neither)")
    step, data, rng = _read(path, model, optimizer, legacy=True)
    split = []
    for r, d in enumerate(data):
        tensors: list = []
        split.append((_split_data(d, f"the data position of rank {r} in path={path!r}", tensors, []), tensors))
    _write(new_path, model, optimizer, step, split, rng)


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree
