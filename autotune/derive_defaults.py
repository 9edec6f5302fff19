"""Derive autotune/gpu_defaults.json (the measured backend order of ``auto`` on a GPU with no
table, autotune/gpu_defaults.py) from the committed GPU results.

    python -m megalodon_kernels.autotune.derive_defaults [--out autotune/gpu_defaults.json] [SOURCE ...]

Sources (default: every one under bench/results/gpu/ this knows how to read):

* ``<run>/ops.json`` of ``bench gpu`` (bench/gpu_steps.py ``step_ops``): every op x backend at the
  run's shape set, with the device's capability from the run's ``env.json``;
* ``h100_run1_probe.txt`` (bench/gpu_probe.py at 4e98e87, H100): fftconv and cema lines, at the
  shapes that script used (below).

Each point is (device class, op, dtype, rows, L) with the forward+backward median of each backend
timed there (training runs both). Where a run timed cema_kernel and fftconv on a backend but not
cema (the CUDA cema did not exist before 2026-11-28), cema's time on that backend is estimated as
their sum and marked in ``estimated``: the composed CUDA cema runs exactly those two stages plus
elementwise passes, so the estimate is a lower bound. A later run that times cema there replaces it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .gpu_defaults import PATH

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu"
MODE = "fwd+bwd"
#: the providers that are backends (ops/_dispatch.py PRIORITY; the tuning layer may not import ops)
BACKEND_NAMES = ("cuda", "triton", "cpu", "torch")
#: the shapes bench/gpu_probe.py (at 4e98e87, the H100 run's script) timed, by its case name: (rows, L)
PROBE_SHAPES = {"fftconv L4096": ("fftconv", 2 * 256, 4096), "fftconv L16384": ("fftconv", 64, 16384),
                "fftconv L65536": ("fftconv", 16, 65536), "cema L4096": ("cema", 2 * 256, 4096)}
_PROBE_LINE = re.compile(r"^(?P<case>\S+ L\d+)\s+(?P<backend>cuda|triton|torch)\s+(?P<dtype>\w+)\s+fwd_err.*"
                         r"fwd\+bwd\s+(?P<ms>[\d.]+) ms")
#: composites estimated from their stages where not timed themselves
STAGES = {"cema": ("cema_kernel", "fftconv")}


def point_features(op: str, shape: dict) -> tuple[int, int]:
    """(rows, L) of a bench shape dict (autotune/shapes.py OP_SHAPES), as gpu_defaults.features of the
    call's inputs."""
    if op in ("cema", "ema_hidden", "fftconv", "timestep_norm"):
        return shape["B"] * shape["D"], shape["L"]
    if op == "cema_kernel":
        return shape["D"] * (shape["B"] if shape.get("hx") else 1), shape["L"]
    if op in ("attention", "rotary"):
        return shape["B"] * shape["H"], shape["L"]
    if op == "dropkey_softmax":
        return shape["B"] * shape["H"], shape["S"]
    raise ValueError(f"no features for op {op!r}")


def _device_class(capability) -> str:
    major, minor = capability
    return f"sm_{major}{minor}"


def from_ops_json(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    env = json.loads((path.parent / "env.json").read_text())
    cap = env["capability"]  # "sm_90" (bench/gpu_steps.py step_env)
    device_class = cap if isinstance(cap, str) else _device_class(cap)
    points: dict = {}
    # the per-op rows at the device's paper shapes, then the ops step's extra tables: cema at the probe
    # and 7B shapes (op implied), fftconv at 8192 rows (the shape's dimensions flat in the row)
    extra = [dict(r, op="cema") for r in data.get("cema", {}).get("points", [])] + data.get("fftconv_rows", [])
    for r in data["rows"] + extra:
        if r["mode"] != MODE or r["provider"] not in BACKEND_NAMES:  # e.g. a baseline, or "auto"
            continue
        shape = r.get("shape") or {k: r[k] for k in ("B", "D", "N", "L") if k in r}
        rows, L = point_features(r["op"], shape)
        key = (r["op"], r["dtype"], rows, L)
        points.setdefault(key, {})[r["provider"]] = round(r["median"] * 1e3, 4)
    return [dict(device_class=device_class, op=op, dtype=dt, rows=rows, L=L, ms=ms,
                 source=str(path.relative_to(ROOT))) for (op, dt, rows, L), ms in points.items()]


def from_probe(path: Path) -> list[dict]:
    text = path.read_text().splitlines()
    m = re.search(r"major=(\d+), minor=(\d+)", text[0])
    device_class = _device_class((int(m.group(1)), int(m.group(2))))
    points: dict = {}
    for line in text:
        hit = _PROBE_LINE.match(line)
        if hit and hit["case"] in PROBE_SHAPES:
            op, rows, L = PROBE_SHAPES[hit["case"]]
            points.setdefault((op, hit["dtype"], rows, L), {})[hit["backend"]] = float(hit["ms"])
    return [dict(device_class=device_class, op=op, dtype=dt, rows=rows, L=L, ms=ms, source=str(path.relative_to(ROOT)))
            for (op, dt, rows, L), ms in points.items()]


def estimate_composites(points: list[dict]) -> None:
    """Add cema's time on a backend from its stages at the same (source, dtype, L), where cema was
    not timed on it there (in place; the point's ``estimated`` names those backends)."""
    by = {(p["source"], p["device_class"], p["op"], p["dtype"], p["L"]): p for p in points}
    for p in points:
        stages = STAGES.get(p["op"])
        if not stages:
            continue
        found = [by.get((p["source"], p["device_class"], s, p["dtype"], p["L"])) for s in stages]
        if None in found:
            continue
        for backend in set.intersection(*(set(s["ms"]) for s in found)) - set(p["ms"]):
            p["ms"][backend] = round(sum(s["ms"][backend] for s in found), 4)
            p.setdefault("estimated", {})[backend] = " + ".join(f"{s} {backend}" for s in stages)


def merge_repeats(points: list[dict]) -> list[dict]:
    """One point per (device class, op, dtype, rows, L): runs that timed the same point are combined,
    per backend the fastest measured time (a loaded or cold run only adds time), a measured time
    always before an estimated one. Without this, two runs disagreeing on the order left two
    points at one place and the ranking picked either."""
    merged: dict = {}
    for p in points:
        key = (p["device_class"], p["op"], p["dtype"], p["rows"], p["L"])
        if key not in merged:
            merged[key] = dict(p, ms=dict(p["ms"]), estimated=dict(p.get("estimated", {})), source=[p["source"]])
            continue
        m = merged[key]
        m["source"].append(p["source"])
        est = p.get("estimated", {})
        for backend, ms in p["ms"].items():
            if backend not in m["ms"]:
                m["ms"][backend] = ms
                if backend in est:
                    m["estimated"][backend] = est[backend]
            elif backend in m["estimated"] and backend not in est:  # measured replaces estimated
                m["ms"][backend] = ms
                del m["estimated"][backend]
            elif (backend in m["estimated"]) == (backend in est):
                m["ms"][backend] = min(m["ms"][backend], ms)
    out = []
    for m in merged.values():
        if not m["estimated"]:
            del m["estimated"]
        m["source"] = "; ".join(sorted(set(m["source"])))
        out.append(m)
    return out


def sources_under(results: Path) -> list[Path]:
    return sorted(results.glob("*/ops.json")) + sorted(results.glob("*_probe.txt"))


def derive(sources: list[Path]) -> dict:
    points = []
    for src in sources:
        points += from_ops_json(src) if src.name == "ops.json" else from_probe(src)
    estimate_composites(points)
    points = merge_repeats(points)
    classes: dict = {}
    for p in sorted(points, key=lambda p: (p["device_class"], p["op"], p["dtype"], p["rows"], p["L"], p["source"])):
        entry = {k: p[k] for k in ("dtype", "rows", "L", "ms", "source")}
        if "estimated" in p:
            entry["estimated"] = p["estimated"]
        classes.setdefault(p["device_class"], {}).setdefault(p["op"], []).append(entry)
    return {"about": "forward+backward median ms per backend at measured points; read by "
                     "autotune/gpu_defaults.py (rank), written by autotune/derive_defaults.py",
            "command": "python -m megalodon_kernels.autotune.derive_defaults --out autotune/gpu_defaults.json",
            "mode": MODE,
            "sources": [str(s.relative_to(ROOT)) for s in sources],
            "classes": classes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="*", type=Path, help="ops.json / *_probe.txt files (default: all found)")
    ap.add_argument("--out", type=Path, default=None, help=f"write here (default: print); the runtime reads {PATH}")
    a = ap.parse_args(argv)
    sources = [s.resolve() for s in a.sources] or sources_under(RESULTS)
    text = json.dumps(derive(sources), indent=1) + "\n"
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.write_text(text)
        print(f"wrote {a.out} from {len(sources)} source(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
