"""Chunk (sequence) parallelism for the Megalodon LM over ``torch.distributed``.

One long sequence of length L is split over the P ranks of a process group: rank r holds the
positions [r L/P, (r+1) L/P). Attention is block-diagonal over chunks of ``chunk_size``, so when
every slice is a whole number of chunks no attention state crosses ranks; what does cross is, per
layer, the CEMA hidden state ``hx`` c(B D N) and the TimestepNorm statistics (mean, var) r(B G),
plus the final output TimestepNorm's (mean, var), and the TimestepNorm count (positions seen so
far, sent exactly as two float halves and without gradient): so slices may have different lengths,
as long as each is a whole number of attention chunks (with equal slices the count received by
rank r is ``prior_count + r L_local``, as upstream's chunk parallelism assumes).

Per layer, rank r

* waits for the predecessor's state (its receive was posted, asynchronously, when the forward
  started) and feeds it to the layer's TimestepNorm and CEMA;
* sends its own outgoing state to the successor asynchronously right after its CEMA, before its
  attention and FFN, so rank r + 1 can start that layer while rank r is still computing it.

Backward mirrors this: the gradient of a received state is sent back to the predecessor as soon as
autograd has it (after the layer's TimestepNorm backward), and the gradient of a sent state is
received from the successor; that receive is posted when the layer's backward starts and waited
for only when the layer's CEMA / TimestepNorm backward needs it. The exchange is built from small
autograd Functions (:class:`_RecvState`, :class:`_SendState`, :class:`_Attach`): the "send" node
returns a scalar token that is tied into the activations by an identity, so autograd visits it
without any zero-weighted loss term.

Each rank's parameter gradients are then its slice's contribution; summing them over the chunk
group (:func:`allreduce_gradients`) gives exactly the gradients of one process running the whole
sequence, provided the loss is normalised by the global token count.

Composition with data parallelism: arrange the world as D data replicas x P chunk ranks, make one
chunk group per replica (its P consecutive ranks, say) and one data group per chunk index. Either

* call :func:`allreduce_gradients(model, chunk_group, data_group)` after ``backward`` (sum over the
  chunk group, mean over the data group) with loss = local token-loss sum / global L; or
* wrap ``ChunkParallelMegalodon`` in ``DistributedDataParallel`` over the *whole world* (D x P
  ranks) and, with equal slices, use loss = mean over the rank's local tokens: DDP's average over
  D P ranks is then the mean over replicas of the full-sequence mean loss. The point-to-point
  exchanges run on the chunk group and DDP's bucketed all-reduces on the world group, so they can
  overlap in the backward. (With norm_prior_count > 0 the learnable priors are used on the first
  chunk rank only, so DDP then needs find_unused_parameters=True; the helper needs nothing.)

Packed rows (``forward(tokens, cu_seqlens=cu)``, batch 1): ``cu`` holds the document boundaries
of the whole row and every rank passes the same one; a rank's documents are ``cu`` clipped to
its slice. The state still goes from rank to rank (the same messages as unpacked), holding the
predecessor's last document's state. If the slice starts inside a document, that document
continues from it; if the slice starts at a document start, every local document starts from
the prior state and the received state gets no use (its gradient, sent back, is zero). Attention
chunks count from each document's start, so a document may cross a rank boundary only at a
multiple of chunk_size from its own start (ValueError otherwise); slices themselves need not be
multiples of chunk_size.

Not supported: unpacked slices that are not a whole number of chunks (ValueError), and
layerwise checkpointing while training (recomputation would re-send; NotImplementedError).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalodon_kernels.ops._packing import check_cu_seqlens

from .megalodon import Megalodon

__all__ = ["ChunkParallelMegalodon", "CommStats", "allreduce_gradients", "chunk_bounds"]

_BWD_TAG = 1 << 12  # tag offset of the backward (gradient) messages
_COUNT_SPLIT = 1 << 22  # count = hi * 2^22 + lo, both halves exact in float32 (count < 2^46)


@dataclass
class CommStats:
    """Wall time spent inside communication calls (posting, waiting) and what was moved."""

    seconds: float = 0.0
    messages: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.seconds, self.messages, self.bytes = 0.0, 0, 0


class _Timed:
    def __init__(self, stats: CommStats):
        self.stats = stats

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.stats.seconds += time.perf_counter() - self.t0


def chunk_bounds(length: int, rank: int, world: int) -> slice:
    """The positions rank ``rank`` of ``world`` holds of a sequence of ``length``."""
    if length % world:
        raise ValueError(f"sequence length {length} is not divisible by the chunk-group size {world}")
    n = length // world
    return slice(rank * n, (rank + 1) * n)


class _Link:
    """One state edge (rank r -> r + 1) of one layer, as seen by one side."""

    def __init__(self, cp: "ChunkParallelMegalodon", tag: int, numel: int, dtype: torch.dtype, device):
        self.cp, self.tag, self.numel, self.dtype, self.device = cp, tag, numel, dtype, device
        self.work = None      # forward irecv of the state (receiver side)
        self.buf = None
        self.grad_work = None  # backward irecv of the state's gradient (sender side)
        self.grad_buf = None

    # receiver side -----------------------------------------------------------------------
    def post_recv(self):
        self.buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.work = self.cp._irecv(self.buf, self.cp.rank - 1, self.tag)

    def wait_recv(self) -> torch.Tensor:
        self.cp._wait(self.work)
        self.work = None
        return self.buf

    # sender side -------------------------------------------------------------------------
    def post_grad_recv(self):
        if self.grad_work is None:
            self.grad_buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.grad_work = self.cp._irecv(self.grad_buf, self.cp.rank + 1, _BWD_TAG + self.tag)

    def wait_grad(self) -> torch.Tensor:
        self.post_grad_recv()
        self.cp._wait(self.grad_work)
        self.grad_work = None
        return self.grad_buf


class _RecvState(torch.autograd.Function):
    """Forward: the predecessor's packed state. Backward: send its gradient back to it."""

    @staticmethod
    def forward(ctx, anchor, link):
        ctx.link = link
        return link.wait_recv()

    @staticmethod
    def backward(ctx, grad):
        link = ctx.link
        link.cp._isend_pending(grad.contiguous(), link.cp.rank - 1, _BWD_TAG + link.tag, in_backward=True)
        return None, None


class _SendState(torch.autograd.Function):
    """Forward: send the packed state to the successor, return a scalar token.
    Backward: receive the state's gradient from the successor."""

    @staticmethod
    def forward(ctx, packed, link):
        ctx.link = link
        link.cp._isend_pending(packed.detach().contiguous(), link.cp.rank + 1, link.tag)
        return packed.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        return ctx.link.wait_grad().clone(), None


class _Ignore(torch.autograd.Function):
    """Identity on x that keeps a received state nobody uses in the graph, with a zero gradient,
    so its :class:`_RecvState` still answers the predecessor's wait for that gradient."""

    @staticmethod
    def forward(ctx, x, unused):
        ctx.unused = (unused.shape, unused.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        shape, dtype = ctx.unused
        return g, g.new_zeros(shape, dtype=dtype)


class _Attach(torch.autograd.Function):
    """Identity on x that makes autograd visit ``token``'s producer; its backward (run when the
    layer's backward starts) posts the receive of the sent state's gradient early."""

    @staticmethod
    def forward(ctx, x, token, link):
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.link.post_grad_recv()
        return g, g.new_zeros(()), None


def _real_dtype(c: torch.dtype) -> torch.dtype:
    return torch.float64 if c == torch.complex128 else torch.float32


def _local_documents(cu: List[int], start: int, length: int, chunk_size: int, device):
    """The documents of the slice [start, start + length) of a packed row with boundaries ``cu``
    (cu_seqlens read to the host): (local cu_seqlens int64 on ``device``, whether the first local
    document continues one begun before the slice). Empty and outside documents are left out."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    bad = next((i for i in range(len(cu) - 1) if cu[i + 1] < cu[i]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{bad}] = {cu[bad]} > "
                         f"cu_seqlens[{bad + 1}] = {cu[bad + 1]}")
    end = start + length
    if start < 0 or end > cu[-1]:
        raise ValueError(f"this rank's slice [{start}, {end}) lies outside the packed row of cu_seqlens[-1] = {cu[-1]} "
                         f"tokens (check start and cu_seqlens)")
    bounds = set(cu)
    for edge in (start, end):
        if edge in bounds or edge == cu[-1]:
            continue
        doc_start = max(c for c in cu if c < edge)
        if (edge - doc_start) % chunk_size:
            raise ValueError(f"the document at cu_seqlens position {doc_start} crosses a rank boundary at {edge}, "
                             f"{edge - doc_start} tokens after its start: not a multiple of chunk_size={chunk_size} "
                             f"(attention chunks count from each document's start); move the slice boundary or "
                             f"the document")
    inner = sorted({c - start for c in cu if start < c < end})
    local = torch.tensor([0, *inner, length], dtype=torch.int64, device=device)
    return local, start not in bounds


class ChunkParallelMegalodon(nn.Module):
    """Runs a :class:`~.megalodon.Megalodon` chunk-parallel over ``group`` (default: the world).

    ``forward(tokens)`` takes this rank's slice (B, L_local) of the sequence, from
    :func:`chunk_bounds` (or any split into consecutive slices, each a multiple of chunk_size).
    It returns this slice's logits, equal to the corresponding rows of ``model(full_tokens)``,
    and its backward yields this slice's share of the parameter gradients (sum them over the
    group with :func:`allreduce_gradients`). Every rank of the group must call forward (and
    backward) the same number of times in the same order. ``comm`` accumulates the time spent
    in send / receive calls and waits.

    ``forward(tokens, cu_seqlens=cu, start=s)`` takes this rank's slice (1, L_local) of a packed
    row, ``cu`` the boundaries of the whole row (the same on every rank) and ``s`` the slice's
    first position in the row (default ``rank * L_local``, allowed only when the slices are
    equal, i.e. ``cu[-1] == world * L_local``); its logits equal the corresponding positions of
    ``model(full_row, cu_seqlens=cu)`` (see the module docstring for the rank boundaries).
    """

    def __init__(self, model: Megalodon, group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised (dist.init_process_group) first")
        self.module = model
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.comm = CommStats()
        self._pending: List = []
        self._callback_queued = False

    # ---- communication primitives (timed) ---------------------------------------------------
    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _irecv(self, buf, src, tag):
        with _Timed(self.comm):
            w = dist.irecv(buf, self._global(src), group=self.group, tag=tag)
        self.comm.messages += 1
        self.comm.bytes += buf.numel() * buf.element_size()
        return w

    def _wait(self, work):
        with _Timed(self.comm):
            work.wait()

    def _isend_pending(self, t, dst, tag, in_backward=False):
        with _Timed(self.comm):
            self._pending.append((dist.isend(t, self._global(dst), group=self.group, tag=tag), t))
        self.comm.messages += 1
        self.comm.bytes += t.numel() * t.element_size()
        if in_backward and not self._callback_queued:
            # wait for the gradient sends once the whole backward pass has run
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _drain(self):
        with _Timed(self.comm):
            for w, _ in self._pending:
                w.wait()
        self._pending.clear()

    def _finish_backward(self):
        self._callback_queued = False
        self._drain()

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *,
                start: Optional[int] = None) -> torch.Tensor:
        m, cfg = self.module, self.module.config
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
            raise TypeError(f"tokens must be an integer tensor (B, L_local), got {tuple(getattr(tokens, 'shape', ()))}")
        B, L = tokens.shape
        C = cfg.chunk_size
        r, P = self.rank, self.world
        if cu_seqlens is None:
            if start is not None:
                raise ValueError("start locates a slice of a packed row; pass it with cu_seqlens")
            if L < 1 or L % C:
                raise ValueError(f"each rank's slice must be a non-empty multiple of chunk_size={C} (attention is "
                                 f"block-diagonal per chunk, so no attention state may cross ranks); got L_local={L}")
            local_cu, continues = None, True
        else:
            if L < 1:
                raise ValueError("each rank's slice must hold at least one token, got L_local=0")
            check_cu_seqlens(cu_seqlens, batch=B, length=L, device=tokens.device, batch_arg="tokens")
            cu = [int(c) for c in cu_seqlens.tolist()]  # the slice's documents are decided on the host
            if start is None:
                if cu[-1] != P * L:
                    raise ValueError(f"start is needed when the slices are not equal: cu_seqlens[-1] = {cu[-1]} "
                                     f"but world * L_local = {P} * {L}")
                start = r * L
            elif not isinstance(start, int) or isinstance(start, bool):
                raise TypeError(f"start must be an int (the slice's first position in the packed row), "
                                f"got {type(start).__name__}")
            local_cu, continues = _local_documents(cu, start, L, C, tokens.device)
            if r == 0 and start != 0:
                raise ValueError(f"rank 0 holds the start of the packed row: start must be 0, got {start}")
            if r == P - 1 and start + L != cu[-1]:
                raise ValueError(f"the last rank holds the end of the packed row: start + L_local must be "
                                 f"cu_seqlens[-1] = {cu[-1]}, got {start} + {L}")
        if cfg.layerwise_ckpt and m.training and torch.is_grad_enabled():
            raise NotImplementedError("layerwise_ckpt is not supported under chunk parallelism (recomputation "
                                      "would repeat the state exchange); set layerwise_ckpt=False")
        self._drain()  # sends of a previous forward (normally complete already)

        x = m.embed(tokens)
        if m.emb_scale is not None:
            x = x * m.emb_scale
        if cfg.dropout > 0:
            x = F.dropout(x, cfg.dropout, m.training)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        D, G, N = cfg.model_dim, cfg.norm_num_groups, cfg.cema_ndim
        dev = x.device

        # one link per layer (count, mean, var, hx) and one for the output norm (count, mean, var)
        links = []
        for i, layer in enumerate(m.layers):
            cdt = torch.complex128 if layer.mega.cema.alpha.dtype == torch.float64 else torch.complex64
            dt = torch.promote_types(acc, _real_dtype(cdt))
            links.append(_Link(self, i, B * (2 + 2 * G + 2 * D * N), dt, dev))
        links.append(_Link(self, len(m.layers), B * (2 + 2 * G), acc, dev))
        if r > 0:
            for ln in links:
                ln.post_recv()
        grad_on = torch.is_grad_enabled()

        def incoming(link, with_hx, hx_dtype=None):
            """The received state, or None for one the first document does not continue (buf: to
            be passed to :class:`_Ignore`, so its zero gradient still goes back)."""
            if r == 0:
                return None, None
            anchor = torch.empty(0, device=dev, requires_grad=grad_on)
            buf = _RecvState.apply(anchor, link)
            if not continues:
                return None, buf
            hi, lo = buf[:B].detach().long(), buf[B:2 * B].detach().long()
            count = hi * _COUNT_SPLIT + lo
            stats = buf[2 * B:]
            mean, var = stats[:B * G].view(B, G).to(acc), stats[B * G:2 * B * G].view(B, G).to(acc)
            hx = None
            if with_hx:
                hx = torch.view_as_complex(stats[2 * B * G:].view(B, D, N, 2).to(_real_dtype(hx_dtype)))
            return (count, mean, var, hx), None

        def per_document(state, norm):
            """A received state as the initial state of the local documents: the first continues
            it, the others start from the prior (a zero CEMA state)."""
            if state is None or local_cu is None:
                return state
            n = local_cu.shape[0] - 1
            count, mean, var, hx = state
            prior = norm.initial_state(n, acc)
            count, mean, var = (torch.cat([got, rest[1:]]) for got, rest in zip((count, mean, var), prior))
            if hx is not None:
                hx = torch.cat([hx, hx.new_zeros(n - 1, D, N)])
            return count, mean, var, hx

        def outgoing(link, count, mean, var, h=None):
            if local_cu is not None:  # the successor may continue the last local document
                count, mean, var = count[-1:], mean[-1:], var[-1:]
                h = None if h is None else h[-1:]
            parts = [torch.div(count, _COUNT_SPLIT, rounding_mode="floor"), torch.remainder(count, _COUNT_SPLIT),
                     mean.reshape(-1), var.reshape(-1)]
            if h is not None:
                parts.append(torch.view_as_real(h).reshape(-1))
            packed = torch.cat([t.to(link.dtype) for t in parts])
            return _SendState.apply(packed, link)

        for i, layer in enumerate(m.layers):
            link = links[i]
            cdt = torch.complex128 if layer.mega.cema.alpha.dtype == torch.float64 else torch.complex64
            received, unused = incoming(link, True, cdt)
            if unused is not None:
                x = _Ignore.apply(x, unused)
            carry = per_document(received, layer.mega.timenorm)
            token = []  # filled by on_carry with the send's token
            on_carry = (lambda *state, _l=link, _t=token: _t.append(outgoing(_l, *state))) if r < P - 1 else None
            x = layer(x, carry=carry, on_carry=on_carry, cu_seqlens=local_cu)
            if token:
                x = _Attach.apply(x, token[0], link)

        norm = m.output.final_norm
        link = links[-1]
        received, unused = incoming(link, False)
        if unused is not None:
            x = _Ignore.apply(x, unused)
        carry = per_document(received, norm)
        count, mean, var, _ = carry if carry is not None else (None, None, None, None)
        x, count_out, mean_out, var_out = norm(x, count, mean, var, cu_seqlens=local_cu)
        if r < P - 1:
            x = _Attach.apply(x, outgoing(link, count_out, mean_out, var_out), link)
        logits = m.output.output(x)
        return logits if logits.dtype == torch.float64 else logits.float()


@torch.no_grad()
def allreduce_gradients(module: nn.Module, chunk_group: Optional[dist.ProcessGroup] = None,
                        data_group: Optional[dist.ProcessGroup] = None, stats: Optional[CommStats] = None):
    """Sum parameter gradients over ``chunk_group``, then average them over ``data_group`` (if given),
    in one flat all-reduce each. Missing gradients count as zeros."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    t0 = time.perf_counter()
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for ps in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, group=chunk_group)
        if data_group is not None:
            dist.all_reduce(flat, group=data_group)
            flat /= dist.get_world_size(data_group)
        off = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
