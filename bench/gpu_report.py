"""Markdown, PNG plots and the one-screen summary of ``python -m megalodon_kernels.bench gpu`` (bench/gpu_run.py).

Plots (matplotlib, the ``bench`` extra; without it the report says so and has no plots):

* ``gpu_ops.png``: median time per call vs L of each op, per backend, forward and forward+backward;
* ``gpu_roofline.png``: achieved FLOP/s of the ideal FLOPs vs arithmetic intensity (ideal FLOPs per
  ideal byte) of every timed point at the longest L, under the roofs of this device's measured copy
  bandwidth and measured fp32 / bf16 matmul rates;
* ``gpu_model.png``: training tokens/s and peak memory vs tokens, decode tokens/s vs context, for
  Megalodon and the matched Transformer.
"""
from __future__ import annotations

import os

OP_ORDER = ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax", "rotary")
COLORS = {"cuda": "tab:green", "triton": "tab:blue", "torch": "tab:orange",
          "megalodon": "tab:purple", "transformer": "tab:gray"}


def _ops_plot(plt, ops: dict, path: str) -> None:
    rows = ops["rows"]
    present = [op for op in OP_ORDER if any(r["op"] == op for r in rows)]
    cols = 4
    nrows = max(1, -(-len(present) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, present):
        for backend in ("cuda", "triton", "torch"):
            for mode, style in (("fwd+bwd", "-o"), ("fwd", "--s")):
                pts = sorted((r["L"], r["median"] * 1e3) for r in rows
                             if r["op"] == op and r["provider"] == backend and r["mode"] == mode)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=COLORS[backend],
                            label=f"{backend} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op} ({ops['shape_set']}, {ops['dtype']})", fontsize=9)
        ax.set_xlabel("L (tokens per point constant)")
        ax.set_ylabel("median ms per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _roofline_plot(plt, ops: dict, env: dict, path: str) -> None:
    rows = ops["rows"]
    Lmax = max(r["L"] for r in rows)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    pts = [r for r in rows if r["L"] == Lmax and r["ideal_bytes"] > 0]
    xs = [r["ideal_flops"] / r["ideal_bytes"] for r in pts]
    lo, hi = min(xs + [0.1]) / 2, max(xs + [100]) * 2
    bw = env.get("d2d_bytes_per_s")
    if bw:
        import numpy as np

        grid = np.logspace(np.log10(lo), np.log10(hi), 200)
        for key, style in (("fp32_flops", "-"), ("bf16_flops", ":")):
            if env.get(key):
                ax.plot(grid, np.minimum(bw * grid, env[key]), "k" + style, lw=1,
                        label=f"roof: {bw / 1e9:.0f} GB/s copy, {key[:4]} matmul {env[key] / 1e12:.1f} TFLOP/s")
    markers = {"fwd": "o", "bwd": "s", "fwd+bwd": "^"}
    for r, x in zip(pts, xs):
        ax.scatter([x], [r["ideal_flops"] / r["median"]], color=COLORS[r["provider"]], marker=markers[r["mode"]], s=28)
        if r["mode"] == "fwd+bwd":
            ax.annotate(r["op"], (x, r["ideal_flops"] / r["median"]), fontsize=6, alpha=0.7)
    for b in ("cuda", "triton", "torch"):
        ax.scatter([], [], color=COLORS[b], label=b)
    for m, mk in markers.items():
        ax.scatter([], [], color="k", marker=mk, label=m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ideal FLOPs / ideal byte (bench/roofline.py)")
    ax.set_ylabel("achieved FLOP/s (ideal FLOPs / median time)")
    ax.set_title(f"roofline at L={Lmax} on {env.get('device', '?')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _model_plot(plt, model: dict, path: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for kind in ("megalodon", "transformer"):
        tr = sorted((r["tokens"], r) for r in model["train"] if r["kind"] == kind and r.get("tokens_per_s"))
        if tr:
            axes[0].plot([t for t, _ in tr], [r["tokens_per_s"] for _, r in tr], "-o", color=COLORS[kind], label=kind)
            axes[1].plot([t for t, _ in tr], [r["peak_bytes"] / 2**20 for _, r in tr], "-o", color=COLORS[kind],
                         label=kind)
        de = sorted((r["context"], r["tokens_per_s"]) for r in model["decode"] if r["kind"] == kind)
        if de:
            axes[2].plot([c for c, _ in de], [v for _, v in de], "-o", color=COLORS[kind], label=kind)
    for ax, title, ylabel in ((axes[0], "training step", "tokens/s (fwd + loss + bwd)"),
                              (axes[1], "training step", "peak memory [MiB]"),
                              (axes[2], "greedy decoding, batch 1", "new tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the sequence" if ax is not axes[2] else "context before decoding")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plots(report: dict, out) -> tuple[list[str], str | None]:
    """([written file names], note when plots are missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [], f"no plots: matplotlib is not installed ({exc}); pip install matplotlib (the bench extra)"
    data, files, notes = report["data"], [], []
    todo = []
    if (data.get("ops") or {}).get("rows"):
        todo += [("gpu_ops.png", lambda p: _ops_plot(plt, data["ops"], p)),
                 ("gpu_roofline.png", lambda p: _roofline_plot(plt, data["ops"], data.get("env") or {}, p))]
    if data.get("model") and (data["model"]["train"] or data["model"]["decode"]):
        todo.append(("gpu_model.png", lambda p: _model_plot(plt, data["model"], p)))
    for name, draw in todo:
        try:
            draw(os.path.join(out, name))
            files.append(name)
        except Exception as exc:  # a plot must not cost the report
            notes.append(f"{name}: {type(exc).__name__}: {exc}")
    return files, ("; ".join(notes) or None)


def summary(report: dict, plot_note: str | None) -> list[str]:
    lines = ["", "=" * 100, f"{report['command']}  ({report['total_s']:.0f} s of {report['budget_s']:g})"]
    for s in report["steps"]:
        lim = f"/{s['limit_s']:.0f}" if "limit_s" in s else ""
        lines.append(f"{s['name']:<9} {s['status'].upper():<7} {s['seconds']:5.0f}{lim} s  " + (s["summary"] or [""])[0])
        lines += [" " * 27 + x for x in s["summary"][1:12]]
    lines.append(f"report: {os.path.join(report['out'], 'gpu_run.md')}, gpu_run.json; plots: "
                 + (", ".join(report["plots"]) or (plot_note or "none")))
    lines.append("=" * 100)
    return lines


def _fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:.3f}"


def _cema_section(cema: dict) -> list[str]:
    """cema per provider (``auto`` with the backend it resolved to) at the probe shape and the 7B shapes
    (bench/gpu_steps.py ``_cema_points``)."""
    if not cema.get("points"):
        return []
    L = ["## CEMA", "",
         "cema (training call: hx None, no state) at the H100 probe's shape (B2 D256 N16 L4096, fp32) and the "
         "paper-7B shapes. x torch = the torch backend's time / this one; floor x = this time / (ideal bytes at "
         "the measured copy bandwidth), 1 = at the bandwidth floor.", "",
         "| shape | dtype | backend | mode | median ms | x torch | floor x |", "|---|---|---|---|---|---|---|"]
    for p in cema["points"]:
        who = p["provider"] + (f" ({p['chosen']})" if p.get("chosen") else "")
        ratio = "-" if p.get("vs_torch") is None else f"{p['vs_torch']:.2f}"
        floor = "-" if p.get("floor_multiple") is None else f"{p['floor_multiple']:.1f}"
        L.append(f"| {p['shape_name']} | {p['dtype']} | {who} | {p['mode']} | {_fmt_ms(p['median'])} | {ratio} | "
                 f"{floor} |")
    if cema.get("skipped"):
        L += ["", "Not timed:", ""] + [f"- {k}: {v}" for k, v in cema["skipped"].items()]
    return L + [""]


def markdown(report: dict, plot_note: str | None) -> str:
    d = report["data"]
    env = d.get("env") or {}
    L = [f"# GPU acceptance run{' (dry run on the CPU)' if report['dry'] else ''}", "",
         f"`{report['command']}`, {report['date']}, {report['total_s']:.0f} s of a {report['budget_s']:g} s budget.", ""]
    if env:
        L += ["| | |", "|---|---|"]
        for k in ("device", "capability", "sms", "memory_gib", "megalodon_kernels", "torch", "torch cuda", "triton",
                  "cupy", "nvrtc", "numpy", "python", "cpu cores", "tf32_matmul"):
            if k in env:
                L.append(f"| {k} | {env[k]} |")
        for k, v in (env.get("clocks") or {}).items():
            L.append(f"| {k} | {v} |")
        L.append(f"| device-to-device copy | {env['d2d_bytes_per_s'] / 1e9:.1f} GB/s (read + write of "
                 f"{env['copy_bytes'] >> 20} MiB, best of 5) |")
        L.append(f"| matmul {env['matmul_n']}^3 | fp32 {env['fp32_flops'] / 1e12:.3g} TFLOP/s, bf16 "
                 f"{env['bf16_flops'] / 1e12:.3g} TFLOP/s |")
        L.append("")
    L += ["## Steps", "", "| step | status | seconds (limit) | result |", "|---|---|---|---|"]
    for s in report["steps"]:
        lim = f" ({s['limit_s']:.0f})" if "limit_s" in s else ""
        res = "<br>".join(x.strip().replace("|", "/") for x in s["summary"]) or "-"
        files = ", ".join(f"`{f}`" for f in s.get("files", []))
        L.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f}{lim} | {res}{'<br>files: ' + files if files else ''} |")
    L.append("")
    ops = d.get("ops")
    if ops and ops.get("rows"):
        L += ["## Per-op times", "",
              f"Shape set `{ops['shape_set']}` ({ops['dtype']}); shapes as `bench/shapes.py`, inputs as the "
              "`bench/test_<op>.py` suites. GB/s = the op's ideal bytes (`bench/roofline.py`: every input read "
              "once, every output written once) / the median time; % of peak = that / the measured copy bandwidth "
              "above: a kernel near 100 % moves no more than the ideal bytes at the copy's speed (it can exceed "
              "100 % only by keeping data in cache). first call = compile (Triton JIT, NVRTC cache) + allocation.",
              "", "| op | L | backend | mode | median ms | p20-p80 ms | reps | GB/s | % of peak | GFLOP/s | first call s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ops["rows"]:
            pk = "-" if r.get("of_peak") is None else f"{r['of_peak'] * 100:.0f}"
            L.append(f"| {r['op']} | {r['L']} | {r['provider']} | {r['mode']} | {_fmt_ms(r['median'])} | "
                     f"{_fmt_ms(r['p20'])}-{_fmt_ms(r['p80'])} | {r['reps']} | {r['bytes_per_s'] / 1e9:.3g} | {pk} | "
                     f"{r['ideal_flops'] / r['median'] / 1e9:.3g} | {r['first_call_s']:.2f} |")
        if ops.get("skipped"):
            L += ["", "Not timed (the backend's own reason, or the error):", ""]
            L += [f"- {k}: {v}" for k, v in ops["skipped"].items()]
        if ops.get("not_reached"):
            L += ["", "Not reached within the step's time: " + ", ".join(ops["not_reached"])]
        L.append("")
        L += _cema_section(ops.get("cema") or {})
    model = d.get("model")
    if model:
        L += ["## Megalodon vs the matched Transformer", "",
              "The bench model (bench/cpu_step.py) and the Llama-style model of the same width, depth and "
              "parameter count (bench/vs_transformer.py), batch 1, same tokens, same fused loss. "
              "Peak memory: " + (model["train"][0]["peak_kind"] if model["train"] else "-") + ".", "",
              "| model | tokens | step ms | tokens/s | peak MiB |", "|---|---|---|---|---|"]
        for r in model["train"]:
            tps = "-" if not r.get("tokens_per_s") else f"{r['tokens_per_s']:.0f}"
            L.append(f"| {r['kind']} | {r['tokens']} | {_fmt_ms(r['step_s'])} | {tps} | {r['peak_bytes'] / 2**20:.0f} |")
        L += ["", "Megalodon / Transformer: " + ", ".join(
            f"{q['tokens']} tokens: time {q['time']:.2f}x, memory {q['memory']:.2f}x" for q in model["ratios"]
            if q["time"] and q["memory"]) or "-"]
        if model.get("non_gemm_share") is not None:
            L += ["", f"Megalodon's non-GEMM share of the step (profiler, {'device' if env.get('capability', '-') != '-' else 'CPU'} "
                      f"time): {model['non_gemm_share']:.2f}"]
        if model["decode"]:
            L += ["", "| model | context | new tokens | prefill s | decode tokens/s |", "|---|---|---|---|---|"]
            for r in model["decode"]:
                L.append(f"| {r['kind']} | {r['context']} | {r['new']} | {r['prefill_s']:.2f} | {r['tokens_per_s']:.1f} |")
        if model.get("notes"):
            L += [""] + [f"- {n}" for n in model["notes"]]
        L.append("")
    if report["plots"]:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    elif plot_note:
        L += [f"({plot_note})", ""]
    failed = [s for s in report["steps"] if s.get("traceback")]
    if failed:
        L += ["## Failures", ""]
        for s in failed:
            L += [f"### {s['name']}", "", "```", s["traceback"], "```", ""]
    return "\n".join(L)
