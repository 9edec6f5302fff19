"""The Megalodon causal LM (docs/math.md, model): embedding, blocks, final TimestepNorm, output head.

state_dict names (upstream's): ``embed.weight``, ``rope.freqs``, ``layers.{i}.mega.*``,
``layers.{i}.nffn.*``, ``output.final_norm.*``, ``output.output.weight``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalodon_kernels.ops._packing import check_cu_seqlens

from .cache import MegalodonCache
from .checkpoint import load_upstream, read_state_dict
from .config import MegalodonConfig
from .decode import decode_constants, decode_step
from .layers import MegalodonBlock, TimestepNorm, fresh_view
from .loss import linear_cross_entropy
from .packing import pack, segment_ids_to_cu_seqlens

__all__ = ["Megalodon", "RotaryEmbedding", "OutputLayer"]


class RotaryEmbedding(nn.Module):
    """Holds upstream's ``rope.freqs`` buffer, freqs_j = base^(-2j/dz), for checkpoint compatibility.

    The rotation itself is ``ops.rotary``, which forms its angles in float64 from ``base`` and
    the integer positions; so a checkpoint whose buffer was rounded to bf16 (as upstream's ``model.to(bf16)`` does) still
    rotates with the exact frequencies. :func:`~.checkpoint.load_upstream` checks that a loaded
    buffer is consistent with ``rope_base``.
    """

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("freqs", self.expected_freqs())

    def expected_freqs(self) -> torch.Tensor:
        # float64 Python arithmetic, one rounding to fp32 (also cheap on the meta device)
        return torch.tensor([self.base ** (-j / self.dim) for j in range(0, self.dim, 2)], dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class OutputLayer(nn.Module):
    """Upstream's MegaOutputLayer: final TimestepNorm, then a bias-free projection."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        D = cfg.model_dim
        self.final_norm = TimestepNorm(D, cfg.norm_num_groups, cfg.norm_prior_count, cfg.norm_eps, cfg.backend)
        self.output = nn.Linear(D, cfg.out_size, bias=False)


def _gaussian_init_(w: torch.Tensor, dim: int) -> None:
    if w.is_meta:
        return
    std = 1.0 / math.sqrt(dim)
    with torch.no_grad():
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Megalodon(nn.Module):
    """Megalodon causal LM.

    ``model(tokens)`` with tokens int (B, L), any L >= 1, returns logits (B, L, V_out) in float32
    (float64 for a float64 model).
    ``model(tokens, cache=cache)`` continues a stream (any number of new tokens per call) and
    updates ``cache`` in place; the logits equal those of one call on the whole sequence. Cache
    rows may hold sequences of different lengths: ``model.prefill(prompts)`` fills a fresh cache
    from prompts of any lengths (one packed row), ``model.decode(tokens, cache)`` adds one token
    per row (a fixed-shape step, :mod:`.decode`), and the cache's rows can be selected, dropped
    and joined between steps (:mod:`.cache`; docs/serving.md).
    ``model(tokens, cu_seqlens=cu)`` with tokens (1, T) runs a packed row of documents (see
    :func:`~.packing.pack`), each as if on its own: logits (1, T, V_out) and every parameter
    gradient equal those of one call per document. ``model(tokens, segment_ids=s)`` with integer
    ids s (B, L) packs the batch into one row, a document starting wherever the id changes and at
    every row start; logits (B, L, V_out).
    ``model(tokens, labels=labels)`` (with any of the above) returns instead the mean token
    cross-entropy against ``labels`` (B, L), aligned with ``tokens`` (``labels[:, i]`` is the
    target of position i: the caller shifts), positions whose label is ``ignore_index`` left out.
    It equals ``F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=...)`` in
    value and gradients but never forms the logits (:func:`~.loss.linear_cross_entropy`: the
    output projection, log-softmax and the logits' gradient fused, block by block).
    Construction needs neither CUDA nor torch.distributed.
    """

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError(f"vocab_size must be set (> 0), got {cfg.vocab_size}; "
                             "e.g. get_config(name, vocab_size=32000)")
        if cfg.share_emb and cfg.out_size != cfg.vocab_size:
            raise ValueError(f"share_emb needs output_size == vocab_size, got {cfg.output_size} vs {cfg.vocab_size}")
        self.config = cfg
        self.emb_scale = math.sqrt(cfg.model_dim) if cfg.scale_emb else None
        # _weight skips nn.Embedding's own N(0, 1) init, which the upstream init overwrites anyway.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim,
                                  _weight=torch.zeros(cfg.vocab_size, cfg.model_dim))
        self.rope = RotaryEmbedding(cfg.z_head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList([MegalodonBlock(cfg, i) for i in range(cfg.num_layers)])
        self.output = OutputLayer(cfg)
        _gaussian_init_(self.embed.weight, cfg.model_dim)
        if cfg.share_emb:
            self.output.output.weight = self.embed.weight
        else:
            _gaussian_init_(self.output.output.weight, cfg.model_dim)

    # ---- streaming ------------------------------------------------------------------------
    def init_cache(self, batch_size: int) -> MegalodonCache:
        """A streaming cache of ``batch_size`` fresh rows (see :mod:`.cache`): fixed-size tensors,
        the statistics set to the model's priors, so every later update is in place."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        cfg = self.config
        p = self.embed.weight
        cache = MegalodonCache.empty(batch_size, cfg.num_layers, cfg.num_heads, cfg.z_head_dim, cfg.v_head_dim,
                                     cfg.chunk_size, dtype=p.dtype, device=p.device)
        probe = torch.empty(0, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for layer, state in zip(self.layers, cache.layers):
                layer.mega._fill_state(state, batch_size, probe)
            acc = torch.float64 if p.dtype == torch.float64 else torch.float32
            cache.norm_count, cache.norm_mean, cache.norm_var = self.output.final_norm.initial_state(batch_size, acc)
        return cache

    def _check_cache(self, cache, rows: int, arg: str = "cache") -> None:
        """A cache of this model (layers, chunk size, head and state sizes, device) with ``rows`` rows."""
        if not isinstance(cache, MegalodonCache):
            raise TypeError(f"{arg} must be a MegalodonCache from model.init_cache(), got {type(cache).__name__}")
        cfg = self.config
        device = self.embed.weight.device
        ok = len(cache.layers) == len(self.layers) and cache.chunk_size == cfg.chunk_size and all(
            s.k.shape[1:] == (cfg.chunk_size, cfg.num_heads, cfg.z_head_dim)
            and s.v.shape[1:] == (cfg.chunk_size, cfg.num_heads, cfg.v_head_dim)
            and (s.hx is None or s.hx.shape[1:] == (2, cfg.model_dim, cfg.cema_ndim))
            and (s.norm_mean is None or s.norm_mean.shape[1:] == (self.layers[0].mega.timenorm.num_groups,))
            and s.k.dtype == self.embed.weight.dtype
            for s in cache.layers) and cache.lengths.device == device
        if not ok:
            heads = tuple(cache.layers[0].k.shape[2:]) if cache.layers else ()
            dtype = cache.layers[0].k.dtype if cache.layers else ""
            raise ValueError(f"{arg} is not a cache of this model: it has {len(cache.layers)} layers, chunk size "
                             f"{cache.chunk_size}, head shapes {heads}, {dtype} "
                             f"on {cache.lengths.device}; the model has {len(self.layers)} layers, chunk size "
                             f"{cfg.chunk_size}, heads {(cfg.num_heads, cfg.z_head_dim)}, {self.embed.weight.dtype} "
                             f"on {device}. "
                             "Create it with this model's init_cache()")
        if cache.batch_size != rows:
            raise ValueError(f"{arg} was made for batch {cache.batch_size} but the tokens bring {rows} sequences")

    def _decode_constants(self):
        """decode_constants(self), recomputed only when a CEMA parameter changed (new storage
        or an in-place update: its version counter)."""
        key = tuple((t.data_ptr(), t._version, t.dtype) for layer in self.layers for t in
                    layer.mega.cema.parameters())
        held = self.__dict__.get("_decode_constants_held")
        if held is None or held[0] != key:
            held = (key, decode_constants(self))
            self.__dict__["_decode_constants_held"] = held
        return held[1]

    @torch.no_grad()
    def prefill(self, prompts: Sequence[torch.Tensor]) -> Tuple[MegalodonCache, torch.Tensor]:
        """Run n prompts of any lengths as one packed row into a fresh cache of n rows:
        ``(cache, logits (n, V_out))``, logits of each prompt's last position. Row d of the
        cache then holds prompt d's state exactly as ``model(prompt_d[None], cache=c)`` would.
        ``prompts``: a list of 1-D integer tensors, each with at least one token."""
        prompts = _check_prompts(prompts)
        tokens, cu = pack(prompts)
        cache = self.init_cache(len(prompts))
        logits = self(tokens.to(self.embed.weight.device), cache=cache, cu_seqlens=cu.to(self.embed.weight.device))
        return cache, logits[0, cu[1:].to(logits.device) - 1]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: MegalodonCache) -> torch.Tensor:
        """One new token per cache row, tokens int (B,) -> logits (B, V_out); the cache (B rows,
        any lengths) is updated in place. Eval mode (see :mod:`.decode`)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype.is_floating_point \
                or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor (B,), got {type(tokens).__name__} "
                            f"{getattr(tokens, 'dtype', '')} {tuple(getattr(tokens, 'shape', ()))}")
        self._check_cache(cache, tokens.shape[0])
        if self.training:
            raise ValueError("decode runs in eval mode: call model.eval() first")
        return decode_step(self, cache, tokens, self._decode_constants())

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: Optional[MegalodonCache] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None, segment_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point \
                or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor of shape (B, L), got {type(tokens).__name__} "
                            f"{getattr(tokens, 'dtype', '')} {tuple(getattr(tokens, 'shape', ()))}")
        B, L = tokens.shape
        if L < 1:
            raise ValueError("tokens must hold at least one position (L >= 1)")
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex \
                    or labels.dtype == torch.bool:
                raise TypeError(f"labels must be an integer tensor, got {type(labels).__name__} "
                                f"{getattr(labels, 'dtype', '')}")
            if labels.shape != tokens.shape:
                raise ValueError(f"labels must have the tokens' shape {tuple(tokens.shape)}, got {tuple(labels.shape)}")
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids cannot be streamed through a cache: pass cu_seqlens (a packed prefill "
                             "into fresh cache rows, one per document) or run without cache")
        if segment_ids is not None:
            if cu_seqlens is not None:
                raise ValueError("pass either cu_seqlens or segment_ids, not both")
            cu_seqlens = segment_ids_to_cu_seqlens(segment_ids, tokens)
            if labels is not None:
                return self(tokens.reshape(1, B * L), cu_seqlens=cu_seqlens, labels=labels.reshape(1, B * L),
                            ignore_index=ignore_index)
            return fresh_view(self(tokens.reshape(1, B * L), cu_seqlens=cu_seqlens), (B, L, -1))
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, batch=B, length=L, device=tokens.device, batch_arg="tokens")
        if cache is not None:
            self._check_cache(cache, B if cu_seqlens is None else cu_seqlens.shape[0] - 1)
            recording = torch.is_grad_enabled() and self.embed.weight.requires_grad
            if L == 1 and cu_seqlens is None and not self.training and labels is None and not recording:
                # one token per row, nothing for autograd to record: the fixed-shape step (model/decode.py)
                with torch.no_grad():
                    return decode_step(self, cache, tokens[:, 0], self._decode_constants())[:, None]

        x = self.embed(tokens)
        if self.emb_scale is not None:
            x = x * self.emb_scale
        if self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, self.training)

        use_ckpt = self.config.layerwise_ckpt and self.training and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if use_ckpt:
                x = checkpoint(layer, x, cu_seqlens=cu_seqlens, use_reentrant=False)
            else:
                x = layer(x, None if cache is None else cache.layers[i], cu_seqlens=cu_seqlens)

        norm = self.output.final_norm
        if cache is None:
            x, _, _, _ = norm(x, cu_seqlens=cu_seqlens)
        else:
            prev = (cache.norm_count, cache.norm_mean, cache.norm_var)
            if torch.is_grad_enabled() and cache.norm_count is not None:
                prev = tuple(t.clone() for t in prev)  # saved for the backward; the cache is updated in place
            x, count, mean, var = norm(x, *prev, cu_seqlens=cu_seqlens)
            if cache.norm_count is None:
                cache.norm_count, cache.norm_mean, cache.norm_var = count.detach(), mean.detach(), var.detach()
            else:
                cache.norm_count.copy_(count)
                cache.norm_mean.copy_(mean.detach())
                cache.norm_var.copy_(var.detach())
            cache.lengths.add_(L if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).to(cache.lengths))
        head = self.output.output
        if labels is not None:
            return linear_cross_entropy(x, head.weight, labels, head.bias, ignore_index=ignore_index)
        logits = head(x)
        # At least fp32 (upstream's .float() for half models); fp64 models keep fp64.
        return logits if logits.dtype == torch.float64 else logits.float()

    # ---- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: Union[torch.Tensor, Sequence[torch.Tensor]], max_new_tokens: Union[int, Sequence[int]],
                 *, attention_mask: Optional[torch.Tensor] = None, lengths: Optional[Sequence[int]] = None,
                 greedy: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
                 cache: Optional[MegalodonCache] = None, prefill_size: Optional[int] = None,
                 eos_token_id: Union[None, int, Sequence[Optional[int]]] = None, pad_token_id: Optional[int] = None,
                 return_logits: bool = False):
        """Continue prompts by up to ``max_new_tokens`` tokens each.

        Prompts, two forms:

        * rectangular: ``prompt`` int (B, L0), every row a full prompt; returns (B, L0 + new).
          The prompt is prefilled through the cache (in pieces of ``prefill_size`` tokens if
          given, bounding memory for very long prompts; ``cache``: continue that cache instead of
          a fresh one).
        * ragged: ``prompt`` a list of 1-D int tensors of any lengths >= 1, or a LEFT-padded
          int (B, L) with ``attention_mask`` (B, L) (1 on tokens, 0 on the leading padding, the
          transformers convention) or ``lengths`` (B,) (row b's prompt = its last lengths[b]
          tokens). The prompts are prefilled as one packed row (:meth:`prefill`) and decoded
          together (:meth:`decode`); each row's tokens and logits are those of generating its
          prompt alone, whatever the other rows hold. Returns, for a list, a list of 1-D tensors
          (prompt + its new tokens, ending at its eos or after its max_new_tokens); for a padded
          tensor, (B, L + T) with T the most new tokens of any row, positions after a row's end
          holding ``pad_token_id`` (default: the row's eos_token_id, else 0).

        Per row (ragged form; an int / single value applies to every row): ``max_new_tokens``,
        ``eos_token_id`` (None: no eos), and ``generator`` (a list of one torch.Generator per row
        makes each row's samples those of generating it alone with that generator).

        Decoding: ``greedy=True`` (or temperature 0) takes the argmax; otherwise samples from
        softmax(logits / temperature), restricted to the ``top_k`` largest logits if given.
        Memory per step is constant. Runs in eval mode (no dropout / DropKey) and restores the
        previous mode. Rectangular form with ``eos_token_id``: stops once every sequence has
        produced it (later positions of finished sequences repeat eos).

        ``return_logits=True`` returns ``(tokens, logits)`` with logits a list, per row, of the
        float logits (new_b, V_out) each new token was chosen from.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        if prefill_size is not None and (not isinstance(prefill_size, int) or prefill_size < 1):
            raise ValueError(f"prefill_size must be None or an int >= 1, got {prefill_size!r}")
        ragged = isinstance(prompt, (list, tuple)) or attention_mask is not None or lengths is not None
        was_training = self.training
        self.eval()
        try:
            if ragged:
                if cache is not None:
                    raise ValueError("cache is for a rectangular prompt; ragged prompts start fresh rows "
                                     "(use model.prefill / model.decode to manage rows yourself)")
                if prefill_size is not None:
                    raise ValueError("prefill_size is for a rectangular prompt; ragged prompts are prefilled packed")
                return self._generate_ragged(prompt, max_new_tokens, attention_mask, lengths, greedy, temperature,
                                             top_k, generator, eos_token_id, pad_token_id, return_logits)
            return self._generate_rect(prompt, max_new_tokens, greedy, temperature, top_k, generator, cache,
                                       prefill_size, eos_token_id, return_logits)
        finally:
            self.train(was_training)

    def _generate_rect(self, prompt, max_new_tokens, greedy, temperature, top_k, generator, cache, prefill_size,
                       eos_token_id, return_logits):
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[1] < 1:
            raise ValueError(f"prompt must be an integer tensor (B, L0) with L0 >= 1 or a list of 1-D prompts, got "
                             f"{tuple(getattr(prompt, 'shape', ()))}")
        if eos_token_id is not None and not isinstance(eos_token_id, int):
            raise TypeError(f"eos_token_id must be an int or None for a rectangular prompt, got {eos_token_id!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError("generator must be a torch.Generator for a rectangular prompt (a list of generators is "
                            "for ragged prompts)")
        B, L0 = prompt.shape
        cache = self.init_cache(B) if cache is None else cache
        step = L0 if prefill_size is None else prefill_size
        for s in range(0, L0, step):
            logits = self(prompt[:, s:s + step], cache=cache)[:, -1]
        out, kept = [prompt], []
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        for i in range(max_new_tokens):
            kept.append(logits)
            nxt = sample_next(logits, greedy=greedy, temperature=temperature, top_k=top_k, generator=generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done = done | (nxt == eos_token_id)
            out.append(nxt[:, None].to(prompt.dtype))
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            logits = self.decode(out[-1][:, 0], cache)
        tokens = torch.cat(out, dim=1)
        if return_logits:
            stacked = torch.stack(kept, 1) if kept else prompt.new_zeros(B, 0, self.config.out_size, dtype=torch.float)
            return tokens, list(stacked.unbind(0))
        return tokens

    def _generate_ragged(self, prompt, max_new_tokens, attention_mask, lengths, greedy, temperature, top_k,
                         generator, eos_token_id, pad_token_id, return_logits):
        prompts, padded = _ragged_prompts(prompt, attention_mask, lengths)
        n = len(prompts)
        limits = _per_row(max_new_tokens, n, "max_new_tokens", int, allow_none=False)
        if any(isinstance(m, bool) or m < 0 for m in limits):
            raise ValueError(f"max_new_tokens must be ints >= 0, got {max_new_tokens!r}")
        eos = _per_row(eos_token_id, n, "eos_token_id", int, allow_none=True)
        gens = _per_row(generator, n, "generator", torch.Generator, allow_none=True)
        shared_gen = generator if isinstance(generator, torch.Generator) or generator is None else None
        device = self.embed.weight.device
        new = [[] for _ in range(n)]
        kept = [[] for _ in range(n)]
        active = [b for b in range(n) if limits[b] > 0]
        if active:
            cache, logits = self.prefill([prompts[b] for b in active])
        while active:
            if shared_gen is not None or greedy or temperature == 0:
                nxt = sample_next(logits, greedy=greedy, temperature=temperature, top_k=top_k, generator=shared_gen)
            else:
                nxt = torch.cat([sample_next(logits[i:i + 1], greedy=False, temperature=temperature, top_k=top_k,
                                             generator=gens[b]) for i, b in enumerate(active)])
            values = nxt.tolist()
            still = []
            for i, b in enumerate(active):
                new[b].append(values[i])
                if return_logits:
                    kept[b].append(logits[i])
                if len(new[b]) < limits[b] and values[i] != eos[b]:
                    still.append(i)
            if not still:
                break
            if len(still) < len(active):
                # finished rows leave the batch (continuous batching: MegalodonCache.select)
                cache, nxt = cache.select(still), nxt[still]
                active = [active[i] for i in still]
            logits = self.decode(nxt.to(device), cache)
        outs = [torch.cat([p, torch.tensor(t, dtype=p.dtype, device=p.device)]) for p, t in zip(prompts, new)]
        if padded is not None:
            T = max(len(t) for t in new)
            rows = []
            for b, t in enumerate(new):
                fill = pad_token_id if pad_token_id is not None else (eos[b] if eos[b] is not None else 0)
                rows.append(t + [fill] * (T - len(t)))
            outs = torch.cat([padded, torch.tensor(rows, dtype=padded.dtype, device=padded.device).reshape(n, T)], 1)
        if return_logits:
            V = self.config.out_size
            return outs, [torch.stack(k) if k else torch.zeros(0, V, device=device) for k in kept]
        return outs

    # ---- checkpoints ------------------------------------------------------------------------
    def load_upstream(self, source: Union[str, os.PathLike, dict]) -> "Megalodon":
        """Load an upstream consolidated state dict strictly (see :func:`.checkpoint.load_upstream`)."""
        load_upstream(self, source)
        return self

    @classmethod
    def from_upstream(cls, checkpoint_dir: Union[str, os.PathLike], **config_overrides) -> "Megalodon":
        """Build from an upstream checkpoint directory (``config.json`` + ``consolidated.pth``).
        A config without vocab_size (-1, old upstream checkpoints) takes it from ``embed.weight``."""
        sd = read_state_dict(checkpoint_dir)
        config_overrides.setdefault("init_mode", "none")  # as upstream: weights come from the checkpoint
        cfg = MegalodonConfig.from_upstream(checkpoint_dir, **config_overrides)
        if cfg.vocab_size == -1 and isinstance(sd.get("embed.weight"), torch.Tensor):
            cfg = cfg.replace(vocab_size=sd["embed.weight"].shape[0])
        model = cls(cfg)
        load_upstream(model, sd)
        return model


def _check_prompts(prompts) -> list:
    """A list of 1-D integer prompt tensors, each with >= 1 token."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of 1-D integer token tensors, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    for b, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex \
                or p.dtype == torch.bool:
            raise TypeError(f"prompt[{b}] must be a 1-D integer tensor, got {type(p).__name__} "
                            f"{getattr(p, 'dtype', '')} {tuple(getattr(p, 'shape', ()))}")
        if p.shape[0] == 0:
            raise ValueError(f"prompt[{b}] is empty: every prompt needs at least one token")
    return list(prompts)


def _ragged_prompts(prompt, attention_mask, lengths):
    """-> (list of 1-D prompts, the padded (B, L) tensor or None)."""
    if isinstance(prompt, (list, tuple)):
        if attention_mask is not None or lengths is not None:
            raise ValueError("attention_mask / lengths go with a padded (B, L) prompt, not with a list of prompts")
        return _check_prompts(prompt), None
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        raise ValueError(f"prompt must be a list of 1-D prompts or a left-padded (B, L) tensor, got "
                         f"{tuple(getattr(prompt, 'shape', ()))}")
    B, L = prompt.shape
    if attention_mask is not None and lengths is not None:
        raise ValueError("pass either attention_mask or lengths, not both")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != prompt.shape:
            raise ValueError(f"attention_mask must be a tensor of the prompt's shape {tuple(prompt.shape)}, got "
                             f"{tuple(getattr(attention_mask, 'shape', ()))}")
        mask = attention_mask.to("cpu", torch.int64)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (tokens)")
        counts = mask.sum(1)
        # left padding: row b's ones are exactly its last counts[b] positions
        expect = (torch.arange(L)[None, :] >= (L - counts)[:, None]).to(torch.int64)
        if not torch.equal(mask, expect):
            bad = int((mask != expect).any(1).nonzero()[0])
            raise ValueError(f"attention_mask row {bad} is not left-padded (zeros first, then ones); right or "
                             "inner padding would enter the recurrent state: left-pad the prompts")
        lengths = counts.tolist()
    elif lengths is not None:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        lengths = list(lengths)
        if len(lengths) != B or any(not isinstance(n, int) or not 0 <= n <= L for n in lengths):
            raise ValueError(f"lengths must hold {B} ints in [0, {L}] (one per row), got {lengths!r}")
    else:
        raise ValueError("a (B, L) prompt with ragged rows needs attention_mask or lengths")
    prompts = [prompt[b, L - n:] for b, n in enumerate(lengths)]
    return _check_prompts(prompts), prompt


def _per_row(value, n: int, arg: str, kind, *, allow_none: bool) -> list:
    """A per-row list from one value or a sequence of n values."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{arg} has {len(value)} entries for {n} prompts")
        values = list(value)
    else:
        values = [value] * n
    for v in values:
        if v is None and allow_none:
            continue
        if not isinstance(v, kind):
            raise TypeError(f"{arg} must be {'None, ' if allow_none else ''}{kind.__name__} or a list of one per "
                            f"prompt, got {value!r}")
    return values


def sample_next(logits: torch.Tensor, *, greedy: bool = False, temperature: float = 1.0,
                top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): argmax, or temperature / top-k sampling."""
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
