"""Megalodon model layer: blocks and a causal LM composed from ``megalodon_kernels.ops``.

Follows upstream Megalodon (docs/math.md, model) with the upstream state_dict names, so upstream
consolidated checkpoints load strictly; adds exact streaming inference through a constant-size
cache, and construction without CUDA or torch.distributed.

Example::

    from megalodon_kernels.model import Megalodon, get_config

    model = Megalodon(get_config("tiny"))
    logits = model(tokens)                         # (B, L, V), any L
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])  # mean cross-entropy, logits never formed
    cache = model.init_cache(batch_size=tokens.shape[0])
    for piece in tokens.split(7, dim=1):           # any split gives the same logits
        step_logits = model(piece, cache=cache)
    out = model.generate(prompt, 32, top_k=20, temperature=0.8)
    outs = model.generate([prompt_a, prompt_b], 32)  # ragged prompts: outs[b] as if alone (docs/serving.md)

    tokens, cu = pack([doc_a, doc_b, doc_c])       # one row (1, T), boundaries (4,)
    logits = model(tokens, cu_seqlens=cu)          # == each document run on its own
"""
from .cache import LayerState, MegalodonCache
from .checkpoint import CheckpointMismatchError, check_state_dict, load_upstream, read_state_dict
from .config import PRESETS, MegalodonConfig, get_config
from .decode import StaticDecoder, decode_step
from .layers import (ComplexEMA, LayerNorm, MegalodonAttention, MegalodonBlock, NormalizedFFN, RMSNorm,
                     TimestepNorm)
from .loss import linear_cross_entropy
from .megalodon import Megalodon, OutputLayer, RotaryEmbedding, sample_next
from .packing import pack, segment_ids_to_cu_seqlens

#: ``from_upstream(checkpoint_dir, **config_overrides)``: a Megalodon built and loaded from an upstream checkpoint
from_upstream = Megalodon.from_upstream

__all__ = [
    "MegalodonConfig", "PRESETS", "get_config",
    "ComplexEMA", "TimestepNorm", "RMSNorm", "LayerNorm", "MegalodonAttention", "NormalizedFFN", "MegalodonBlock",
    "Megalodon", "RotaryEmbedding", "OutputLayer", "sample_next", "linear_cross_entropy",
    "MegalodonCache", "LayerState", "StaticDecoder", "decode_step",
    "pack", "segment_ids_to_cu_seqlens",
    "CheckpointMismatchError", "load_upstream", "from_upstream", "read_state_dict", "check_state_dict",
]
