"""L1 wavefronts of the Triton fftconv tile transform's twiddle and DFT-matrix loads, per warp and
transform: the gathered table entries (before) against the contiguous pre-arranged tiles (now).

    python -m megalodon_kernels.bench.fftconv_table_wavefronts

A warp-wide global load costs one L1 wavefront (one cycle of the SM's 128 B/clk L1/shared data
path) per distinct 128-byte line its 32 lanes touch. The model takes the distributed layouts
that Triton 3.9 gives these loads for sm_90 at N = 2048 (A = 8, 4 warps; read from the TTGIR:
``#blocked1`` = sizePerThread [1, 1], threadsPerWarp [4, 8] for the [256, 8] tiles, ``#blocked2`` =
[1, 1], [2, 16] for the [16, 16] and [128, 16] tiles, warps stacked along the rows) and counts
the distinct lines of each load instruction from the table index of every element, as the kernels
computed it before (``table_twiddle``: W_M^e at index (e mod M) 4096 / M of a [2, 4096] table) and
as they compute it now (row-major tiles of ``twiddle_table``'s planes). No GPU needed; the
lines-per-wavefront rule is the documented L1 behaviour (ncu: l1tex__data_pipe_lsu_wavefronts).
"""
from __future__ import annotations

import numpy as np

LINE_FLOATS = 32          # 128-byte lines of fp32


def lanes(shape, tpw, warps=4):
    """{(warp, register): [(row, col)] * 32} of a blocked layout with sizePerThread [1, 1], order
    [1, 0], threadsPerWarp ``tpw`` and the warps stacked along the rows."""
    rows, cols = shape
    out = {}
    for r in range(rows):
        for c in range(cols):
            lr, lc = r % tpw[0], c % tpw[1]
            w = (r // tpw[0]) % warps
            reg = (r // (tpw[0] * warps), c // tpw[1])
            out.setdefault((w, reg), []).append((r, c))
    return out


def wavefronts(shape, tpw, index) -> float:
    """Distinct 128-byte lines per warp summed over the load's instructions (averaged over warps)."""
    per_warp = {}
    for (w, _), pts in lanes(shape, tpw).items():
        lines = {index(r, c) // LINE_FLOATS for r, c in pts}
        per_warp[w] = per_warp.get(w, 0) + len(lines)
    return float(np.mean(list(per_warp.values())))


def table_index(e, log_m):
    return (e % (1 << log_m)) << (12 - log_m)


def main() -> int:
    A, LOG_A = 8, 3
    B1, B2 = (4, 8), (2, 16)
    loads = {   # name: (shape, threadsPerWarp, before index, now index (row-major plane), per transform)
        "F8 (block-diagonal)": ((16, 16), B2, lambda r, c: table_index((r % 8) * (c % 8), 3), lambda r, c: 16 * r + c, 1),
        "F16": ((16, 16), B2, lambda r, c: table_index(r * c, 4), lambda r, c: 16 * r + c, 2),
        "W_16A (twiddle_a)": ((256, A), B1, lambda r, c: table_index((r // 16) * c, LOG_A + 4), lambda r, c: A * r + c, 1),
        "W_N (twiddle_n)": ((16 * A, 16), B2, lambda r, c: table_index((r // A) * (r % A + A * c), LOG_A + 8),
                            lambda r, c: 16 * r + c, 1),
    }
    print("N = 2048 tile transform (A = 8, 4 warps): L1 wavefronts per warp, cos + sin planes")
    print(f"{'load':<22} {'per transform':>13} {'before':>8} {'now':>8}")
    tot_b = tot_n = 0.0
    for name, (shape, tpw, before, now, times) in loads.items():
        b = 2 * times * wavefronts(shape, tpw, before)
        n = 2 * times * wavefronts(shape, tpw, now)
        tot_b, tot_n = tot_b + b, tot_n + n
        print(f"{name:<22} {times:>13} {b:>8.0f} {n:>8.0f}")
    print(f"{'total':<22} {'':>13} {tot_b:>8.0f} {tot_n:>8.0f}")
    x = 2 * wavefronts((256, A), B1, lambda r, c: r + 256 * c)
    print(f"for scale: the pair's fp32 data tile (two [256, 8] loads, x[r + 256 a]): {x:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
