"""Shape sets to tune on: ``a100`` and ``h100`` (the paper's 7B setting) and ``cpu`` (scaled down).

A set is a model size plus sequence lengths and a token budget per device; every op's shapes
follow from it the way a Megalodon block calls that op, so the tuned keys are the keys a real
run looks up. The batch is the token budget over the length (at least 1).

Paper 7B (Megalodon, section 4): D=4096, CEMA order N=16, G=64 TimestepNorm groups, H=4 heads,
head dims dz=256 (q/k) and dv=2048 (v), attention chunk 4096, L in {4096, 32768}, 16K tokens per
GPU (at L=32768 that is one sequence, split across devices by chunk parallelism upstream).

The shape dicts use each op's own argument letters (as in the ops' docstrings); the op's tuning
harness turns them into tensors.

Plain data shared by the tuner and the benchmarks (bench/shapes.py): imports nothing, so reading
it pulls in no op and no tuning tool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ShapeSet", "SHAPE_SETS", "OP_SHAPES"]


@dataclass(frozen=True)
class ShapeSet:
    name: str
    device_type: str  # "cuda" sets must be measured on the GPU they are named after
    D: int
    N: int
    G: int
    H: int
    dz: int
    dv: int
    chunk: int
    lengths: tuple[int, ...]
    tokens: int
    dtypes: tuple[str, ...]
    note: str = ""

    def batch(self, L: int) -> int:
        return max(1, self.tokens // L)

    def shapes(self, op: str) -> list[dict]:
        """Every shape of ``op`` in this set (empty when the set does not cover the op)."""
        make = OP_SHAPES.get(op)
        return [make(self, L) for L in self.lengths] if make else []


def _attention_rows(s: ShapeSet, L: int) -> tuple[int, int]:
    """(batch x chunks, rows per chunk) of block-diagonal chunked attention."""
    C = min(L, s.chunk)
    return s.batch(L) * (L // C), C


OP_SHAPES: dict[str, Callable[[ShapeSet, int], dict]] = {
    # Training calls the CEMA kernel without a carried state (hx=None).
    "cema_kernel": lambda s, L: {"B": s.batch(L), "D": s.D, "N": s.N, "L": L, "hx": False},
    "ema_hidden": lambda s, L: {"B": s.batch(L), "D": s.D, "N": s.N, "L": L},
    "fftconv": lambda s, L: {"B": s.batch(L), "D": s.D, "L": L},
    "cema": lambda s, L: {"B": s.batch(L), "D": s.D, "N": s.N, "L": L},
    "timestep_norm": lambda s, L: {"B": s.batch(L), "L": L, "D": s.D, "G": s.G},
    "attention": lambda s, L: {"B": s.batch(L), "L": L, "H": s.H, "dh": s.dz, "dv": s.dv, "chunk": s.chunk},
    "dropkey_softmax": lambda s, L: {"B": _attention_rows(s, L)[0], "H": s.H, "L": _attention_rows(s, L)[1],
                                     "S": _attention_rows(s, L)[1]},
    "rotary": lambda s, L: {"B": s.batch(L), "L": L, "H": s.H, "d": s.dz},
}

_PAPER_7B = dict(D=4096, N=16, G=64, H=4, dz=256, dv=2048, chunk=4096, lengths=(4096, 32768), tokens=16384)

SHAPE_SETS: dict[str, ShapeSet] = {
    "a100": ShapeSet("a100", "cuda", **_PAPER_7B, dtypes=("bfloat16", "float32"),
                     note="paper 7B on an A100 (sm_80)"),
    "h100": ShapeSet("h100", "cuda", **_PAPER_7B, dtypes=("bfloat16", "float32"),
                     note="paper 7B on an H100 (sm_90)"),
    # 1/32 of the width, 1/16 of the lengths, 1/8 of the tokens, keeping what shapes the kernels:
    # N=16, group size D/G=64, chunk = L/8 at the long length. The whole set tunes on 2 (shared) CPU
    # cores in minutes; much of that is the float64 references.
    "cpu": ShapeSet("cpu", "cpu", D=128, N=16, G=2, H=2, dz=32, dv=64, chunk=256, lengths=(256, 2048),
                    tokens=2048, dtypes=("float32",), note="scaled for a small CPU"),
}
