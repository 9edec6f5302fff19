"""Streaming state of a Megalodon LM, of constant size per sequence.

Per layer (:class:`LayerState`):

* ``norm_count`` int64 (B,), ``norm_mean`` / ``norm_var`` r(B G): the TimestepNorm running
  statistics, cumulative over every token so far (never reset at chunk boundaries);
* ``hx`` c(B D N): the CEMA hidden state after the last token;
* ``k`` r(B c H dz) (already rotated) and ``v`` r(B c H dv): keys and values of the current,
  unfinished attention chunk, c = tokens seen mod chunk_size, so c < chunk_size. They are
  dropped whenever a chunk completes, because attention never crosses a chunk boundary.

Plus the output layer's TimestepNorm statistics. Nothing grows with the number of tokens: the
largest the cache gets is chunk_size - 1 keys and values per layer.

A cache is created with ``model.init_cache(batch_size)`` and updated IN PLACE by
``model(tokens, cache=cache)``; every tensor in it is detached (inference state).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import List, Optional

import torch

__all__ = ["LayerState", "MegalodonCache"]


def _clone(t):
    return None if t is None else t.clone()


@dataclass
class LayerState:
    k: torch.Tensor
    v: torch.Tensor
    norm_count: Optional[torch.Tensor] = None
    norm_mean: Optional[torch.Tensor] = None
    norm_var: Optional[torch.Tensor] = None
    hx: Optional[torch.Tensor] = None

    @property
    def chunk_offset(self) -> int:
        """Position of the next token inside its attention chunk (= number of cached keys)."""
        return self.k.shape[1]

    def tensors(self) -> List[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def clone(self) -> "LayerState":
        return LayerState(**{f.name: _clone(getattr(self, f.name)) for f in fields(self)})


@dataclass
class MegalodonCache:
    layers: List[LayerState]
    chunk_size: int
    norm_count: Optional[torch.Tensor] = None
    norm_mean: Optional[torch.Tensor] = None
    norm_var: Optional[torch.Tensor] = None
    #: Tokens consumed so far.
    num_tokens: int = 0
    batch_size: int = field(default=0)

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, num_heads: int, z_head_dim: int, v_head_dim: int,
              chunk_size: int, *, dtype: torch.dtype = torch.float32, device=None) -> "MegalodonCache":
        def state():
            return LayerState(k=torch.zeros(batch_size, 0, num_heads, z_head_dim, dtype=dtype, device=device),
                              v=torch.zeros(batch_size, 0, num_heads, v_head_dim, dtype=dtype, device=device))
        return cls(layers=[state() for _ in range(num_layers)], chunk_size=chunk_size, batch_size=batch_size)

    @property
    def chunk_offset(self) -> int:
        return self.layers[0].chunk_offset if self.layers else self.num_tokens % self.chunk_size

    def tensors(self) -> List[torch.Tensor]:
        out = [t for s in self.layers for t in s.tensors()]
        return out + [t for t in (self.norm_count, self.norm_mean, self.norm_var) if t is not None]

    def nbytes(self) -> int:
        """Bytes held by the cache's storages (what it keeps alive, not just its views)."""
        seen, total = set(), 0
        for t in self.tensors():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def clone(self) -> "MegalodonCache":
        """An independent copy (e.g. to branch a stream)."""
        return MegalodonCache(layers=[s.clone() for s in self.layers], chunk_size=self.chunk_size,
                              norm_count=_clone(self.norm_count), norm_mean=_clone(self.norm_mean),
                              norm_var=_clone(self.norm_var), num_tokens=self.num_tokens,
                              batch_size=self.batch_size)
