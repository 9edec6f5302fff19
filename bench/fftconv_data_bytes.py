"""Data traffic of the Triton fftconv tile and slice paths against the ideal bytes, the twiddle table left out.

    TRITON_INTERPRET=1 python -m megalodon_kernels.bench.fftconv_data_bytes

The interpreter's byte counter (bench/triton_bytes.py) counts every load and store; this report
drops the accesses that fall in the twiddle table (the DFT matrices and twiddles are read from it
per level: at most 66 KB at one tile size, L1/L2 hits on a GPU, excepted by issue 39's criterion), so what is
left is the traffic of x, k, dy, y, dx, dk, any partial sums and the slice path's workspaces (k's
slice spectra, the slices' inverse transforms, the parked spectra). Ideal: forward x and k read once,
y written once; backward dy, x and k read once, dx and dk written once (fp32 here).
"""
from __future__ import annotations

import os
import sys

#: (B, D, L): the FFT sizes 512, 2048 (block-diagonal first level) and 4096 of the tile path, and
#: 8192 (R = 4 slices) and 32768 (R = 16) of the slice path
SHAPES = ((4, 1, 256), (4, 1, 1000), (4, 1, 2048), (4, 1, 4096), (4, 1, 16384))


def data_bytes(count, lo: int, hi: int) -> int:
    """Bytes of the counted accesses outside the address range [lo, hi)."""
    total = 0
    for chunks in (count._load_addrs, count._store_addrs):
        for addrs, size in chunks:
            total += int(((addrs < lo) | (addrs >= hi)).sum()) * size
    return total


def ratios(B: int, D: int, L: int) -> tuple[float, float, float, float]:
    """(forward data / ideal, forward total / ideal, backward data / ideal, backward total / ideal) of
    one fp32 call of the default config at (B, D, L) (random inputs), the table left out of "data"."""
    import torch

    from ..ops.fftconv import triton_impl as T
    from .triton_bytes import count_bytes

    cfg = dict(T.DEFAULT_CONFIG, direct_max_len=0)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(B, D, L, generator=g), torch.randn(B, D, L, generator=g)
    k = torch.randn(D, L, generator=g)
    tw = T.twiddle_table(x.device)
    lo, hi = tw.data_ptr(), tw.data_ptr() + tw.numel() * tw.element_size()
    with count_bytes() as c:
        T.forward(x, k, **cfg)
    ideal = 4 * (2 * B * D * L + D * L)
    fwd = (data_bytes(c, lo, hi) / ideal, c.total / ideal)
    with count_bytes() as c:
        T.backward(dy, x, k, True, True, **cfg)
    ideal = 4 * (3 * B * D * L + 2 * D * L)
    return fwd + (data_bytes(c, lo, hi) / ideal, c.total / ideal)


def main() -> int:
    from ..ops.fftconv import triton_impl as T

    print(f"{'pass':<5} {'shape':<16} {'N':>5} {'data/ideal':>10} {'total/ideal':>11}")
    for B, D, L in SHAPES:
        fd, ft, bd, bt = ratios(B, D, L)
        for name, data, total in (("fwd", fd, ft), ("bwd", bd, bt)):
            print(f"{name:<5} {f'B{B} D{D} L{L}':<16} {T.fft_size(L):>5} {data:>10.2f} {total:>11.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
