"""Streaming state of a Megalodon LM: fixed-size tensors, one row per sequence.

Per layer (:class:`LayerState`), for B rows:

* ``length`` int64 (B,): tokens this row has consumed;
* ``norm_count`` int64 (B,), ``norm_mean`` / ``norm_var`` r(B G): the TimestepNorm running
  statistics, cumulative over every token so far (never reset at chunk boundaries);
* ``hx`` r(B 2 D N): the CEMA hidden state after the last token, real parts then imaginary
  parts (``torch.complex(hx[:, 0], hx[:, 1])`` is the complex state; planar, so the one-token
  update reads and writes contiguous memory);
* ``k`` r(B C H dz) (already rotated) and ``v`` r(B C H dv): one attention chunk of key / value
  slots. Slot j holds the key of chunk position j of the row's current chunk; only the slots
  below the row's ``length % C`` are live (attention never crosses a chunk boundary, so older
  slots are simply overwritten).

Plus the output layer's TimestepNorm statistics and ``lengths`` (B,). Nothing grows with the
number of tokens, and nothing changes shape while decoding: every update is in place, which is
what lets a decode step be compiled as one graph and captured into a CUDA graph
(:mod:`.decode`). Rows are independent: each may hold a sequence of a different length.

A cache is created with ``model.init_cache(batch_size)`` and updated IN PLACE by
``model(tokens, cache=cache)``; every tensor in it is detached (inference state).

Row operations, for a server that keeps many sequences in one batch (docs/serving.md):

* :meth:`MegalodonCache.select` (reorder, keep or duplicate rows) and :meth:`MegalodonCache.drop`
  (remove finished rows) return a new cache;
* :meth:`MegalodonCache.cat` joins caches (rows from a new prefill join the batch);
* :meth:`MegalodonCache.write_rows_` copies rows of another cache into rows of this one in place
  (fixed batch shape: for a compiled or CUDA-graph decode step).

A row's state after any sequence of these equals its state had it run alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Union

import torch

__all__ = ["LayerState", "MegalodonCache"]

Rows = Union[Sequence[int], torch.Tensor]


def _clone(t):
    return None if t is None else t.clone()


def _rows_index(rows: Rows, batch_size: int, arg: str, device) -> torch.Tensor:
    """``rows`` as an int64 index tensor on ``device``, every entry in [0, batch_size) (a host
    check: row operations run between decode steps, not inside them)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype.is_floating_point or rows.dtype.is_complex:
            raise TypeError(f"{arg} must hold integer row indices, got dtype {rows.dtype}")
        if rows.dtype == torch.bool:
            if rows.shape != (batch_size,):
                raise ValueError(f"{arg} as a boolean mask must have shape ({batch_size},), got {tuple(rows.shape)}")
            rows = rows.nonzero().reshape(-1)
        if rows.dim() != 1:
            raise ValueError(f"{arg} must be 1-D, got shape {tuple(rows.shape)}")
        idx = rows.to(device=device, dtype=torch.int64)
        values = rows.tolist()
    else:
        try:
            values = [operator.index(r) for r in rows]
        except TypeError:
            raise TypeError(f"{arg} must be a sequence of ints or a 1-D integer tensor, got {rows!r}") from None
        idx = torch.tensor(values, dtype=torch.int64, device=device)
    bad = [r for r in values if not 0 <= r < batch_size]
    if bad:
        raise IndexError(f"{arg} holds row index {bad[0]}, out of range for a cache of {batch_size} rows")
    return idx


@dataclass
class LayerState:
    """One layer's streaming state (see the module docstring for shapes). The statistics and
    ``hx`` may be None before the first token (then the layer's priors and a zero state are
    used); :meth:`Megalodon.init_cache` fills them so the tensors never change afterwards."""
    k: torch.Tensor
    v: torch.Tensor
    length: torch.Tensor
    norm_count: Optional[torch.Tensor] = None
    norm_mean: Optional[torch.Tensor] = None
    norm_var: Optional[torch.Tensor] = None
    hx: Optional[torch.Tensor] = None

    @classmethod
    def empty(cls, batch_size: int, chunk_size: int, num_heads: int, z_head_dim: int, v_head_dim: int, *,
              dtype: torch.dtype = torch.float32, device=None) -> "LayerState":
        """A state for ``batch_size`` fresh rows (statistics and ``hx`` None: filled on first use)."""
        return cls(k=torch.zeros(batch_size, chunk_size, num_heads, z_head_dim, dtype=dtype, device=device),
                   v=torch.zeros(batch_size, chunk_size, num_heads, v_head_dim, dtype=dtype, device=device),
                   length=torch.zeros(batch_size, dtype=torch.int64, device=device))

    @property
    def chunk_size(self) -> int:
        return self.k.shape[1]

    @property
    def chunk_offsets(self) -> torch.Tensor:
        """Position of each row's next token inside its attention chunk, int64 (B,)."""
        return torch.remainder(self.length, self.chunk_size)

    @property
    def chunk_offset(self) -> int:
        """The chunk position of the next token, when every row has the same one (a host read);
        ValueError when rows differ (use :attr:`chunk_offsets`)."""
        return _uniform(self.chunk_offsets, "chunk offset", "chunk_offsets")

    def tensors(self) -> List[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def clone(self) -> "LayerState":
        return LayerState(**{f.name: _clone(getattr(self, f.name)) for f in fields(self)})

    def rows(self, idx: torch.Tensor) -> "LayerState":
        """A new state of the rows ``idx`` (int64 tensor, already checked), copied."""
        return LayerState(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                             for f in fields(self)})


def _uniform(t: torch.Tensor, what: str, per_row: str) -> int:
    if t.numel() == 0:
        return 0
    first = int(t[0])
    if bool((t != first).any()):
        raise ValueError(f"the rows of this cache differ in {what} ({t.tolist()}); read {per_row} for per-row values")
    return first


def _cat_opt(ts, name):
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise ValueError(f"cannot join caches where some have {name} and others not; create them with model.init_cache")
    return torch.cat(ts)


@dataclass
class MegalodonCache:
    layers: List[LayerState]
    chunk_size: int
    lengths: torch.Tensor
    norm_count: Optional[torch.Tensor] = None
    norm_mean: Optional[torch.Tensor] = None
    norm_var: Optional[torch.Tensor] = None

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, num_heads: int, z_head_dim: int, v_head_dim: int,
              chunk_size: int, *, dtype: torch.dtype = torch.float32, device=None) -> "MegalodonCache":
        """Fresh rows with statistics left None (``Megalodon.init_cache`` fills them from the
        model's priors; prefer it)."""
        return cls(layers=[LayerState.empty(batch_size, chunk_size, num_heads, z_head_dim, v_head_dim,
                                            dtype=dtype, device=device) for _ in range(num_layers)],
                   chunk_size=chunk_size, lengths=torch.zeros(batch_size, dtype=torch.int64, device=device))

    # ---- shape ------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def __len__(self) -> int:
        return self.batch_size

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far, when every row has consumed the same number (a host read);
        ValueError when rows differ (use :attr:`lengths`)."""
        return _uniform(self.lengths, "length", "lengths")

    @property
    def chunk_offset(self) -> int:
        """Chunk position of every row's next token, when they agree (see :attr:`num_tokens`)."""
        return _uniform(torch.remainder(self.lengths, self.chunk_size), "chunk offset", "lengths % chunk_size")

    def tensors(self) -> List[torch.Tensor]:
        out = [t for s in self.layers for t in s.tensors()]
        return out + [t for t in (self.lengths, self.norm_count, self.norm_mean, self.norm_var) if t is not None]

    def nbytes(self) -> int:
        """Bytes held by the cache's storages (what it keeps alive, not just its views)."""
        seen, total = set(), 0
        for t in self.tensors():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def signature(self) -> tuple:
        """What two caches must share to exchange rows: layer count, chunk size, per-row tensor
        shapes, dtypes and device (a cache of another model differs in at least one)."""
        return (len(self.layers), self.chunk_size, self.lengths.device,
                tuple((t.shape[1:], t.dtype) for t in self.tensors()))

    def _check_compatible(self, other, arg: str) -> None:
        if not isinstance(other, MegalodonCache):
            raise TypeError(f"{arg} must be a MegalodonCache, got {type(other).__name__}")
        if other.signature() != self.signature():
            raise ValueError(f"{arg} is a cache of another model or layout (layers, chunk size, head sizes, dtype "
                             f"or device differ: {other.signature()} vs {self.signature()}); create both with "
                             "the same model's init_cache")

    # ---- copies and rows --------------------------------------------------------------------
    def clone(self) -> "MegalodonCache":
        """An independent copy (e.g. to branch a stream)."""
        return MegalodonCache(layers=[s.clone() for s in self.layers], chunk_size=self.chunk_size,
                              lengths=self.lengths.clone(), norm_count=_clone(self.norm_count),
                              norm_mean=_clone(self.norm_mean), norm_var=_clone(self.norm_var))

    def select(self, rows: Rows) -> "MegalodonCache":
        """A new cache of the given rows, in the given order (reorder, keep, or repeat rows, e.g.
        to branch one prompt into several samples). ``rows``: ints or a 1-D integer tensor of row
        indices in [0, batch_size), or a boolean mask (batch_size,). The rows are copied."""
        idx = _rows_index(rows, self.batch_size, "rows", self.lengths.device)

        def pick(t):
            return None if t is None else t[idx]
        return MegalodonCache(layers=[s.rows(idx) for s in self.layers], chunk_size=self.chunk_size,
                              lengths=self.lengths[idx], norm_count=pick(self.norm_count),
                              norm_mean=pick(self.norm_mean), norm_var=pick(self.norm_var))

    def drop(self, rows: Rows) -> "MegalodonCache":
        """A new cache without the given rows (e.g. finished sequences); the others keep their order."""
        idx = _rows_index(rows, self.batch_size, "rows", self.lengths.device)
        keep = torch.ones(self.batch_size, dtype=torch.bool, device=idx.device)
        keep[idx] = False
        return self.select(keep)

    @staticmethod
    def cat(caches: Sequence["MegalodonCache"]) -> "MegalodonCache":
        """One cache with the rows of ``caches`` in order (e.g. the running batch, then the rows
        of a new prefill)."""
        if isinstance(caches, MegalodonCache) or not isinstance(caches, (list, tuple)) or not caches:
            raise TypeError("caches must be a non-empty list of MegalodonCache")
        first = caches[0]
        for i, c in enumerate(caches):
            first._check_compatible(c, f"caches[{i}]")
        layers = []
        for i in range(len(first.layers)):
            states = [c.layers[i] for c in caches]
            layers.append(LayerState(**{f.name: (torch.cat([getattr(s, f.name) for s in states])
                                                 if f.name in ("k", "v", "length")
                                                 else _cat_opt([getattr(s, f.name) for s in states], f.name))
                                        for f in fields(LayerState)}))
        return MegalodonCache(layers=layers, chunk_size=first.chunk_size,
                              lengths=torch.cat([c.lengths for c in caches]),
                              norm_count=_cat_opt([c.norm_count for c in caches], "norm_count"),
                              norm_mean=_cat_opt([c.norm_mean for c in caches], "norm_mean"),
                              norm_var=_cat_opt([c.norm_var for c in caches], "norm_var"))

    def write_rows_(self, rows: Rows, source: "MegalodonCache", source_rows: Optional[Rows] = None) -> "MegalodonCache":
        """Copy rows of ``source`` into rows ``rows`` of this cache, in place (tensors keep their
        storage: a compiled or CUDA-graph decode step over this cache stays valid). ``source_rows``
        (default: all of source's rows, in order) must be as many as ``rows``. Returns self."""
        self._check_compatible(source, "source")
        dst = _rows_index(rows, self.batch_size, "rows", self.lengths.device)
        src = (torch.arange(source.batch_size, device=self.lengths.device) if source_rows is None
               else _rows_index(source_rows, source.batch_size, "source_rows", self.lengths.device))
        if dst.numel() != src.numel():
            raise ValueError(f"rows has {dst.numel()} entries but source_rows {src.numel()}")
        for mine, theirs in zip(self.tensors(), source.tensors()):
            mine.index_copy_(0, dst, theirs[src])
        return self
