"""Convert between upstream Megalodon checkpoints and transformers directories, both ways.

Upstream: a directory with ``config.json`` (the training config, whose ``"model"`` entry is the
ModelConf, or the ModelConf itself) and ``consolidated.pth``. transformers: ``config.json``
(``model_type="megalodon"``) and ``model.safetensors`` (sharded with an index past 5 GB), loadable
with ``AutoModelForCausalLM.from_pretrained`` once :mod:`megalodon_kernels.model.hf` is imported.

The tensors are copied as they are (same names, same dtype, same bits): converting one way and
back gives the same state dict. The names and shapes are checked against the config first
(strictly, with :func:`~.checkpoint.load_upstream`'s error listing every problem), on the meta
device, so a 7B checkpoint is never instantiated. Command line::

    python -m megalodon_kernels.model.hf_convert to-hf UPSTREAM_DIR HF_DIR
    python -m megalodon_kernels.model.hf_convert to-upstream HF_DIR UPSTREAM_DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence, Union

import torch

from .checkpoint import check_state_dict, load_upstream, read_state_dict
from .config import MegalodonConfig
from .megalodon import Megalodon

__all__ = ["upstream_to_hf", "hf_to_upstream", "main"]

PathLike = Union[str, os.PathLike]
_TIED = "output.output.weight"
# Our config fields that change the network, with the value upstream's ModelConf implies.
_NOT_UPSTREAM = {"attn_fn": "softmax", "norm_prior_count": 0}


def _checked(cfg: MegalodonConfig, sd: dict) -> dict:
    """``sd`` in the model's key order with the tied head alias filled in, after a strict name /
    shape check against ``cfg``."""
    with torch.device("meta"):
        model = Megalodon(cfg)
    sd, missing, unexpected, mismatched, other = check_state_dict(model, sd)
    if missing or unexpected or mismatched or other:
        load_upstream(model, sd)  # raises CheckpointMismatchError listing every problem
    return {k: sd[k] for k in model.state_dict()}  # the model's (upstream's) key order


def _dtype_of(sd: dict) -> torch.dtype:
    """The floating dtype of the weights (embed.weight's)."""
    return sd["embed.weight"].dtype


def upstream_to_hf(src: PathLike, dst: PathLike, *, max_shard_size: Union[int, str] = "5GB",
                   **config_overrides) -> str:
    """Write the transformers directory ``dst`` for the upstream checkpoint directory ``src``.

    ``config_overrides`` set :class:`~.config.MegalodonConfig` fields or transformers' ones
    (e.g. ``eos_token_id=2``). Returns ``dst``.
    """
    from huggingface_hub import save_torch_state_dict

    from .hf import MegalodonHFConfig

    src, dst = os.fspath(src), os.fspath(dst)
    sd = read_state_dict(src)
    model_fields = {k: v for k, v in config_overrides.items() if k in MegalodonConfig.__dataclass_fields__}
    hf_fields = {k: v for k, v in config_overrides.items() if k not in model_fields}
    cfg = MegalodonConfig.from_upstream(src, **model_fields)
    if cfg.vocab_size == -1 and isinstance(sd.get("embed.weight"), torch.Tensor):
        cfg = cfg.replace(vocab_size=sd["embed.weight"].shape[0])  # old upstream configs leave it to the tokenizer
    sd = _checked(cfg, sd)
    hf_cfg = MegalodonHFConfig.from_model_config(cfg, **hf_fields)
    hf_cfg.dtype = _dtype_of(sd)
    hf_cfg.architectures = ["MegalodonForCausalLM"]
    os.makedirs(dst, exist_ok=True)
    hf_cfg.save_pretrained(dst)
    if cfg.share_emb:
        sd = {k: v for k, v in sd.items() if k != _TIED}  # one copy; transformers re-ties it
    save_torch_state_dict({k: v.contiguous() for k, v in sd.items()}, dst, max_shard_size=max_shard_size,
                          metadata={"format": "pt"})
    return dst


def _read_safetensors(src: str) -> dict:
    from safetensors.torch import load_file

    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fp:
            files = sorted(set(json.load(fp)["weight_map"].values()))
    elif os.path.exists(os.path.join(src, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {src}")
    sd = {}
    for f in files:
        sd.update(load_file(os.path.join(src, f)))
    return sd


def hf_to_upstream(src: PathLike, dst: PathLike) -> str:
    """Write the upstream checkpoint directory ``dst`` (``config.json`` with the ModelConf under
    ``"model"``, ``consolidated.pth``) for the transformers directory ``src``. Returns ``dst``.

    Runtime-only fields (``backend``, ``dropkey_p``) are not part of upstream's config and are
    dropped; a model upstream cannot represent (``attn_fn="laplace"``, ``norm_prior_count > 0``)
    is refused.
    """
    from .hf import MegalodonHFConfig

    src, dst = os.fspath(src), os.fspath(dst)
    hf_cfg = MegalodonHFConfig.from_pretrained(src)
    cfg = hf_cfg.to_model_config()
    for name, upstream_value in _NOT_UPSTREAM.items():
        if getattr(cfg, name) != upstream_value:
            raise ValueError(f"{src} has {name}={getattr(cfg, name)!r}, which upstream's ModelConf cannot express "
                             f"(upstream: {upstream_value!r}); such a model has no upstream checkpoint format")
    sd = _checked(cfg, _read_safetensors(src))
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as fp:
        json.dump({"model": cfg.to_upstream_dict()}, fp, indent=2)
    if cfg.share_emb:
        sd[_TIED] = sd["embed.weight"]  # upstream's state dict holds the tied alias under both names
    torch.save(sd, os.path.join(dst, "consolidated.pth"))
    return dst


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megalodon_kernels.model.hf_convert",
        description="Convert an upstream Megalodon checkpoint (config.json + consolidated.pth) into a transformers "
                    "directory (config.json + model.safetensors), or back. Tensors are copied bit for bit.")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="upstream checkpoint directory -> transformers directory")
    to_hf.add_argument("src", help="upstream directory (config.json + consolidated.pth)")
    to_hf.add_argument("dst", help="transformers directory to write")
    to_hf.add_argument("--eos-token-id", type=int, default=None, help="the tokenizer's end-of-sequence id")
    to_hf.add_argument("--bos-token-id", type=int, default=None, help="the tokenizer's beginning-of-sequence id")
    to_hf.add_argument("--pad-token-id", type=int, default=None, help="the tokenizer's padding id")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    to_up = sub.add_parser("to-upstream", help="transformers directory -> upstream checkpoint directory")
    to_up.add_argument("src", help="transformers directory (config.json + model.safetensors)")
    to_up.add_argument("dst", help="upstream directory to write")
    args = parser.parse_args(argv)
    try:
        if args.direction == "to-hf":
            ids = {k: getattr(args, k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")
                   if getattr(args, k) is not None}
            out = upstream_to_hf(args.src, args.dst, max_shard_size=args.max_shard_size, **ids)
        else:
            out = hf_to_upstream(args.src, args.dst)
    except (OSError, ValueError) as e:  # a missing file, a mismatched checkpoint: the message says which
        print(f"hf_convert {args.direction}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
