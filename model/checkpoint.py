"""Loading upstream Megalodon consolidated checkpoints, strictly.

Upstream reloads with ``load_state_dict(strict=False)``, so a renamed or missing key silently
leaves a layer at its random init. Here every key must match by name and shape;
otherwise one :class:`CheckpointMismatchError` lists every missing key, unexpected key and shape
mismatch at once, with hints for the usual causes (a config flag that adds or removes a
parameter, a wrapper prefix such as ``module.``, a different preset).
"""
from __future__ import annotations

import glob
import os
from typing import Mapping, Union

import torch

from .config import MegalodonConfig

__all__ = ["CheckpointMismatchError", "read_state_dict", "check_state_dict", "load_upstream"]

Source = Union[str, os.PathLike, Mapping]

# A parameter that exists only under a config flag -> the flag (for hints).
_FLAG_KEYS = {
    "nffn.fc3.weight": "swiglu",
    "nffn.alpha": "rescale_nffn",
    "mega.rmsnorm.weight": "norm_affine",
    "nffn.norm.weight": "norm_affine",
    "nffn.norm.bias": "norm_affine",
}


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not match the model; the message lists all of them."""

    def __init__(self, message, missing=(), unexpected=(), mismatched=(), other=()):
        super().__init__(message)
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.mismatched, self.other = list(mismatched), list(other)


def read_state_dict(source: Source) -> dict:
    """A state dict from a mapping, a ``.pth`` file, or an upstream checkpoint directory."""
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        file = os.path.join(path, "consolidated.pth")
        if not os.path.exists(file):
            shards = sorted(glob.glob(os.path.join(path, "consolidated.*.pth")))
            if shards:
                raise ValueError(f"{path} holds {len(shards)} model-parallel shards "
                                 f"({os.path.basename(shards[0])}, ...); "
                                 "only model-parallel size 1 checkpoints (consolidated.pth) are supported: "
                                 "re-consolidate with model_parallel_size=1")
            raise FileNotFoundError(f"no consolidated.pth in {path}")
        path = file
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, Mapping):
        raise TypeError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    # Unwrap {"model": state_dict} style containers.
    if not any(isinstance(v, torch.Tensor) for v in sd.values()):
        for key in ("model", "state_dict", "module"):
            if isinstance(sd.get(key), Mapping):
                return dict(sd[key])
    return dict(sd)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else f"<{type(t).__name__}>"


def _strip_suffix(key: str) -> str:
    parts = key.split(".")
    # "layers.3.nffn.fc3.weight" -> "nffn.fc3.weight"; "output.final_norm.weight" stays
    if parts[0] == "layers" and len(parts) > 2:
        return ".".join(parts[2:])
    return key


def _hints(cfg: MegalodonConfig, missing, unexpected, mismatched) -> list:
    hints = []
    # A flag-dependent key on either side means the checkpoint used the other value of that flag.
    flags = sorted({_FLAG_KEYS[_strip_suffix(k)] for k in [*missing, *unexpected] if _strip_suffix(k) in _FLAG_KEYS})
    for flag in flags:
        hints.append(f"the checkpoint was probably made with {flag}={not getattr(cfg, flag)} "
                     f"(this model has {flag}={getattr(cfg, flag)})")
    if unexpected and missing:
        for prefix in ("module.", "model.", "_orig_mod.", "_fsdp_wrapped_module."):
            stripped = {k[len(prefix):] for k in unexpected if k.startswith(prefix)}
            if stripped and stripped & set(missing):
                hints.append(f"checkpoint keys carry a {prefix!r} prefix: strip it before loading")
    layer_ids = {int(k.split(".")[1]) for k in unexpected if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if layer_ids and max(layer_ids) >= cfg.num_layers:
        hints.append(f"the checkpoint has {max(layer_ids) + 1} layers, the config num_layers={cfg.num_layers}")
    if mismatched:
        hints.append("shape mismatches mean the config differs from the checkpoint's (compare model_dim, "
                     "z_dim, value_dim, num_heads, ffn_hidden_dim, cema_ndim, norm_num_groups, vocab_size "
                     "with its config.json)")
    return hints


def check_state_dict(model, state_dict: Mapping) -> tuple:
    """(state_dict ready to load, missing, unexpected, mismatched, other problems) for ``model``."""
    cfg: MegalodonConfig = model.config
    sd = dict(state_dict)
    expected = model.state_dict()
    other = []
    tied = "output.output.weight"
    if cfg.share_emb and "embed.weight" in sd:
        if tied not in sd:
            sd[tied] = sd["embed.weight"]  # the tied alias may be stored once
        elif isinstance(sd[tied], torch.Tensor) and sd[tied].shape == sd["embed.weight"].shape \
                and not torch.equal(sd[tied], sd["embed.weight"]):
            other.append(f"share_emb=True but {tied} differs from embed.weight in the checkpoint "
                         "(it was probably trained with share_emb=False)")
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    mismatched = [(k, sd[k], expected[k]) for k in expected if k in sd and
                  (not isinstance(sd[k], torch.Tensor) or sd[k].shape != expected[k].shape)]
    freqs = sd.get("rope.freqs")
    if isinstance(freqs, torch.Tensor) and freqs.shape == expected["rope.freqs"].shape:
        want = model.rope.expected_freqs()
        got = freqs.detach().to(torch.float64).cpu()
        if not torch.allclose(got, want.to(torch.float64), rtol=1e-2, atol=0.0):
            guess = ""
            if got.numel() > 1 and 0 < float(got[1]) < 1:
                guess = f" (they look like rope_base={float(got[1]) ** (-model.rope.dim / 2.0):.6g})"
            other.append(f"rope.freqs does not match rope_base={model.rope.base}{guess}; "
                         "set rope_base in the config to the checkpoint's value")
    return sd, missing, unexpected, mismatched, other


def load_upstream(model, source: Source) -> None:
    """Load an upstream consolidated state dict into ``model`` with strict name and shape checks.

    ``source``: a state dict, a ``.pth`` file, or a directory with ``consolidated.pth``. Values
    are cast to the model's parameter dtypes. Raises :class:`CheckpointMismatchError` listing
    every missing/unexpected key and shape mismatch (nothing is loaded in that case).
    """
    sd, missing, unexpected, mismatched, other = check_state_dict(model, read_state_dict(source))
    if missing or unexpected or mismatched or other:
        lines = [f"upstream checkpoint does not match the model: {len(missing)} missing, {len(unexpected)} "
                 f"unexpected, {len(mismatched)} shape mismatch(es), {len(other)} other problem(s)"]
        if missing:
            lines.append("  missing keys (in the model, not in the checkpoint):")
            exp = model.state_dict()
            lines += [f"    {k}  expected shape {_shape(exp[k])}" for k in missing]
        if unexpected:
            lines.append("  unexpected keys (in the checkpoint, not in the model):")
            lines += [f"    {k}  shape {_shape(sd[k])}" for k in unexpected]
        if mismatched:
            lines.append("  shape mismatches:")
            lines += [f"    {k}: checkpoint {_shape(a)} vs model {_shape(b)}" for k, a, b in mismatched]
        if other:
            lines.append("  other problems:")
            lines += [f"    {m}" for m in other]
        hints = _hints(model.config, missing, unexpected, mismatched)
        if hints:
            lines.append("  hints:")
            lines += [f"    {h}" for h in hints]
        raise CheckpointMismatchError("\n".join(lines), missing, unexpected, [k for k, _, _ in mismatched], other)
    model.load_state_dict(sd, strict=True)
