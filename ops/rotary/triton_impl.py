"""Triton backend of rotary: one elementwise kernel over (rows = B*L) x (pairs = H*d/2).

Each program rotates a [BLOCK_ROWS, BLOCK_PAIRS] tile of adjacent feature pairs with the
precomputed (cos, sin) tables (xPos scale folded in, float64-accurate angles rounded once to
fp32). Reads x once and the tables once per (row, pair), writes the output once: memory-bound,
ideal bytes = 2 * |x| + |tables|.
"""
from __future__ import annotations

import torch

from .._triton_common import HAVE_TRITON, device_reasons, dtype_reasons, grid_launches, store_rounded, tl, triton

#: every config this backend may launch with (the tuner chooses among them; each is AOT-compiled
#: in tests); the first values are the default
CONFIG_SPACE: dict = {"block_rows": [16, 4], "block_pairs": [64, 128], "num_warps": [4]}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(x) -> list[str]:
    return device_reasons(x, op="rotary") + dtype_reasons("x", x)


if HAVE_TRITON:

    @triton.jit
    def _rotary_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr,
        n_rows, L, n_pairs, half_d, tab_batch_stride, sign, Y0,
        OUT_BF16: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
    ):
        o_r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # row = b * L + l
        o_p = (Y0 + tl.program_id(1)) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)  # pair = h * d/2 + j; Y0: grid_launches
        m = (o_r[:, None] < n_rows) & (o_p[None, :] < n_pairs)
        # [BR, BP] offsets of the pair's first feature in x (contiguous (B, L, H, d))
        p_x = x_ptr + o_r[:, None].to(tl.int64) * (2 * n_pairs) + 2 * o_p[None, :]
        b_x0 = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
        b_x1 = tl.load(p_x + 1, mask=m, other=0.0).to(tl.float32)
        # tables are (P, L, 1, d/2) with P in {1, B}: batch stride 0 when shared
        o_b = o_r // L
        o_l = o_r % L
        o_t = o_b[:, None].to(tl.int64) * tab_batch_stride + o_l[:, None] * half_d + (o_p[None, :] % half_d)
        b_c = tl.load(cos_ptr + o_t, mask=m, other=0.0)
        b_s = tl.load(sin_ptr + o_t, mask=m, other=0.0) * sign
        p_o = out_ptr + o_r[:, None].to(tl.int64) * (2 * n_pairs) + 2 * o_p[None, :]
        store_rounded(p_o, b_x0 * b_c - b_x1 * b_s, m, OUT_BF16)
        store_rounded(p_o + 1, b_x0 * b_s + b_x1 * b_c, m, OUT_BF16)


def _launch(x, cos, sin, sign, block_rows, block_pairs, num_warps):
    B, L, H, d = x.shape
    x = x.contiguous()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    n_rows, n_pairs = B * L, H * d // 2
    tab_batch_stride = 0 if cos.shape[0] == 1 else L * (d // 2)
    for grid, y0, _ in grid_launches(triton.cdiv(n_rows, block_rows), triton.cdiv(n_pairs, block_pairs)):
        _rotary_kernel[grid[:2]](
            x, cos, sin, out, n_rows, L, n_pairs, d // 2, tab_batch_stride, sign, y0,
            OUT_BF16=x.dtype == torch.bfloat16,
            BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs, num_warps=num_warps,
        )
    return out


def forward(x, cos, sin, block_rows=16, block_pairs=64, num_warps=4):
    return _launch(x, cos, sin, 1.0, block_rows, block_pairs, num_warps)


def backward(dy, cos, sin, block_rows=16, block_pairs=64, num_warps=4):
    return _launch(dy, cos, sin, -1.0, block_rows, block_pairs, num_warps)
