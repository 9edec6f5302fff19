"""The tuner: every candidate is checked against the float64 reference BEFORE it is timed.

For one (op, shape, dtype) the tuner

1. builds the case (and a cheaper check case with the same key, if the harness asks for one) and
   computes the reference once;
2. for every (backend, config) of the op's space: skips it if the harness prunes it ahead of time
   (does not compile / does not fit shared memory on the target), runs it forward and backward on
   the check case and measures the norm-wise error of every output and gradient
   (max|out - ref| / max|ref|); a candidate that raises is recorded as ``unsupported`` (no backend
   can take the inputs) or ``failed``, one above tolerance as ``wrong``, and neither is timed;
3. times the correct ones forward+backward on the full case, ``time.perf_counter`` on CPU and CUDA
   events on GPU: one warm-up round, then rounds in which every remaining candidate runs once, in
   rotating order, until each had its time budget (at least ``MIN_REPS`` rounds). Interleaving
   spreads a burst of load from other processes over all candidates instead of penalising
   whichever one was running; a candidate whose fastest run is already ``CUTOFF`` x slower than the
   best p20 stops being timed. Reports median, p20, p80 per candidate;
4. picks the correct candidate with the lowest p20 (interference only ever adds time, so the low
   quantile is the most faithful estimate of a candidate's own cost). It records the ``default``
   too: the first backend in the dispatcher's priority list that can run the case, with the first
   value of every knob (its DEFAULT_CONFIG). The default stays the winner unless the fastest
   candidate is significantly faster (one-sided Mann-Whitney U test on the timing samples, p < 0.01;
   with 5 samples each that means every run faster than every default run): on a noisy machine a
   table of measurement noise would only churn configs (seen here: two configs running identical
   code "differed" by 4x under load).

The entry records the candidate set it was measured over (``cache.candidate_set``: the op's
space and, on CUDA, Triton's release); once the registration offers other candidates, lookups
pass over the entry and ``show``/``verify`` call it stale.

Shapes whose key was already tuned in this run are not tuned again: a new batch size or a length
in the same power-of-two bucket is the same key.

Tuning layer: runs the ops through their harnesses (``tuning/harness/<op>.py``, found by the op's
name) and writes nothing itself; the command line merges the entries into a table.
"""
from __future__ import annotations

import gc
import importlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from .. import cache, registry
from ..device import identity

__all__ = ["Timing", "time_interleaved", "rel_error", "tune_shape", "tune_op", "verify_entry", "HarnessError",
           "DEFAULT_BUDGET_S", "harness_for"]

DEFAULT_BUDGET_S = 0.25
MIN_REPS, MAX_REPS = 5, 200
#: A candidate whose fastest run is CUTOFF x slower than the best p20 is not timed further.
CUTOFF = 3.0

#: Backends never timed on a device type, with the reason (mirrors the dispatcher, which never picks
#: them there): on CPU tensors Triton is the interpreter, a test vehicle.
NOT_TIMED = {("cpu", "triton"): "the Triton interpreter is a test vehicle on CPU, never a performance choice"}


@dataclass(frozen=True)
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    reps: int
    samples: tuple = ()

    @staticmethod
    def of(samples) -> "Timing":
        p20, med, p80 = np.percentile(np.asarray(samples, dtype=np.float64), [20, 50, 80])
        return Timing(float(med), float(p20), float(p80), len(samples), tuple(samples))


def significantly_faster(fast, slow, z_crit: float = 2.326) -> bool:
    """One-sided Mann-Whitney U test that samples ``fast`` come from a faster distribution than
    ``slow`` (normal approximation with continuity correction; z 2.326 = p 0.01). Rank-based, so
    a few runs slowed down by other processes do not decide it."""
    a, b = np.asarray(fast, dtype=np.float64), np.asarray(slow, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        return False
    u = float(np.sum(a[:, None] < b[None, :]) + 0.5 * np.sum(a[:, None] == b[None, :]))
    n1, n2 = a.size, b.size
    sd = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)
    return (u - n1 * n2 / 2.0 - 0.5) / sd > z_crit


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_interleaved(fns: Mapping, device, *, budget_s: float = DEFAULT_BUDGET_S, min_reps: int = MIN_REPS,
                     max_reps: int = MAX_REPS, cutoff: float = CUTOFF) -> tuple[dict, dict]:
    """Time every ``fns[name]()`` in interleaved rounds (see the module docstring); returns
    ({name: Timing}, {name: exception}) for those that ran and those that raised."""
    device = torch.device(device)
    samples = {name: [] for name in fns}
    failed = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for name, fn in fns.items():  # warm-up round: caches, allocator, lazy initialisation
        try:
            _time_once(fn, device)
        except Exception as exc:
            failed[name] = exc
    alive = [name for name in fns if name not in failed]
    start, rounds = time.perf_counter(), 0
    while alive:
        shift = rounds % len(alive)
        for name in alive[shift:] + alive[:shift]:
            try:
                samples[name].append(_time_once(fns[name], device))
            except Exception as exc:
                failed[name] = exc
        alive = [name for name in alive if name not in failed]
        rounds += 1
        if alive and rounds >= 2:
            best = min(np.percentile(samples[name], 20) for name in alive)
            alive = [name for name in alive if min(samples[name]) <= cutoff * best]
        if rounds >= max_reps or (rounds >= min_reps and time.perf_counter() - start >= budget_s * len(fns)):
            break
    return {name: Timing.of(s) for name, s in samples.items() if s and name not in failed}, failed


def rel_error(outputs: Mapping, expected: Mapping) -> float:
    """Max over outputs of max|out - ref| / max|ref| (norm-wise: elementwise relative error is
    meaningless where outputs cancel to ~0). NaN where the reference has none counts as inf. A
    :class:`registry.Part` reference is compared with that part of the output."""
    if set(outputs) != set(expected):
        raise ValueError(f"run returned {sorted(outputs)} but the reference has {sorted(expected)}")
    worst = 0.0
    for name, ref in expected.items():
        out = outputs[name]
        if isinstance(out, torch.Tensor):
            out = out.detach().cpu()
            out = out.to(torch.complex128 if out.is_complex() else torch.float64).numpy()
        out = np.asarray(out)
        if isinstance(ref, registry.Part):  # the reference covers part of this output only
            out, ref = out[ref.index], ref.value
        ref = np.asarray(ref)
        if out.shape != ref.shape:
            raise ValueError(f"output {name}: shape {out.shape}, reference {ref.shape}")
        if out.size == 0:
            continue
        if not np.array_equal(np.isnan(out), np.isnan(ref)):
            return math.inf
        diff = np.abs(out - ref)
        diff = diff[~np.isnan(diff)]
        if diff.size:
            scale = max(float(np.max(np.abs(ref[~np.isnan(ref)]), initial=0.0)), 1e-30)
            worst = max(worst, float(np.max(diff)) / scale)
    return worst


def _no_backend_error():
    try:
        from ...ops._dispatch import NoBackendError

        return NoBackendError
    except Exception:  # the ops package is not importable: only tests' fake ops are being tuned
        return ()


def _default_priority() -> tuple[str, ...]:
    try:
        from ...ops._dispatch import PRIORITY

        return tuple(PRIORITY)
    except Exception:
        return ()


class HarnessError(RuntimeError):
    """A harness that does not exercise what it claims to; a bug to fix, not a failed candidate."""


def harness_for(tunable: registry.Tunable) -> registry.Harness:
    """The harness that tunes ``tunable``: the object it was registered with if any (tests), else
    ``HARNESS`` of the module ``megalodon_kernels.autotune.tuning.harness.<op>``."""
    if tunable.harness is not None:
        return tunable.harness
    module_name = f"{__package__}.harness.{tunable.op}"
    try:
        module = importlib.import_module(module_name) if tunable.op.isidentifier() else None
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the harness exists but something it imports does not
        module = None
    if module is None:
        raise LookupError(f"op {tunable.op} has no tuning harness: write {module_name} (a module defining "
                          "HARNESS = registry.Harness(...)) or register the op with harness=")
    harness = getattr(module, "HARNESS", None)
    if not isinstance(harness, registry.Harness):
        raise TypeError(f"{module_name}.HARNESS must be a registry.Harness, got {type(harness).__name__}")
    return harness


def _run(tunable: registry.Tunable, harness: registry.Harness, case: registry.Case, backend: str, config: dict,
         key: dict) -> Mapping:
    """One forward+backward of a candidate, forced through the op's dispatcher."""
    with registry.force(tunable.op, backend, config) as seen:
        outputs = harness.run(case, backend, config)
    if any(k != key for k in seen.keys):
        raise HarnessError(f"the harness of {tunable.op} tunes key {key} but the op dispatched on "
                           f"{[k for k in seen.keys if k != key][0]}: its Case.inputs must be what the op passes "
                           "to its dispatcher")
    return outputs


def _describe(shape: Mapping) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _candidate_record(backend, config, status, note="", error=None, tolerance=None, timing=None) -> dict:
    finite = error is not None and math.isfinite(error)
    return {
        "backend": backend, "config": dict(config), "status": status, "note": note[:300],
        "error": float(error) if finite else None, "tolerance": tolerance,
        "median_s": timing.median_s if timing else None, "p20_s": timing.p20_s if timing else None,
        "p80_s": timing.p80_s if timing else None, "reps": timing.reps if timing else 0,
    }


def _release(device: torch.device) -> None:
    """Give a GPU's memory back between candidates (a big candidate must not starve the next)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def tune_shape(tunable: registry.Tunable, shape: Mapping, dtype: torch.dtype, device, *, seed: int = 0,
               budget_s: float = DEFAULT_BUDGET_S, priority: Iterable[str] | None = None,
               progress: Callable[[str], None] = lambda s: None) -> tuple[str, dict]:
    """Check and time every candidate of ``tunable`` on ``shape``; return (entry id, table entry)."""
    device = torch.device(device)
    harness = harness_for(tunable)
    shape = dict(shape)
    check_shape = dict(harness.check_shape(shape)) if harness.check_shape else dict(shape)

    case = harness.make_case(shape, dtype, device, seed)
    key = tunable.key(case.inputs)
    dname = cache.dtype_name(case.dtype or dtype)
    if dname not in harness.tolerance:
        raise ValueError(f"the harness of {tunable.op} has no tolerance for {dname}")
    tolerance = float(harness.tolerance[dname])
    check_case = case if check_shape == shape else harness.make_case(check_shape, dtype, device, seed)
    if tunable.key(check_case.inputs) != key:
        raise ValueError(f"{tunable.op}: check shape {check_shape} has key {tunable.key(check_case.inputs)}, "
                         f"not the key {key} of {shape}: the check would test another configuration")
    expected = harness.reference(check_case)
    eid = cache.entry_id(tunable.op, dname, key)
    unsupported = _no_backend_error()
    ident = identity(device)

    records, timed = [], {}
    for backend, config in tunable.candidates():
        label = f"  {backend} {config or '{}'}"
        pruned = [NOT_TIMED[(device.type, backend)]] if (device.type, backend) in NOT_TIMED else []
        if not pruned and harness.prune:
            pruned = list(harness.prune(backend, config, check_shape, dname, ident))
        if pruned:
            records.append(_candidate_record(backend, config, "pruned", "; ".join(pruned)))
            progress(f"{label}: pruned ({'; '.join(pruned)})")
            continue
        try:
            error = rel_error(_run(tunable, harness, check_case, backend, config, key), expected)
            if error <= tolerance and check_case is not case:
                _run(tunable, harness, case, backend, config, key)  # the full case must run too
        except HarnessError:
            raise
        except unsupported as exc:
            records.append(_candidate_record(backend, config, "unsupported", str(exc).replace("\n", " ")))
            progress(f"{label}: unsupported")
            continue
        except Exception as exc:  # a candidate that crashes is recorded, never chosen
            records.append(_candidate_record(backend, config, "failed", f"{type(exc).__name__}: {exc}"))
            progress(f"{label}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
            continue
        finally:
            _release(device)
        if not error <= tolerance:
            records.append(_candidate_record(backend, config, "wrong", "", error, tolerance))
            progress(f"{label}: WRONG, error {error:.2e} > tolerance {tolerance:.1e}; not timed")
            continue
        progress(f"{label}: correct, error {error:.1e}")
        timed[len(records)] = (backend, config, error)
        records.append(None)  # filled in after timing

    def call(backend, config):
        def fn():
            with registry.force(tunable.op, backend, config):
                harness.run(case, backend, config)
        return fn

    samples = {}  # id(record) -> timing samples, for the significance test below
    if timed:
        progress(f"  timing {len(timed)} correct candidate(s), interleaved")
    timings, failures = time_interleaved({i: call(b, c) for i, (b, c, _) in timed.items()}, device, budget_s=budget_s)
    _release(device)
    for i, (backend, config, error) in timed.items():
        label = f"  {backend} {config or '{}'}"
        if i in failures:
            exc = failures[i]
            records[i] = _candidate_record(backend, config, "failed", f"{type(exc).__name__}: {exc}", error, tolerance)
            progress(f"{label}: failed while timing ({type(exc).__name__})")
            continue
        t = timings[i]
        records[i] = _candidate_record(backend, config, "ok", "", error, tolerance, t)
        samples[id(records[i])] = t.samples
        progress(f"{label}: p20 {t.p20_s * 1e3:.3f} ms, median {t.median_s * 1e3:.3f}, "
                 f"p80 {t.p80_s * 1e3:.3f} x{t.reps}")

    default = None
    for backend in [*(priority if priority is not None else _default_priority()), *tunable.space]:
        if backend in tunable.space and any(r["backend"] == backend and r["status"] not in ("unsupported", "pruned")
                                            for r in records):
            default = {"backend": backend, "config": tunable.default_config(backend)}
            break
    ok = [r for r in records if r["status"] == "ok"]
    best = min(ok, key=lambda r: r["p20_s"]) if ok else None
    base = next((r for r in ok if default and r["backend"] == default["backend"]
                 and r["config"] == default["config"]), None)
    if best is not None and base is not None and best is not base and not significantly_faster(
            samples[id(best)], samples[id(base)]):
        progress(f"  fastest {best['backend']} {best['config']} is not significantly faster than the default: "
                 "keeping the default")
        best = base
    entry = {
        "op": tunable.op, "dtype": dname, "key": key, "shape": shape, "check_shape": check_shape, "seed": seed,
        "date": cache.utc_now(),
        "winner": {"backend": best["backend"], "config": best["config"]} if best else None,
        "default": default, "candidates": records,
        # what these candidates were (lookups pass over the entry once the op's candidates change)
        "candidate_set": cache.candidate_set(tunable.space, device.type),
    }
    progress(_summary(entry))
    return eid, entry


def _summary(entry: Mapping) -> str:
    win = entry["winner"]
    if win is None:
        return "  -> no correct candidate: no winner (auto keeps its priority list for this key)"
    times = {(c["backend"], repr(sorted(c["config"].items()))): c["p20_s"] for c in entry["candidates"]}
    t_win = times[(win["backend"], repr(sorted(win["config"].items())))]
    text = f"  -> winner {win['backend']} {win['config'] or '{}'} (p20 {t_win * 1e3:.3f} ms)"
    default = entry["default"]
    t_def = times.get((default["backend"], repr(sorted(default["config"].items())))) if default else None
    if t_def:
        text += f", default {t_def * 1e3:.3f} ms: x{t_def / t_win:.2f}"
    return text


def tune_op(op: str, shapes: Iterable[Mapping], dtypes: Iterable[torch.dtype], device, *, seed: int = 0,
            budget_s: float = DEFAULT_BUDGET_S, skip: Iterable[str] = (), priority=None,
            progress: Callable[[str], None] = lambda s: None) -> dict[str, dict]:
    """Tune ``op`` on every shape x dtype; a key already tuned (in this run or in ``skip``) is not
    tuned again. Returns entry id -> entry."""
    tunable = registry.get(op)
    if tunable is None:
        raise LookupError(f"op {op} is not registered for autotuning")
    harness = harness_for(tunable)
    shapes, dtypes = [dict(s) for s in shapes], list(dtypes)
    done, entries = set(skip), {}
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            # The key comes from the real inputs, so build a (cheap, check-sized) case to get it.
            probe = harness.make_case(dict(harness.check_shape(shape)) if harness.check_shape else shape,
                                      dtype, device, seed)
            eid = cache.entry_id(op, probe.dtype or dtype, tunable.key(probe.inputs))
            where = f"[{op} {i + 1}/{len(shapes)} {cache.dtype_name(dtype)}] {_describe(shape)}"
            del probe
            if eid in done:
                progress(f"{where}: key {eid} already tuned, skipped")
                continue
            progress(f"{where}: key {eid}")
            eid, entry = tune_shape(tunable, shape, dtype, device, seed=seed, budget_s=budget_s,
                                    priority=priority, progress=progress)
            entries[eid] = entry
            done.add(eid)
    return entries


def verify_entry(entry: Mapping, device) -> tuple[bool, str]:
    """Re-run an entry's winner here on its check shape against the reference: (ok, message)."""
    tunable = registry.get(entry["op"])
    if tunable is None:
        return False, f"op {entry['op']} is not registered in this version"
    winner = entry["winner"]
    if winner is None:
        return True, "no winner recorded (nothing to check)"
    problems = tunable.config_problems(winner["backend"], winner["config"])
    if problems:
        return False, "; ".join(problems)
    harness = harness_for(tunable)
    dtype = getattr(torch, entry["dtype"])
    tolerance = float(harness.tolerance[entry["dtype"]])
    case = harness.make_case(dict(entry["check_shape"]), dtype, torch.device(device), entry["seed"])
    if cache.entry_id(entry["op"], case.dtype or dtype, tunable.key(case.inputs)) != cache.entry_id(
            entry["op"], dtype, entry["key"]):
        return False, f"shape {entry['check_shape']} no longer maps to {entry['op']}/{entry['dtype']}/{entry['key']}"
    try:
        outputs = _run(tunable, harness, case, winner["backend"], winner["config"], tunable.key(case.inputs))
        error = rel_error(outputs, harness.reference(case))
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        _release(torch.device(device))
    verdict = error <= tolerance
    return verdict, f"error {error:.2e} {'<=' if verdict else '>'} tolerance {tolerance:.1e}"
