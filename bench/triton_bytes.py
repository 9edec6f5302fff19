"""Count the bytes Triton kernels actually load and store, by instrumenting the interpreter.

    python -m megalodon_kernels.bench.triton_bytes [--ops rotary ...]

Inside :func:`count_bytes` every masked load/store (and atomic) the interpreter executes adds
``mask.sum() * element size`` to the totals, so masked-off lanes cost nothing, as on a GPU. The
report compares a kernel's bytes with the ideal of its op (every input read once, every output
written once). "total" counts every access (what a cache-less GPU would move, an upper bound on
DRAM traffic); "unique" counts distinct addresses (what perfect caching would move).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ByteCount:
    loaded: int = 0
    stored: int = 0
    _load_addrs: list = field(default_factory=list, repr=False)
    _store_addrs: list = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        return self.loaded + self.stored

    def _unique(self, chunks) -> int:
        if not chunks:
            return 0
        addrs = np.concatenate([a for a, _ in chunks])
        sizes = np.concatenate([np.full(a.shape, s, dtype=np.int64) for a, s in chunks])
        uniq, idx = np.unique(addrs, return_index=True)
        return int(sizes[idx].sum())

    @property
    def loaded_unique(self) -> int:
        return self._unique(self._load_addrs)

    @property
    def stored_unique(self) -> int:
        return self._unique(self._store_addrs)


@contextlib.contextmanager
def count_bytes():
    """Count interpreter memory traffic inside the block (requires TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("count_bytes needs TRITON_INTERPRET=1 set before triton is imported")
    from triton.runtime import interpreter as interp

    builder = type(interp.interpreter_builder)
    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store
    orig_rmw = getattr(builder, "create_atomic_rmw", None)
    count = ByteCount()

    def elem_bytes(ptrs):
        return ptrs.get_element_ty().primitive_bitwidth // 8

    def record(sink, ptrs, mask):
        m = np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)
        n = int(m.sum())
        sink.append((ptrs.data[m].astype(np.int64).ravel(), elem_bytes(ptrs)))
        return n * elem_bytes(ptrs)

    # *policy: the cache / volatility arguments, whose number differs between Triton releases
    def load(self, ptrs, mask, other, *policy):
        count.loaded += record(count._load_addrs, ptrs, mask)
        return orig_load(self, ptrs, mask, other, *policy)

    def store(self, ptrs, value, mask, *policy):
        count.stored += record(count._store_addrs, ptrs, mask)
        return orig_store(self, ptrs, value, mask, *policy)

    def rmw(self, rmwOp, ptr, val, mask, sem, scope):
        n = record(count._load_addrs, ptr, mask)
        count.loaded += n
        count.stored += record(count._store_addrs, ptr, mask)
        return orig_rmw(self, rmwOp, ptr, val, mask, sem, scope)

    builder.create_masked_load, builder.create_masked_store = load, store
    if orig_rmw is not None:
        builder.create_atomic_rmw = rmw
    try:
        yield count
    finally:
        builder.create_masked_load, builder.create_masked_store = orig_load, orig_store
        if orig_rmw is not None:
            builder.create_atomic_rmw = orig_rmw


# ------------------------------------------------------------------ per-op measurement cases
# bench/triton_variants.py declares each op's ``bytes_cases``: (kernel name, shape text, run) where
# ``run()`` launches the kernel(s) at a medium shape and returns the ideal byte count (every input
# read once, every output written once); it is called inside count_bytes().


def measure(op):
    """[(kernel, shape, ByteCount, ideal bytes)] for one op."""
    from .triton_variants import bytes_cases

    rows = []
    for name, shape, run in bytes_cases(op):
        with count_bytes() as c:
            ideal = run()
        rows.append((name, shape, c, ideal))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="bytes moved per Triton kernel vs the ideal")
    from .aot import TRITON_OPS

    ap.add_argument("--ops", nargs="*", default=list(TRITON_OPS), choices=list(TRITON_OPS))
    a = ap.parse_args(argv)
    print(f"{'kernel':<22} {'shape':<28} {'loaded':>10} {'stored':>10} {'total':>10} {'unique':>10} "
          f"{'ideal':>10} {'total/ideal':>11} {'unique/ideal':>12}")
    for op in a.ops:
        for name, shape, c, ideal in measure(op):
            uniq = c.loaded_unique + c.stored_unique
            print(f"{name:<22} {shape:<28} {c.loaded:>10} {c.stored:>10} {c.total:>10} {uniq:>10} {ideal:>10} "
                  f"{c.total / ideal:>11.3f} {uniq / ideal:>12.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
