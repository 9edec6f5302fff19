"""Backend selection for every op (DESIGN.md section 3).

Each op owns an :class:`OpBackends` naming the modules that implement it, one per backend
(``ops/<op>/torch_impl.py``, later ``triton_impl.py`` and ``cuda_impl.py``). A backend module
provides:

* ``not_supported_reasons(**inputs) -> list[str]``: empty when it can run these inputs, else one
  sentence per obstacle, each with a hint how to fix it;
* ``DEFAULT_CONFIG: dict``: its tuning knobs (the autotune registry enumerates alternatives);
* the op's ``fwd``/``bwd`` functions, with the same signature in every backend;
* optionally ``AUTO_PRIORITY = False``: the priority list skips it (a backend that is correct but
  known to be slow, e.g. Triton kernels that spill registers); it still runs when named, forced by
  the environment variable or chosen by a tuned table entry.

``backend="auto"`` resolves as: explicit argument > ``MEGALODON_KERNELS_BACKEND`` > autotune
table entry for (op, device, dtype, key) > first supported backend in :data:`PRIORITY`. ``auto``
never picks Triton for CPU tensors: that is the interpreter (``TRITON_INTERPRET=1``), which runs
only when asked for by name. The choice is
logged once per (op, backend, device type, dtype) at INFO level on the ``megalodon_kernels``
logger.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from types import ModuleType

import torch

from ..autotune import cache as autotune_cache
from ..autotune import registry as autotune_registry

logger = logging.getLogger("megalodon_kernels")

ENV_VAR = "MEGALODON_KERNELS_BACKEND"
#: Every backend name the library knows, in the order ``auto`` tries them.
PRIORITY = ("cuda", "triton", "torch")

_logged: set = set()


@dataclass(frozen=True)
class Choice:
    """A resolved backend: its name, its implementation module and the knob values to use."""

    name: str
    module: ModuleType
    config: dict = field(default_factory=dict)


class NoBackendError(ValueError):
    """No backend can run the given inputs; the message lists every backend's reasons."""


class OpBackends:
    def __init__(self, op: str, modules: dict[str, str]):
        unknown = set(modules) - set(PRIORITY)
        if unknown:
            raise ValueError(f"unknown backend names {sorted(unknown)} for op {op}")
        self.op = op
        self._modules = dict(modules)
        self._loaded: dict[str, ModuleType | Exception] = {}

    def _load(self, name: str) -> ModuleType | Exception:
        if name not in self._loaded:
            try:
                self._loaded[name] = importlib.import_module(self._modules[name])
            except Exception as exc:  # an optional dependency (triton, the extension) is absent
                self._loaded[name] = exc
        return self._loaded[name]

    def reasons(self, name: str, inputs: dict) -> list[str]:
        """Why backend ``name`` cannot run ``inputs`` (empty list: it can)."""
        if name not in self._modules:
            return [f"no {name} implementation of {self.op} exists in this version"]
        mod = self._load(name)
        if isinstance(mod, Exception):
            return [f"cannot import {self._modules[name]}: {type(mod).__name__}: {mod}"]
        return list(mod.not_supported_reasons(**inputs))

    def all_reasons(self, inputs: dict) -> dict[str, list[str]]:
        return {name: self.reasons(name, inputs) for name in PRIORITY}

    def _error(self, inputs: dict, head: str) -> NoBackendError:
        reasons = self.all_reasons(inputs)
        lines = [head]
        for name, why in reasons.items():
            lines.append(f"  {name}: " + ("supported" if not why else "; ".join(why)))
        err = NoBackendError("\n".join(lines))
        err.reasons = reasons  # per backend, for callers that report them (python -m megalodon_kernels)
        return err

    def select(self, backend: str, inputs: dict, *, device: torch.device, dtype: torch.dtype) -> Choice:
        """Resolve ``backend`` ("auto" or a name in PRIORITY) for these inputs."""
        if not isinstance(backend, str) or backend not in ("auto", *PRIORITY):
            raise ValueError(f"backend must be one of {['auto', *PRIORITY]}, got {backend!r}")
        tuning = autotune_registry.forced(self.op, inputs)
        if tuning is not None:  # the tuner is measuring one candidate: exactly that one
            name, config = tuning
            if self.reasons(name, inputs):
                raise self._error(inputs, f"{self.op}: backend {name!r} (forced by the tuner) cannot run these inputs:")
            return self._finish(name, "autotune override", device, dtype, config)
        source = "argument"
        if backend == "auto":
            forced = os.environ.get(ENV_VAR, "").strip()
            if forced and forced != "auto":
                if forced not in PRIORITY:
                    raise ValueError(
                        f"environment variable {ENV_VAR} must be one of {['auto', *PRIORITY]}, got {forced!r}"
                    )
                backend, source = forced, ENV_VAR
        # The autotune key: feature sizes and length buckets from the op's registration.
        tunable = autotune_registry.get(self.op)
        key = tunable.key(inputs) if tunable is not None else None
        if backend != "auto":
            why = self.reasons(backend, inputs)
            if why:
                raise self._error(inputs, f"{self.op}: backend {backend!r} (from {source}) cannot run these inputs:")
            # A named backend still runs its best tuned config for this key, if the table has one.
            hit = autotune_cache.lookup(self.op, device, dtype, key, backend=backend) if key else None
            return self._finish(backend, source, device, dtype, hit[1] if hit else None, key)
        if key is not None:
            hit = autotune_cache.lookup(self.op, device, dtype, key)
            if hit is not None and not self.reasons(hit[0], inputs):
                return self._finish(hit[0], "autotune table", device, dtype, hit[1], key)
        for name in PRIORITY:
            if name == "triton" and device.type == "cpu":
                continue  # the Triton interpreter is a test vehicle, never a performance choice
            if getattr(self._load(name), "AUTO_PRIORITY", True) is False:
                continue  # a backend that is correct but known slow: named, env or tuned use only
            if not self.reasons(name, inputs):
                return self._finish(name, "priority list", device, dtype, None, key)
        raise self._error(inputs, f"{self.op}: no backend can run these inputs:")

    def _finish(self, name: str, source: str, device: torch.device, dtype: torch.dtype,
                config: dict | None = None, key: dict | None = None) -> Choice:
        mod = self._load(name)
        merged = dict(getattr(mod, "DEFAULT_CONFIG", {}))
        merged.update(config or {})
        key_text = autotune_registry.key_string(key) if key else ""
        log_key = (self.op, name, device.type, dtype, key_text)
        if log_key not in _logged:
            _logged.add(log_key)
            logger.info("%s: using backend %r %s for %s/%s%s (chosen by %s)", self.op, name, merged or "",
                        device.type, dtype, f" key {key_text}" if key_text else "", source)
        return Choice(name, mod, merged)
