"""One decode step of a Megalodon LM: one new token per cache row, rows of any lengths.

:func:`decode_step` runs the model on tokens (B,) against a :class:`~.cache.MegalodonCache` of B
rows and updates the cache in place. It is written for a fixed shape:

* every cache tensor keeps its shape and storage (keys and values go to slot ``length % C`` of
  a chunk-sized buffer with ``index_put_``; the statistics, CEMA state and lengths are
  overwritten with ``copy_``);
* nothing is read on the host and no Python branch depends on a tensor's value: a row's chunk
  position only selects a slot and masks the attention scores, so rows at different positions
  (ragged batches) run together;
* the sequence mixing of one token is a few plain tensor ops (the TimestepNorm and CEMA
  recurrences for one step, attention of one query against one chunk of slots), not the
  ``megalodon_kernels.ops`` custom ops, whose strengths (long sequences, backward) a single step
  does not need and whose per-call dispatch a compiled graph could not remove.

So ``torch.compile(decode_step, fullgraph=True)`` traces it into one graph, and on CUDA the step
can be captured into a CUDA graph (:class:`StaticDecoder` does both). Outputs equal
``model(tokens[:, None], cache=cache)`` of the general path to float rounding (the same math).

The step assumes eval mode (no dropout, no DropKey): ``Megalodon.forward`` uses it for one token
with a cache when the model is not training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from megalodon_kernels.ops.attention import laplace
from megalodon_kernels.ops.rotary import rotation_tables

from .cache import LayerState, MegalodonCache

__all__ = ["LayerConstants", "layer_constants", "decode_constants", "mega_step", "decode_step", "StaticDecoder"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class LayerConstants:
    """What one step of a layer uses that depends on the parameters only: the CEMA coefficients
    as real tensors, (p, q = exp(log_q), gamma) r(D N) each, q and gamma split into real and
    imaginary parts; the rotary tables cos / sin r(C, dz/2) for the chunk positions 0..C-1 (the
    values ``ops.rotary`` uses)."""
    p: torch.Tensor
    q_re: torch.Tensor
    q_im: torch.Tensor
    g_re: torch.Tensor
    g_im: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@torch.no_grad()
def layer_constants(mega) -> LayerConstants:
    """:class:`LayerConstants` of one attention sub-layer."""
    p, log_q, gamma = mega.cema.coefficients()
    acc = p.dtype
    q = torch.exp(log_q.to(torch.complex128))  # q = exp(log_q) in float64, rounded once
    C = mega.chunk_size
    cos, sin = rotation_tables(torch.arange(C, device=p.device), mega.z_head_dim, mega.rope_base, None, False, acc)
    return LayerConstants(p=p, q_re=q.real.to(acc), q_im=q.imag.to(acc), g_re=gamma.real.contiguous(),
                          g_im=gamma.imag.contiguous(), cos=cos.reshape(C, -1), sin=sin.reshape(C, -1))


def decode_constants(model) -> List[LayerConstants]:
    """Per-layer constants of :func:`decode_step` (recompute them after changing the weights)."""
    return [layer_constants(layer.mega) for layer in model.layers]


def _timestep_norm_step(norm, x: torch.Tensor, count: torch.Tensor, mean: torch.Tensor, var: torch.Tensor):
    """TimestepNorm of one step x r(B D) from (count, mean, var); the state is updated in place
    (docs/math.md, TimestepNorm: one Welford merge of the step's group mean and variance)."""
    B, D = x.shape
    G = norm.num_groups
    acc = mean.dtype
    xg = x.to(acc).view(B, G, D // G)
    gmu = xg.mean(-1)
    gvar = (xg - gmu[..., None]).square().mean(-1)
    n = count.to(acc)[:, None]
    c2 = 1.0 / (n + 1.0)
    c1 = n * c2
    delta = gmu - mean
    new_mean = c1 * mean + c2 * gmu
    new_var = c1 * var + c2 * gvar + c1 * c2 * delta.square()
    scale = norm.weight.to(acc) + 1.0
    y = (xg - new_mean[..., None]) * torch.rsqrt(new_var + norm.eps)[..., None]
    y = y.view(B, D) * scale + norm.bias.to(acc)
    count.add_(1)
    mean.copy_(new_mean)
    var.copy_(new_var)
    return y.to(x.dtype)


def _cema_step(cema, c: LayerConstants, x: torch.Tensor, hx: torch.Tensor) -> torch.Tensor:
    """h = q h + p x, y = Re sum_n gamma_n h_n + omega x for one step x r(B D); hx r(B 2 D N)
    (real, imaginary planes) updated in place."""
    acc = c.p.dtype
    xa = x.to(acc)
    h_re, h_im = hx[:, 0], hx[:, 1]
    # each line one pass over (B, D, N): these tensors are the step's largest at large batch
    new_re = (c.p * xa[..., None]).addcmul_(c.q_re, h_re).addcmul_(c.q_im, h_im, value=-1.0)
    new_im = torch.mul(c.q_re, h_im).addcmul_(c.q_im, h_re)
    h_re.copy_(new_re)
    h_im.copy_(new_im)
    y = (h_re * c.g_re).sum(-1) - (h_im * c.g_im).sum(-1) + cema.omega.view(-1).to(acc) * xa
    return y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x r(B H d) rotated by per-row tables cos / sin r(B d/2) (adjacent feature pairs)."""
    acc = cos.dtype
    xr = x.to(acc).unflatten(-1, (-1, 2))
    a, b = xr[..., 0], xr[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


def _attend(mega, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One query per row q r(B H dz) against the chunk slots k r(B C H dz), v r(B C H dv), slot j
    visible when j <= the row's offset: -> r(B H dv)."""
    acc = _acc(q.dtype)
    s = torch.einsum("bhd,bchd->bhc", q.to(acc), k.to(acc))
    C = k.shape[1]
    visible = (torch.arange(C, device=q.device)[None, :] <= offsets[:, None])[:, None, :]  # (B, 1, C)
    if mega.attn_fn == "laplace":
        p = torch.special.erfc((s - laplace.MU) * -laplace.INV) * 0.5
        p = p.masked_fill(~visible, 0.0)
    else:
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhc,bchd->bhd", p, v.to(acc)).to(v.dtype)


def mega_step(mega, c: LayerConstants, x: torch.Tensor, state: LayerState) -> torch.Tensor:
    """The attention sub-layer for one token per row, x r(B D) -> r(B D); ``state`` in place."""
    B = x.shape[0]
    H, dz, dv = mega.num_heads, mega.z_head_dim, mega.v_head_dim
    mega._fill_state(state, B, x)  # a branch on None only: fixed for a cache from init_cache
    offsets = torch.remainder(state.length, mega.chunk_size)
    out_tsn = _timestep_norm_step(mega.timenorm, x, state.norm_count, state.norm_mean, state.norm_var)
    out_cema = _cema_step(mega.cema, c, out_tsn, state.hx)
    mx = mega.rmsnorm(out_cema)
    z = mega.znorm(mega.wz(mx).view(B, H, dz)).view(B, mega.zdim)
    scale = (mega.gamma + 1.0) / math.sqrt(dz)
    q = torch.addcmul(mega.beta[0], z, scale[0]).view(B, H, dz)
    k = torch.addcmul(mega.beta[1], z, scale[1]).view(B, H, dz)
    v = F.silu(mega.wv(out_tsn)).view(B, H, dv)
    u_gate = mega.wr(mx)
    cos, sin = c.cos[offsets], c.sin[offsets]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    rows = torch.arange(B, device=x.device)
    state.k.index_put_((rows, offsets), k.to(state.k.dtype))
    state.v.index_put_((rows, offsets), v.to(state.v.dtype))
    attn = _attend(mega, q.to(v.dtype), state.k, state.v, offsets)
    gated = attn.reshape(B, mega.hdim) * F.silu(u_gate)
    state.length.add_(1)
    return x + mega.wh1(mx) + mega.wh2(gated)


def decode_step(model, cache: MegalodonCache, tokens: torch.Tensor,
                constants: Optional[List[LayerConstants]] = None) -> torch.Tensor:
    """Logits r(B V_out) (float32, float64 for a float64 model) of one new token per row,
    tokens int (B,); ``cache`` (B rows, any lengths) is updated in place. ``constants``: from
    :func:`decode_constants` (computed here if None; pass them when calling repeatedly)."""
    if constants is None:
        constants = decode_constants(model)
    x = model.embed(tokens)
    if model.emb_scale is not None:
        x = x * model.emb_scale
    for layer, c, state in zip(model.layers, constants, cache.layers):
        x = layer.nffn(mega_step(layer.mega, c, x, state), x)
    norm = model.output.final_norm
    B = x.shape[0]
    if cache.norm_count is None:
        cache.norm_count, cache.norm_mean, cache.norm_var = norm.initial_state(B, _acc(x.dtype))
    x = _timestep_norm_step(norm, x, cache.norm_count, cache.norm_mean, cache.norm_var)
    cache.lengths.add_(1)
    logits = model.output.output(x)
    return logits if logits.dtype == torch.float64 else logits.float()


class StaticDecoder:
    """A decode step bound to one model and one cache, with fixed input and output buffers:
    ``decoder.step(tokens)`` copies tokens (B,) into its input buffer, runs the step, and returns
    its logits buffer (overwritten by the next step: copy what you keep).

    ``compile``: None (eager), or keyword arguments for ``torch.compile`` (``fullgraph=True`` is
    always set), e.g. ``{}`` for inductor or ``{"backend": "aot_eager"}``. ``cuda_graph=True``
    (CUDA tensors only) captures the step into a CUDA graph after ``warmup`` eager runs on a
    scratch copy of the cache (the cache itself is advanced only by :meth:`step`).

    The cache's tensors must keep their storage while the decoder is used: change rows with
    :meth:`MegalodonCache.write_rows_` (in place), not ``select`` / ``cat`` (new caches: make a new
    decoder for them). Rows that are not in use still run (their outputs are ignored).
    """

    def __init__(self, model, cache: MegalodonCache, *, compile: Optional[dict] = None,
                 cuda_graph: bool = False, warmup: int = 2):
        if not isinstance(cache, MegalodonCache):
            raise TypeError(f"cache must be a MegalodonCache from model.init_cache(), got {type(cache).__name__}")
        model._check_cache(cache, cache.batch_size)
        if any(t is None for s in cache.layers for t in (s.norm_count, s.hx)) or cache.norm_count is None:
            raise ValueError("cache must come from model.init_cache() (its statistics and CEMA state allocated), "
                             "so that the step never allocates cache tensors")
        if model.training:
            raise ValueError("the static decode step runs in eval mode: call model.eval() first")
        if cuda_graph and cache.lengths.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a cache on a CUDA device, got {cache.lengths.device}")
        self.model, self.cache = model, cache
        self.constants = decode_constants(model)
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.int64, device=cache.lengths.device)
        fn = self._eager
        if compile is not None:
            fn = torch.compile(self._eager, **{**compile, "fullgraph": True})
        self._fn = fn
        self._graph = None
        self.logits = None
        if cuda_graph:
            self._capture(warmup)

    @torch.no_grad()
    def _eager(self, tokens: torch.Tensor, cache: MegalodonCache) -> torch.Tensor:
        return decode_step(self.model, cache, tokens, self.constants)

    @torch.no_grad()
    def _capture(self, warmup: int) -> None:
        saved = self.cache.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self._fn(self.tokens, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self.logits = self._fn(self.tokens, self.cache)
        # the warm-up and the capture advanced the cache: put its values back
        for mine, kept in zip(self.cache.tensors(), saved.tensors()):
            mine.copy_(kept)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        if self._graph is not None:
            self._graph.replay()
            return self.logits
        self.logits = self._fn(self.tokens, self.cache)
        return self.logits
