"""Measured backend defaults on a GPU with no autotune table: which backend ``auto`` tries first.

Without a table entry, ``auto`` used to take the first backend of a fixed priority (cuda, triton,
cpu, torch) that can run the call. The GPU runs showed that order is wrong for some ops and shapes
(the CUDA fftconv slower than torch's cuFFT path at the paper-7B shapes, faster at small ones), so
on a CUDA device the order comes from the measurements instead: ``gpu_defaults.json`` beside this
file holds, per device class (``sm_90``...) and op, the measured points (dtype, rows, L) with the
forward+backward median time of each backend there. It is derived from the committed results by

    python -m megalodon_kernels.autotune.derive_defaults --out autotune/gpu_defaults.json

(autotune/derive_defaults.py says which files and how); a regenerated autotune table for the
device still takes precedence (ops/_dispatch.py asks the table first).

:func:`rank` orders the backends able to run a call: for each pair of them, the measured point
nearest the call where both were timed decides which is faster (distance: |log2 of the length
ratio| + |log2 of the rows ratio| + 2 when the dtype differs); the backends are sorted by wins minus
losses over those pairs, ties (and pairs never timed together) in the fixed priority order. A
device class or op without points gives no ranking (the fixed priority applies).

Part of the autotune runtime: imports only the standard library (and reads one JSON file once).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Mapping, Sequence

PATH = Path(__file__).resolve().parent / "gpu_defaults.json"
#: what a dtype mismatch adds to the distance between a call and a measured point (in log2 units)
DTYPE_DISTANCE = 2.0


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """The committed defaults ({} when the file is absent or unreadable: the fixed priority applies)."""
    try:
        return json.loads(PATH.read_text())
    except (OSError, ValueError):
        return {}


def _shape(t) -> tuple | None:
    return tuple(t.shape) if hasattr(t, "shape") else None


def features(op: str, inputs: Mapping) -> tuple[int, int] | None:
    """(rows, L) of a call of ``op`` from its dispatch inputs (ops/<op>/__init__.py's select), in
    the units the measured points use (autotune/derive_defaults.py ``point_features``); None for an
    op or input it does not know."""
    try:
        if op in ("cema", "ema_hidden", "fftconv"):        # x r(B D L)
            B, D, L = _shape(inputs["x"])
            return B * D, L
        if op == "cema_kernel":                            # p r(D N), length, hx c(B D N) or None
            hx = inputs.get("hx")
            return _shape(inputs["p"])[0] * (1 if hx is None else _shape(hx)[0]), int(inputs["length"])
        if op == "timestep_norm":                          # x r(B L D)
            B, L, D = _shape(inputs["x"])
            return B * D, L
        if op in ("attention", "rotary"):                  # q / x r(B L H d)
            s = _shape(inputs["q" if op == "attention" else "x"])
            return s[0] * s[2], s[1]
        if op == "dropkey_softmax":                        # scores (..., L, S)
            s = _shape(inputs["scores"])
            return math.prod(s[:-2]), s[-1]
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    return None


def _distance(point: Mapping, dtype: str, rows: int, L: int) -> float:
    return (abs(math.log2(max(L, 1) / max(point["L"], 1))) + abs(math.log2(max(rows, 1) / max(point["rows"], 1)))
            + (0.0 if point["dtype"] == dtype else DTYPE_DISTANCE))


def rank(op: str, device_class: str, dtype: str, inputs: Mapping, able: Sequence[str],
         data: Mapping | None = None) -> list[str] | None:
    """``able`` (backend names in the fixed priority order) reordered by the measurements of
    ``op`` on ``device_class`` nearest this call; None when there are none (or one backend)."""
    points = ((data if data is not None else table()).get("classes", {}).get(device_class, {}).get(op))
    feats = features(op, inputs)
    if not points or feats is None or len(able) < 2:
        return None
    rows, L = feats
    score = {name: 0 for name in able}
    decided = False
    for i, a in enumerate(able):
        for b in able[i + 1:]:
            both = [p for p in points if a in p["ms"] and b in p["ms"]]
            if not both:
                continue
            near = min(both, key=lambda p: _distance(p, dtype, rows, L))
            faster, slower = (a, b) if near["ms"][a] <= near["ms"][b] else (b, a)
            # a pair timed right here outweighs one timed far away: without the weight, three pairs
            # decided at different points can form a cycle that the fixed priority would break
            weight = 1.0 / (1.0 + _distance(near, dtype, rows, L))
            score[faster] += weight
            score[slower] -= weight
            decided = True
    if not decided:
        return None
    return sorted(able, key=lambda name: (-score[name], able.index(name)))
