"""Hugging Face transformers integration: Megalodon as a ``PreTrainedModel`` with the Auto classes.

Importing this module registers ``model_type="megalodon"`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (no ``trust_remote_code``)::

    import megalodon_kernels.model.hf  # registers "megalodon"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("path/to/dir")
    out = model.generate(input_ids, max_new_tokens=32)

* :class:`MegalodonHFConfig` is a ``PreTrainedConfig`` with every field of
  :class:`~.config.MegalodonConfig` under the same name and default (``to_model_config()``
  gives the dataclass back), plus transformers' own (``eos_token_id``, ``use_cache``, ...).
  ``tie_word_embeddings`` mirrors ``share_emb``.
* :class:`MegalodonForCausalLM` holds the modules of a :class:`~.megalodon.Megalodon` directly,
  so its ``state_dict`` keys are the upstream names (``embed.weight``, ``layers.0.mega...``),
  the same as ``Megalodon``'s and an upstream ``consolidated.pth``'s.
* ``generate`` runs transformers' loop over :class:`MegalodonHFCache`, a ``Cache`` that carries
  the constant-size streaming state (:class:`~.cache.MegalodonCache`: CEMA hidden state,
  TimestepNorm statistics, keys and values of the unfinished attention chunk). A recurrent state
  cannot be rolled back: the model is stateful (``_is_stateful``), so transformers refuses
  assisted and prompt-lookup decoding. A continuation gets either only the new tokens or the
  whole sequence, of which the cache is fed only the part it has not consumed.
* ``labels=`` (transformers' convention: ``labels`` aligned with ``input_ids``, shifted inside)
  or ``shift_labels=`` (aligned already) returns the fused cross-entropy of
  :func:`~.loss.linear_cross_entropy`; the logits are not formed, so ``logits`` is ``None`` in
  that output.
* ``inputs_embeds`` and ``output_hidden_states`` as in transformers' decoder models;
  activation checkpointing through transformers' ``GradientCheckpointingLayer`` (each block);
  ``init_weights()`` initialises every parameter and buffer as the constructor does.
* ``attention_mask``: a padded batch runs each row's tokens as a document of its own (a packed
  row), the padding skipped, so left-padded ragged batches generate each row exactly as alone
  (the ragged semantics of :meth:`~.megalodon.Megalodon.generate`). Padding between tokens is
  refused: a recurrent state has no way to skip it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
    from transformers.cache_utils import Cache
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("megalodon_kernels.model.hf needs transformers 5.x and safetensors: "
                      "from a checkout, pip install -e '.[hf]'") from e

from .cache import MegalodonCache
from .config import MegalodonConfig
from .layers import ComplexEMA, LayerNorm, MegalodonAttention, MegalodonBlock, NormalizedFFN, RMSNorm, TimestepNorm, \
    init_linear
from .megalodon import Megalodon, RotaryEmbedding

__all__ = ["MegalodonHFConfig", "MegalodonForCausalLM", "MegalodonHFCache", "CACHE_ARG"]

#: The name transformers gives the cache, as generate's argument and as the outputs' field:
#: "cache" since transformers 5.24, "past_key_values" before.
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(MegalodonConfig))


class MegalodonHFConfig(PreTrainedConfig):
    """transformers config of a Megalodon LM: the fields of :class:`~.config.MegalodonConfig`
    (same names, defaults and checks) plus transformers' generation and tying fields.

    ``MegalodonHFConfig.from_model_config(get_config("tiny"))`` converts ours;
    ``config.to_model_config()`` converts back.
    """

    model_type = "megalodon"
    # Standard names that tools (pipelines, evaluation harnesses) read.
    attribute_map = {"hidden_size": "model_dim", "num_hidden_layers": "num_layers",
                     "num_attention_heads": "num_heads", "intermediate_size": "ffn_hidden_dim"}

    # ---- MegalodonConfig's fields (a test keeps names and defaults equal) ----
    num_layers: int = 8
    model_dim: int = 1024
    z_dim: int = 256
    value_dim: int = 2048
    num_heads: int = 1
    ffn_hidden_dim: int = 2048
    cema_ndim: int = 16
    chunk_size: int = 2048
    efficient_attn: Optional[str] = None
    init_mode: str = "he"
    vocab_size: int = -1
    output_size: int = -1
    norm_num_groups: int = 32
    norm_affine: bool = True
    norm_eps: float = 1e-5
    rope_base: Optional[float] = None
    dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    swiglu: bool = False
    rescale_nffn: bool = False
    scale_emb: bool = False
    share_emb: bool = False
    layerwise_ckpt: bool = False
    backend: Union[str, dict] = "auto"
    dropkey_p: Optional[float] = None
    attn_fn: str = "softmax"
    norm_prior_count: int = 0

    # ---- transformers' fields ----
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None
    use_cache: bool = True
    #: Mirrors share_emb (None: take share_emb); transformers ties output.output.weight to embed.weight by it.
    tie_word_embeddings: Optional[bool] = None

    def __post_init__(self, **kwargs):
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = bool(self.share_emb)
        elif bool(self.tie_word_embeddings) != bool(self.share_emb):
            raise ValueError(f"tie_word_embeddings ({self.tie_word_embeddings}) must equal share_emb "
                             f"({self.share_emb}): Megalodon ties the output head to the embedding exactly "
                             "when share_emb is set")
        super().__post_init__(**kwargs)
        self.to_model_config()  # the dataclass's checks, with its messages

    def to_model_config(self) -> MegalodonConfig:
        """The :class:`~.config.MegalodonConfig` these fields describe."""
        return MegalodonConfig(**{name: getattr(self, name) for name in _MODEL_FIELDS})

    @classmethod
    def from_model_config(cls, cfg: MegalodonConfig, **kwargs) -> "MegalodonHFConfig":
        """From our dataclass; ``kwargs`` set transformers' fields (e.g. ``eos_token_id=2``)."""
        if not isinstance(cfg, MegalodonConfig):
            raise TypeError(f"cfg must be a MegalodonConfig, got {type(cfg).__name__}")
        return cls(**cfg.to_dict(), **kwargs)


class MegalodonHFCache(Cache):
    """A transformers ``Cache`` carrying a :class:`~.cache.MegalodonCache` (``self.state``).

    Its size is constant in the number of tokens, and its rows may hold sequences of different
    lengths (see :mod:`.cache`). ``generate`` creates one; to continue a stream, pass the returned
    cache back with only the new tokens as ``input_ids``. Row operations (beam reordering,
    ``num_return_sequences`` expansion) are :meth:`~.cache.MegalodonCache.select`. ``crop`` is
    refused: a recurrent state cannot drop tokens.
    """

    def __init__(self, state: MegalodonCache):
        if not isinstance(state, MegalodonCache):
            raise TypeError(f"state must be a MegalodonCache (model.init_cache()), got {type(state).__name__}")
        # No per-layer transformers layers: the state is one object, so generate treats the cache as
        # recurrent (it never slices a prompt by get_seq_length) and never compiles it as a static cache.
        super().__init__(layers=[])
        self.state = state

    def __repr__(self) -> str:
        return f"MegalodonHFCache(lengths={self.state.lengths.tolist()})"

    def __len__(self) -> int:
        return len(self.state.layers)  # transformers' meaning: the number of layers

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens consumed so far (the longest row's count: rows may differ)."""
        lengths = self.state.lengths
        return int(lengths.max()) if lengths.numel() else 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1  # no limit: the state does not grow

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError("MegalodonHFCache cannot be cropped: the EMA and TimestepNorm states are "
                                  "recurrent and do not keep the tokens they absorbed; keep a clone() of the "
                                  "cache from before the tokens you may want to drop instead")

    def reset(self) -> None:
        raise NotImplementedError("MegalodonHFCache cannot be reset in place: make a new one with "
                                  "model.new_cache(batch_size)")

    def _select(self, idx: torch.Tensor) -> None:
        self.state = self.state.select(idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows become ``state[beam_idx]`` (beam search)."""
        idx = torch.as_tensor(beam_idx, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.state.batch_size):
            raise ValueError(f"beam_idx must hold row indices in [0, {self.state.batch_size}), got {idx.tolist()}")
        self._select(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times, next to each other (``num_return_sequences``, beams)."""
        self._select(torch.arange(self.state.batch_size).repeat_interleave(repeats))

    def clone(self) -> "MegalodonHFCache":
        """An independent copy (e.g. to branch a stream)."""
        return MegalodonHFCache(self.state.clone())


def _is_integer_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.dtype.is_floating_point or t.dtype.is_complex)


class CheckpointedMegalodonBlock(MegalodonBlock, GradientCheckpointingLayer):
    """A :class:`~.layers.MegalodonBlock` that transformers' activation checkpointing drives: same
    parameters and names; ``activation_checkpointing_enable(...)`` sets its ``gradient_checkpointing``
    flag and ``_gradient_checkpointing_func`` (``torch.utils.checkpoint.checkpoint`` with the caller's
    options, e.g. ``use_reentrant``; ``every_n_layers`` picks the blocks). :class:`MegalodonForCausalLM`
    gives its blocks this class, so ``model.megalodon`` checkpoints the same way. A block that
    updates a streaming state is never checkpointed: replaying it in the backward would absorb its
    tokens into the state twice."""


if "__call__" in vars(GradientCheckpointingLayer):
    # transformers up to 5.2x: the layer checkpoints its __call__ (hooks and forward) when flagged
    def _checkpointed_block_call(self, x, state=None, **kwargs):
        if state is not None:
            return nn.Module.__call__(self, x, state, **kwargs)
        return GradientCheckpointingLayer.__call__(self, x, **kwargs)  # x alone positional (use_reentrant)

    CheckpointedMegalodonBlock.__call__ = _checkpointed_block_call
else:
    # later versions wrap forward (GradientCheckpointingLayer.__init_subclass__); this replaces the wrapper
    def _checkpointed_block_forward(self, x, state=None, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and state is None:
            return self._gradient_checkpointing_func(functools.partial(MegalodonBlock.forward, self, **kwargs), x)
        return MegalodonBlock.forward(self, x, state, **kwargs)

    CheckpointedMegalodonBlock.forward = _checkpointed_block_forward


def _init_keeping_loaded(module: nn.Module, fn) -> None:
    """Run ``fn`` (which re-initialises ``module``'s own tensors) and put back every tensor that
    from_pretrained marked as loaded (``_is_hf_initialized``), so only missing weights change."""
    own = list(module.parameters(recurse=False)) + [b for b in module.buffers(recurse=False) if b is not None]
    kept = [(t, t.detach().clone()) for t in own if getattr(t, "_is_hf_initialized", False)]
    with torch.no_grad():
        fn()
        for t, value in kept:
            t.copy_(value)


def _gaussian_(w: torch.Tensor, dim: int) -> None:
    """Megalodon's embedding / head init: N(0, 1/dim) truncated at 3 std."""
    std = 1.0 / math.sqrt(dim)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


class MegalodonForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`~.megalodon.Megalodon` causal LM as a transformers ``PreTrainedModel``.

    ``state_dict`` keys are :class:`~.megalodon.Megalodon`'s (upstream's) names. The underlying
    model is ``self.megalodon`` (sharing these modules), for our own API: streaming caches,
    packed rows (``cu_seqlens``), ``generate(..., prefill_size=...)``.
    """

    config_class = MegalodonHFConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # A recurrent state: transformers refuses assisted / prompt-lookup decoding for it (it cannot roll back).
    _is_stateful = True
    _no_split_modules = ["MegalodonBlock", "CheckpointedMegalodonBlock"]
    _tied_weights_keys = {"output.output.weight": "embed.weight"}

    def __init__(self, config: MegalodonHFConfig):
        if not isinstance(config, MegalodonHFConfig):
            raise TypeError(f"config must be a MegalodonHFConfig, got {type(config).__name__}")
        super().__init__(config)
        # Checkpointing is transformers' (CheckpointedMegalodonBlock), never the core's own loop.
        core = Megalodon(config.to_model_config().replace(layerwise_ckpt=False))
        for block in core.layers:
            block.__class__ = CheckpointedMegalodonBlock
        # The modules are registered on self (upstream names at the top level); the Megalodon
        # object that runs them is kept outside the module tree so they are not registered twice.
        for name, child in core.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_megalodon", core)
        self.post_init()
        if config.layerwise_ckpt:  # upstream's flag: every block checkpointed, non-reentrant
            self._set_gradient_checkpointing(True, functools.partial(checkpoint, use_reentrant=False))

    @property
    def megalodon(self) -> Megalodon:
        """The :class:`~.megalodon.Megalodon` running this model's modules (same parameters)."""
        return self._megalodon

    def train(self, mode: bool = True):
        super().train(mode)
        # The core is not a child (see __init__), so its own flag (dropout) follows here.
        self._megalodon.training = mode
        return self

    def _init_weights(self, module):
        """Initialise ``module``'s own parameters and buffers as Megalodon's constructor does
        (``init_mode``; the embedding and an untied head N(0, 1/model_dim) truncated; CEMA's
        upstream init; norms and TimestepNorm priors; ``rope.freqs``). transformers calls it on
        every module: from ``init_weights()`` (e.g. after building on the meta device and
        ``to_empty``) and for the weights a checkpoint lacks; loaded weights are kept."""
        cfg = self.config
        # transformers calls this once per module, on a module's own tensors only (a module whose own
        # tensors were all loaded, or that has none, is not called): each branch initialises just those.
        if isinstance(module, nn.Embedding):
            _init_keeping_loaded(module, lambda: _gaussian_(module.weight, cfg.model_dim))
        elif isinstance(module, nn.Linear):
            role = self._init_role(module)
            if role == "head":
                if not cfg.tie_word_embeddings:
                    _init_keeping_loaded(module, lambda: _gaussian_(module.weight, cfg.model_dim))
            elif role == "block":
                # init_mode "none" keeps PyTorch's Linear init, as the constructor does
                fn = module.reset_parameters if cfg.init_mode == "none" else functools.partial(init_linear, module,
                                                                                            cfg.init_mode)
                _init_keeping_loaded(module, fn)
        elif isinstance(module, MegalodonAttention):
            _init_keeping_loaded(module, lambda: (module.gamma.zero_(), module.beta.zero_()))
        elif isinstance(module, NormalizedFFN):
            if module.alpha is not None:
                layer_id = self._init_role(module)
                _init_keeping_loaded(module, lambda: module.alpha.fill_(0.1 * 0.5 ** layer_id))
        elif isinstance(module, ComplexEMA):
            _init_keeping_loaded(module, module.reset_parameters)
        elif isinstance(module, TimestepNorm):
            def norm_init():
                module.prior_count.fill_(cfg.norm_prior_count)
                for t in (module.prior_mean, module.prior_logv, module.weight, module.bias):
                    t.zero_()
            _init_keeping_loaded(module, norm_init)
        elif isinstance(module, (RMSNorm, LayerNorm)):
            _init_keeping_loaded(module, lambda: [t.zero_() for t in module.parameters(recurse=False)])
        elif isinstance(module, RotaryEmbedding):
            _init_keeping_loaded(module, lambda: module.freqs.copy_(module.expected_freqs()))

    def _init_role(self, module):
        """"head" for the output projection, "block" for a block's Linear, the layer index for a
        NormalizedFFN, None for a module this model does not hold (e.g. a resized head not yet set)."""
        roles = self.__dict__.get("_init_roles")
        if roles is None or id(module) not in roles:
            roles = {id(self.output.output): "head"}
            for i, block in enumerate(self.layers):
                roles[id(block.nffn)] = i
                for lin in block.modules():
                    if isinstance(lin, nn.Linear):
                        roles[id(lin)] = "block"
            self.__dict__["_init_roles"] = roles
        return roles.get(id(module))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, strict: Optional[bool] = None, **kwargs):
        """transformers' ``from_pretrained``, strict by default: a weight the checkpoint lacks, or one
        the model lacks, is an error (a missing Megalodon weight would otherwise run as a random
        one). Not strict, as transformers is (missing weights initialised as the constructor does,
        listed in the loading info): with ``strict=False``, with ``output_loading_info=True`` (the
        caller receives the list), and without a checkpoint (``from_pretrained(None, config=...,
        state_dict=...)``: the weights given are all there is)."""
        want_info = kwargs.pop("output_loading_info", False)
        if strict is None:
            strict = not want_info and pretrained_model_name_or_path is not None
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")
               and v}
        if strict and bad:
            raise ValueError(f"the checkpoint does not match the MegalodonForCausalLM config: {bad} "
                             "(strict=False loads it anyway, initialising the missing weights)")
        return (model, info) if want_info else model

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint, **kwargs):
        # transformers' own: the flag and function go to every CheckpointedMegalodonBlock (every_n_layers
        # and the checkpoint options honoured); config.layerwise_ckpt records whether it is on.
        super()._set_gradient_checkpointing(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func,
                                            **kwargs)
        self.config.layerwise_ckpt = bool(enable)

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value
        self._megalodon.embed = value

    def get_output_embeddings(self):
        return self.output.output

    def set_output_embeddings(self, value):
        self.output.output = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The streaming state is not a key/value list: prepare_inputs_for_generation creates ours.
        return False

    def new_cache(self, batch_size: int) -> MegalodonHFCache:
        """An empty cache for ``batch_size`` sequences."""
        return MegalodonHFCache(self._megalodon.init_cache(batch_size))

    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, *args, **kwargs):
        # Only called when generate was given no attention_mask: transformers then masks every
        # pad_token_id of input_ids. Leading ones are left padding (each row then runs alone); one
        # after a row's first token would be a gap in the recurrent state, refused here with what to pass.
        mask = super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, *args, **kwargs)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            left = torch.cummax(mask.long(), dim=1).values == mask.long()
            if not bool(left.all()):
                pad = getattr(generation_config, "pad_token_id", None)
                raise ValueError(f"input_ids hold the pad_token_id ({pad}) after a row's first token and no "
                                 "attention_mask was passed, so transformers masks those positions, which a "
                                 "recurrent state cannot skip. Pass attention_mask: torch.ones_like(input_ids) to "
                                 "read them as tokens, or the mask of your (left) padding; or set pad_token_id to an "
                                 "id the prompts do not use")
        return mask

    @staticmethod
    def _unseen_part(input_ids, attention_mask, lengths):
        """The part of a continuation's ``input_ids`` that ``cache`` (lengths (B,), tokens each row
        has consumed) has not seen. transformers' convention for continuing a cache is the whole
        sequence with an attention_mask as wide (the cache holding its first part); only the new
        tokens are the other form, told apart by being fewer than the cache holds or narrower
        than the attention_mask."""
        B, L = input_ids.shape
        width = L if attention_mask is None else attention_mask.shape[1]
        if width != L or L <= int(lengths.min()):
            return input_ids
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
        seen = lengths.to(mask.device) + (L - mask.sum(1))  # columns the cache covers, padding included
        c = int(seen[0])
        if not (bool((seen == c).all()) and 0 < c < L and bool((mask[:, c:] == 1).all())):
            raise ValueError(f"input_ids hold {L} positions per row and the cache has consumed {lengths.tolist()} "
                             "tokens: generate continues a cache from either only the new tokens, or the whole "
                             "sequence (padding included) with an attention_mask as wide whose tokens before the "
                             "new ones are exactly those the cache consumed; these input_ids are neither")
        return input_ids[:, c:]

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        cache = None
        for name in ("cache", "past_key_values"):
            given = kwargs.pop(name, None)
            cache = given if given is not None else cache
        if cache is None and kwargs.get("use_cache", True) is not False:
            rows = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
            cache = self.new_cache(rows)
        if (cache is not None and is_first_iteration and next_sequence_length is None and inputs_embeds is None
                and isinstance(cache, MegalodonHFCache) and bool((cache.state.lengths > 0).any())):
            # Continuing a cache: feed it only what it has not consumed (transformers >= 5.24 does
            # not cut a recurrent cache's prompt itself; older versions pass next_sequence_length).
            input_ids = self._unseen_part(input_ids, attention_mask, cache.state.lengths)
        kwargs[CACHE_ARG] = cache
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        # The mask only grows by ones after the prompt; it was checked on the prompt.
        if cache is not None and not is_first_iteration:
            model_inputs.pop("attention_mask", None)
        return model_inputs

    def _packing_mask(self, attention_mask, input_ids, cache) -> Optional[torch.Tensor]:
        """None when ``input_ids`` can run as they are; else the bool (B, L) mask of the tokens
        to run, each row's tokens one packed document (see :meth:`forward`)."""
        B, L = input_ids.shape
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
                or attention_mask.shape[0] != B or attention_mask.shape[1] < L:
            raise ValueError(f"attention_mask must be a (batch, length) tensor matching input_ids {(B, L)} "
                             f"(length >= that of input_ids), got {tuple(getattr(attention_mask, 'shape', ()))}")
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (tokens)")
        # Columns before the last L describe tokens a cache has already consumed: they must be the cache's.
        past = attention_mask.shape[1] - L
        if past:
            if cache is None:
                raise ValueError(f"attention_mask has {attention_mask.shape[1]} columns for {L} positions of "
                                 f"input_ids: its first {past} describe tokens a cache has consumed, but no cache "
                                 "was given")
            held = attention_mask[:, :past].sum(1).to(cache.state.lengths)
            if not torch.equal(held, cache.state.lengths):
                raise ValueError(f"attention_mask's first {past} columns (before the {L} of input_ids) hold "
                                 f"{held.tolist()} tokens per row, but the cache has consumed "
                                 f"{cache.state.lengths.tolist()}: input_ids must be exactly the tokens the cache has "
                                 "not seen")
        new = attention_mask[:, past:]
        if bool((new == 1).all()):
            return None
        mask = new.bool()
        counts = mask.sum(1)
        first = torch.where(counts > 0, mask.int().argmax(1), 0)
        cols = torch.arange(L, device=mask.device)[None, :]
        span = (cols >= first[:, None]) & (cols < (first + counts)[:, None])
        if not bool((counts > 0).all()) or not torch.equal(mask, span):
            bad = int(((counts == 0) | (mask != span).any(1)).nonzero()[0])
            raise ValueError(f"attention_mask row {bad} is not one run of tokens (padding only before and/or after "
                             "them, and at least one token): padding between tokens would enter the recurrent state")
        if cache is None:
            if bool((first == 0).all()):
                return None  # right padding: causal, so the tokens never see the padding after them
            return mask
        if not bool((first + counts == L).all()):
            raise ValueError("attention_mask with a cache must be left padding (each row's tokens end at the last "
                             "position), so that every row's next token follows its own last token")
        if bool((cache.state.lengths != 0).any()):
            raise ValueError("attention_mask with padding needs a fresh cache (rows that have consumed nothing): a "
                             "padded batch is prefilled as one packed row of documents into new rows")
        return mask

    @contextlib.contextmanager
    def _hooks(self, embeds: Optional[torch.Tensor], hidden: Optional[dict]):
        """While running the core: the embedding's output replaced by ``embeds`` (inputs_embeds), and
        the hidden states recorded into ``hidden`` ("in": the first block's input, i: block i's output,
        "final": the final norm's output). Both the general path and the one-token step (decode.py)
        run through these modules; a block's own output (outside its checkpoint) takes precedence."""
        handles = []
        try:
            if embeds is not None:
                handles.append(self.embed.register_forward_hook(
                    lambda m, args, out: embeds.reshape(out.shape).to(out.dtype)))
            if hidden is not None:
                blocks = list(self.layers)

                def block_in(m, args):
                    hidden["in"] = args[0]

                def ffn_in(m, args):
                    hidden.setdefault("in", args[1])  # the one-token step: nffn(y, residual=block input)

                def out(i):
                    def hook(m, args, output):
                        hidden[i] = output
                    return hook

                handles.append(blocks[0].register_forward_pre_hook(block_in))
                handles.append(blocks[0].nffn.register_forward_pre_hook(ffn_in))
                for i, block in enumerate(blocks[:-1]):
                    handles.append(block.nffn.register_forward_hook(out(i)))
                    handles.append(block.register_forward_hook(out(i)))

                def final_norm(m, args, output):
                    hidden["final"] = output[0]

                def head_in(m, args):
                    hidden.setdefault("final", args[0])  # the one-token step runs the norm inline

                handles.append(self.output.final_norm.register_forward_hook(final_norm))
                handles.append(self.output.output.register_forward_pre_hook(head_in))
            yield
        finally:
            for h in handles:
                h.remove()

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[MegalodonHFCache] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None,
                logits_to_keep: Union[int, torch.Tensor] = 0, inputs_embeds: Optional[torch.Tensor] = None,
                position_ids=None, past_key_values=None, num_items_in_batch=None, output_attentions=None,
                output_hidden_states: Optional[bool] = None, **kwargs):
        """Logits (B, L, V) in float32, or with ``labels`` (B, L) the mean next-token loss
        (``labels[:, i + 1]`` is the target at position i; -100 is ignored) without forming logits.

        ``inputs_embeds`` r(B L model_dim) instead of ``input_ids``: what ``get_input_embeddings()``
        would give for them (the model scales them by sqrt(model_dim) itself when ``scale_emb``).
        ``shift_labels`` (B, L), a keyword: targets already aligned with the positions (``shift_labels[:, i]``
        is the target at position i, as sequence-parallel trainers pass them); they replace
        ``labels`` in the loss.
        ``cache``: a :class:`MegalodonHFCache` to continue (updated in place and returned); the
        input is only the tokens the cache has not consumed (``generate`` also takes the whole
        sequence and feeds the cache only the new part). With ``use_cache`` (default:
        ``config.use_cache`` outside training and without labels) a new one is made.
        ``attention_mask`` (B, L), or with a cache (B, n + L): its first n columns describe the
        tokens the cache has consumed (their count per row must be the cache's) and its last L
        ``input_ids``. Each row's tokens must be one run. With padding, each row runs as a
        document of its own, the padding skipped (a packed row, ``cu_seqlens``); the logits and
        hidden states at padded positions are zero (right padding without a cache runs as it is:
        the padded positions' outputs are then those of the pad tokens). With a cache, padding
        must be on the left and the cache fresh; every row then continues from its own last token.
        ``output_hidden_states``: ``hidden_states`` = (the first block's input, i.e. the scaled
        embeddings; the outputs of blocks 1 .. n-1; the final norm's output, which the head reads),
        n + 1 tensors r(B L model_dim), as transformers' decoder models order them.
        ``logits_to_keep`` k > 0 keeps only the last k positions' logits (the head runs on those only).
        ``num_items_in_batch`` (passed by ``Trainer``): the loss is the sum over this batch's
        target tokens divided by it, so gradient accumulation weighs every token equally.
        """
        # A keyword, not a parameter, as in transformers' models: Trainer takes every parameter named
        # like a label for a label its batches must carry.
        shift_labels = kwargs.pop("shift_labels", None)
        if past_key_values is not None:
            if cache is not None:
                raise ValueError("pass either cache or past_key_values (its old name), not both")
            cache = past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        # position_ids (which generate passes) are not read: a token's position is its place in its
        # row's stream, which the cache carries (and padding is skipped, see attention_mask).
        if output_attentions:
            raise ValueError("output_attentions is not supported by MegalodonForCausalLM (no attention weights are "
                             "formed: the attention is fused)")
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        if inputs_embeds is not None:
            D = self.config.model_dim
            if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point \
                    or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != D:
                raise ValueError(f"inputs_embeds must be a floating tensor (batch, length, {D}), got "
                                 f"{type(inputs_embeds).__name__} {tuple(getattr(inputs_embeds, 'shape', ()))}")
            # placeholder ids: the embedding's output is replaced by inputs_embeds (see _hooks)
            input_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        elif not _is_integer_tensor(input_ids) or input_ids.dim() != 2:
            raise TypeError(f"input_ids must be an integer tensor (batch, length), got {type(input_ids).__name__} "
                            f"{tuple(getattr(input_ids, 'shape', ()))}")
        if cache is not None and not isinstance(cache, MegalodonHFCache):
            raise TypeError(f"cache must be a MegalodonHFCache (model.new_cache(batch_size) or the cache a previous "
                            f"call returned), got {type(cache).__name__}")
        for name, value in (("labels", labels), ("shift_labels", shift_labels)):
            if value is not None and (not _is_integer_tensor(value) or value.shape != input_ids.shape):
                raise ValueError(f"{name} must be an integer tensor of the input's shape {tuple(input_ids.shape)}, "
                                 f"got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
        with_loss = labels is not None or shift_labels is not None
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if use_cache is None:  # a cache serves generation: not made for training or a loss
            use_cache = bool(self.config.use_cache) and not self.training and not with_loss
        if cache is None and use_cache:
            cache = self.new_cache(input_ids.shape[0])
        mask = None if attention_mask is None else self._packing_mask(attention_mask, input_ids, cache)
        state = None if cache is None else cache.state
        embeds = inputs_embeds
        if mask is None:
            tokens, cu = input_ids, None
        else:
            tokens = input_ids[mask][None]
            cu = F.pad(mask.sum(1).cumsum(0), (1, 0))
            embeds = None if embeds is None else embeds[mask][None]

        core = self._megalodon
        loss = logits = None
        hidden = {} if output_hidden_states else None
        with self._hooks(embeds, hidden):
            if with_loss:
                if shift_labels is not None:
                    targets = shift_labels  # aligned already: the target of position i
                    if mask is not None:
                        targets = targets[mask][None]
                else:
                    # transformers' convention: labels align with input_ids, the model shifts.
                    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
                    if mask is not None:
                        has_next = F.pad(mask[:, 1:], (0, 1), value=False)
                        targets = targets.masked_fill(~has_next, -100)[mask][None]
                loss = core(tokens, cache=state, cu_seqlens=cu, labels=targets, ignore_index=-100)
                if num_items_in_batch is not None:
                    n_valid = (targets != -100).sum()
                    loss = loss * n_valid.to(loss.dtype) / torch.as_tensor(num_items_in_batch, dtype=loss.dtype,
                                                                            device=loss.device)
            else:
                logits = self._logits(core, tokens, state, cu, mask, self._kept_columns(logits_to_keep, input_ids))
        hidden_states = None
        if hidden is not None:
            n = len(self.layers)
            hidden_states = tuple(self._unpacked(hidden[k], mask, input_ids.shape)
                                  for k in ("in", *range(n - 1), "final"))

        out_cache = cache if use_cache or cache is not None else None
        if not return_dict:
            out = tuple(v for v in (logits, out_cache, hidden_states) if v is not None)
            return ((loss,) + out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden_states, **{CACHE_ARG: out_cache})

    @staticmethod
    def _unpacked(h: torch.Tensor, mask: Optional[torch.Tensor], shape) -> torch.Tensor:
        """A hidden state r(B L D): as it is, or from the packed row (zeros at padded positions)."""
        if h.dim() == 2:  # the one-token step: (B, D)
            h = h[:, None]
        if mask is None:
            return h
        out = h.new_zeros(*shape, h.shape[-1])
        out[mask] = h[0]
        return out

    @staticmethod
    def _kept_columns(logits_to_keep, input_ids):
        """None (every position) or an index (slice or 1-D tensor) of the positions to keep."""
        if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool):
            if logits_to_keep < 0:
                raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
            if logits_to_keep == 0 or logits_to_keep >= input_ids.shape[1]:
                return None
            return slice(input_ids.shape[1] - logits_to_keep, None)
        if _is_integer_tensor(logits_to_keep) and logits_to_keep.dim() == 1 and logits_to_keep.dtype != torch.bool:
            return logits_to_keep.to(input_ids.device)
        raise TypeError(f"logits_to_keep must be an int or a 1-D integer tensor of positions, "
                        f"got {type(logits_to_keep).__name__}")

    def _logits(self, core, tokens, state, cu, mask, cols):
        if mask is None:
            select = cols
        else:
            # position of each real token of the (B, L) grid in the packed row
            pos = (mask.flatten().cumsum(0) - 1).view(mask.shape)
            kept, valid = (pos, mask) if cols is None else (pos[:, cols], mask[:, cols])
            select = kept[valid]
        if select is None:
            logits = core(tokens, cache=state, cu_seqlens=cu)
        else:
            # The head is the last op of Megalodon.forward: feeding it only the kept positions skips
            # the other positions' logits entirely (for a long prompt, L x V floats).
            def keep_rows(module, args):
                return (args[0][:, select],) + tuple(args[1:])

            handle = self.output.output.register_forward_pre_hook(keep_rows)
            try:
                logits = core(tokens, cache=state, cu_seqlens=cu)
            finally:
                handle.remove()
        if mask is None:
            return logits
        out = logits.new_zeros(*valid.shape, logits.shape[-1])
        out[valid] = logits[0]
        return out


AutoConfig.register("megalodon", MegalodonHFConfig, exist_ok=True)
AutoModelForCausalLM.register(MegalodonHFConfig, MegalodonForCausalLM, exist_ok=True)
