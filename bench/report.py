"""Markdown table + PNG plots from a pytest-benchmark JSON of the bench/ suite.

    python -m megalodon_kernels.bench report bench/results/cpu.json --out bench/results/

Writes ``<out>/<stem>.md`` (device, versions, commit, the commands, per-op tables of median and
p20-p80 per provider, speed-up of the best library backend over the best baseline, achieved GB/s
and GFLOP/s against the ideal counts, and the A100/H100 roofline table) and ``<out>/<stem>_<op>.png``
(time vs L per provider, one panel per mode) plus ``<out>/<stem>_speedup.png``.

Speed-up = best baseline time / best library time at the same (op, L, mode); > 1 means the library
is faster. It is given on medians (the headline) and on minima (the least disturbed round: this
machine's 2 cores are shared, so the minimum is the better estimate of the code's own cost).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

OP_ORDER = ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax", "rotary")
MODES = ("fwd", "bwd", "fwd+bwd")
LIBRARY = ("cuda", "triton", "cpu", "torch")


def load(path: str):
    with open(path) as f:
        data = json.load(f)
    rows = []
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if "op" not in e:
            continue
        st = b["stats"]
        rows.append(dict(e, median=st["median"], min=st["min"], p20=e.get("p20", st["q1"]), p80=e.get("p80", st["q3"])))
    return data, rows


def index(rows):
    """(op, mode, L) -> provider -> row."""
    t = defaultdict(dict)
    for r in rows:
        t[(r["op"], r["mode"], r["L"])][r["provider"]] = r
    return t


def speedups(t, key="median"):
    """(op, mode, L) -> (speed-up, best library provider, best baseline provider)."""
    out = {}
    for k, provs in t.items():
        lib = [(r[key], p) for p, r in provs.items() if r["kind"] == "library"]
        base = [(r[key], p) for p, r in provs.items() if r["kind"] == "baseline"]
        if lib and base:
            (tl, pl), (tb, pb) = min(lib), min(base)
            out[k] = (tb / tl, pl, pb)
    return out


def _ms(x):
    return f"{x * 1e3:.3g}"


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def providers_of(t, op):
    seen = []
    for (o, _, _), provs in t.items():
        if o == op:
            for p, r in provs.items():
                if p not in seen:
                    seen.append(p)
    return sorted(seen, key=lambda p: (p not in LIBRARY, LIBRARY.index(p) if p in LIBRARY else 0, p))


def plots(t, sp, out_dir, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    ops = [op for op in OP_ORDER if any(k[0] == op for k in t)]
    for op in ops:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, mode in zip(axes, MODES):
            for p in providers_of(t, op):
                pts = sorted((L, provs[p]) for (o, m, L), provs in t.items() if o == op and m == mode and p in provs)
                if not pts:
                    continue
                Ls = [L for L, _ in pts]
                med = [r["median"] * 1e3 for _, r in pts]
                lo = [max(0.0, (r["median"] - r["p20"]) * 1e3) for _, r in pts]
                hi = [max(0.0, (r["p80"] - r["median"]) * 1e3) for _, r in pts]
                style = "-o" if pts[0][1]["kind"] == "library" else "--s"
                ax.errorbar(Ls, med, yerr=[lo, hi], fmt=style, capsize=3, label=f"{p} ({pts[0][1]['kind']})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("L (constant tokens: B = tokens / L)")
            ax.set_ylabel("median time per call [ms] (bars: p20-p80)")
            ax.set_title(f"{op} {mode}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{stem}_{op}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        files.append(name)
    # speed-up over the best baseline
    n = len(ops)
    cols = 4
    rows_ = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.6 * rows_), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for mode in MODES:
            pts = sorted((L, v[0]) for (o, m, L), v in sp.items() if o == op and m == mode)
            if pts:
                ax.plot([L for L, _ in pts], [s for _, s in pts], "-o", label=mode)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op}: best library / best baseline")
        ax.set_xlabel("L")
        ax.set_ylabel("speed-up (median), >1 = library faster")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    name = f"{stem}_speedup.png"
    fig.savefig(os.path.join(out_dir, name), dpi=90)
    plt.close(fig)
    files.append(name)
    return files


def roofline_plot(table, rows, out_dir, stem):
    """``<stem>_roofline.png``: left, the A100/H100 roofs (datasheet bandwidth, fp32 and bf16 tensor peaks)
    with every op x mode at the paper shapes placed at its ideal FLOPs per byte and the FLOP/s its lower
    bound implies; right, the measured points of this run: achieved FLOP/s of the ideal FLOPs against the
    same intensity, per library provider (no roof: no peak is claimed for the machine that ran it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .roofline import DEVICES

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5))
    xs = [r["intensity"] for r in table] + [r["ideal_flops"] / r["ideal_bytes"] for r in rows if r["ideal_bytes"]]
    grid = np.logspace(np.log10(max(min(xs), 1e-3) / 2), np.log10(max(xs) * 2), 200)
    for (name, dev), color in zip(DEVICES.items(), ("tab:blue", "tab:red")):
        left.plot(grid, np.minimum(dev["bw"] * grid, dev["fp32"]), "-", color=color, lw=1, label=f"{name} fp32 roof")
        left.plot(grid, np.minimum(dev["bw"] * grid, dev["bf16_tensor"]), ":", color=color, lw=1,
                  label=f"{name} bf16 tensor roof")
        pts = [r for r in table if r["device"] == name]
        left.scatter([r["intensity"] for r in pts], [r["flops"] / (r["lb_us"] * 1e-6) for r in pts], color=color,
                     s=14, alpha=0.7)
        if name.startswith("H100"):
            for r in pts:
                if r["mode"] == "fwd" and r["L"] == max(p["L"] for p in pts):
                    left.annotate(r["op"], (r["intensity"], r["flops"] / (r["lb_us"] * 1e-6)), fontsize=6)
    left.set_title("lower bounds at the paper 7B shapes (bf16 I/O), datasheet roofs")
    markers = {"fwd": "o", "bwd": "s", "fwd+bwd": "^"}
    colors = {}
    for r in rows:
        if r["kind"] != "library" or not r["ideal_bytes"]:
            continue
        c = colors.setdefault(r["provider"], f"C{len(colors)}")
        right.scatter([r["ideal_flops"] / r["ideal_bytes"]], [r["ideal_flops"] / r["median"]], color=c,
                      marker=markers.get(r["mode"], "o"), s=18)
    for p, c in colors.items():
        right.scatter([], [], color=c, label=p)
    for m, mk in markers.items():
        right.scatter([], [], color="k", marker=mk, label=m)
    right.set_title("measured in this run: achieved FLOP/s of the ideal FLOPs")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ideal FLOPs / ideal byte (bench/roofline.py)")
        ax.set_ylabel("FLOP/s")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"{stem}_roofline.png"
    fig.savefig(os.path.join(out_dir, name), dpi=90)
    plt.close(fig)
    return name


def markdown(data, rows, json_path, out_dir, png_files, roofline_md):
    t = index(rows)
    sp_med, sp_min = speedups(t, "median"), speedups(t, "min")
    mi, ci = data.get("machine_info", {}), data.get("commit_info", {})
    first = rows[0] if rows else {}
    set_name = first.get("shape_set", mi.get("shape_set", "?"))
    L = []
    L.append(f"# Benchmarks: shape set `{set_name}` on {first.get('device_name', mi.get('processor', '?'))}")
    L.append("")
    L.append("Made by (from the repository root):")
    L.append("")
    L.append("```")
    L.append(mi.get("command", f"pytest bench/ --shape-set {set_name} --benchmark-json {json_path}"))
    L.append(f"python -m megalodon_kernels.bench report {json_path} --out {out_dir}")
    L.append("```")
    L.append("")
    L.append(f"- date: {data.get('datetime', '?')}; commit `{ci.get('id', '?')}` (branch {ci.get('branch', '?')}, "
             f"dirty={ci.get('dirty', '?')})")
    L.append(f"- device: {first.get('device', '?')} ({first.get('device_name', '?')}), {mi.get('cpu_count', '?')} "
             f"logical CPUs ({mi.get('cpu', {}).get('brand_raw', '?')}), torch threads {mi.get('torch_threads', '?')}; "
             f"GPU: {mi.get('gpu') or 'none'}")
    L.append(f"- versions: python {mi.get('python_version', '?')}, torch {mi.get('torch', '?')}, "
             f"triton {mi.get('triton') or 'absent'}, CUDA {mi.get('cuda') or 'none'}, "
             f"pytest-benchmark {data.get('version', '?')}")
    L.append(f"- dtype {first.get('dtype', '?')}; token count per point {first.get('tokens', '?')} at every L")
    if not mi.get("gpu"):
        L.append("- **No GPU on this machine: no GPU time is measured or reported.** The `a100`/`h100` sets "
                 "(`--shape-set a100|h100`) skip with that reason; the roofline below gives lower bounds only.")
    skipped = data.get("skipped", {})
    if skipped:
        L.append("")
        L.append("Providers skipped on this machine (reason from the op's backend table):")
        L.append("")
        for k, why in sorted(skipped.items()):
            L.append(f"- `{k}`: {why}")
    L.append("")
    L.append("## Speed-up of the library over the best baseline")
    L.append("")
    L.append("Best library backend time vs best baseline time at the same point; > 1 = library faster. "
             "Medians (minima in parentheses).")
    L.append("")
    ops = [op for op in OP_ORDER if any(k[0] == op for k in t)]
    Ls = sorted({k[2] for k in t})
    L.append("| op | mode | " + " | ".join(f"L={x}" for x in Ls) + " | geomean |")
    L.append("|---|---|" + "---|" * (len(Ls) + 1))
    for op in ops:
        for mode in MODES:
            cells, gm, gmn = [], [], []
            for x in Ls:
                k = (op, mode, x)
                if k in sp_med:
                    cells.append(f"{sp_med[k][0]:.2f}x ({sp_min[k][0]:.2f}x)")
                    gm.append(sp_med[k][0])
                    gmn.append(sp_min[k][0])
                else:
                    cells.append("-")
            L.append(f"| {op} | {mode} | " + " | ".join(cells) + f" | {_geomean(gm):.2f}x ({_geomean(gmn):.2f}x) |")
    L.append("")
    sp_png = f"{stem_of(json_path)}_speedup.png"
    L.append(f"![speed-up]({sp_png})" if sp_png in png_files else "(no plots: pip install matplotlib, the bench extra)")
    L.append("")
    L.append("## Per-op times")
    L.append("")
    L.append("Median ms per call (p20-p80); GB/s and GFLOP/s of the fastest library backend use the ideal "
             "bytes/FLOPs of `bench/roofline.py` (no CPU peak is claimed for this shared machine).")
    for op in ops:
        provs = providers_of(t, op)
        L.append("")
        L.append(f"### {op}")
        L.append("")
        some = max((r for (o, _, _), pr in t.items() if o == op for r in pr.values()), key=lambda r: r["L"])
        L.append("Shape at the longest L: " + " ".join(f"{k}={v}" for k, v in some["shape"].items() if k != "L") +
                 "; providers: " + ", ".join(f"{p} ({'library' if p in LIBRARY else 'baseline'})" for p in provs))
        L.append("")
        L.append("| L | mode | " + " | ".join(provs) + " | speed-up | library GB/s | library GFLOP/s |")
        L.append("|---|---|" + "---|" * (len(provs) + 3))
        for mode in MODES:
            for x in Ls:
                k = (op, mode, x)
                if k not in t:
                    continue
                pr = t[k]
                cells = [f"{_ms(pr[p]['median'])} ({_ms(pr[p]['p20'])}-{_ms(pr[p]['p80'])})" if p in pr else "skip"
                         for p in provs]
                s = sp_med.get(k)
                best = min((r["median"], p) for p, r in pr.items() if r["kind"] == "library") \
                    if any(r["kind"] == "library" for r in pr.values()) else None
                gbs = gfl = "-"
                if best:
                    r = pr[best[1]]
                    gbs = f"{r['ideal_bytes'] / r['median'] / 1e9:.2f}"
                    gfl = f"{r['ideal_flops'] / r['median'] / 1e9:.2f}"
                L.append(f"| {x} | {mode} | " + " | ".join(cells) +
                         f" | {'-' if not s else f'{s[0]:.2f}x'} | {gbs} | {gfl} |")
        if f"{stem_of(json_path)}_{op}.png" in png_files:
            L.append("")
            L.append(f"![{op}]({stem_of(json_path)}_{op}.png)")
    L.append("")
    L.append("## Roofline: ideal bytes and FLOPs per call, lower-bound time on A100-80GB and H100 SXM")
    L.append("")
    L.append("Datasheet numbers: A100-80GB SXM 2.039 TB/s, 19.5 TFLOP/s fp32, 312 TFLOP/s bf16 tensor; H100 SXM "
             "3.35 TB/s, 67 TFLOP/s fp32, 989 TFLOP/s bf16 tensor (dense). Lower bound = max(bytes / bandwidth, "
             "FLOPs / peak); only attention's matmuls may use the tensor peak, every other op computes in fp32. "
             "Formulas and conventions: `bench/roofline.py`. Shapes: the paper's 7B setting of the a100/h100 sets, "
             "in bf16. These are bounds, not measurements: there is no GPU here.")
    L.append("")
    L.append(roofline_md)
    L.append("")
    if f"{stem_of(json_path)}_roofline.png" in png_files:
        L.append(f"![roofline]({stem_of(json_path)}_roofline.png)")
        L.append("")
    return "\n".join(L)


def stem_of(path):
    return os.path.splitext(os.path.basename(path))[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megalodon_kernels.bench report",
                                 description="markdown + PNG report from a bench/ pytest-benchmark JSON")
    ap.add_argument("json", help="output of pytest bench/ --benchmark-json")
    ap.add_argument("--out", default=None, help="output directory (default: the JSON's directory)")
    ap.add_argument("--no-triton-bytes", action="store_true",
                    help="skip the Triton interpreter byte counter in the roofline (about 30 s)")
    a = ap.parse_args(argv)
    out = a.out or os.path.dirname(os.path.abspath(a.json))
    os.makedirs(out, exist_ok=True)
    data, rows = load(a.json)
    if not rows:
        print(f"{a.json}: no bench/ benchmarks in it (all skipped?)", file=sys.stderr)
    stem = stem_of(a.json)
    t = index(rows)
    try:
        pngs = plots(t, speedups(t), out, stem) if rows else []
    except ImportError as exc:
        print(f"no plots ({exc}): pip install matplotlib", file=sys.stderr)
        pngs = []
    from . import roofline

    ratios = None
    if not a.no_triton_bytes:
        ratios = roofline.triton_ratios(roofline.measure_triton()) or None
    table = roofline.table_rows(("a100", "h100"), ratios)
    roof = roofline.markdown(table, ratios)
    if pngs:
        pngs.append(roofline_plot(table, rows, out, stem))
    md = markdown(data, rows, a.json, a.out or out, pngs, roof)
    path = os.path.join(out, f"{stem}.md")
    with open(path, "w") as f:
        f.write(md)
    print(f"wrote {path} and {len(pngs)} plots")
    return 0
