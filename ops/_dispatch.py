"""Backend selection for every op (docs/design.md, "Backends and dispatch").

Each op owns an :class:`OpBackends` naming the modules that implement it, one per backend
(``ops/<op>/torch_impl.py``, ``triton_impl.py``, ``cuda_impl.py``, ``cpu_impl.py``). A backend
module provides, with the same names and signatures in every backend of the op:

* ``not_supported_reasons(**inputs) -> list[str]``: empty when it can run these inputs, else one
  sentence per obstacle, each with a hint how to fix it;
* ``CONFIG_SPACE: dict`` (knob -> allowed values, the first the default; the op registers it
  with the autotune registry) and ``DEFAULT_CONFIG`` (the first values);
* ``forward(...)`` and ``backward(...)``, which take the knobs as keyword arguments.

``backend="auto"`` resolves as: explicit argument > ``MEGALODON_KERNELS_BACKEND`` > autotune
table entry for (op, device, dtype, key) > on a CUDA device, the supported backend the GPU runs
measured fastest nearest these inputs (autotune/gpu_defaults.py, from the committed
autotune/gpu_defaults.json; nothing for a device class or op never measured) > first supported
backend in :data:`PRIORITY`. ``auto``
never picks Triton for CPU tensors: that is the interpreter (``TRITON_INTERPRET=1``), which runs
only when asked for by name. The choice is logged once per (op, backend, device type, dtype, key)
at INFO level on the ``megalodon_kernels`` logger.

``select`` runs inside each op's torch.library custom op (``ops/_library.py``), when the op
runs, never while torch.compile or torch.export trace it: it reads the environment, the autotune
tables and its cache, none of which a graph could hold. The backward op selects again from the
same inputs and gets the same (cached) choice.

The cache: a resolved :class:`Choice` is kept per op (at most :data:`MAX_CHOICES`, oldest
dropped first), so that a repeated call costs building a key and one dictionary lookup. The key
holds everything the choice was resolved from: the backend argument, ``MEGALODON_KERNELS_BACKEND``
(for ``auto``), the autotune user cache dir, device, dtype, the device's capability profile
(cuda/device.py) and the :func:`signature` of the inputs. All entries are dropped when the
autotune tables are re-read or the registrations change (``autotune.cache.version``); an entry
is not used when its backend module was swapped (:meth:`OpBackends.use`) or the module's
``DEFAULT_CONFIG`` was changed in place. While the tuner forces a candidate
(``autotune.registry.force``) the cache is neither read nor written. So a backend's reasons must
depend on the inputs, its module and its DEFAULT_CONFIG only, and on settings fixed for the
process (``TRITON_INTERPRET``, whether the CUDA runtime is available).
"""
from __future__ import annotations

import importlib
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch

from ..autotune import cache as autotune_cache
from ..autotune import gpu_defaults
from ..autotune import registry as autotune_registry
from ..cuda import device as cuda_device

logger = logging.getLogger("megalodon_kernels")

ENV_VAR = "MEGALODON_KERNELS_BACKEND"
#: Every backend name the library knows, in the order ``auto`` tries them. "cpu" (compiled C++
#: with OpenMP, built on first use) comes before "torch": where an op has it, it is the faster CPU
#: path, and it reports itself unsupported when no compiler is present.
PRIORITY = ("cuda", "triton", "cpu", "torch")
_BACKEND_ARGS = ("auto", *PRIORITY)
#: Resolved choices kept per op; the oldest is dropped beyond this (a model calls a few shapes).
MAX_CHOICES = 1024

#: (op, backend, device type, dtype, key) already logged; cleared when it reaches MAX_LOGGED
_logged: set = set()
MAX_LOGGED = 4096
_MISSING = object()


def env_reader(name: str):
    """A function returning environment variable ``name`` ("" when unset), for the per-call cache
    key of :meth:`OpBackends.select`. ``os.environ.get`` of an unset name raises and catches a
    KeyError inside (``os._Environ`` has no ``get`` of its own): ~1 us alone and 4-6 us between a
    backend's ATen calls on this CPU (bench/results/host_cost.md, round 3). The reader looks the
    encoded name up in ``os.environ``'s own mapping instead (the one every ``os.environ[...] = ``
    and ``del`` updates), while ``os.environ`` is still the object it was made for; elsewhere (a
    Python without that mapping, or a test that replaced ``os.environ``) it calls ``os.environ.get``."""
    env = os.environ
    data, encodekey, decodevalue = (getattr(env, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if type(data) is not dict or not callable(encodekey) or not callable(decodevalue):
        return lambda: os.environ.get(name, "")
    key = encodekey(name)

    def read() -> str:
        if os.environ is not env:
            return os.environ.get(name, "")
        value = data.get(key)
        return "" if value is None else decodevalue(value)
    return read


_READ_BACKEND_ENV = env_reader(ENV_VAR)
_READ_CACHE_ENV = env_reader(autotune_cache.ENV_CACHE)


@dataclass(frozen=True)
class Choice:
    """A resolved backend: its name, its implementation module and the knob values to use.
    Cached and shared between calls: read it, never modify it."""

    name: str
    module: ModuleType
    config: dict = field(default_factory=dict)


class NoBackendError(ValueError):
    """No backend can run the given inputs; the message lists every backend's reasons."""


def signature(inputs: dict) -> tuple:
    """What a backend's ``not_supported_reasons`` and the op's key function can read from
    ``inputs`` besides the call's device (part of the cache key on its own: the public functions
    refuse inputs on different devices): each tensor's shape, strides and dtype, each other
    value itself (with its type, so that True and 1 stay apart)."""
    return tuple([
        (name, value.shape, value.stride(), value.dtype) if isinstance(value, torch.Tensor)
        else (name, type(value), value)
        for name, value in inputs.items()
    ])


def _device_class(device: torch.device) -> str:
    """``sm_<major><minor>`` of a CUDA device (its capability profile: faked in tests)."""
    return f"sm_{cuda_device.caps(device).arch}"


def _default_config(module) -> dict:
    return getattr(module, "DEFAULT_CONFIG", {})


def check_backend(backend) -> str:
    """The public functions' check of the ``backend`` argument (the choice itself is made inside
    the custom op, see ``ops/_library.py``)."""
    if not isinstance(backend, str) or backend not in _BACKEND_ARGS:
        raise ValueError(f"backend must be one of {list(_BACKEND_ARGS)}, got {backend!r}")
    return backend


class OpBackends:
    def __init__(self, op: str, modules: dict[str, str]):
        unknown = set(modules) - set(PRIORITY)
        if unknown:
            raise ValueError(f"unknown backend names {sorted(unknown)} for op {op}")
        self.op = op
        # memo -> (choice, the chosen module's DEFAULT_CONFIG when it was resolved); see select
        self._choices: dict[tuple, tuple[Choice, dict]] = {}
        self._version = autotune_cache.version()
        self._declared = dict(modules)  # name -> import path of the op's own module
        self._modules = dict(modules)  # the same, or a description of a module swapped in (use)
        self._loaded: dict = {}  # name -> module, or the exception that kept it from loading

    def config_spaces(self) -> dict:
        """{backend: its module's CONFIG_SPACE}, in the order the op lists its backends: the op's
        autotune space (autotune/registry.py reads it on first use)."""
        return {name: importlib.import_module(path).CONFIG_SPACE for name, path in self._declared.items()}

    def _load(self, name: str) -> ModuleType | Exception:
        if name not in self._loaded:
            try:
                self._loaded[name] = importlib.import_module(self._modules[name])
            except Exception as exc:  # an optional dependency (triton, the extension) is absent
                self._loaded[name] = exc
        return self._loaded[name]

    @contextmanager
    def use(self, name: str, module, description: str | None = None):
        """Within this block, backend ``name`` is ``module`` (any object with the backend-module
        interface): how tests run an op's CUDA backend in the emulator or wrap a backend to record
        its calls. Cached choices made with the previous module are not used meanwhile, nor after."""
        if name not in PRIORITY:
            raise ValueError(f"unknown backend name {name!r}; one of {list(PRIORITY)}")
        # (dict, its previous entry) pairs: a dict is not hashable, so not a key of another dict
        saved = [(d, d.get(name, _MISSING)) for d in (self._modules, self._loaded)]
        self._modules[name] = description or f"(swapped in) {getattr(module, '__name__', type(module).__name__)}"
        self._loaded[name] = module
        try:
            yield module
        finally:
            for d, value in saved:
                if value is _MISSING:
                    d.pop(name, None)
                else:
                    d[name] = value

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
        """Resolve ``backend`` ("auto" or a name in PRIORITY) for these inputs (cached: see the
        module docstring)."""
        if type(backend) is not str or backend not in _BACKEND_ARGS:
            check_backend(backend)  # raises
        # the tuner's forced candidate, read only while the tuner forces one (most calls: never)
        tuning = autotune_registry.forced(self.op, inputs) if autotune_registry.forcing() else None
        if tuning is not None:  # the tuner is measuring one candidate: exactly that one
            name, config = tuning
            if self.reasons(name, inputs):
                raise self._error(inputs, f"{self.op}: backend {name!r} (forced by the tuner) cannot run these inputs:")
            return self._finish(name, "autotune override", device, dtype, config)
        env = _READ_BACKEND_ENV() if backend == "auto" else ""
        memo = (backend, env, _READ_CACHE_ENV(), device, dtype, cuda_device.generation(),
                signature(inputs))
        version = autotune_cache.version()
        if version != self._version:
            self._choices.clear()
            self._version = version
        try:
            cached = self._choices.get(memo)
        except TypeError:  # an unhashable input value: nothing to key a cache entry on
            return self._resolve(backend, env, inputs, device, dtype)
        if cached is not None:
            choice, config = cached
            # still the module the dispatcher holds (tests swap modules: use), with the same knobs
            if self._loaded.get(choice.name) is choice.module and config == _default_config(choice.module):
                return choice
        choice = self._resolve(backend, env, inputs, device, dtype)
        if len(self._choices) >= MAX_CHOICES:
            self._choices.pop(next(iter(self._choices), None), None)  # the oldest (another thread may race)
        self._choices[memo] = (choice, dict(_default_config(choice.module)))
        return choice

    def _resolve(self, backend: str, env: str, inputs: dict, device: torch.device, dtype: torch.dtype) -> Choice:
        source = "argument"
        if backend == "auto":
            forced = env.strip()
            if forced and forced != "auto":
                if forced not in PRIORITY:
                    raise ValueError(
                        f"environment variable {ENV_VAR} must be one of {list(_BACKEND_ARGS)}, got {forced!r}"
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
        if device.type == "cuda":  # no table entry: the order the GPU runs measured, where they did
            able = [name for name in PRIORITY if not self.reasons(name, inputs)]
            ranked = gpu_defaults.rank(self.op, _device_class(device), autotune_cache.dtype_name(dtype), inputs, able)
            if ranked:
                return self._finish(ranked[0], "measured GPU defaults (autotune/gpu_defaults.json)", device, dtype,
                                    None, key)
        for name in PRIORITY:
            if name == "triton" and device.type == "cpu":
                continue  # the Triton interpreter is a test vehicle, never a performance choice
            if not self.reasons(name, inputs):
                return self._finish(name, "priority list", device, dtype, None, key)
        raise self._error(inputs, f"{self.op}: no backend can run these inputs:")

    def _finish(self, name: str, source: str, device: torch.device, dtype: torch.dtype,
                config: dict | None = None, key: dict | None = None) -> Choice:
        mod = self._load(name)
        merged = dict(_default_config(mod))
        merged.update(config or {})
        key_text = autotune_registry.key_string(key) if key else ""
        log_key = (self.op, name, device.type, dtype, key_text)
        if log_key not in _logged:
            if len(_logged) >= MAX_LOGGED:
                _logged.clear()  # a process that meets this many keys hears of some choices twice
            _logged.add(log_key)
            logger.info("%s: using backend %r %s for %s/%s%s (chosen by %s)", self.op, name, merged or "",
                        device.type, dtype, f" key {key_text}" if key_text else "", source)
        return Choice(name, mod, merged)
