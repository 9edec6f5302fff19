"""The cache of rotary tables: rotary() called again with the same positions (q and k of every
layer, every step of a fixed length) reuses the tables it built, and the torch backend reuses the
complex forms it multiplies by.

One bounded, explicit cache (:data:`TABLES`, at most :data:`SIZE` entries, the oldest evicted
first), used only by calls in plain eager mode (ops/rotary/__init__.py ``_tables``; a traced call
must build its own tensors). How a call finds its entry:

* CPU positions: an entry is used only if the call's positions (and tensor reference) EQUAL the
  cached ones (a copy is kept), so a hit returns exactly what ``rotation_tables`` would.
* GPU positions (``identity=True``): comparing values would wait for the GPU, so an entry is
  used only for the SAME positions tensor (and tensor reference) unchanged since: the same
  object, data pointer and version counter, the counter autograd reads to detect that a saved
  tensor was modified (every in-place torch op bumps it: ``copy_``, ``add_``, an indexed write,
  also through a view). The key holds the device and the current stream (another stream could
  read the tables before the stream that fills them has run), and no call that captures a CUDA
  graph uses or fills the cache (a graph must compute its own tables from its positions at
  every replay). A write that bypasses the version counter (through ``.data``, a raw pointer,
  DLPack) is not seen: :data:`IDENTITY` turns this kind of entry off. The cached cos and sin are never handed out by the public
``rotation_tables``, so nobody outside the op holds them to modify; a write through them anyway
(they are views of the entry's complex table) bumps its version, and the torch backend then
rebuilds what it derived from them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

#: entries kept (a model calls rotary with a few distinct position tensors)
SIZE = 16
#: whether GPU calls cache their tables by the positions tensor's identity (see the module doc)
IDENTITY = True


@dataclass
class Entry:
    """The tables of one (positions, arguments) key.

    ``table`` (2, P, L, 1, d/2) complex: [0] = cos + i sin (``cos`` and ``sin`` are its real and
    imaginary views) and [1] its conjugate (the backward's), both filled at ``version`` of
    ``table``. ``per_head``: (heads, conjugate) -> the half repeated over the heads, contiguous
    (P, L, heads, d/2): a multiply broadcasting the table over the heads runs an inner loop of d/2
    elements, several times slower per element on the CPU than one whose dimensions coalesce with
    x's. It holds one table per head count and direction the calls used (a model has one or two)."""

    positions: torch.Tensor
    reference: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    table: torch.Tensor
    version: int
    per_head: dict = field(default_factory=dict)
    #: for an identity entry (GPU), the (data pointer, version) of positions and of a tensor
    #: reference when it was filled; None for an entry found by value (CPU)
    stamp: tuple | None = None

    def same_tensors(self, positions: torch.Tensor, reference) -> bool:
        """Whether ``positions`` (and ``reference``) are this identity entry's own tensors, unchanged."""
        return (self.stamp is not None and self.positions is positions and self.stamp == _stamp(positions, reference)
                and (self.reference is reference if isinstance(reference, torch.Tensor) else self.reference is None))

    def complex_table(self, conjugate: bool, heads: int) -> torch.Tensor:
        """cos + i sin, or its conjugate, for x with ``heads`` heads."""
        if self.table._version != self.version:  # written to since: only [0] (the views' memory) is current
            return torch.conj_physical(self.table[0]) if conjugate else self.table[0]
        half = self.table[1] if conjugate else self.table[0]
        if heads == 1:
            return half
        table = self.per_head.get((heads, conjugate))
        if table is None:
            table = self.per_head[(heads, conjugate)] = half.expand(*half.shape[:-2], heads,
                                                                    half.shape[-1]).contiguous()
        return table


class TableCache:
    """Key -> :class:`Entry`, at most ``size`` entries, the oldest evicted first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict = {}
        self._lock = threading.Lock()

    def get(self, key, positions: torch.Tensor, reference, identity: bool = False) -> Entry | None:
        """The entry of ``key`` if its positions (and tensor reference) equal the call's, or with
        ``identity`` are the call's own tensors, unchanged since (see the module doc)."""
        entry = self._entries.get(key)
        if identity:
            return entry if entry is not None and entry.same_tensors(positions, reference) else None
        if entry is None or entry.stamp is not None or not torch.equal(entry.positions, positions):
            return None
        if isinstance(reference, torch.Tensor) and not torch.equal(entry.reference, reference):
            return None
        return entry

    def put(self, key, positions: torch.Tensor, reference, cos: torch.Tensor, sin: torch.Tensor,
            identity: bool = False) -> Entry:
        """Cache the tables (cos, sin) of ``key`` (copied into one complex table, see Entry); with
        ``identity`` the entry holds the call's own positions (and reference) tensors and their
        stamp, else copies of them."""
        table = torch.empty((2, *cos.shape), dtype=torch.complex128 if cos.dtype == torch.float64 else torch.complex64,
                            device=cos.device)
        table[0] = torch.complex(cos, sin)
        torch.conj_physical(table[0], out=table[1])
        ref_is_tensor = isinstance(reference, torch.Tensor)
        if identity:
            entry = Entry(positions, reference if ref_is_tensor else None, table[0].real, table[0].imag, table,
                          table._version, stamp=_stamp(positions, reference))
        else:
            entry = Entry(positions.clone(), reference.clone() if ref_is_tensor else None,
                          table[0].real, table[0].imag, table, table._version)
        with self._lock:
            self._entries.pop(key, None)
            while len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = entry
        return entry

    def entry_of(self, cos: torch.Tensor, sin: torch.Tensor) -> Entry | None:
        """The entry whose tables ``cos`` and ``sin`` are (the same tensors), or None."""
        for entry in list(self._entries.values()):
            if entry.cos is cos and entry.sin is sin:
                return entry
        return None

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _stamp(positions: torch.Tensor, reference) -> tuple:
    """What an in-place write or a new storage changes: (data pointer, version) of positions, and of
    a tensor reference."""
    if isinstance(reference, torch.Tensor):
        return positions.data_ptr(), positions._version, reference.data_ptr(), reference._version
    return positions.data_ptr(), positions._version


TABLES = TableCache(SIZE)
