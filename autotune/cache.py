"""Autotune tables: JSON files, one per device; validated on load, merged and written atomically.

Runtime layer: :func:`lookup` runs under op calls (on a dispatcher's cache miss); imports no op
and nothing from ``autotune.tuning``.

A table (schema version :data:`SCHEMA_VERSION`)::

    {"schema": 1,
     "device": {"type": "cpu", "name": "Intel(R) Xeon(R) Processor", "cores": 2},
     "versions": {"megalodon_kernels": "0.1.0", "torch": "2.13.0", "triton": "3.9.0", "python": "3.11.7"},
     "date": "2025-01-01T00:00:00Z",
     "entries": {
       "rotary/float32/H=2,L=256,d=32": {
         "op": "rotary", "dtype": "float32", "key": {"H": 2, "L": 256, "d": 32},
         "shape": {...}, "check_shape": {...}, "seed": 0, "date": "...",
         "winner": {"backend": "torch", "config": {}},           # lowest p20; null when none was correct
         "default": {"backend": "torch", "config": {}},          # what "auto" picks without a table
         "candidate_set": {"space": {"torch": {}}, "versions": {},     # what it was measured over
                           "fingerprint": "9c1e04d2b7a3f0e1"},           # (see "Stale entries" below)
         "candidates": [{"backend": "torch", "config": {}, "status": "ok", "note": "",
                         "error": 3e-8, "tolerance": 5e-5,
                         "median_s": 4.1e-4, "p20_s": 4.0e-4, "p80_s": 4.3e-4, "reps": 50}]}}}

Where tables come from: every ``*.json`` in the user cache dir (``MEGALODON_KERNELS_CACHE``,
default ``~/.cache/megalodon_kernels``) and then in the shipped ``autotune/tables/``; an entry in
the user dir overrides the shipped one with the same (op, dtype, key). A table measured on another
device is ignored. A table that is not valid JSON, is truncated, has a wrong type anywhere, or
another schema version is skipped with ONE warning per file. Tables are data only: parsed with
``json`` (NaN/Infinity and duplicate names refused), never pickled or evaluated, and every config is
checked against the op's declared space when it is looked up (out of space: the entry is rejected).

Stale entries. An entry records the candidate set it was measured over (:func:`candidate_set`):
the op's declared space (backends, knobs, values, each knob's default) less the backends that
never run on the table's device type (Triton and cuda on CPU, cpu on CUDA), and the versions that
change what a candidate's measurement means there (Triton's major.minor on CUDA, where it
generates the Triton candidates' code; nothing on CPU). The library, torch and Python versions
are not part of it: a release that adds a backend or a knob changes the space, and a patch
release that does not must not throw away every table. An entry whose candidate set differs
from today's registration, or that records none (tables written before entries carried one), is
stale: :func:`lookup` passes over it (``auto`` then falls back to its default order), logging once
per (table, op) why and which command re-tunes it; ``show`` and ``verify`` flag it. Without this a
table tuned before an op gained its ``cpu`` backend would keep pinning ``torch`` forever. The
check is computed once per entry per table load and registration.

Writes merge into the existing file under an exclusive ``fcntl.flock`` on a lock file in the same
directory, and replace it atomically (temporary file in the same directory, then ``os.replace``),
so several processes tuning at once all land their entries and a reader never sees half a file.

A process reads the tables once, at its first lookup; :func:`refresh` (called after every write
and clear) makes it read them again. :func:`version` changes with every refresh and every
(re)registration, so a cache of lookups (the dispatcher's) knows when to forget them.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import tempfile
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

import torch

from . import registry
from .device import describe, identity

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, but concurrent writers may drop each other's entries
    fcntl = None

__all__ = [
    "SCHEMA_VERSION", "ENV_CACHE", "SHIPPED_DIR", "TableError", "AutotuneWarning", "user_dir", "search_dirs",
    "table_name", "entry_id", "dtype_name", "read_table", "validate", "lookup", "find_entry", "tables_for",
    "write_entries", "refresh", "clear", "utc_now", "version", "candidate_set", "staleness", "regenerate_hint",
    "NEVER_ON",
]

logger = logging.getLogger("megalodon_kernels")

SCHEMA_VERSION = 1
ENV_CACHE = "MEGALODON_KERNELS_CACHE"
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"
LOCK_NAME = ".megalodon_kernels.lock"
MAX_TABLE_BYTES = 16 << 20
STATUSES = ("ok", "wrong", "failed", "unsupported", "pruned")
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Versions whose change makes old measurements stale when merging (python is informational).
_STALE_IF_CHANGED = ("megalodon_kernels", "torch", "triton")


class TableError(ValueError):
    """A table file that cannot be used; the message says where and why."""


class AutotuneWarning(UserWarning):
    """An autotune table (or one of its entries) was skipped."""


def user_dir() -> Path:
    env = os.environ.get(ENV_CACHE, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megalodon_kernels"


def search_dirs() -> list[Path]:
    """Directories read by :func:`lookup`, highest priority first."""
    return [user_dir(), SHIPPED_DIR]


def table_name(ident: Mapping) -> str:
    """File name of a device's table, e.g. ``cpu-intel-r-xeon-r-processor-2c.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", str(ident["name"]).lower()).strip("-") or "device"
    if "capability" in ident:
        slug += "-sm" + str(ident["capability"]).replace(".", "")
    if "cores" in ident:
        slug += f"-{ident['cores']}c"
    return f"{ident['type']}-{slug}.json"


def dtype_name(dtype) -> str:
    """``torch.float32`` or ``"float32"`` -> ``"float32"``."""
    return dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


_DTYPE_NAMES = {getattr(torch, name): name for name in DTYPES}


def entry_id(op: str, dtype, key: Mapping) -> str:
    return f"{op}/{dtype_name(dtype)}/{registry.key_string(key)}"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the candidate set an entry was measured over -------------------------------------------------

@functools.lru_cache(maxsize=None)
def _triton_release() -> str | None:
    """Installed Triton's major.minor, read from the package metadata (importing Triton is slow and
    the runtime layer must not); None when it is not installed."""
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"):
        try:
            return ".".join(importlib.metadata.version(dist).split(".")[:2])
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # broken metadata: treat as unknown, which is a version of its own
            return "unknown"
    return None


def _order(value) -> tuple:
    return type(value).__name__, value


def _canonical_space(space: Mapping) -> dict:
    """backend -> knob -> [default, other values sorted]: the first value is what the tuner
    compares the others with (the backend's DEFAULT_CONFIG), the order of the rest means nothing."""
    return {backend: {name: [values[0], *sorted(values[1:], key=_order)] for name, values in knobs.items()}
            for backend, knobs in space.items()}


def _fingerprint(space: Mapping, versions: Mapping) -> str:
    text = json.dumps({"space": space, "versions": versions}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


#: Backends that never run on a device type, so they cannot change a measurement there: on CPU
#: tensors Triton is the interpreter (the tuner never times it, ``auto`` never picks it) and the
#: ``cuda`` backends need CUDA tensors; the compiled ``cpu`` backends need CPU tensors. Leaving them
#: out keeps a CPU table valid when a Triton config is added or pruned, and a GPU table when a
#: ``cpu`` knob changes.
NEVER_ON = {"cpu": ("cuda", "triton"), "cuda": ("cpu",)}


def candidate_set(space: Mapping, device_type: str) -> dict:
    """What an entry for an op with this declared ``space`` (``Tunable.space``) measured on a
    ``device_type`` device is measured over: ``{"space", "versions", "fingerprint"}``.

    ``space``: the declared space less the backends that never run on that device type
    (:data:`NEVER_ON`). ``versions`` holds only what changes the candidates' code on that device
    without changing the space: Triton's major.minor on CUDA when the op has Triton candidates (a
    Triton release changes register allocation and spilling, so the fastest config can change).
    The compiled ``cpu`` backends are built from the library's own sources: a release that changes
    what they can be tuned over changes the space."""
    never = NEVER_ON.get(device_type, ())
    canon = _canonical_space({b: knobs for b, knobs in space.items() if b not in never})
    versions = {}
    if device_type == "cuda" and "triton" in canon:
        versions["triton"] = _triton_release()
    return {"space": canon, "versions": versions, "fingerprint": _fingerprint(canon, versions)}


def _space_changes(old: Mapping, new: Mapping) -> list[str]:
    """What differs between two canonical spaces, in words (for the log, ``show`` and ``verify``)."""
    out = []
    for backend in sorted(set(old) | set(new)):
        if backend not in old:
            out.append(f"backend {backend} added")
            continue
        if backend not in new:
            out.append(f"backend {backend} removed")
            continue
        for name in sorted(set(old[backend]) | set(new[backend])):
            was, now = old[backend].get(name), new[backend].get(name)
            if was is None or now is None:
                out.append(f"{backend} knob {name} {'added' if was is None else 'removed'}")
                continue
            added = [v for v in now if not any(registry.same_value(v, w) for w in was)]
            dropped = [v for v in was if not any(registry.same_value(v, w) for w in now)]
            if added:
                out.append(f"{backend} {name} values {added} added")
            if dropped:
                out.append(f"{backend} {name} values {dropped} removed")
            if not registry.same_value(was[0], now[0]):
                out.append(f"{backend} {name} default {was[0]!r} -> {now[0]!r}")
    return out


def regenerate_hint(op: str, device_type: str) -> str:
    """The command that re-tunes ``op`` into the user's table (which overrides a shipped one)."""
    shapes = "cpu" if device_type == "cpu" else "h100 (or a100)"
    return f"python -m megalodon_kernels.autotune regenerate --shapes {shapes} --ops {op}"


def staleness(entry: Mapping, device_type: str, tunable=None) -> str | None:
    """Why ``entry`` (of a table for a ``device_type`` device) was not measured over today's
    candidates of its op, or None when it was. ``tunable``: the op's registration (default: the
    registry's); an op that is not registered has no candidates today, so its entries are stale."""
    tunable = tunable if tunable is not None else registry.get(entry["op"])
    if tunable is None:
        return f"op {entry['op']} is not registered for autotuning in this version"
    recorded = entry.get("candidate_set")
    if recorded is None:
        return "no candidate set recorded (an older table: it may predate the op's backends and knobs)"
    today = _today(tunable, device_type)
    if recorded["fingerprint"] == today["fingerprint"]:
        return None
    changes = _space_changes(recorded["space"], today["space"])
    for name in sorted(set(recorded["versions"]) | set(today["versions"])):
        was, now = recorded["versions"].get(name), today["versions"].get(name)
        if was != now:
            changes.append(f"{name} {was} -> {now}")
    return "measured over another candidate set than today's: " + ("; ".join(changes) or "the set changed")


_today_memo: dict[tuple, tuple] = {}  # (op, device type) -> (registration, its candidate set)


def _today(tunable, device_type: str) -> dict:
    memo = _today_memo.get((tunable.op, device_type))
    if memo is None or memo[0] is not tunable:  # registered again: another space, perhaps
        memo = (tunable, candidate_set(tunable.space, device_type))
        _today_memo[(tunable.op, device_type)] = memo
    return memo[1]


# --- validation: every field, every type; the message names the path --------------------------

def _fail(where: str, what: str, got) -> None:
    text = repr(got)
    raise TableError(f"{where}: expected {what}, got {text[:80]}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_dict(where: str, value, required: dict, optional: dict = ()) -> None:
    """``required``/``optional`` map field name -> checker(where, value)."""
    if not isinstance(value, dict):
        _fail(where, "an object", value)
    optional = dict(optional)
    missing = set(required) - set(value)
    if missing:
        raise TableError(f"{where}: missing field(s) {sorted(missing)}")
    extra = set(value) - set(required) - set(optional)
    if extra:
        raise TableError(f"{where}: unknown field(s) {sorted(extra)}")
    for name, check in {**required, **optional}.items():
        if name in value:
            check(f"{where}.{name}", value[name])


def _str(where, v):
    if not isinstance(v, str):
        _fail(where, "a string", v)


def _opt_str(where, v):
    if v is not None:
        _str(where, v)


def _int(where, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _fail(where, "a non-negative integer", v)


def _opt_number(where, v):
    if v is not None and (not _is_number(v) or v < 0):
        _fail(where, "null or a finite number >= 0", v)


def _scalars(where, v):
    if not isinstance(v, dict):
        _fail(where, "an object of scalars", v)
    for k, x in v.items():
        if not registry.is_scalar(x) or (isinstance(x, float) and not math.isfinite(x)):
            _fail(f"{where}.{k}", "an int, float, string or bool", x)


def _device(where, v):
    _scalars(where, v)
    for name in ("type", "name"):
        if not isinstance(v.get(name), str):
            _fail(f"{where}.{name}", "a string", v.get(name))


def _choice(where, v):
    if v is not None:
        _check_dict(where, v, {"backend": _str, "config": _scalars})


def _status(where, v):
    if v not in STATUSES:
        _fail(where, f"one of {list(STATUSES)}", v)


def _candidate(where, v):
    _check_dict(where, v, {
        "backend": _str, "config": _scalars, "status": _status, "note": _str, "error": _opt_number,
        "tolerance": _opt_number, "median_s": _opt_number, "p20_s": _opt_number, "p80_s": _opt_number,
        "reps": _int,
    })
    times = [v["p20_s"], v["median_s"], v["p80_s"]]
    if v["status"] == "ok":
        if None in times or v["error"] is None or v["tolerance"] is None:
            raise TableError(f"{where}: a correct candidate needs its error, tolerance and times")
        if not times[0] <= times[1] <= times[2]:
            raise TableError(f"{where}: expected p20_s <= median_s <= p80_s, got {times}")
        if v["error"] > v["tolerance"]:
            raise TableError(f"{where}: status ok but error {v['error']} > tolerance {v['tolerance']}")


def _candidates(where, v):
    if not isinstance(v, list) or not v:
        _fail(where, "a non-empty list", v)
    for i, c in enumerate(v):
        _candidate(f"{where}[{i}]", c)


def _space(where, v):
    if not isinstance(v, dict):
        _fail(where, "an object backend -> {knob: [values]}", v)
    for backend, knobs in v.items():
        if not isinstance(knobs, dict):
            _fail(f"{where}.{backend}", "an object knob -> [values]", knobs)
        for name, values in knobs.items():
            if not isinstance(values, list) or not values or not all(
                    registry.is_scalar(x) and not (isinstance(x, float) and not math.isfinite(x)) for x in values):
                _fail(f"{where}.{backend}.{name}", "a non-empty list of int/float/str/bool", values)


def _candidate_set(where, v):
    """An entry's recorded candidate set; its fingerprint must be that of its space and versions
    (a hand-edited set whose fingerprint still says "today" would otherwise pass as fresh)."""
    _check_dict(where, v, {"space": _space, "versions": _versions, "fingerprint": _str})
    if v["fingerprint"] != _fingerprint(v["space"], v["versions"]):
        raise TableError(f"{where}.fingerprint: {v['fingerprint']!r} is not the fingerprint of its space and "
                         f"versions ({_fingerprint(v['space'], v['versions'])!r})")


def _entry(where, eid, v):
    _check_dict(where, v, {
        "op": _str, "dtype": _str, "key": _scalars, "shape": _scalars, "check_shape": _scalars, "seed": _int,
        "date": _str, "winner": _choice, "default": _choice, "candidates": _candidates,
    }, {"candidate_set": _candidate_set})
    if v["dtype"] not in DTYPES:
        _fail(f"{where}.dtype", f"one of {list(DTYPES)}", v["dtype"])
    try:
        registry.check_key(v["op"], v["key"])
    except TypeError as exc:
        raise TableError(f"{where}.key: {exc}") from None
    if entry_id(v["op"], v["dtype"], v["key"]) != eid:
        raise TableError(f"{where}: the entry's op/dtype/key say {entry_id(v['op'], v['dtype'], v['key'])!r}")
    for role in ("winner", "default"):
        choice = v[role]
        if choice is not None and not any(
            c["backend"] == choice["backend"] and _same_config(c["config"], choice["config"])
            and (role == "default" or c["status"] == "ok") for c in v["candidates"]
        ):
            raise TableError(f"{where}.{role}: not among the {'correct ' if role == 'winner' else ''}candidates")


def _same_config(a: Mapping, b: Mapping) -> bool:
    return set(a) == set(b) and all(registry.same_value(a[k], b[k]) for k in a)


def _versions(where, v):
    if not isinstance(v, dict):
        _fail(where, "an object", v)
    for k, x in v.items():
        _opt_str(f"{where}.{k}", x)


def _entries(where, v):
    if not isinstance(v, dict):
        _fail(where, "an object", v)
    for eid, entry in v.items():
        _entry(f"{where}[{eid!r}]", eid, entry)


def validate(table) -> None:
    """Raise :class:`TableError` unless ``table`` is a complete, well-typed table of this schema."""
    if not isinstance(table, dict):
        _fail("table", "an object", table)
    if table.get("schema") != SCHEMA_VERSION or isinstance(table.get("schema"), bool):
        _fail("schema", f"schema version {SCHEMA_VERSION}", table.get("schema"))
    _check_dict("table", table, {
        "schema": lambda w, v: None, "device": _device, "versions": _versions, "date": _str, "entries": _entries,
    })


def _refuse_constant(name):
    raise ValueError(f"{name} is not allowed in a table")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate name {k!r}")
        out[k] = v
    return out


def read_table(path) -> dict:
    """Parse and validate one table file; :class:`TableError` says why it cannot be used."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_TABLE_BYTES:
            raise TableError(f"{size} bytes, more than the {MAX_TABLE_BYTES} a table may have")
        text = path.read_bytes().decode("utf-8")
        table = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except TableError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TableError(f"not a readable JSON table ({type(exc).__name__}: {exc})") from None
    validate(table)
    return table


# --- reading: which entries apply to this device ------------------------------------------------

_parsed: dict[str, tuple[tuple, dict | None, str]] = {}  # path -> (stat signature, table, error)
_warned: set = set()
_index: dict[tuple, dict[str, list[tuple[dict, str]]]] = {}
_rejected: dict[tuple, list[str]] = {}  # (path, entry id, registration) -> space problems, checked once
_refreshes = 0


def refresh() -> None:
    """Forget what was read; the next lookup reads the table files again."""
    global _refreshes
    _index.clear()
    _rejected.clear()
    _stale.clear()
    _refreshes += 1


def version() -> tuple[int, int]:
    """Changes whenever :func:`lookup` may answer differently for the same arguments: after a
    :func:`refresh` (every write and clear calls it) or a change of the registrations. The user
    cache dir setting is not in it: lookups are keyed on it (``MEGALODON_KERNELS_CACHE``)."""
    return _refreshes, registry.version()


def _warn_once(tag, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, AutotuneWarning, stacklevel=3)


def _load(path: Path) -> tuple[dict | None, str]:
    """(table, "") or (None, reason); parsed once per file version, warned once per file version."""
    try:
        st = path.stat()
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError as exc:
        return None, f"cannot stat: {exc}"
    cached = _parsed.get(str(path))
    if cached is None or cached[0] != sig:
        try:
            cached = (sig, read_table(path), "")
        except TableError as exc:
            cached = (sig, None, str(exc))
        _parsed[str(path)] = cached
    if cached[1] is None:
        _warn_once((str(path), sig), f"megalodon_kernels autotune: skipping table {path}: {cached[2]}")
    return cached[1], cached[2]


def _table_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.suffix == ".json" and p.is_file())
    except OSError:
        return []


def tables_for(ident: Mapping, dirs=None) -> list[tuple[Path, str, dict | None]]:
    """Every table file in the search dirs with its state for this device: ``"used"``,
    ``"other device"`` or ``"invalid: <reason>"`` (for ``show``)."""
    out = []
    for directory in dirs if dirs is not None else search_dirs():
        for path in _table_files(Path(directory)):
            table, why = _load(path)
            if table is None:
                out.append((path, f"invalid: {why}", None))
            elif table["device"] != dict(ident):
                out.append((path, f"other device ({describe(table['device'])})", table))
            else:
                out.append((path, "used", table))
    return out


def _entries_for(device) -> dict[str, list[tuple[dict, str]]]:
    """Entry id -> [(entry, file)], highest priority first, for a torch.device or an identity dict.
    Memoised on what decides it (device, cache dir setting, shipped dir): this is on every op call."""
    if isinstance(device, torch.device):
        where = (device.type, device.index)
    elif isinstance(device, Mapping):
        where = tuple(sorted(device.items()))
    else:
        device = torch.device(device)
        where = (device.type, device.index)
    memo = (where, os.environ.get(ENV_CACHE, ""), SHIPPED_DIR)
    index = _index.get(memo)
    if index is None:
        index = {}
        ident = identity(device) if isinstance(device, torch.device) else device
        for path, state, table in tables_for(ident, search_dirs()):
            if state != "used":
                logger.debug("autotune: not using %s (%s)", path, state)
                continue
            for eid, entry in table["entries"].items():
                index.setdefault(eid, []).append((entry, str(path)))
        _index[memo] = index
    return index


def _space_problems(tunable, entry: dict, path: str, eid: str) -> list[str]:
    memo = (path, eid, id(tunable))
    if memo not in _rejected:
        problems = []
        for c in entry["candidates"]:
            if c["status"] == "ok":
                problems += tunable.config_problems(c["backend"], c["config"])
        _rejected[memo] = problems
        if problems:
            _warn_once(("entry", path, eid, entry["date"]),
                       f"megalodon_kernels autotune: rejecting entry {eid} of {path}: " + "; ".join(problems))
    return _rejected[memo]


_stale: dict[tuple, tuple] = {}  # (path, entry id, device type) -> (registration, why stale or None)
_stale_logged: set = set()


def _is_stale(tunable, entry: dict, path: str, eid: str, device_type: str) -> bool:
    """Whether lookups must pass over this entry (see "Stale entries" above); decided once per
    entry per table load and registration, logged once per (table, op, today's candidate set)."""
    memo = (path, eid, device_type)
    cached = _stale.get(memo)
    if cached is None or cached[0] is not tunable:
        cached = (tunable, staleness(entry, device_type, tunable))
        _stale[memo] = cached
        tag = (path, tunable.op, _today(tunable, device_type)["fingerprint"])
        if cached[1] is not None and tag not in _stale_logged:
            _stale_logged.add(tag)
            # The user's own table: they can act on it (warning). A shipped table for this machine
            # predates this release's candidates: the default order is what they get (info).
            shipped = Path(path).parent == Path(SHIPPED_DIR)
            logger.log(logging.INFO if shipped else logging.WARNING,
                       "autotune: ignoring %s's entries in %s that were not measured over today's candidates "
                       "(%s: %s); `auto` uses its default order for them. To tune them again: %s",
                       tunable.op, path, eid, cached[1], regenerate_hint(tunable.op, device_type))
    return cached[1] is not None


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, Mapping):
        return str(device.get("type"))
    return torch.device(device).type


def find_entry(op: str, device, dtype, key: Mapping) -> tuple[dict, str] | None:
    """The highest-priority acceptable entry for (op, device, dtype, key) and its file, or None.
    Acceptable: every correct candidate's config is in today's space and the entry is not stale."""
    tunable = registry.get(op)
    if tunable is None:
        return None
    eid = entry_id(op, dtype, key)
    found = _entries_for(device).get(eid, ())
    if not found:
        return None
    device_type = _device_type(device)
    for entry, path in found:
        if not _space_problems(tunable, entry, path, eid) and not _is_stale(tunable, entry, path, eid, device_type):
            return entry, path
    return None


def lookup(op: str, device, dtype, key: Mapping, backend: str | None = None) -> tuple[str, dict] | None:
    """What the dispatcher asks: the table's (backend, config) for these inputs, or None.

    ``device``: a torch.device (or its identity dict); ``dtype``: torch dtype or its name; ``key``:
    the op's key function applied to the inputs. With ``backend`` given (the user forced one): the
    winner's config if the winner is that backend, else None (the backend runs its DEFAULT_CONFIG;
    the tuner only established that the winner beats the default, nothing about the runners-up).
    """
    found = find_entry(op, device, dtype, key)
    if found is None or found[0]["winner"] is None:
        return None
    winner = found[0]["winner"]
    if backend is not None and winner["backend"] != backend:
        return None
    return winner["backend"], dict(winner["config"])


# --- writing --------------------------------------------------------------------------------------

@contextmanager
def _locked(directory: Path):
    """Exclusive lock shared by every process writing tables in ``directory``."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _atomic_write(path: Path, table: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_entries(path, ident: Mapping, entries: Mapping[str, dict], versions: Mapping) -> dict:
    """Merge ``entries`` (entry id -> entry) into the table at ``path`` and return the new table.

    Same device required (a table holds one device's measurements). Entries measured with another
    library/torch/triton version are dropped on merge: a table describes one software stack. An
    unreadable existing file is replaced, with a warning.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ident, versions = dict(ident), dict(versions)
    with _locked(path.parent):
        old = None
        if path.exists():
            try:
                old = read_table(path)
            except TableError as exc:
                warnings.warn(f"megalodon_kernels autotune: replacing unreadable table {path}: {exc}",
                              AutotuneWarning, stacklevel=2)
        if old is not None and old["device"] != ident:
            raise TableError(f"{path} holds measurements of {describe(old['device'])}, not of "
                             f"{describe(ident)}; write this device's table to another file")
        merged = {}
        if old is not None:
            if all(old["versions"].get(k) == versions.get(k) for k in _STALE_IF_CHANGED):
                merged.update(old["entries"])
            else:
                logger.info("autotune: %s was measured with %s; dropping its entries", path, old["versions"])
        merged.update(entries)
        table = {"schema": SCHEMA_VERSION, "device": ident, "versions": versions, "date": utc_now(),
                 "entries": merged}
        validate(table)
        _atomic_write(path, table)
    refresh()
    return table


def clear(directory=None) -> list[Path]:
    """Delete the table files (and the lock file) in ``directory`` (default: the user cache dir).
    Never touches the shipped tables unless asked for that directory explicitly."""
    directory = Path(directory) if directory is not None else user_dir()
    removed = []
    for path in [*_table_files(directory), directory / LOCK_NAME]:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    refresh()
    return removed
