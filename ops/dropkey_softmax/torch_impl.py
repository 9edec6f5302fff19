"""PyTorch backend of dropkey_softmax: row blocks of the (..., L, S) scores, fp32 softmax each.

The scores already exist in full, so tiling is only about temporaries: a block's fp32 copy,
its mask and the int64 DropKey hash stay within ``max_block_elems`` entries. Keys beyond a
block's last causal position are never computed; they are written as 0.
"""
from __future__ import annotations

import math

import torch

from .._checks import acc_dtype
from .._host_sync import any_or_device
from ..dropkey_rule import drop_mask

CONFIG_SPACE: dict = {
    # Rows per block (upper bound; shrunk to respect max_block_elems).
    "block_q": [256, 64, 128, 512],
    # Upper bound on entries (batch * heads * rows * S) of one block's temporaries.
    "max_block_elems": [1 << 22],
}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(scores) -> list[str]:
    return []  # every device and dtype torch supports; no length limit


def _as_bhls(x):
    """(..., L, S) -> (Bf, Hf, L, S): b = flat index over dims before -3, h = index along -3."""
    L, S = x.shape[-2:]
    H = x.shape[-3] if x.dim() >= 3 else 1
    return x.reshape(math.prod(x.shape[:-3]), H, L, S)  # explicit sizes: -1 is ambiguous for empty x


def _blocks(Bf, Hf, L, S, causal, block_q, max_block_elems):
    rows = max(1, min(block_q, max_block_elems // max(1, Bf * Hf * S)))
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        hi = max(0, min(S, i1 - 1 + S - L + 1)) if causal else S  # keys past the block's last position: 0
        yield i0, i1, hi


def _blocked(Bf, Hf, i0, i1, hi, L, S, causal, dropkey_p, seed, device):
    """Entries of the block that get no probability (causally hidden or dropped), or None."""
    i_idx = torch.arange(i0, i1, device=device).view(1, 1, -1, 1)  # [1, 1, rows, 1]
    j = torch.arange(hi, device=device).view(1, 1, 1, -1)  # [1, 1, 1, hi]
    blocked = (j > i_idx + (S - L)) if causal else None
    if dropkey_p > 0.0:
        b_idx = torch.arange(Bf, device=device).view(-1, 1, 1, 1)
        h_idx = torch.arange(Hf, device=device).view(1, -1, 1, 1)
        dropped = drop_mask(seed, dropkey_p, b_idx, h_idx, i_idx, j)  # block-sized: OR the causal mask in, in place
        blocked = dropped if blocked is None else dropped.bitwise_or_(blocked)
    return blocked


def forward(scores, *, causal, dropkey_p, seed, block_q, max_block_elems):
    """y of the scores' shape and dtype."""
    x = _as_bhls(scores)
    Bf, Hf, L, S = x.shape
    acc = acc_dtype(scores.dtype)
    blocks = list(_blocks(Bf, Hf, L, S, causal, block_q, max_block_elems))
    # one block over every row and key, already in the compute dtype: its softmax IS y (no copy)
    whole = len(blocks) == 1 and blocks[0][2] == S and scores.dtype == acc
    y = None if whole else torch.empty(x.shape, dtype=scores.dtype, device=scores.device)
    for i0, i1, hi in blocks:
        if not whole:
            y[:, :, i0:i1, hi:] = 0
        if hi == 0:
            continue
        blocked = _blocked(Bf, Hf, i0, i1, hi, L, S, causal, dropkey_p, seed, scores.device)
        s = x[:, :, i0:i1, :hi].to(acc, copy=True)  # [Bf, Hf, rows, hi]
        if blocked is not None:
            s.masked_fill_(blocked, -math.inf)
        p = torch.softmax(s, dim=-1)
        if blocked is not None:
            empty = blocked.all(dim=-1, keepdim=True)  # rows with no visible kept key: softmax gave NaN
            if any_or_device(empty):
                p.masked_fill_(empty, 0.0)
        if whole:
            y = p
        else:
            y[:, :, i0:i1, :hi] = p
    return y.view(scores.shape)


def backward(dy, y, *, causal, dropkey_p, seed, block_q, max_block_elems):
    """dscores = y (dy - sum_j y dy); masked and dropped entries have y = 0, so no mask replay."""
    yb, dyb = _as_bhls(y), _as_bhls(dy)
    Bf, Hf, L, S = yb.shape
    acc = acc_dtype(y.dtype)
    blocks = list(_blocks(Bf, Hf, L, S, causal, block_q, max_block_elems))
    if y.dtype == acc:
        # fp32/fp64: torch's fused softmax backward computes the same y (dy - sum_j y dy) in one
        # kernel, no temporaries; one block over every row and key is the whole result
        if len(blocks) == 1 and blocks[0][2] == S:
            return torch._softmax_backward_data(dyb, yb, -1, acc).view(y.shape)
    dx = torch.empty(yb.shape, dtype=y.dtype, device=y.device)
    for i0, i1, hi in blocks:
        dx[:, :, i0:i1, hi:] = 0
        if hi == 0:
            continue
        if y.dtype == acc:
            dx[:, :, i0:i1, :hi] = torch._softmax_backward_data(dyb[:, :, i0:i1, :hi], yb[:, :, i0:i1, :hi], -1, acc)
            continue
        p = yb[:, :, i0:i1, :hi].to(acc)
        g = dyb[:, :, i0:i1, :hi].to(acc, copy=True)
        dx[:, :, i0:i1, :hi] = g.sub_((p * g).sum(dim=-1, keepdim=True)).mul_(p)
    return dx.view(y.shape)
