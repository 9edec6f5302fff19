"""The Megalodon causal LM (docs/math.md, model): embedding, blocks, final TimestepNorm, output head.

state_dict names (upstream's): ``embed.weight``, ``rope.freqs``, ``layers.{i}.mega.*``,
``layers.{i}.nffn.*``, ``output.final_norm.*``, ``output.output.weight``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalodon_kernels.ops._packing import check_cu_seqlens

from .cache import MegalodonCache
from .checkpoint import load_upstream, read_state_dict
from .config import MegalodonConfig
from .layers import MegalodonBlock, TimestepNorm, fresh_view
from .loss import linear_cross_entropy
from .packing import segment_ids_to_cu_seqlens

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
    updates ``cache`` in place; the logits equal those of one call on the whole sequence.
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
        """An empty streaming cache for ``batch_size`` sequences (see :mod:`.cache`)."""
        cfg = self.config
        p = self.embed.weight
        return MegalodonCache.empty(batch_size, cfg.num_layers, cfg.num_heads, cfg.z_head_dim, cfg.v_head_dim,
                                    cfg.chunk_size, dtype=p.dtype, device=p.device)

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
        if cache is not None and (cu_seqlens is not None or segment_ids is not None):
            raise ValueError("a packed row (cu_seqlens / segment_ids) cannot be streamed through a cache: "
                             "run packed rows without cache, or stream each document with a cache of its own")
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
            if not isinstance(cache, MegalodonCache):
                raise TypeError(f"cache must be a MegalodonCache from model.init_cache(), got {type(cache).__name__}")
            if cache.batch_size != B or len(cache.layers) != len(self.layers):
                raise ValueError(f"cache was made for batch {cache.batch_size} and {len(cache.layers)} layers; "
                                 f"got tokens of batch {B} for a {len(self.layers)}-layer model")

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
            x, count, mean, var = norm(x, cache.norm_count, cache.norm_mean, cache.norm_var)
            cache.norm_count, cache.norm_mean, cache.norm_var = count.detach(), mean.detach(), var.detach()
            cache.num_tokens += L
        head = self.output.output
        if labels is not None:
            return linear_cross_entropy(x, head.weight, labels, head.bias, ignore_index=ignore_index)
        logits = head(x)
        # At least fp32 (upstream's .float() for half models); fp64 models keep fp64.
        return logits if logits.dtype == torch.float64 else logits.float()

    # ---- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, greedy: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 cache: Optional[MegalodonCache] = None, prefill_size: Optional[int] = None,
                 eos_token_id: Optional[int] = None) -> torch.Tensor:
        """Continue ``prompt`` (B, L0) by ``max_new_tokens`` tokens; returns (B, L0 + new).

        Decoding: ``greedy=True`` (or temperature 0) takes the argmax; otherwise samples from
        softmax(logits / temperature), restricted to the ``top_k`` largest logits if given.
        The prompt is prefilled through the cache (in pieces of ``prefill_size`` tokens if given,
        bounding memory for very long prompts), then one token per step: memory per step is
        constant. Runs in eval mode (no dropout / DropKey) and restores the previous mode.
        With ``eos_token_id``, stops once every sequence has produced it (later positions of
        finished sequences repeat eos).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[1] < 1:
            raise ValueError(f"prompt must be an integer tensor (B, L0) with L0 >= 1, got "
                             f"{tuple(getattr(prompt, 'shape', ()))}")
        if prefill_size is not None and (not isinstance(prefill_size, int) or prefill_size < 1):
            raise ValueError(f"prefill_size must be None or an int >= 1, got {prefill_size!r}")
        was_training = self.training
        self.eval()
        try:
            B, L0 = prompt.shape
            cache = self.init_cache(B) if cache is None else cache
            step = L0 if prefill_size is None else prefill_size
            for s in range(0, L0, step):
                logits = self(prompt[:, s:s + step], cache=cache)[:, -1]
            out = [prompt]
            done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
            for i in range(max_new_tokens):
                nxt = sample_next(logits, greedy=greedy, temperature=temperature, top_k=top_k, generator=generator)
                if eos_token_id is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                    done = done | (nxt == eos_token_id)
                out.append(nxt[:, None].to(prompt.dtype))
                if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                    break
                logits = self(out[-1], cache=cache)[:, -1]
            return torch.cat(out, dim=1)
        finally:
            self.train(was_training)

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
