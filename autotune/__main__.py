"""Command line: ``python -m megalodon_kernels.autotune regenerate|show|verify|clear``.

    regenerate --shapes cpu|a100|h100 [--ops OP ...] [--out DIR_OR_FILE] [--budget SECONDS]
        Tune every registered op (or the given ones) on the shape set, here, and merge the entries
        into this device's table (default: the user cache dir). GPU sets refuse to run without a
        GPU: a table is only valid for the device it was measured on.
    show [--table FILE]     print the tables this machine uses (or one file) and why others are not used;
                            entries not measured over today's candidates are marked STALE
    verify [--table FILE]   re-check every winner against the reference on this machine; a stale
                            entry is a problem too (``auto`` does not use it), exit status 1
    clear [--dir DIR]       delete the tables in the user cache dir (shipped tables are never touched)

Tuning layer: ``regenerate`` and ``verify`` import ``autotune.tuning``, inside the commands, so
that ``show`` and ``clear`` stay light. ``show`` and ``verify`` import the ops: whether an entry
is stale depends on the candidates the ops register today.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import torch

from . import cache, registry
from .device import describe, identity, versions
from .shapes import SHAPE_SETS


def _say(text: str) -> None:
    print(text, flush=True)


def _load_ops() -> None:
    """Import every op package: that runs their ``registry.register`` calls. An op that fails to
    import is reported and left out; the others are still tuned."""
    ops = importlib.import_module("megalodon_kernels.ops")
    for info in pkgutil.iter_modules(ops.__path__):
        if info.ispkg:
            try:
                importlib.import_module(f"megalodon_kernels.ops.{info.name}")
            except Exception as exc:
                _say(f"warning: cannot import op {info.name} ({type(exc).__name__}: {exc}); it is not tuned")


def _local_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.insert(0, torch.device("cuda", torch.cuda.current_device()))
    return devices


def _output_path(out: str | None, ident: dict) -> Path:
    if out is None:
        return cache.user_dir() / cache.table_name(ident)
    path = Path(out).expanduser()
    return path if path.suffix == ".json" else path / cache.table_name(ident)


def regenerate(args) -> int:
    from .tuning.tuner import tune_op  # the tuner pulls in NumPy and the harnesses; only needed here

    shape_set = SHAPE_SETS[args.shapes]
    if shape_set.device_type == "cuda":
        if not torch.cuda.is_available():
            _say(f"refusing to regenerate the {shape_set.name} table: it must be measured on a CUDA GPU "
                 f"({shape_set.note}), and this machine has none (torch {torch.__version__}, "
                 "torch.cuda.is_available() is False). Tables are only shipped for the device they were "
                 "measured on: run this command on that GPU, or use --shapes cpu here.")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        if shape_set.name.lower() not in name.lower():
            _say(f"note: measuring the {shape_set.name} shape set on {name}; the table is named after {name}")
    else:
        device = torch.device("cpu")
    _load_ops()
    ops = args.ops or [op for op in registry.registered() if shape_set.shapes(op)]
    for op in ops:
        if registry.get(op) is None:
            _say(f"op {op!r} is not registered for autotuning (registered: {registry.registered() or 'none'})")
            return 2
        if not shape_set.shapes(op):
            _say(f"the {shape_set.name} shape set has no shapes for op {op!r}")
            return 2
    if not ops:
        _say("no registered op has shapes in this set; nothing to tune")
        return 2
    ident = identity(device)
    path = _output_path(args.out, ident)
    vers = versions()
    dtypes = [getattr(torch, d) for d in (args.dtypes or shape_set.dtypes)]
    _say(f"tuning {', '.join(ops)} on {describe(ident)}, shape set {shape_set.name}, dtypes "
         f"{[cache.dtype_name(d) for d in dtypes]}, {args.budget:.2f} s per candidate -> {path}")
    for op in ops:
        entries = tune_op(op, shape_set.shapes(op), dtypes, device, budget_s=args.budget, progress=_say)
        cache.write_entries(path, ident, entries, vers)  # after every op, so an interrupted run keeps its work
        _say(f"[{op}] wrote {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} to {path}")
    _say(f"done; `python -m megalodon_kernels.autotune show --table {path}` prints it")
    return 0


def _fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _stale_entries(table: dict) -> dict[str, str]:
    """Entry id -> why it is stale, for the entries of ``table`` not measured over today's candidates."""
    device_type = str(table["device"].get("type"))
    found = ((eid, cache.staleness(entry, device_type)) for eid, entry in table["entries"].items())
    return {eid: why for eid, why in found if why is not None}


def _stale_summary(table: dict, stale: dict) -> None:
    if not stale:
        return
    ops = sorted({table["entries"][eid]["op"] for eid in stale})
    hint = cache.regenerate_hint(" ".join(ops), str(table["device"].get("type")))
    _say(f"  {len(stale)} of {len(table['entries'])} entries are STALE (not measured over today's candidates of "
         f"{', '.join(ops)}): `auto` ignores them and uses its default order. On this device, tune them again "
         f"with: {hint}")


def _print_table(path: Path, table: dict) -> None:
    _say(f"{path}\n  device {describe(table['device'])}; measured {table['date']}; versions "
         + ", ".join(f"{k} {v}" for k, v in sorted(table["versions"].items())))
    stale = _stale_entries(table)
    for eid, entry in sorted(table["entries"].items()):
        _say(f"  {eid}   (tuned on {' '.join(f'{k}={v}' for k, v in entry['shape'].items())})")
        if eid in stale:
            _say(f"    STALE, not used: {stale[eid]}")
        for c in entry["candidates"]:
            marks = ("W" if entry["winner"] and (c["backend"], c["config"]) == (entry["winner"]["backend"],
                     entry["winner"]["config"]) else " ") + ("d" if entry["default"] and (c["backend"], c["config"])
                     == (entry["default"]["backend"], entry["default"]["config"]) else " ")
            err = "-" if c["error"] is None else f"{c['error']:.1e}"
            extra = f" [{_fmt_ms(c['p20_s'])} .. {_fmt_ms(c['p80_s'])}]" if c["status"] == "ok" else ""
            note = f"  {c['note'][:100]}" if c["note"] else ""
            _say(f"    {marks} {c['backend']:<7} {str(c['config'] or '{}'):<36} {c['status']:<11} err {err:<8} "
                 f"median {_fmt_ms(c['median_s'])}{extra}{note}")
    _say("  (W = winner, d = the default `auto` uses without a table)")
    _stale_summary(table, stale)


def show(args) -> int:
    _load_ops()  # staleness is judged against the candidates the ops register today
    if args.table:
        try:
            table = cache.read_table(args.table)
        except cache.TableError as exc:
            _say(f"{args.table}: not a usable table: {exc}")
            return 1
        _print_table(Path(args.table), table)
        return 0
    found = False
    for device in _local_devices():
        ident = identity(device)
        _say(f"tables for {describe(ident)} (user dir {cache.user_dir()}, then shipped {cache.SHIPPED_DIR}):")
        for path, state, table in cache.tables_for(ident):
            found = True
            if state == "used":
                _print_table(path, table)
            else:
                _say(f"{path}\n  not used: {state}")
    if not found:
        _say("no tables found")
    return 0


def verify(args) -> int:
    _load_ops()
    if args.table:
        try:
            tables = [(Path(args.table), cache.read_table(args.table))]
        except cache.TableError as exc:
            _say(f"{args.table}: not a usable table: {exc}")
            return 1
    else:
        tables = [(p, t) for d in _local_devices() for p, state, t in cache.tables_for(identity(d)) if state == "used"]
    from .tuning.tuner import verify_entry

    failures = checked = stale_count = 0
    for path, table in tables:
        device = next((d for d in _local_devices() if identity(d) == table["device"]), None)
        if device is None:
            _say(f"{path}: measured on {describe(table['device'])}, which is not here; cannot verify")
            failures += 1
            continue
        _say(f"{path}:")
        stale = _stale_entries(table)
        for eid, entry in sorted(table["entries"].items()):
            checked += 1
            if eid in stale:  # `auto` passes over it, so its winner is not what runs: nothing to re-check
                stale_count += 1
                _say(f"  STALE {eid}: {stale[eid]}; not used by `auto`")
                continue
            ok, message = verify_entry(entry, device)
            failures += not ok
            _say(f"  {'ok  ' if ok else 'FAIL'} {eid}: {message}")
        _stale_summary(table, stale)
    _say(f"verified {checked} entr{'y' if checked == 1 else 'ies'}, {failures + stale_count} problem(s)"
         + (f" ({stale_count} stale)" if stale_count else ""))
    return 1 if failures or stale_count else 0


def clear(args) -> int:
    removed = cache.clear(args.dir)
    for path in removed:
        _say(f"removed {path}")
    _say(f"{len(removed)} file(s) removed from {Path(args.dir) if args.dir else cache.user_dir()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalodon_kernels.autotune",
                                     description="Tune, inspect and check megalodon_kernels' autotune tables.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("regenerate", help="tune the ops on a shape set and write this device's table")
    p.add_argument("--shapes", required=True, choices=sorted(SHAPE_SETS))
    p.add_argument("--ops", nargs="+", metavar="OP", help="ops to tune (default: every registered op)")
    p.add_argument("--out", help="directory or .json file (default: the user cache dir)")
    p.add_argument("--dtypes", nargs="+", choices=list(cache.DTYPES), help="default: the shape set's dtypes")
    p.add_argument("--budget", type=float, default=0.25, help="seconds of timing per candidate (default 0.25)")
    p.set_defaults(run=regenerate)
    p = sub.add_parser("show", help="print the tables in use here")
    p.add_argument("--table", help="print this file instead")
    p.set_defaults(run=show)
    p = sub.add_parser("verify", help="re-check every table winner against the reference here")
    p.add_argument("--table", help="verify this file instead")
    p.set_defaults(run=verify)
    p = sub.add_parser("clear", help="delete the tables in the user cache dir")
    p.add_argument("--dir", help="clear this directory instead")
    p.set_defaults(run=clear)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
