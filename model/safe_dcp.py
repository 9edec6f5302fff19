"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

DCP itself unpickles its ``.metadata`` file with plain ``pickle.load`` and every non-tensor item of
a state dict with ``torch.load(weights_only=False)``, so a checkpoint from someone else can run
anything on every rank that loads it. Here:

* :func:`read_metadata` unpickles ``.metadata`` admitting only the types DCP writes there (its
  metadata dataclasses, ``torch.Size``, dtypes, layouts, paths); any other global is refused before
  it is looked up, so nothing it names is ever called;
* :class:`SafeReader` is a ``FileSystemReader`` whose ``read_metadata`` is that one (tensor data DCP
  already reads with ``weights_only=True``);
* :class:`WeightsOnlyLoadPlanner` is a ``DefaultLoadPlanner`` whose ``load_bytes`` (every non-tensor
  item) uses ``torch.load(weights_only=True)``: plain Python data and tensors only.

Each refusal raises :class:`UnsafeCheckpointError` naming the file or item and what was refused.
"""
from __future__ import annotations

import io
import os
import pickle
import pathlib
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["UnsafeCheckpointError", "read_metadata", "SafeReader", "WeightsOnlyLoadPlanner", "METADATA_FILE"]

METADATA_FILE = ".metadata"


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something that could run code when read (or a format that does): refused."""


def _metadata_types() -> dict:
    from torch.distributed.checkpoint import filesystem

    admitted = {("torch.distributed.checkpoint.metadata", n): getattr(_md, n, None) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    admitted[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = getattr(filesystem, "_StorageInfo", None)
    admitted[("torch", "Size")] = torch.Size
    # torch pickles a layout as a call of this function with the layout's name: ours only looks it up
    admitted[("torch.serialization", "_get_layout")] = _layout_named
    # the checkpoint id DCP records is the path the writer was given (pathlib's module moved in 3.13)
    for mod in ("pathlib", "pathlib._local"):
        for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
            admitted[(mod, n)] = getattr(pathlib, n)
    return {k: v for k, v in admitted.items() if v is not None}


def _layout_named(name):
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return layouts[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata types and torch dtypes (pickled as ``torch.<name>``), nothing else."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where
        self.admitted = _metadata_types()

    def find_class(self, module, name):
        found = self.admitted.get((module, name))
        if found is not None:
            return found
        # vars(), not getattr: torch's module __getattr__ would import submodules by the given name
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise UnsafeCheckpointError(
            f"{self.where} names {module}.{name}, which is not one of DCP's metadata types: refused (unpickling it "
            f"could run code). Only a checkpoint written by torch.distributed.checkpoint.save loads")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where} holds a persistent id {pid!r}: not DCP metadata, refused")


def read_metadata(path: str, filename: str = METADATA_FILE):
    """The DCP ``Metadata`` in ``path/filename``, unpickled admitting only DCP's metadata types.
    Raises UnsafeCheckpointError naming the file and the refused global."""
    where = os.path.join(path, filename)
    with open(where, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, where).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or malformed: say which file
            raise UnsafeCheckpointError(f"{where} is not readable DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, _md.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    # the storage entries name the data files to open: only files inside the checkpoint directory
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel != os.path.basename(rel) or rel in ("", ".", ".."):
            raise UnsafeCheckpointError(f"{where}: item {getattr(index, 'fqn', index)!r} is stored at {rel!r}, "
                                        f"outside the checkpoint directory: refused")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = _md.StorageMeta()
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` reading ``.metadata`` through :func:`read_metadata` (once, then kept)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._dir = str(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        # DCP falls back to per-rank metadata files when this raises: our saves always write the
        # global file, so the fallback is refused rather than read by DCP's own unpickler
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self._dir}: per-rank metadata is not read (no global {METADATA_FILE})")
        if self._metadata is None:
            self._metadata = read_metadata(self._dir)
            self._metadata.storage_meta.load_id = getattr(self, "load_id", None)  # as FileSystemReader does
        return self._metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page of advice; the line naming the refused global is what matters here
            found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\n|$)", str(e))
            raise UnsafeCheckpointError(
                f"the checkpoint's item {fqn!r} is not plain data (tensors, numbers, strings, lists, dicts): refused, "
                f"unpickling it could run code ({found.group(1) if found else type(e).__name__})") from e
        if self.flatten_state_dict:
            _set_at(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_at(tree, path, value) -> None:
    """``tree[path[0]][path[1]]... = value``: the containers exist, the load target has every key."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
