"""Benchmark shape sets: ``a100``/``h100`` (the paper's 7B setting) and ``cpu`` (scaled down).

Reuses :mod:`megalodon_kernels.autotune.shapes` so the benchmarked shapes are the shapes the
autotune tables are keyed on. The bench ``cpu`` set adds two lengths between the tuning set's
256 and 2048 (for the time-vs-L plots); the token count stays 2048 at every length (batch =
tokens / L), so every point does the same number of tokens' work.

Each op's benchmark builds its tensors from ``shape(op, set, L)``, the dict of that op's argument
letters (the ops' signatures in docs/design.md).
"""
from __future__ import annotations

import dataclasses

from megalodon_kernels.autotune.shapes import OP_SHAPES, SHAPE_SETS, ShapeSet

__all__ = ["BENCH_SETS", "OP_SHAPES", "ShapeSet", "shape", "dtype_name"]

BENCH_SETS: dict[str, ShapeSet] = {
    "a100": SHAPE_SETS["a100"],
    "h100": SHAPE_SETS["h100"],
    "cpu": dataclasses.replace(SHAPE_SETS["cpu"], lengths=(256, 512, 1024, 2048)),
}

#: pytest --shape-set default
DEFAULT_SET = "cpu"


def shape(op: str, set_name: str, L: int) -> dict:
    return dict(OP_SHAPES[op](BENCH_SETS[set_name], L))


def dtype_name(set_name: str) -> str:
    """The dtype a set benchmarks: bf16 on the GPUs (training precision), fp32 on the CPU."""
    return BENCH_SETS[set_name].dtypes[0]
