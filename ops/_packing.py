"""Packed sequences: documents laid end to end in one row, delimited by ``cu_seqlens``
(docs/design.md, Packed sequences).

A packed call must equal each document run on its own from an empty (or its own initial) state.
Kernels that read the document bounds themselves take them from :func:`document_bounds`
(TimestepNorm on every backend, attention on Triton). The other ops run a packed row as
*document rows*: the documents are grouped
into buckets of equal row length (by default the next power of two of their length), each bucket
is gathered into a zero-padded batch (nb, ..., row_length, ...) and runs through the op's ordinary
batched kernels in one launch, and the valid positions are scattered back. So:

* a row of thousands of short documents costs a few launches per bucket, never one per document:
  there are at most log2(L) + 1 buckets;
* each document's cost is that of its own row length, at most twice its length, so the
  convolutions stay O(L log L) and the chunked attention O(L C) whatever the lengths;
* every backend (torch, Triton, CUDA) supports packing with the kernels it already has, and what
  the kernels were verified for (exact causal prefixes, padding masks, per-row initial states)
  carries over.

Documents sit at the start of their rows (``align="left"``: outputs at the valid positions are
exact because every op is causal) or at the end (``align="right"``: the zeros in front leave a
sum over the document unchanged, which gives ema_hidden the state at the document's last step).

Planning reads ``cu_seqlens`` on the host once per tensor (a device synchronisation when it lives
on a GPU, like FlashAttention's ``max_seqlen``); the plan is cached on the tensor, so the forward
and backward of every layer of a model reuse it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ._checks import INT_DTYPES
from ._host_sync import check_on_device, on_host

__all__ = ["Bucket", "Plan", "cached", "check_cu_seqlens", "check_per_document", "document_bounds", "document_positions", "next_pow2",
           "plan"]


def next_pow2(n: int) -> int:
    """The row length of a document of n >= 1 steps: the smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def _check_boundaries_tensor(cu_seqlens) -> None:
    """cu_seqlens is an integer tensor (n + 1,), n >= 1 (TypeError / ValueError naming it)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an integer torch.Tensor of shape (n + 1,), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INT_DTYPES:
        raise TypeError(f"cu_seqlens must have an integer dtype (int32 or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (n + 1,) with n >= 1 documents, got shape {tuple(cu_seqlens.shape)}")


def check_cu_seqlens(cu_seqlens, *, batch: int, length: int, device: torch.device, batch_arg: str = "x") -> int:
    """Validate the shape, dtype and device of ``cu_seqlens`` for a packed call on a row of
    ``length`` steps; returns the number of documents n. Its values (0 first, non-decreasing,
    ``length`` last) are checked when the op plans the call (:func:`plan`)."""
    _check_boundaries_tensor(cu_seqlens)
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the other inputs are on {device}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens, {batch_arg} must hold one packed row (batch size 1), got batch size {batch} "
                         f"(flatten the batch into one row and offset cu_seqlens)")
    return cu_seqlens.shape[0] - 1


def check_per_document(name: str, state, n: int, dims: str) -> None:
    """With cu_seqlens, an initial state (already checked as a tensor of the right rank) holds
    one row per document: leading size n, else a ValueError naming ``name``."""
    if state is not None and state.shape[0] != n:
        raise ValueError(f"with cu_seqlens, {name} must hold one state per document, shape {dims} with n = {n} "
                         f"documents, got shape {tuple(state.shape)}")


def document_positions(cu_seqlens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Each token's position within its document, int64 (L,), on cu_seqlens's device: for
    :func:`ops.rotary` on a packed row. cu_seqlens = [0, 3, 5] gives [0, 1, 2, 0, 1].

    ``length`` (= cu_seqlens[-1]) saves the one host read of cu_seqlens[-1]; positions themselves
    are computed on the device."""
    _check_boundaries_tensor(cu_seqlens)
    cu = cu_seqlens.to(torch.int64)
    if not torch.compiler.is_compiling():  # a traced value check would break the graph; the packed
        # ops check the same values when they plan the call
        check_on_device((cu[0] == 0) & (cu[1:] >= cu[:-1]).all(),
                        "cu_seqlens must start at 0 and be non-decreasing")
    if length is None:
        length = int(cu[-1])
    t = torch.arange(length, dtype=torch.int64, device=cu.device)
    # the document of step t is the last one starting at or before t (empty documents share a start)
    doc = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[doc.clamp(0, cu.shape[0] - 2)]


@dataclass(frozen=True)
class Bucket:
    """Documents run as rows of one length.

    size: the row length Lb; docs (nb,) int64: the documents' indices; lengths (nb,) int64;
    valid (nb, Lb) bool: the step holds a document token. The valid steps as flat lists:
    ``valid_rows``, ``valid_steps`` (their row and step), ``valid_flat`` (row * Lb + step) and
    ``valid_src`` (their packed position), so gathering and scattering touch only real tokens."""

    size: int
    docs: torch.Tensor
    lengths: torch.Tensor
    valid: torch.Tensor
    valid_rows: torch.Tensor
    valid_steps: torch.Tensor
    valid_src: torch.Tensor
    valid_flat: torch.Tensor  # valid_rows * size + valid_steps

    def rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Gather the packed tensor t (batch 1, time at ``dim``) into contiguous rows
        (nb, ..., Lb, ...), zeros at padded steps."""
        nb = self.docs.shape[0]
        if dim == t.dim() - 1:
            # time last (fftconv, cema: (1, D, L)): gather and scatter along the contiguous last
            # dimension, never across it (an index on the time axis of a (D, L) view would read
            # one element per cache line)
            flat = t.new_zeros((*t.shape[1:-1], nb * self.size))
            flat.index_copy_(-1, self.valid_flat, t[0].index_select(-1, self.valid_src))
            return flat.view(*t.shape[1:-1], nb, self.size).movedim(-2, 0).contiguous()
        shape = list(t.shape)
        shape[0], shape[dim] = nb, self.size
        out = t.new_zeros(shape)
        out.movedim(dim, 1)[self.valid_rows, self.valid_steps] = t[0].movedim(dim - 1, 0)[self.valid_src]
        return out

    def put(self, rows: torch.Tensor, out: torch.Tensor, dim: int) -> None:
        """Write the valid steps of rows (nb, ..., Lb, ...) into the packed tensor out (batch 1)."""
        if dim == rows.dim() - 1:
            flat = rows.movedim(0, -2).reshape(*rows.shape[1:-1], -1)  # (..., nb * Lb)
            out[0].index_copy_(-1, self.valid_src, flat.index_select(-1, self.valid_flat).to(out.dtype))
            return
        out[0].movedim(dim - 1, 0)[self.valid_src] = rows.movedim(dim, 1)[self.valid_rows, self.valid_steps].to(out.dtype)


@dataclass(frozen=True)
class Plan:
    """How a packed row of length L runs: n documents, their lengths (n,) int64 on the device, the
    buckets (documents of length 0 are in none) and the longest length (a host int)."""

    n: int
    length: int
    lengths: torch.Tensor
    buckets: tuple
    longest: int  # the longest document's length (0 without documents)


_CACHE: dict = {}


def cached(cu_seqlens: torch.Tensor, key, make):
    """``make()``, computed once per ``cu_seqlens`` tensor (its identity and version) and ``key``:
    what a packed call derives from the boundaries alone is shared by the forward and backward of
    every layer. The entry goes when the tensor does."""
    cache_key = (id(cu_seqlens), cu_seqlens._version, key)
    hit = _CACHE.get(cache_key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1]
    result = make()
    ref = weakref.ref(cu_seqlens, lambda _, k=cache_key: _CACHE.pop(k, None))
    _CACHE[cache_key] = (ref, result)
    return result


def plan(cu_seqlens: torch.Tensor, length: int, *, align: str = "left") -> Plan:
    """Plan a packed call on a row of ``length`` steps (see the module docstring); raises
    ValueError naming cu_seqlens when its values are not 0 first, non-decreasing, ``length``
    last."""
    if align not in ("left", "right"):
        raise ValueError(f"align must be 'left' or 'right', got {align!r}")
    return cached(cu_seqlens, ("plan", length, align), lambda: _make_plan(cu_seqlens, length, align))


def _check_values(cu: list, length: int) -> list:
    """The documents' lengths of the host list ``cu`` (= cu_seqlens); ValueError naming cu_seqlens
    unless it is 0 first, non-decreasing, ``length`` last."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{bad}] = {cu[bad]} > "
                         f"cu_seqlens[{bad + 1}] = {cu[bad + 1]}")
    if cu[-1] != length:
        raise ValueError(f"cu_seqlens must end at the packed length L = {length}, got cu_seqlens[-1] = {cu[-1]}")
    return lengths


def document_bounds(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``cu_seqlens`` as the int64 contiguous tensor a kernel that reads document bounds itself
    takes (no plan, no gathers), its values checked: on the host for CPU tensors (ValueError
    naming cu_seqlens), on the device otherwise (reported asynchronously, no synchronisation)."""
    cu = cu_seqlens.to(torch.int64).contiguous()
    if on_host(cu):
        _check_values(cu.tolist(), length)
    else:
        check_on_device((cu[0] == 0) & (cu[-1] == length) & (cu[1:] >= cu[:-1]).all(),
                        f"cu_seqlens must start at 0, be non-decreasing and end at the packed length L = {length}")
    return cu


def _make_plan(cu_seqlens, length, align) -> Plan:
    cu = [int(v) for v in cu_seqlens.tolist()]  # the one host read of a packed call
    lengths = _check_values(cu, length)
    dev = cu_seqlens.device
    groups: dict = {}
    for d, n in enumerate(lengths):
        if n:  # a row never needs to be longer than the packed row itself
            groups.setdefault(min(next_pow2(n), length), []).append(d)
    buckets = []
    for size in sorted(groups):
        docs = groups[size]
        starts = torch.tensor([cu[d] for d in docs], dtype=torch.int64)
        lens = torch.tensor([lengths[d] for d in docs], dtype=torch.int64)
        steps = torch.arange(size, dtype=torch.int64)
        offset = starts[:, None] if align == "left" else (starts + lens - size)[:, None]
        index = offset + steps  # the packed position each row step stands for
        valid = (index >= starts[:, None]) & (index < (starts + lens)[:, None])
        valid_rows, valid_steps = valid.nonzero(as_tuple=True)
        buckets.append(Bucket(size, torch.tensor(docs, dtype=torch.int64, device=dev), lens.to(dev),
                              valid.to(dev), valid_rows.to(dev), valid_steps.to(dev),
                              index[valid_rows, valid_steps].to(dev), (valid_rows * size + valid_steps).to(dev)))
    return Plan(len(lengths), length, torch.tensor(lengths, dtype=torch.int64, device=dev), tuple(buckets),
                max(lengths, default=0))
