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
* or shard the parameters with FSDP2 over the whole world: :func:`.distributed.parallelize` does
  it in one call (docs/distributed.md). Each block's exchange runs inside the block's call
  (:func:`_run_as_forward`), so FSDP2's all-gather of the block comes before the wait for the
  predecessor's state, and the state's gradient is sent before the block's reduce-scatter.

Packed rows (``forward(tokens, cu_seqlens=cu)``, batch 1): ``cu`` holds the document boundaries
of the whole row and every rank passes the same one; a rank's documents are ``cu`` clipped to
its slice. The state still goes from rank to rank (the same messages as unpacked), holding the
predecessor's last document's state. If the slice starts inside a document, that document
continues from it; if the slice starts at a document start, every local document starts from
the prior state and the received state gets no use (its gradient, sent back, is zero). Attention
chunks count from each document's start, so a document may cross a rank boundary only at a
multiple of chunk_size from its own start (ValueError otherwise); slices themselves need not be
multiples of chunk_size.

``forward(tokens, segment_ids=s)`` takes this rank's slice (1, L_local) of document ids; the
group all-gathers the slices (small integer tensors) to find the row's boundaries, then runs as with
``cu_seqlens``. ``forward(tokens, labels=y)`` returns the *sum* of this slice's token
cross-entropies (the output head fused with the loss, logits never formed) instead of the logits:
divide by the global number of predicted tokens (:mod:`.distributed` does) so that summing the
ranks' gradients gives the gradient of the global mean.

Activation checkpointing (``checkpoint_layers``, default ``config.layerwise_ckpt``): each block runs
under ``torch.utils.checkpoint`` (non-reentrant) while the exchange stays outside the recomputed
region: the received state enters the block as a saved input, and the send happens only on the
first run of a layer's forward (:class:`_Link` remembers it), so the recomputation in the backward
re-computes the outgoing state for the local graph but sends nothing and receives nothing.

Not supported: unpacked slices that are not a whole number of chunks (ValueError).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalodon_kernels.ops._packing import check_cu_seqlens

from .loss import linear_cross_entropy
from .megalodon import Megalodon
from .packing import segment_ids_to_cu_seqlens

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
        self.sent = False  # the state went out: a recomputation (activation checkpointing) sends nothing

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


def _alias(x: torch.Tensor) -> torch.Tensor:
    """x itself as an identity Function's output that is not an autograd view of x (FSDP2 warns
    when a wrapped module returns a view: an in-place op on it would drop its backward hook).
    Safe here: x is a block's output that nothing writes in place."""
    return torch.ops.aten._unsafe_view.default(x, x.shape)


class _RecvState(torch.autograd.Function):
    """Forward: (x unchanged, the predecessor's packed state). Backward: send the state's gradient
    back to the predecessor, then release x's gradient.

    The state travels with x so that, inside a block, the send comes before autograd reaches the
    block's input: FSDP2's post-backward reduce-scatter (a collective over every rank, which the
    predecessor joins only once it has this gradient) waits on the gradient of that input. A state
    no local document continues is not used: its gradient is zero and is still sent. ``anchor``
    (a leaf that requires grad) keeps the backward running even where x needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, link):
        ctx.link = link
        return _alias(x), link.wait_recv()

    @staticmethod
    def backward(ctx, g, grad):
        link = ctx.link
        link.cp._isend_pending(grad.contiguous(), link.cp.rank - 1, _BWD_TAG + link.tag, in_backward=True)
        return g, None, None


class _SendState(torch.autograd.Function):
    """Forward: send the packed state to the successor, return a scalar token.
    Backward: receive the state's gradient from the successor."""

    @staticmethod
    def forward(ctx, packed, link):
        ctx.link = link
        if not link.sent:  # a checkpointed layer's recomputation computes the state again, sends nothing
            link.cp._isend_pending(packed.detach().contiguous(), link.cp.rank + 1, link.tag)
            link.sent = True
        return packed.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        return ctx.link.wait_grad().clone(), None


class _Attach(torch.autograd.Function):
    """Identity on x that makes autograd visit ``token``'s producer; its backward (run when the
    layer's backward starts) posts the receive of the sent state's gradient early."""

    @staticmethod
    def forward(ctx, x, token, link):
        ctx.link = link
        return _alias(x)

    @staticmethod
    def backward(ctx, g):
        ctx.link.post_grad_recv()
        return g, g.new_zeros(()), None


def _run_as_forward(module: nn.Module, fn, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with ``fn`` as its forward for this one call: the module's hooks (FSDP2's
    all-gather before, its reshard and backward hooks after) enclose all of ``fn``."""
    module.forward = fn
    try:
        return module(x)
    finally:
        del module.forward


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

    def __init__(self, model: Megalodon, group: Optional[dist.ProcessGroup] = None, *,
                 checkpoint_layers: Optional[bool] = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised (dist.init_process_group) first")
        self.module = model
        self.group = group
        #: run each block under activation checkpointing while training (None: config.layerwise_ckpt)
        self.checkpoint_layers = model.config.layerwise_ckpt if checkpoint_layers is None else bool(checkpoint_layers)
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
                start: Optional[int] = None, segment_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
        m = self.module
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
            raise TypeError(f"tokens must be an integer tensor (B, L_local), got {tuple(getattr(tokens, 'shape', ()))}")
        if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != tokens.shape
                                   or labels.dtype.is_floating_point):
            raise ValueError(f"labels must be an integer tensor of the tokens' shape {tuple(tokens.shape)}, got "
                             f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
        if segment_ids is not None:
            if cu_seqlens is not None or start is not None:
                raise ValueError("pass segment_ids alone: it replaces cu_seqlens and start")
            cu_seqlens, start = self._gather_segments(segment_ids, tokens)
        x = self._trunk(tokens, cu_seqlens, start)
        head = m.output.output
        if labels is not None:
            n = int((labels != ignore_index).sum())
            if n == 0:  # nothing to predict here: a zero that still reaches every parameter of the graph
                return (x.float().sum() + head.weight.float().sum()) * 0.0
            return linear_cross_entropy(x, head.weight, labels, head.bias, ignore_index=ignore_index) * n
        logits = head(x)
        return logits if logits.dtype == torch.float64 else logits.float()

    def _gather_segments(self, segment_ids: torch.Tensor, tokens: torch.Tensor):
        """(cu_seqlens of the whole row, this slice's start) from every rank's slice of document ids."""
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype.is_floating_point \
                or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
            raise TypeError(f"segment_ids must be an integer tensor (1, L_local), got "
                            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}")
        if segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids must have the tokens' shape {tuple(tokens.shape)}, got "
                             f"{tuple(segment_ids.shape)}")
        if tokens.shape[0] != 1:
            raise ValueError(f"segment_ids under chunk parallelism describe one packed row per chunk group: tokens "
                             f"must be (1, L_local), got batch {tokens.shape[0]} (pack the rows into one, or give "
                             f"each data-parallel rank its own row)")
        ids = segment_ids.reshape(-1).to(torch.int64)
        with _Timed(self.comm):
            lengths = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(self.world)]
            dist.all_gather(lengths, torch.tensor([ids.numel()], device=ids.device), group=self.group)
            lengths = [int(n) for n in lengths]
            parts = [torch.empty(n, dtype=torch.int64, device=ids.device) for n in lengths]
            if len(set(lengths)) == 1:
                dist.all_gather(parts, ids, group=self.group)
            else:  # unequal slices: gloo's all_gather wants equal sizes, so pad to the longest
                most = max(lengths)
                padded = [torch.empty(most, dtype=torch.int64, device=ids.device) for _ in lengths]
                dist.all_gather(padded, torch.cat([ids, ids.new_zeros(most - ids.numel())]), group=self.group)
                parts = [p[:n] for p, n in zip(padded, lengths)]
        row = torch.cat(parts)[None]
        return segment_ids_to_cu_seqlens(row, row), sum(lengths[:self.rank])

    def _trunk(self, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor], start: Optional[int]) -> torch.Tensor:
        """This slice's output of the final TimestepNorm (before the head)."""
        m, cfg = self.module, self.module.config
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
        use_ckpt = self.checkpoint_layers and m.training and torch.is_grad_enabled()
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

        def incoming(link, x, with_hx, hx_dtype=None):
            """(x, the received state), the state None where the first document does not continue it."""
            if r == 0:
                return x, None
            anchor = torch.empty(0, device=dev, requires_grad=grad_on)
            x, buf = _RecvState.apply(x, anchor, link)
            if not continues:
                return x, None
            hi, lo = buf[:B].detach().long(), buf[B:2 * B].detach().long()
            count = hi * _COUNT_SPLIT + lo
            stats = buf[2 * B:]
            mean, var = stats[:B * G].view(B, G).to(acc), stats[B * G:2 * B * G].view(B, G).to(acc)
            hx = None
            if with_hx:
                hx = torch.view_as_complex(stats[2 * B * G:].view(B, D, N, 2).to(_real_dtype(hx_dtype)))
            return x, (count, mean, var, hx)

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

        def stage(h, layer, link, cdt):
            """One block with its exchange, all inside the block's call (see :class:`_RecvState`)."""
            h, received = incoming(link, h, True, cdt)
            carry = per_document(received, layer.mega.timenorm)
            token = []  # filled by on_carry with the send's token
            on_carry = (lambda *state: token.append(outgoing(link, *state))) if r < P - 1 else None
            block = type(layer).forward
            if use_ckpt:
                # carry is an input of the recomputed region and its send a no-op there (_Link.sent)
                h = checkpoint(lambda y: block(layer, y, carry=carry, on_carry=on_carry, cu_seqlens=local_cu),
                               h, use_reentrant=False)
            else:
                h = block(layer, h, carry=carry, on_carry=on_carry, cu_seqlens=local_cu)
            return _Attach.apply(h, token[0], link) if token else h

        for i, layer in enumerate(m.layers):
            cdt = torch.complex128 if layer.mega.cema.alpha.dtype == torch.float64 else torch.complex64
            x = _run_as_forward(layer, lambda h, _l=layer, _k=links[i], _c=cdt: stage(h, _l, _k, _c), x)

        norm = m.output.final_norm
        link = links[-1]
        x, received = incoming(link, x, False)
        carry = per_document(received, norm)
        count, mean, var, _ = carry if carry is not None else (None, None, None, None)
        x, count_out, mean_out, var_out = norm(x, count, mean, var, cu_seqlens=local_cu)
        if r < P - 1:
            x = _Attach.apply(x, outgoing(link, count_out, mean_out, var_out), link)
        return x


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
