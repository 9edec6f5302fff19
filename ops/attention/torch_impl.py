"""PyTorch backend of attention: flash-style tiling over query blocks, no L x S matrix.

Two paths, both exact (no approximation, same masks and DropKey rule):

* general: loop over blocks of ``block_q`` query rows. Each block computes scores only over the
  key range [lo, hi) it can see (causal, chunk and block_causal bounds), so a causal block pays
  for the keys up to its last row and a chunked block for its one or two chunks. The forward
  keeps the per-row log-sum-exp; the backward recomputes P block by block with the forward's own
  softmax steps (bit for bit the forward's P) and uses delta = rowsum(dO * O) for the softmax
  gradient. Only one [B, H, rows, hi - lo] tile is alive at a time, and the visibility mask is
  applied only to the tile's columns that need it (a causal tile's diagonal part).
* chunk-batched: with ``chunk_size`` and L == S, queries and keys are reshaped into chunks
  [B, H, n_chunks, C, d] (the ragged last chunk padded and masked; block_causal appends the
  previous chunk's keys) and ``chunks_per_step`` chunks go through ONE batched matmul, so
  Megalodon's small chunks do not cost a Python iteration each.

Both paths cap a tile at ``max_block_elems`` score entries (B * H * rows * keys), shrinking the
rows per step, so memory stays bounded whatever B, H and S are. Everything is computed in fp32
(fp64 for fp64 inputs) and rounded once to the input dtype.

Kept tiles: recomputing a tile in the backward (its scores, softmax and DropKey hash) costs more on
the CPU than the tile's other matmuls, so an eager forward that autograd records
(:func:`forward` with ``tiles_out``) may return every tile's P (softmax) or DropKey mask in one flat
tensor, in tile order, when that takes little memory (:func:`_tiles_to_keep`). The op saves it on
its autograd node and hands it to :func:`backward`, which reads the tiles instead of rebuilding
them.
"""
from __future__ import annotations

import math

import torch

from .._checks import acc_dtype
from .._host_sync import any_or_device, on_host
from ..dropkey_rule import drop_mask
from . import laplace

CONFIG_SPACE: dict = {
    # Query rows per tile of the general path.
    "block_q": [128, 64, 256],
    # Chunks per batched matmul on the chunk-batched path; 0 disables that path.
    "chunks_per_step": [64, 0, 4, 16],
    # Upper bound on score entries (B * H * rows * keys) of one tile; bounds the fp32 scores,
    # probabilities and the int64 DropKey hash temporaries.
    "max_block_elems": [1 << 22],
}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(q, k, v, **mask_modes) -> list[str]:
    return []  # every device and dtype torch supports; no length limit


# ---------------------------------------------------------------------------------------------
# Shared tile math


def _key_range(i0, i1, L, S, causal, chunk_size, block_causal):
    """Keys [lo, hi) that query rows [i0, i1) can see at all (hi <= lo: none)."""
    p0, p1 = i0 + S - L, i1 - 1 + S - L  # key-space positions of the first and last row
    lo, hi = 0, S
    if causal:
        hi = min(hi, p1 + 1)
    if chunk_size is not None:
        c0 = p0 // chunk_size - (1 if block_causal else 0)
        lo = max(lo, c0 * chunk_size)
        hi = min(hi, (p1 // chunk_size + 1) * chunk_size)
    return lo, hi


def _blocked(pos, j, S, causal, chunk_size, block_causal):
    """Bool mask of NOT visible entries from broadcastable int64 query positions ``pos`` and
    key indices ``j`` (keys outside [0, S) are padding and never visible)."""
    blocked = (j < 0) | (j >= S)
    if causal:
        blocked = blocked | (j > pos)
    if chunk_size is not None:
        cp = torch.div(pos, chunk_size, rounding_mode="floor")
        cj = torch.div(j, chunk_size, rounding_mode="floor")
        seen = (cj == cp) | (cj == cp - 1) if block_causal else cj == cp
        blocked = blocked | ~seen
    return blocked


def _tile_mask(B, H, pos, i_idx, j, S, causal, chunk_size, block_causal, dropkey_p, seed, batch_index, out=None):
    """Which entries of a score tile [B, H, ..., rows, keys] get no probability.

    ``pos``/``i_idx`` (query positions / query indices) and ``j`` (key indices) are int64 index
    tensors broadcasting against the tile; DropKey uses these GLOBAL indices, so every tiling
    regenerates the same mask. ``batch_index`` (B,) int64 or None: the batch index the DropKey
    rule sees for each batch row (None: the row's own index; packed document rows pass their
    documents' indices). Returns (blocked, a, b): ``blocked`` covers only the key columns
    [a, b) of the tile that hold any blocked entry (None if there is none), so a causal tile
    masks its diagonal part only instead of every column. ``out`` (DropKey only): the bool tile
    the mask is written to (a kept tile).
    """
    blocked = _blocked(pos, j, S, causal, chunk_size, block_causal)  # small: no B, H dims
    if dropkey_p > 0.0:
        nd = pos.dim()
        b_idx = torch.arange(B, device=pos.device) if batch_index is None else batch_index
        b_idx = b_idx.view((B,) + (1,) * (nd - 1))
        h_idx = torch.arange(H, device=pos.device).view((1, H) + (1,) * (nd - 2))
        # Padding keys may have j < 0 or j >= S: clamp so the hash sees valid 32-bit inputs (they stay blocked).
        # The dropped mask (= ~keep_mask) is tile-sized already: OR the small visibility mask into it in place.
        dropped = drop_mask(seed, dropkey_p, b_idx, h_idx, i_idx, j.clamp(0, max(S - 1, 0)))
        return torch.bitwise_or(dropped, blocked, out=dropped if out is None else out), 0, j.shape[-1]
    if not on_host(blocked):  # finding the blocked columns would read the mask on the host
        return blocked, 0, j.shape[-1]
    cols = blocked.flatten(0, -2).any(0).nonzero()
    if cols.numel() == 0:
        return None, 0, 0
    a, b = int(cols[0]), int(cols[-1]) + 1
    return blocked[..., a:b], a, b


def _fill(x, mask, value):
    blocked, a, b = mask
    if blocked is not None:
        x[..., a:b].masked_fill_(blocked, value)
    return x


def _probs_fwd(s, mask, attn_fn, out=None):
    """Probabilities of a score tile (``s`` is consumed) and, for softmax, the row log-sum-exp;
    ``out`` (softmax only): the tile P is written to (a kept tile)."""
    if attn_fn == "laplace":
        # 0.5 * (1 + erf(z)) as 0.5 * erfc(-z): equal, but 1 + erf(z) cancels to 0 in fp32 for z << 0.
        p = torch.special.erfc(s.sub_(laplace.MU).mul_(-laplace.INV)).mul_(0.5)
        return _fill(p, mask, 0.0), None
    p, m, empty = _softmax_tile(s, mask, out)
    # softmax's largest entry is exp(0) / z, so lse = m + log z = m - log(max p) without another exp pass.
    lse = m - p.amax(dim=-1).log()
    if empty is not None:
        lse = lse.masked_fill(empty, -math.inf)
    return p, lse


def _softmax_tile(s, mask, out=None):
    """(P, the row maxima of the masked scores, the empty rows or None) of a score tile (``s`` is
    consumed; P is written to ``out`` if given). The forward and the backward's recomputation both
    run this, so the backward's P is bit for bit the forward's."""
    _fill(s, mask, -math.inf)
    m = s.amax(dim=-1)  # [..., rows]
    p = torch.softmax(s, dim=-1) if out is None else torch.softmax(s, dim=-1, out=out)
    empty = torch.isneginf(m)  # rows with no visible kept key: softmax gave NaN there
    if not any_or_device(empty):
        return p, m, None
    p.masked_fill_(empty.unsqueeze(-1), 0.0)
    return p, m, empty


def _probs_bwd(s, mask, lse, attn_fn):
    """Recompute P (and for laplace the derivative factor) of a score tile in the backward."""
    if attn_fn == "laplace":
        x = s.sub_(laplace.MU)
        p = _fill(torch.special.erfc(x * -laplace.INV).mul_(0.5), mask, 0.0)
        dlap = _fill(x.square_().mul_(-laplace.HALF_INV_VAR).exp_().mul_(laplace.PDF), mask, 0.0)
        return p, dlap
    # The forward's own steps on the same scores, so P is bit for bit the forward's (and a kept
    # tile's); lse is not needed.
    return _softmax_tile(s, mask)[0], None


def _ds(p, dp, extra, delta, attn_fn):
    """Gradient w.r.t. the scaled scores: softmax dS = P (dP - delta), laplace dS = dP laplace'(s)."""
    if attn_fn == "laplace":
        return dp.mul_(extra)
    return dp.sub_(delta.unsqueeze(-1)).mul_(p)


def _to_bhld(x, dtype, scale=None):
    """(B, T, H, d) -> contiguous [B, H, T, d] in the compute dtype (one copy, reused by all tiles).

    With ``scale``, the result is multiplied by it: scaling q once instead of every score tile.
    """
    if scale is None:
        return x.transpose(1, 2).to(dtype).contiguous()
    out = x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format, copy=True)  # never alias x
    return out.mul_(scale)


def _rows_per_tile(block_q, keys, B, H, max_block_elems):
    return max(1, min(block_q, max_block_elems // max(1, B * H * keys)))


def use_chunk_path(L, S, B, H, chunk_size, block_causal, chunks_per_step, max_block_elems, **_):
    """Whether the chunk-batched path runs: chunked, L == S, >= 2 chunks, one chunk fits a tile."""
    if chunk_size is None or chunks_per_step <= 0 or L != S or chunk_size >= L:
        return False
    keys = chunk_size * (2 if block_causal else 1)
    return B * H * chunk_size * keys <= max_block_elems


# ---------------------------------------------------------------------------------------------
# General path: query blocks


def _general_tiles(B, H, L, S, causal, chunk_size, block_causal, block_q, max_block_elems):
    keys = S if chunk_size is None else min(S, chunk_size * (2 if block_causal else 1) + block_q)
    rows = _rows_per_tile(block_q, keys, B, H, max_block_elems)
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        lo, hi = _key_range(i0, i1, L, S, causal, chunk_size, block_causal)
        yield i0, i1, lo, hi


def _tile_indices(i0, i1, lo, hi, L, S, device):
    i_idx = torch.arange(i0, i1, device=device).view(1, 1, -1, 1)  # [1, 1, rows, 1]
    j = torch.arange(lo, hi, device=device).view(1, 1, 1, -1)  # [1, 1, 1, keys]
    return i_idx, i_idx + (S - L), j


def _general_fwd(qt, kt, vt, o, lse, causal, chunk_size, block_causal, dropkey_p, seed, batch_index, attn_fn,
                 block_q, max_block_elems, kept=None):
    B, H, L, _ = qt.shape
    S = kt.shape[2]
    for i0, i1, lo, hi in _general_tiles(B, H, L, S, causal, chunk_size, block_causal, block_q,
                                         max_block_elems):
        if hi <= lo:  # no key visible to any row of this block
            o[:, i0:i1] = 0
            if lse is not None:
                lse[:, :, i0:i1] = -math.inf
            continue
        s = torch.matmul(qt[:, :, i0:i1], kt[:, :, lo:hi].transpose(-1, -2))  # [B, H, rows, keys]
        mask_out, p_out = _kept_outs(kept, s.shape)
        i_idx, pos, j = _tile_indices(i0, i1, lo, hi, L, S, qt.device)
        mask = _tile_mask(B, H, pos, i_idx, j, S, causal, chunk_size, block_causal, dropkey_p, seed, batch_index,
                          out=mask_out)
        p, row_lse = _probs_fwd(s, mask, attn_fn, out=p_out)
        ob = torch.matmul(p, vt[:, :, lo:hi])  # [B, H, rows, dv]
        o[:, i0:i1] = ob.transpose(1, 2)
        if lse is not None:
            lse[:, :, i0:i1] = row_lse


def _general_bwd(qt, kt, vt, dot, delta, lse, dq, dk, dv, scale, causal, chunk_size, block_causal, dropkey_p,
                 seed, batch_index, attn_fn, block_q, max_block_elems, kept=None):
    B, H, L, _ = qt.shape
    S = kt.shape[2]
    for i0, i1, lo, hi in _general_tiles(B, H, L, S, causal, chunk_size, block_causal, block_q,
                                         max_block_elems):
        if hi <= lo:
            dq[:, :, i0:i1] = 0
            continue
        qb, kb, vb, dob = qt[:, :, i0:i1], kt[:, :, lo:hi], vt[:, :, lo:hi], dot[:, :, i0:i1]
        if kept is not None and kept.probs:  # the forward's P of this tile
            p, extra = kept.next((B, H, i1 - i0, hi - lo)), None
        else:
            if kept is not None:  # the forward's DropKey mask of this tile
                mask = (kept.next((B, H, i1 - i0, hi - lo)), 0, hi - lo)
            else:
                i_idx, pos, j = _tile_indices(i0, i1, lo, hi, L, S, qt.device)
                mask = _tile_mask(B, H, pos, i_idx, j, S, causal, chunk_size, block_causal, dropkey_p, seed,
                                  batch_index)
            s = torch.matmul(qb, kb.transpose(-1, -2))  # [B, H, rows, keys]
            p, extra = _probs_bwd(s, mask, None if lse is None else lse[:, :, i0:i1], attn_fn)
        dv[:, :, lo:hi] += torch.matmul(p.transpose(-1, -2), dob)
        dp = torch.matmul(dob, vb.transpose(-1, -2))  # [B, H, rows, keys]
        ds = _ds(p, dp, extra, None if delta is None else delta[:, :, i0:i1], attn_fn)
        dq[:, :, i0:i1] = torch.matmul(ds, kb).mul_(scale)
        dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), qb)


# ---------------------------------------------------------------------------------------------
# Chunk-batched path (chunk_size given, L == S)


def _chunked(x, C, nc, front):
    """[B, H, L, d] -> [B, H, front + nc, C, d], zero-padding ``front`` chunks before and the ragged tail."""
    L = x.shape[2]
    if front or nc * C != L:  # otherwise a view: no copy of x
        x = torch.nn.functional.pad(x, (0, 0, front * C, nc * C - L))
    return x.view(x.shape[0], x.shape[1], front + nc, C, x.shape[-1])


def _chunk_steps(B, H, L, C, block_causal, chunks_per_step, max_block_elems):
    nc = -(-L // C)
    keys = C * (2 if block_causal else 1)
    per_step = max(1, min(chunks_per_step, max_block_elems // max(1, B * H * C * keys)))
    for c0 in range(0, nc, per_step):
        yield c0, min(nc, c0 + per_step)


def _chunk_keys(xc, c0, c1, block_causal):
    """Keys/values of chunks [c0, c1): [B, H, G, C or 2C, d] (block_causal: previous chunk first)."""
    if not block_causal:
        return xc[:, :, c0:c1]
    # xc has one zero chunk in front, so chunk c lives at c + 1 and its predecessor at c.
    return torch.cat((xc[:, :, c0:c1], xc[:, :, c0 + 1:c1 + 1]), dim=-2)


def _chunk_indices(c0, c1, C, block_causal, device):
    """Global query indices [1, 1, G, C, 1] and key indices [1, 1, G, 1, keys] of a chunk group."""
    c = torch.arange(c0, c1, device=device).view(1, 1, -1, 1, 1)
    r = torch.arange(C, device=device).view(1, 1, 1, -1, 1)
    i_idx = c * C + r
    first = (c - 1) * C if block_causal else c * C
    keys = C * (2 if block_causal else 1)
    j = first + torch.arange(keys, device=device).view(1, 1, 1, 1, -1)
    return i_idx, j


def _chunk_fwd(qt, kt, vt, o, lse, causal, chunk_size, block_causal, dropkey_p, seed, batch_index, attn_fn,
               chunks_per_step, max_block_elems, kept=None):
    B, H, L, _ = qt.shape
    C = chunk_size
    nc = -(-L // C)
    front = 1 if block_causal else 0
    qc, kc, vc = _chunked(qt, C, nc, 0), _chunked(kt, C, nc, front), _chunked(vt, C, nc, front)
    for c0, c1 in _chunk_steps(B, H, L, C, block_causal, chunks_per_step, max_block_elems):
        kb, vb = _chunk_keys(kc, c0, c1, block_causal), _chunk_keys(vc, c0, c1, block_causal)
        s = torch.matmul(qc[:, :, c0:c1], kb.transpose(-1, -2))  # [B, H, G, C, keys]
        mask_out, p_out = _kept_outs(kept, s.shape)
        i_idx, j = _chunk_indices(c0, c1, C, block_causal, qt.device)
        mask = _tile_mask(B, H, i_idx, i_idx, j, L, causal, C, block_causal, dropkey_p, seed, batch_index,
                          out=mask_out)
        p, row_lse = _probs_fwd(s, mask, attn_fn, out=p_out)
        ob = torch.matmul(p, vb).flatten(2, 3)  # [B, H, G*C, dv]
        r0, r1 = c0 * C, min(L, c1 * C)
        o[:, r0:r1] = ob[:, :, : r1 - r0].transpose(1, 2)
        if lse is not None:
            lse[:, :, r0:r1] = row_lse.flatten(2, 3)[:, :, : r1 - r0]


def _chunk_bwd(qt, kt, vt, dot, delta, lse, dq, dk, dv, scale, causal, chunk_size, block_causal, dropkey_p,
               seed, batch_index, attn_fn, chunks_per_step, max_block_elems, kept=None):
    B, H, L, _ = qt.shape
    C = chunk_size
    nc = -(-L // C)
    front = 1 if block_causal else 0
    qc, kc, vc, doc = (_chunked(qt, C, nc, 0), _chunked(kt, C, nc, front), _chunked(vt, C, nc, front),
                       _chunked(dot, C, nc, 0))
    if delta is not None:
        delta_c = torch.nn.functional.pad(delta, (0, nc * C - L)).view(B, H, nc, C)
        lse_c = torch.nn.functional.pad(lse, (0, nc * C - L), value=-math.inf).view(B, H, nc, C)
    # Accumulators in the chunk layout: views of dq, dk, dv when no chunk is padded, else padded
    # buffers whose padding rows are cut off at the end. Every chunk's dq is written once; so are
    # dk and dv without block_causal, where no zero fill is needed.
    padded = front or nc * C != L
    if padded:
        dqc = qc.new_empty(qc.shape)
        dkc = kc.new_zeros(kc.shape) if block_causal else kc.new_empty(kc.shape)
        dvc = vc.new_zeros(vc.shape) if block_causal else vc.new_empty(vc.shape)
    else:
        dqc, dkc, dvc = (t.view(B, H, nc, C, t.shape[-1]) for t in (dq, dk, dv))
    for c0, c1 in _chunk_steps(B, H, L, C, block_causal, chunks_per_step, max_block_elems):
        qb, dob = qc[:, :, c0:c1], doc[:, :, c0:c1]
        kb, vb = _chunk_keys(kc, c0, c1, block_causal), _chunk_keys(vc, c0, c1, block_causal)
        shape = (B, H, c1 - c0, C, kb.shape[-2])
        if kept is not None and kept.probs:  # the forward's P of this step
            p, extra = kept.next(shape), None
        else:
            if kept is not None:  # the forward's DropKey mask of this step
                mask = (kept.next(shape), 0, shape[-1])
            else:
                i_idx, j = _chunk_indices(c0, c1, C, block_causal, qt.device)
                mask = _tile_mask(B, H, i_idx, i_idx, j, L, causal, C, block_causal, dropkey_p, seed, batch_index)
            s = torch.matmul(qb, kb.transpose(-1, -2))  # [B, H, G, C, keys]
            p, extra = _probs_bwd(s, mask, None if delta is None else lse_c[:, :, c0:c1], attn_fn)
        dvb = torch.matmul(p.transpose(-1, -2), dob)  # [B, H, G, keys, dv]
        dp = torch.matmul(dob, vb.transpose(-1, -2))
        ds = _ds(p, dp, extra, None if delta is None else delta_c[:, :, c0:c1], attn_fn)
        dq_b = torch.matmul(ds, kb)
        dqc[:, :, c0:c1] = dq_b.mul_(scale) if scale != 1.0 else dq_b  # x 1.0 is exact: skip the pass
        dkb = torch.matmul(ds.transpose(-1, -2), qb)  # [B, H, G, keys, dh]
        if block_causal:
            # First C key slots belong to the previous chunk (stored one chunk earlier in the padded layout).
            dkc[:, :, c0:c1] += dkb[..., :C, :]
            dvc[:, :, c0:c1] += dvb[..., :C, :]
            dkc[:, :, c0 + 1:c1 + 1] += dkb[..., C:, :]
            dvc[:, :, c0 + 1:c1 + 1] += dvb[..., C:, :]
        else:
            dkc[:, :, c0:c1] = dkb
            dvc[:, :, c0:c1] = dvb
    if padded:
        first = front * C
        dq.copy_(dqc.flatten(2, 3)[:, :, :L])
        dk.copy_(dkc.flatten(2, 3)[:, :, first:first + L])
        dv.copy_(dvc.flatten(2, 3)[:, :, first:first + L])


# ---------------------------------------------------------------------------------------------
# Kept tiles (module doc)


class _KeptTiles:
    """A cursor over the flat tensor of a pass's kept tiles, in tile order: P in the accumulation
    dtype (softmax) or the DropKey masks (bool)."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.at = flat, 0
        self.probs = flat.dtype != torch.bool

    def next(self, shape) -> torch.Tensor:
        n = math.prod(shape)
        tile = self.flat[self.at:self.at + n].view(shape)
        self.at += n
        return tile


def _kept_outs(kept, shape):
    """(out of the tile's mask, out of its P): where the forward writes the tile it keeps."""
    if kept is None:
        return None, None
    tile = kept.next(shape)
    return (None, tile) if kept.probs else (tile, None)


def _tile_shapes(B, H, L, S, causal, chunk_size, block_causal, chunked, block_q, chunks_per_step,
                 max_block_elems) -> list[tuple]:
    """The shapes of a pass's score tiles, in the order both passes visit them."""
    if chunked:
        keys = chunk_size * (2 if block_causal else 1)
        return [(B, H, c1 - c0, chunk_size, keys)
                for c0, c1 in _chunk_steps(B, H, L, chunk_size, block_causal, chunks_per_step, max_block_elems)]
    return [(B, H, i1 - i0, hi - lo) for i0, i1, lo, hi in
            _general_tiles(B, H, L, S, causal, chunk_size, block_causal, block_q, max_block_elems) if hi > lo]


def _tiles_to_keep(q, k, v, entries, attn_fn, dropkey_p) -> torch.dtype | None:
    """The dtype of the tiles a forward keeps, or None to keep nothing. Keeping P saves the
    backward its most expensive recomputation (scores, softmax and DropKey hash), at the price of
    memory: P is kept when it takes at most twice what the op saves anyway (q, k, v, o); else, with
    DropKey, the masks (a byte per entry) when they take at most that much."""
    B, L, H, _ = q.shape
    saved = sum(t.numel() * t.element_size() for t in (q, k, v)) + B * L * H * v.shape[-1] * q.element_size()
    acc = acc_dtype(q.dtype)
    if attn_fn == "softmax" and entries * torch.finfo(acc).bits // 8 <= 2 * saved:
        return acc
    if dropkey_p > 0.0 and entries <= saved:
        return torch.bool
    return None


# ---------------------------------------------------------------------------------------------
# Entry points (same signature in every backend)


def _forward(q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, block_q,
             chunks_per_step, max_block_elems, batch_index, keep):
    B, L, H, _ = q.shape
    S, dv = k.shape[1], v.shape[-1]
    acc = acc_dtype(q.dtype)
    qt, kt, vt = _to_bhld(q, acc, scale), _to_bhld(k, acc), _to_bhld(v, acc)  # qt = scale * q
    o = torch.empty((B, L, H, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, L), dtype=acc, device=q.device) if attn_fn == "softmax" else None
    common = dict(causal=causal, chunk_size=chunk_size, block_causal=block_causal,
                  dropkey_p=dropkey_p, seed=seed, batch_index=batch_index, attn_fn=attn_fn,
                  max_block_elems=max_block_elems)
    chunked = use_chunk_path(L, S, B, H, chunk_size, block_causal, chunks_per_step, max_block_elems)
    tiles = None
    if keep:
        entries = sum(math.prod(t) for t in _tile_shapes(B, H, L, S, causal, chunk_size, block_causal, chunked,
                                                          block_q, chunks_per_step, max_block_elems))
        dtype = _tiles_to_keep(q, k, v, entries, attn_fn, dropkey_p)
        tiles = None if dtype is None else torch.empty(entries, dtype=dtype, device=q.device)
    kept = None if tiles is None else _KeptTiles(tiles)
    if chunked:
        _chunk_fwd(qt, kt, vt, o, lse, chunks_per_step=chunks_per_step, kept=kept, **common)
    else:
        _general_fwd(qt, kt, vt, o, lse, block_q=block_q, kept=kept, **common)
    return o, lse, tiles


#: forward can keep its tiles for the backward (``tiles_out``; backward's ``tiles``)
KEEPS_TILES = True


def forward(q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
            block_q, chunks_per_step, max_block_elems, batch_index=None, tiles_out=None):
    """Returns (o r(B L H dv) in q's dtype, lse r(B H L) fp32/fp64 or None for laplace).

    ``batch_index`` (B,) int64 or None: the batch index b of each row in the DropKey rule
    (packed document rows pass their documents' indices; None: b is the row itself).
    ``tiles_out``: None, or a list to append the kept tiles to (one flat tensor, for
    :func:`backward`'s ``tiles``; nothing when they would take too much memory): a forward that
    autograd records (module doc)."""
    o, lse, tiles = _forward(q, k, v, scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
                             dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, block_q=block_q,
                             chunks_per_step=chunks_per_step, max_block_elems=max_block_elems,
                             batch_index=batch_index, keep=tiles_out is not None and batch_index is None)
    if tiles is not None:
        tiles_out.append(tiles)
    return o, lse


def backward(do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                  block_q, chunks_per_step, max_block_elems, batch_index=None, tiles=None):
    """Returns (dq, dk, dv) in the input dtype, recomputing the probabilities tile by tile, or
    reading them from ``tiles`` (kept by :func:`forward` of the same inputs)."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    acc = acc_dtype(q.dtype)
    qt, kt, vt, dot = _to_bhld(q, acc, scale), _to_bhld(k, acc), _to_bhld(v, acc), _to_bhld(do, acc)
    # Softmax: rowsum(P * dP) = rowsum(dO * O), one [B, H, L] vector instead of a per-tile sum.
    delta = (dot * _to_bhld(o, acc)).sum(-1) if attn_fn == "softmax" else None  # [B, H, L]
    # dk = dS^T (scale q) comes out scaled because qt is; dq = scale dS k is scaled per tile.
    dq = torch.empty_like(qt, memory_format=torch.contiguous_format)
    common = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
                  dropkey_p=dropkey_p, seed=seed, batch_index=batch_index, attn_fn=attn_fn,
                  max_block_elems=max_block_elems)
    chunked = use_chunk_path(L, S, B, H, chunk_size, block_causal, chunks_per_step, max_block_elems)
    kept = None
    if tiles is not None and batch_index is None:
        # kept by the forward of the same node: same inputs, so the same backend choice and tiles
        # (a tensor that cannot be them, say after the tuning tables changed in between, is not used)
        entries = sum(math.prod(t) for t in _tile_shapes(B, H, L, S, causal, chunk_size, block_causal, chunked,
                                                          block_q, chunks_per_step, max_block_elems))
        usable = (acc, torch.bool) if attn_fn == "softmax" else (torch.bool,)
        if tiles.numel() == entries and tiles.dtype in usable:
            kept = _KeptTiles(tiles)
    if chunked:
        dk = torch.empty_like(kt, memory_format=torch.contiguous_format)  # the chunk path writes every row
        dv = torch.empty_like(vt, memory_format=torch.contiguous_format)
        _chunk_bwd(qt, kt, vt, dot, delta, lse, dq, dk, dv, chunks_per_step=chunks_per_step, kept=kept, **common)
    else:
        dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)  # accumulated over query blocks
        _general_bwd(qt, kt, vt, dot, delta, lse, dq, dk, dv, block_q=block_q, kept=kept, **common)
    back = lambda x, like: x.transpose(1, 2).to(like.dtype).contiguous()  # noqa: E731
    return back(dq, q), back(dk, k), back(dv, v)
