"""What can be tuned: per op, a key function over its inputs and a declared config space.

Runtime layer: imported by every op and consulted by the dispatcher on every call; imports only
the standard library (no op, nothing from ``autotune.tuning``).

An op registers itself once, at import, in its ``__init__.py``::

    registry.register(
        "rotary",
        key=lambda x: {"H": x.shape[2], "d": x.shape[3], "L": registry.pow2_bucket(x.shape[1])},
        space=BACKENDS.config_spaces,  # backend -> knob -> allowed values, read on first use
    )

* The key function receives the same ``inputs`` dict the op passes to its dispatcher (and to each
  backend's ``not_supported_reasons``) and returns a flat dict of feature sizes and power-of-two
  buckets of lengths. Never the raw batch size or the raw length: every new length would be a new
  key and so a miss (FLA users saw 50-100x slowdowns from re-tuning per length).
* The space lists, per backend, every knob with its allowed values; the FIRST value of each knob is
  the backend's ``DEFAULT_CONFIG`` value. Each backend module declares its own ``CONFIG_SPACE``;
  the op hands the registry a function that collects them (``OpBackends.config_spaces``). Candidates are the product of the knobs. A table entry
  whose config is outside this space is rejected (tables are data, not trusted code).
* The harness (how to build a test case for a shape, run it forward and backward, and compute the
  float64 reference) imports the op and its reference, so it lives in the tuning layer, in
  ``megalodon_kernels.autotune.tuning.harness.<op>``, where the tuner finds it by the op's name.
  Tests may register a :class:`Harness` object instead (``harness=``), which the tuner then uses.

:func:`force` is how the tuner makes the dispatcher use one particular candidate: the dispatcher
calls :func:`forced` (with its inputs) first and, if it returns a choice, uses it.

:func:`version` changes whenever a registration does, so that what was derived from the
registrations (the dispatcher's cached choices) can tell it is stale.
"""
from __future__ import annotations

import itertools
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "Case", "Part", "Harness", "Tunable", "register", "unregister", "get", "registered", "pow2_bucket",
    "key_string", "force", "forced", "is_scalar", "version",
]

_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


def is_scalar(v) -> bool:
    """A JSON scalar allowed in keys and configs: int, float, str or bool (not None)."""
    return isinstance(v, (bool, int, float, str))


def same_value(a, b) -> bool:
    """Equality that does not confuse True with 1 or 1 with 1.0 (a table must match the space exactly)."""
    return type(a) is type(b) and a == b


def pow2_bucket(n: int) -> int:
    """Smallest power of two >= n: lengths 2049..4096 all share the key 4096. An empty input
    (n = 0, e.g. an empty streaming segment) is its own bucket, 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"pow2_bucket needs a non-negative int, got {n!r}")
    return 1 << (n - 1).bit_length() if n else 0


def key_string(key: Mapping[str, Any]) -> str:
    """Canonical, readable text of a key: ``"H=2,L=256,d=32"`` (sorted names)."""
    return ",".join(f"{k}={_scalar_text(v)}" for k, v in sorted(key.items()))


def _scalar_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


_GOOD_NAMES: set = set()  # key-name tuples already validated (check_key runs on every op call)


def check_key(op: str, key) -> dict:
    """Validate what a key function returned; raise TypeError naming the op otherwise."""
    if type(key) is not dict and not isinstance(key, Mapping) or not key:
        raise TypeError(f"key function of {op} must return a non-empty dict, got {key!r}")
    names = tuple(key)
    if names not in _GOOD_NAMES:
        for k in names:
            if not isinstance(k, str) or not _NAME.match(k):
                raise TypeError(f"key function of {op}: names must match {_NAME.pattern}, got {k!r}")
        _GOOD_NAMES.add(names)
    for k, v in key.items():
        kind = type(v)
        if kind is not int and kind is not bool and (kind is not str or not _NAME.match(v)):
            raise TypeError(f"key function of {op}: {k} must be an int, bool or short name, got {v!r}")
    return dict(key)


@dataclass
class Case:
    """One tuning problem: ``inputs`` is what the op hands its dispatcher (the key function sees it);
    ``data`` is anything else ``run`` and ``reference`` need (positions, upstream gradients...);
    ``dtype`` is the dtype the op dispatches on when it is not the one asked for (cema_kernel
    dispatches on p's float32 even in a bfloat16 model), so the entry lands where lookups look."""

    inputs: dict
    data: dict = field(default_factory=dict)
    dtype: Any = None


@dataclass(frozen=True)
class Part:
    """A reference for part of an output only: ``value`` is expected at ``output[index]`` (a NumPy
    index). For ops whose output rows are independent (attention chunks, fftconv channels) this
    keeps a float64 reference affordable at GPU sizes without changing the key being checked."""

    index: Any
    value: Any


@dataclass(frozen=True)
class Harness:
    """How the tuner exercises an op.

    * ``make_case(shape: dict, dtype: torch.dtype, device: torch.device, seed: int) -> Case``
    * ``run(case, backend: str, config: dict) -> dict[str, Tensor]``: forward AND backward through
      the public op called with ``backend=backend`` (the tuner wraps the call in :func:`force`, so
      the dispatcher applies ``config``); the returned outputs and gradients are what is compared
      and what is timed.
    * ``reference(case) -> dict[str, numpy.ndarray | Part]``: float64 expected values, same names
      (a :class:`Part` checks only part of that output).
    * ``tolerance``: dtype name -> allowed max|err| / max|ref| over every output.
    * ``check_shape(shape) -> shape``: a cheaper shape with the SAME key used for the correctness
      check (e.g. batch 1), so a float64 reference stays affordable at GPU sizes. Default: same.
    * ``prune(backend, config, shape, dtype_name, device_identity) -> list[str]``: reasons a
      candidate cannot work on the target (does not compile, shared memory does not fit), decided
      ahead of time. Default: none.
    """

    make_case: Callable[..., Case]
    run: Callable[..., Mapping]
    reference: Callable[..., Mapping]
    tolerance: Mapping[str, float]
    check_shape: Callable[[dict], dict] | None = None
    prune: Callable[..., list] | None = None


@dataclass(frozen=True)
class Tunable:
    """A registered op: its key function, config space and, for tests, a harness object (None:
    the tuner uses the op's module in ``autotune.tuning.harness``)."""

    op: str
    key_fn: Callable[..., Mapping]
    space: Mapping[str, Mapping[str, tuple]]
    harness: Harness | None = None

    def key(self, inputs: Mapping) -> dict:
        return check_key(self.op, self.key_fn(**inputs))

    def candidates(self) -> list[tuple[str, dict]]:
        """Every (backend, config) in the space, backends in declaration order."""
        out = []
        for backend, knobs in self.space.items():
            names = list(knobs)
            for values in itertools.product(*(knobs[n] for n in names)):
                out.append((backend, dict(zip(names, values))))
        return out

    def default_config(self, backend: str) -> dict:
        """The first value of every knob: by convention the backend module's DEFAULT_CONFIG."""
        return {name: values[0] for name, values in self.space[backend].items()}

    def config_problems(self, backend, config) -> list[str]:
        """Why (backend, config) is not in the declared space; empty when it is."""
        if backend not in self.space:
            return [f"backend {backend!r} is not declared for {self.op} (declared: {sorted(self.space)})"]
        knobs = self.space[backend]
        if not isinstance(config, Mapping):
            return [f"config must be a dict, got {type(config).__name__}"]
        problems = []
        if set(config) != set(knobs):
            problems.append(f"{self.op}/{backend} config has knobs {sorted(config)}, expected {sorted(knobs)}")
        for name, value in config.items():
            allowed = knobs.get(name)
            if allowed is not None and not any(same_value(value, a) for a in allowed):
                problems.append(f"{self.op}/{backend} knob {name}={value!r} is not one of {list(allowed)}")
        return problems


_OPS: dict[str, Tunable] = {}
_version = 0  # bumped by every register/unregister


def version() -> int:
    """A number that changes whenever an op is registered, re-registered or unregistered."""
    return _version


def _changed() -> None:
    global _version
    _version += 1


def _check_space(op: str, space) -> dict:
    if not isinstance(space, Mapping) or not space:
        raise TypeError(f"space of {op} must be a non-empty dict backend -> {{knob: [values]}}")
    out = {}
    for backend, knobs in space.items():
        if not isinstance(backend, str) or not _NAME.match(backend) or not isinstance(knobs, Mapping):
            raise TypeError(f"space of {op}: {backend!r} must be a backend name mapping to a dict of knobs")
        checked = {}
        for name, values in knobs.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise TypeError(f"space of {op}/{backend}: knob names must match {_NAME.pattern}, got {name!r}")
            values = tuple(values)
            if not values or not all(is_scalar(v) for v in values):
                raise TypeError(f"space of {op}/{backend}: {name} needs a non-empty list of int/float/str/bool")
            if len({(type(v), v) for v in values}) != len(values):
                raise ValueError(f"space of {op}/{backend}: {name} lists a value twice: {list(values)}")
            checked[name] = values
        out[backend] = checked
    return out


class _DeclaredLater(Mapping):
    """A space given as a function (the op's ``OpBackends.config_spaces``: each backend module's
    ``CONFIG_SPACE``), called and checked on first read, so that registering an op at import
    imports none of its backend modules (Triton's, say)."""

    def __init__(self, op: str, source: Callable[[], Mapping]):
        self._op, self._source, self._space = op, source, None

    def _resolved(self) -> dict:
        if self._space is None:
            self._space = _check_space(self._op, self._source())
        return self._space

    def __getitem__(self, backend):
        return self._resolved()[backend]

    def __iter__(self):
        return iter(self._resolved())

    def __len__(self):
        return len(self._resolved())

    def __repr__(self):
        return repr(self._resolved())


def register(op: str, *, key: Callable[..., Mapping], space: Mapping | Callable[[], Mapping],
             harness: Harness | None = None, replace: bool = False) -> Tunable:
    """Declare ``op`` tunable (see the module docstring). ``space``: the space, or a function
    returning it, called on first use. Registering an op twice is an error unless
    ``replace=True``. ``harness``: a :class:`Harness` object to tune with instead of the op's
    harness module (tests tune fake ops this way)."""
    if not isinstance(op, str) or not _NAME.match(op):
        raise TypeError(f"op name must match {_NAME.pattern}, got {op!r}")
    if not callable(key):
        raise TypeError(f"key of {op} must be callable")
    if harness is not None and not isinstance(harness, Harness):
        raise TypeError(f"harness of {op} must be a Harness or None, got {type(harness).__name__}")
    if op in _OPS and not replace:
        raise ValueError(f"op {op} is already registered for autotuning")
    declared = _DeclaredLater(op, space) if callable(space) else _check_space(op, space)
    _OPS[op] = Tunable(op, key, declared, harness)
    _changed()
    return _OPS[op]


def unregister(op: str) -> None:
    if _OPS.pop(op, None) is not None:
        _changed()


def get(op: str) -> Tunable | None:
    return _OPS.get(op)


def registered() -> list[str]:
    return sorted(_OPS)


# --- the tuner's override ----------------------------------------------------------------------

@dataclass
class _Forced:
    op: str
    backend: str
    config: dict
    used: bool = False
    keys: list = field(default_factory=list)  # keys of the inputs the dispatcher saw


_FORCED: ContextVar[_Forced | None] = ContextVar("megalodon_kernels_autotune_forced", default=None)


@contextmanager
def force(op: str, backend: str, config: Mapping):
    """Within this block, the dispatcher of ``op`` uses exactly (backend, config); yields a record
    whose ``keys`` lists the key of every input set the dispatcher saw (the tuner compares them
    with the key it tunes, so a harness cannot drift from what the op really dispatches on).

    If ``config`` is non-empty and the dispatcher never asked (:func:`forced`), leaving the block
    raises: the tuner would otherwise time the default config under another config's name.
    """
    state = _Forced(op, backend, dict(config))
    token = _FORCED.set(state)
    try:
        yield state
    finally:
        _FORCED.reset(token)
    if state.config and not state.used:
        raise RuntimeError(
            f"the dispatcher of {op} never consulted megalodon_kernels.autotune.registry.forced(), so the "
            f"config {state.config} was not applied; see autotune/registry.py for the dispatcher hook"
        )


def forcing() -> bool:
    """Whether the tuner forces a candidate in this context right now (the dispatcher's cheap test
    before it calls :func:`forced`; outside the tuner it is False)."""
    return _FORCED.get() is not None


def forced(op: str, inputs: Mapping | None = None) -> tuple[str, dict] | None:
    """For the dispatcher: the (backend, config) the tuner forces for ``op`` right now, if any.
    Pass the op's dispatch ``inputs`` so the tuner can check they have the key it is tuning."""
    state = _FORCED.get()
    if state is None or state.op != op:
        return None
    state.used = True
    if inputs is not None and op in _OPS:
        state.keys.append(_OPS[op].key(inputs))
    return state.backend, dict(state.config)
