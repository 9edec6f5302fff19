"""MegalodonConfig: upstream ``ModelConf`` field names, plus our extras, plus the registered presets.

The first block of fields is upstream's ``ModelConf``, with the same names, types and
defaults, so the ``"model"`` section of an upstream ``config.json`` loads unchanged
(:meth:`MegalodonConfig.from_upstream`). The second block is ours; each has a default, so an
upstream config never needs them.

Presets (upstream's registered configs): ``mega200M``, ``mega1.3B``, ``mega1.3B_pg19``, ``mega7.1B``, ``mega7.3B``, and a
``tiny`` one for CPU tests and examples. ``vocab_size`` is -1 in the upstream presets (upstream sets
it from the tokenizer); pass it with ``get_config(name, vocab_size=...)``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["MegalodonConfig", "PRESETS", "get_config"]

_UPSTREAM_FIELDS = (
    "num_layers", "model_dim", "z_dim", "value_dim", "num_heads", "ffn_hidden_dim", "cema_ndim",
    "chunk_size", "efficient_attn", "init_mode", "vocab_size", "output_size", "norm_num_groups",
    "norm_affine", "norm_eps", "rope_base", "dropout", "hidden_dropout", "attention_dropout", "swiglu",
    "rescale_nffn", "scale_emb", "share_emb", "layerwise_ckpt",
)

_INIT_MODES = ("he", "bert", "gaussian", "xavier", "none")


@dataclass
class MegalodonConfig:
    # ---- upstream ModelConf (names, types and defaults as upstream) ----
    num_layers: int = 8
    model_dim: int = 1024
    z_dim: int = 256
    value_dim: int = 2048
    num_heads: int = 1
    ffn_hidden_dim: int = 2048
    cema_ndim: int = 16
    chunk_size: int = 2048
    #: Upstream's attention kernel choice (None = unfused, "swift"/"fused" = fused). Kept for
    #: config compatibility only: we always call ops.attention (see ``backend``).
    efficient_attn: Optional[str] = None
    init_mode: str = "he"
    vocab_size: int = -1
    #: Output vocabulary; -1 means vocab_size.
    output_size: int = -1
    norm_num_groups: int = 32
    norm_affine: bool = True
    norm_eps: float = 1e-5
    #: RoPE base; None means 10000.
    rope_base: Optional[float] = None
    dropout: float = 0.0
    hidden_dropout: float = 0.0
    #: Attention dropout, applied as DropKey (pre-softmax, unscaled), upstream's fused path.
    attention_dropout: float = 0.0
    swiglu: bool = False
    rescale_nffn: bool = False
    scale_emb: bool = False
    share_emb: bool = False
    #: Upstream's activation checkpointing switch; honoured with torch.utils.checkpoint.
    layerwise_ckpt: bool = False

    # ---- our extras (defaults keep upstream behaviour) ----
    #: Backend for every op ("auto", "torch", "triton", "cuda"), or a dict op name -> backend
    #: (missing ops use "auto").
    backend: Union[str, dict] = "auto"
    #: DropKey rate used in training; None means ``attention_dropout`` (upstream's fused path).
    dropkey_p: Optional[float] = None
    #: Attention function: "softmax" (Megalodon) or "laplace" (Mega).
    attn_fn: str = "softmax"
    #: Prior count of the TimestepNorms (upstream MEGA: 0, i.e. non-learnable zero priors).
    norm_prior_count: int = 0

    def __post_init__(self):
        for name in ("num_layers", "model_dim", "z_dim", "value_dim", "num_heads", "ffn_hidden_dim",
                     "cema_ndim", "chunk_size", "norm_num_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        # Upstream asserts z_dim % z_dim (a typo for num_heads); we check what was meant.
        if self.z_dim % self.num_heads:
            raise ValueError(f"z_dim ({self.z_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.value_dim % self.num_heads:
            raise ValueError(f"value_dim ({self.value_dim}) must be divisible by num_heads ({self.num_heads})")
        if (self.z_dim // self.num_heads) % 2:
            raise ValueError(f"z_dim / num_heads = {self.z_dim // self.num_heads} must be even (RoPE pairs)")
        if self.model_dim % self.norm_num_groups:
            raise ValueError(f"norm_num_groups ({self.norm_num_groups}) must divide model_dim ({self.model_dim})")
        for name in ("dropout", "hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        if self.dropkey_p is not None and not 0.0 <= self.dropkey_p < 1.0:
            raise ValueError(f"dropkey_p must be None or in [0, 1), got {self.dropkey_p!r}")
        if self.efficient_attn not in (None, "swift", "fused"):
            raise ValueError(f"efficient_attn must be None, 'swift' or 'fused', got {self.efficient_attn!r}")
        if self.init_mode not in _INIT_MODES:
            raise ValueError(f"init_mode must be one of {_INIT_MODES}, got {self.init_mode!r}")
        if self.attn_fn not in ("softmax", "laplace"):
            raise ValueError(f"attn_fn must be 'softmax' or 'laplace', got {self.attn_fn!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.norm_prior_count < 0:
            raise ValueError(f"norm_prior_count must be >= 0, got {self.norm_prior_count!r}")
        if not (isinstance(self.backend, str) or isinstance(self.backend, dict)):
            raise TypeError(f"backend must be a str or a dict op name -> str, got {type(self.backend).__name__}")

    # ---- derived sizes ----
    @property
    def z_head_dim(self) -> int:
        return self.z_dim // self.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.value_dim // self.num_heads

    @property
    def out_size(self) -> int:
        return self.vocab_size if self.output_size == -1 else self.output_size

    @property
    def rope_theta(self) -> float:
        return 10000.0 if self.rope_base is None else float(self.rope_base)

    @property
    def dropkey_rate(self) -> float:
        return self.attention_dropout if self.dropkey_p is None else self.dropkey_p

    def backend_for(self, op: str) -> str:
        if isinstance(self.backend, dict):
            return self.backend.get(op, "auto")
        return self.backend

    # ---- (de)serialisation ----
    def replace(self, **changes) -> "MegalodonConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_upstream_dict(self) -> dict:
        """Only upstream's ModelConf fields (what upstream's ``config.json["model"]`` holds)."""
        return {k: getattr(self, k) for k in _UPSTREAM_FIELDS}

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "MegalodonConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MegalodonConfig fields: {unknown}; known fields: {sorted(known)}")
        return cls(**{**d, **overrides})

    @classmethod
    def from_upstream(cls, source: Union[str, os.PathLike, dict], **overrides) -> "MegalodonConfig":
        """From upstream's ``config.json`` (a path to it, to its directory, or the loaded dict).

        Accepts the whole training config (whose ``"model"`` entry is the ModelConf) or the
        ModelConf dict itself. Upstream-only runtime flags that are not model fields
        (``custom_bwd``, ``loss_parallel``) are ignored; anything else unknown is an error.
        """
        if not isinstance(source, dict):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as fp:
                source = json.load(fp)
        d = dict(source.get("model", source)) if isinstance(source.get("model", None), dict) else dict(source)
        for runtime_only in ("custom_bwd", "loss_parallel"):
            d.pop(runtime_only, None)
        return cls.from_dict(d, **overrides)


def _preset(**kw) -> MegalodonConfig:
    return MegalodonConfig(**kw)


#: Upstream's registered ModelStore configs, plus ``tiny``.
PRESETS: dict[str, MegalodonConfig] = {
    "mega200M": _preset(num_layers=12, model_dim=1024, num_heads=1, z_dim=256, value_dim=2048,
                        ffn_hidden_dim=2560, chunk_size=2048, norm_num_groups=32),
    "mega1.3B": _preset(num_layers=24, model_dim=2048, num_heads=2, z_dim=512, value_dim=4096,
                        ffn_hidden_dim=4864, chunk_size=2048, norm_num_groups=64),
    "mega1.3B_pg19": _preset(num_layers=24, model_dim=2048, num_heads=2, z_dim=512, value_dim=4096,
                             ffn_hidden_dim=3584, chunk_size=2048, norm_num_groups=64, swiglu=True,
                             scale_emb=True, share_emb=True),
    "mega7.1B": _preset(num_layers=32, model_dim=4096, num_heads=4, z_dim=1024, value_dim=8192,
                        ffn_hidden_dim=11264, chunk_size=2048, norm_num_groups=64),
    "mega7.3B": _preset(num_layers=32, model_dim=4096, num_heads=4, z_dim=1024, value_dim=8192,
                        ffn_hidden_dim=8192, chunk_size=2048, norm_num_groups=64, swiglu=True),
    # CPU-sized: trains in minutes, every code path (multi-head, several chunks) still exercised.
    "tiny": _preset(num_layers=2, model_dim=64, num_heads=2, z_dim=32, value_dim=64, ffn_hidden_dim=128,
                    cema_ndim=8, chunk_size=16, norm_num_groups=8, vocab_size=256),
}


def get_config(name: str, **overrides) -> MegalodonConfig:
    """A copy of preset ``name`` with ``overrides`` applied, e.g. ``get_config("mega200M", vocab_size=32000)``."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
