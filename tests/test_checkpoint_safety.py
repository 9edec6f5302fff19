"""Checkpoints that load without running code (model/dist_checkpoint.py, model/safe_dcp.py).

One process (gloo, world 1, a 1 x 1 mesh: FSDP2-sharded DTensors over one rank) saves a genuine
checkpoint after one AdamW step; copies of it then get a payload planted in each place a reader
could unpickle: DCP's ``.metadata``, a non-tensor item (an optimizer hyperparameter), and our train
state (a checkpoint of the earlier format, whose train state was a pickle). The payload creates a
marker file when unpickled; each test first shows that plain unpickling (or DCP's own loader) does
run it, then that ``load_checkpoint`` refuses it naming what it refused, and the marker is absent.
The 4-rank resumes across meshes are in tests/test_distributed.py.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch
from test_distributed import _model, _train_losses


class Payload:
    """Unpickles as a call of ``exec`` (any code) that writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megalodon_kernels.model.dist_checkpoint import save_checkpoint
    from megalodon_kernels.model.distributed import parallelize

    tmp = tmp_path_factory.mktemp("ckpt_safety")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
        dm = parallelize(_model(), mesh)
        opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
        _train_losses(dm, opt, 1)
        data = {"pos": [3, 1.5, None, True, "shard-2"], "order": torch.arange(6), "nested": {"w": torch.ones(2, 2)}}
        save_checkpoint(str(tmp / "genuine"), dm, opt, step=1, data_state=data)
        saved = {"rng": torch.get_rng_state(), "data": data,
                 "params": {k: _full(v) for k, v in dm.module.state_dict().items()},
                 "next": _train_losses(dm, opt, 2, first=2)}
        yield {"tmp": tmp, "mesh": mesh, "genuine": str(tmp / "genuine"), "saved": saved}
    finally:
        dist.destroy_process_group()


def _full(v):
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()


def _fresh(world):
    from megalodon_kernels.model.distributed import parallelize

    dm = parallelize(_model(), world["mesh"])
    return dm, torch.optim.AdamW(dm.parameters(), lr=1e-2)


def _copy(world, name):
    dst = str(world["tmp"] / name)
    shutil.copytree(world["genuine"], dst)
    return dst


def _refused(world, path, marker, match):
    from megalodon_kernels.model.dist_checkpoint import UnsafeCheckpointError, load_checkpoint

    dm, opt = _fresh(world)
    before = {k: _full(v) for k, v in dm.module.state_dict().items()}
    with pytest.raises(UnsafeCheckpointError, match=match) as e:
        load_checkpoint(path, dm, opt)
    print(f"refused: {e.value}")
    assert not os.path.exists(marker), "the payload ran"
    assert not opt.state and all(torch.equal(_full(v), before[k]) for k, v in dm.module.state_dict().items())


def test_genuine_resumes_bit_for_bit(world):
    from megalodon_kernels.model.dist_checkpoint import load_checkpoint

    dm, opt = _fresh(world)
    torch.manual_seed(99)
    loaded = load_checkpoint(world["genuine"], dm, opt)
    saved = world["saved"]
    assert torch.equal(torch.get_rng_state(), saved["rng"])
    assert loaded["step"] == 1
    got, want = loaded["data"], saved["data"]
    assert got["pos"] == want["pos"] and torch.equal(got["order"], want["order"])
    assert torch.equal(got["nested"]["w"], want["nested"]["w"]) and got["order"].dtype == torch.int64
    for k, v in dm.module.state_dict().items():
        assert torch.equal(_full(v), saved["params"][k]), k
    assert _train_losses(dm, opt, 2, first=2) == saved["next"]


def test_metadata_reader_admits_what_dcp_writes(world, tmp_path):
    """Beyond our own checkpoints: a plain state dict of other dtypes, layouts and non-tensor items,
    written under a pathlib checkpoint id."""
    import pathlib

    import torch.distributed.checkpoint as dcp

    from megalodon_kernels.model.safe_dcp import SafeReader, WeightsOnlyLoadPlanner, read_metadata

    sd = {"f": torch.randn(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "i": torch.arange(4, dtype=torch.int32),
          "c": torch.randn(1, 2, 3, 4).to(memory_format=torch.channels_last),
          "z": torch.zeros(2, dtype=torch.complex64),
          "s": "text", "n": {"k": [1, 2.5, None, (3, "x")]}, "flag": False}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(pathlib.Path(tmp_path) / "plain"))
    meta = read_metadata(str(tmp_path / "plain"))
    assert set(meta.state_dict_metadata) >= {"f", "b", "i", "c", "z", "s", "flag"}
    assert set(read_metadata(world["genuine"]).state_dict_metadata) >= {"train.json", "optim.param_groups.0.lr"}
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    back["n"] = {"k": None}
    dcp.load(back, storage_reader=SafeReader(str(tmp_path / "plain")), planner=WeightsOnlyLoadPlanner())
    for k, v in sd.items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k


def test_payload_in_metadata_runs_nothing(world, tmp_path):
    from megalodon_kernels.model.safe_dcp import read_metadata

    path = _copy(world, "bad_metadata")
    meta = read_metadata(path)
    meta.planner_data["extra"] = Payload(tmp_path / "marker")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with open(os.path.join(path, ".metadata"), "rb") as f:  # DCP's own reading (pickle.load) runs it
        pickle.load(f)
    assert os.path.exists(tmp_path / "marker")
    os.remove(tmp_path / "marker")
    _refused(world, path, tmp_path / "marker", r"bad_metadata/\.metadata names builtins\.exec, which is not one of "
                                                r"DCP's metadata types: refused")


def test_payload_in_non_tensor_item_runs_nothing(world, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megalodon_kernels.model.dist_checkpoint import _state_dicts, _train_state
    from megalodon_kernels.model.safe_dcp import SafeReader

    dm, opt = _fresh(world)
    _train_losses(dm, opt, 1)
    model_sd, optim_sd = _state_dicts(dm, opt)
    optim_sd["param_groups"][0]["lr"] = Payload(tmp_path / "marker")
    path = str(tmp_path / "bad_item")
    train = _train_state(1, [({}, [])], [{"torch": torch.get_rng_state()}])
    dcp.save({"model": model_sd, "optim": optim_sd, "train": train}, storage_writer=dcp.FileSystemWriter(path))
    shutil.copy(os.path.join(world["genuine"], "megalodon.json"), path)
    # DCP's default planner (torch.load(weights_only=False)) runs it
    dcp.load({"optim": {"param_groups": [{"lr": 0.0}]}}, storage_reader=SafeReader(path), planner=DefaultLoadPlanner())
    assert os.path.exists(tmp_path / "marker")
    os.remove(tmp_path / "marker")
    _refused(world, path, tmp_path / "marker",
             r"item 'optim\.param_groups\.0\.lr' is not plain data .*refused.*GLOBAL (builtins\.)?exec\)")


def test_malformed_train_state_refused(world, tmp_path):
    import torch.distributed.checkpoint as dcp

    from megalodon_kernels.model.dist_checkpoint import _state_dicts, _train_state, load_checkpoint

    dm, opt = _fresh(world)
    model_sd, optim_sd = _state_dicts(dm, opt)
    train = _train_state(1, [({}, [])], [{"torch": torch.get_rng_state()}])
    train["json"] = torch.frombuffer(bytearray(b'{"format": 1, "step": 1}'), dtype=torch.uint8)
    path = str(tmp_path / "bad_json")
    dcp.save({"model": model_sd, "optim": optim_sd, "train": train}, storage_writer=dcp.FileSystemWriter(path))
    shutil.copy(os.path.join(world["genuine"], "megalodon.json"), path)
    dm, opt = _fresh(world)
    with pytest.raises(ValueError, match=r"bad_json' has a malformed train state \(ValueError: format 1, expected 2"):
        load_checkpoint(path, dm, opt)
    assert not opt.state


def _legacy(world, path, train):
    """A checkpoint as the earlier save_checkpoint wrote it: the train state one pickled item."""
    import torch.distributed.checkpoint as dcp

    from megalodon_kernels.model.dist_checkpoint import _state_dicts

    dm, opt = _fresh(world)
    _train_losses(dm, opt, 1)
    model_sd, optim_sd = _state_dicts(dm, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "train": pickle.dumps(train)},
             storage_writer=dcp.FileSystemWriter(path))
    shutil.copy(os.path.join(world["genuine"], "megalodon.json"), path)
    return {k: _full(v) for k, v in dm.module.state_dict().items()}


def test_payload_in_train_state_runs_nothing(world, tmp_path):
    train = {"step": 1, "data": [Payload(tmp_path / "marker")], "rng": [{"torch": torch.get_rng_state()}]}
    path = str(tmp_path / "bad_train")
    _legacy(world, path, train)
    pickle.loads(pickle.dumps(train))  # unpickling it, as the earlier load_checkpoint did, runs it
    assert os.path.exists(tmp_path / "marker")
    os.remove(tmp_path / "marker")
    _refused(world, path, tmp_path / "marker",
             r"earlier format.*pickle.*not loaded.*resave_legacy_checkpoint\(path, new_path, model, optimizer\)")


def test_legacy_checkpoint_resaved(world, tmp_path):
    from megalodon_kernels.model.dist_checkpoint import load_checkpoint, resave_legacy_checkpoint

    rng = torch.get_rng_state()
    old = str(tmp_path / "old")
    params = _legacy(world, old, {"step": 1, "data": [{"pos": 7}], "rng": [{"torch": rng}]})
    dm, opt = _fresh(world)
    resave_legacy_checkpoint(old, str(tmp_path / "new"), dm, opt)
    with open(tmp_path / "new" / "megalodon.json") as f:
        assert json.load(f)["step"] == 1
    dm, opt = _fresh(world)
    torch.manual_seed(5)
    assert load_checkpoint(str(tmp_path / "new"), dm, opt) == {"step": 1, "data": {"pos": 7}}
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(_full(v), params[k]) for k, v in dm.module.state_dict().items())


@pytest.mark.parametrize("bad, where", [
    ((1, 2), r"data_state is a builtins\.tuple"),
    ({"a": [1, {2: 3}]}, r"data_state\['a'\]\[1\] has the key 2 \(int\)"),
    ({"a": io.BytesIO()}, r"data_state\['a'\] is a _io\.BytesIO"),
    ({"s": {1, 2}}, r"data_state\['s'\] is a builtins\.set"),
], ids=["tuple", "int_key", "object", "set"])
def test_data_state_must_be_json_or_tensors(world, tmp_path, bad, where):
    from megalodon_kernels.model.dist_checkpoint import save_checkpoint

    dm, opt = _fresh(world)
    with pytest.raises(TypeError, match=where):
        save_checkpoint(str(tmp_path / "c"), dm, opt, step=1, data_state=bad)
    assert not os.path.exists(tmp_path / "c")  # refused before anything is written


@pytest.mark.parametrize("module, name", [("torch", "load"), ("torch", "_dynamo"), ("os", "system"),
                                          ("builtins", "getattr"), ("torch.serialization", "load"),
                                          ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
                                          ("torch.distributed.checkpoint.metadata", "field")])
def test_metadata_unpickler_admits_only_metadata_types(module, name):
    """Names next to the admitted ones (torch itself, DCP's other classes) are refused too, and looked
    up nowhere: a name in torch is checked against torch's attributes without importing anything."""
    from megalodon_kernels.model.safe_dcp import UnsafeCheckpointError, _MetadataUnpickler

    with pytest.raises(UnsafeCheckpointError, match=rf"x/\.metadata names {module}\.{name}, which is not one of"):
        _MetadataUnpickler(io.BytesIO(b""), "x/.metadata").find_class(module, name)
