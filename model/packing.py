"""Packed rows for the model: documents laid end to end in one row, delimited by ``cu_seqlens``
(docs/design.md, Packed sequences).

:func:`pack` builds the row and its boundaries from a list of token tensors;
:func:`segment_ids_to_cu_seqlens` turns per-token document ids (B, L) into the same thing for the
flattened batch. ``Megalodon.forward`` accepts either.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["pack", "segment_ids_to_cu_seqlens"]

_CU_DTYPES = (torch.int32, torch.int64)


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def pack(documents: Sequence[torch.Tensor], *, dtype: torch.dtype = torch.int64) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lay 1-D token tensors end to end in one row: ``(tokens (1, T), cu_seqlens (n + 1,))``.

    Args:
        documents: a list (or tuple) of n >= 1 integer tensors of shape (L_d,), one dtype and one
            device; empty documents are kept (they produce nothing in the model), but the row
            must hold at least one token.
        dtype: the dtype of ``cu_seqlens``, ``torch.int64`` (default) or ``torch.int32``.

    Returns:
        tokens (1, T) with T = sum of L_d, in the documents' dtype and on their device, and
        ``cu_seqlens`` (n + 1,) on the same device: document d is ``tokens[0, cu[d]:cu[d + 1]]``.

    Example::

        tokens, cu = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])   # cu = [0, 3, 5]
        logits = model(tokens, cu_seqlens=cu)    # == cat of model(doc[None]) for each document
    """
    if isinstance(documents, torch.Tensor) or not isinstance(documents, (list, tuple)):
        raise TypeError(f"documents must be a list or tuple of 1-D integer token tensors, got {type(documents).__name__}")
    if not documents:
        raise ValueError("documents must hold at least one document, got an empty list")
    if dtype not in _CU_DTYPES:
        raise TypeError(f"dtype (of cu_seqlens) must be torch.int32 or torch.int64, got {dtype}")
    first = documents[0]
    for d, doc in enumerate(documents):
        if not isinstance(doc, torch.Tensor):
            raise TypeError(f"documents[{d}] must be a 1-D integer torch.Tensor, got {type(doc).__name__}")
        if doc.dim() != 1:
            raise ValueError(f"documents[{d}] must be 1-D (L_d,), got shape {tuple(doc.shape)}")
        if not _is_integer(doc):
            raise TypeError(f"documents[{d}] must hold integer token ids, got dtype {doc.dtype}")
        if doc.dtype != first.dtype:
            raise TypeError(f"documents must share one dtype: documents[0] is {first.dtype}, documents[{d}] is {doc.dtype}")
        if doc.device != first.device:
            raise ValueError(f"documents must be on one device: documents[0] is on {first.device}, "
                             f"documents[{d}] on {doc.device}")
    lengths = [doc.shape[0] for doc in documents]
    total = sum(lengths)
    if total == 0:
        raise ValueError(f"documents hold no tokens ({len(documents)} empty documents); the row needs at least one")
    if total > torch.iinfo(dtype).max:
        raise ValueError(f"the packed row has {total} tokens, more than cu_seqlens of dtype {dtype} can index; "
                         f"use dtype=torch.int64")
    cu_seqlens = torch.zeros(len(documents) + 1, dtype=torch.int64)
    cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return torch.cat(documents)[None], cu_seqlens.to(device=first.device, dtype=dtype)


def segment_ids_to_cu_seqlens(segment_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` int64 of the batch of ``tokens`` (B, L) flattened into one row of B L
    tokens, from integer document ids (B, L): a document starts at every position whose id differs
    from the previous position's, and at the start of every row. (A host read: the number of
    documents decides the output's size.)"""
    if not isinstance(segment_ids, torch.Tensor):
        raise TypeError(f"segment_ids must be an integer torch.Tensor (B, L), got {type(segment_ids).__name__}")
    if not _is_integer(segment_ids):
        raise TypeError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")
    if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must have the shape of tokens {tuple(tokens.shape)}, got {tuple(segment_ids.shape)}")
    if segment_ids.device != tokens.device:
        raise ValueError(f"segment_ids is on {segment_ids.device} but tokens are on {tokens.device}")
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    end = torch.tensor([segment_ids.numel()], dtype=torch.int64, device=segment_ids.device)
    return torch.cat([starts.reshape(-1).nonzero().reshape(-1), end])
