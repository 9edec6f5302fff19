"""The ``upstream`` step of ``python -m megalodon_kernels.bench gpu`` (registered in bench/gpu_run.py).

Two measurements on the same GPU, in the step's time limit (about 90 s on an H200):

1. ops (about 60 % of the limit): bench/vs_upstream.py at the paper-7B shapes, then the probe shapes
   while time is left: forward / backward / forward+backward time of upstream's CUDA extension and of
   the cuda, triton and torch backends, the ratio to upstream, the error against a float64 reference;
2. model (the rest): one training step (bf16 autocast, AdamW) of Megalodon and of the matched
   Llama-style Transformer at the 7B width (D 4096, 2 layers each, vocabulary 32000) at 4096 and
   32768 tokens (bench/vs_transformer.py, ``measure_paper``): tokens/s, peak memory, the throughput
   ratio beside the paper's (0.95 at 4K, 1.32 at 32K).

The upstream module is ``$MEGALODON_UPSTREAM`` (the .so or its folder), else ``.upstream/`` in the
checkout root (bench/upstream_build.py --out puts it there). When it is absent or does not load,
the upstream rows are skipped with the reason and everything else still runs. ``--dry``: tiny shapes
on the CPU, torch backend only, a 64-wide one-layer model step (CI keeps the step working).

Writes ``upstream.json`` (all figures), ``upstream.md`` (the section appended to gpu_run.md) and
``upstream.png`` (time per case and backend relative to upstream = 1).
"""
from __future__ import annotations

import json
import time

import torch

OPS_SHARE = 0.6


def _model_lines(model: dict) -> list[str]:
    from megalodon_kernels.bench.vs_transformer import PAPER_THROUGHPUT_RATIO

    L = ["### Training step at the 7B width: Megalodon vs the matched Transformer", "",
         "bench/vs_transformer.py `measure_paper`: " + (model["rows"][0]["precision"] if model["rows"] else "-")
         + f"; {model['layers']} layer(s) of each at width {model['width']} (the paper's models have 32: the "
         "embedding and output head, the same in both, weigh more here), batch 1. Paper ratio = Megalodon / "
         "Llama2 tokens/s per device, section 4.1, Fig. 4 (" + ", ".join(
             f"{k}: {v:.2f}" for k, v in PAPER_THROUGHPUT_RATIO.items()) + ").", "",
         "| model | tokens | params | step ms | tokens/s | peak MiB |", "|---|---|---|---|---|---|"]
    for r in model["rows"]:
        if r.get("error"):
            L.append(f"| {r['kind']} | {r['tokens']} | {r['params'] / 1e6:.1f}M | ERROR: {r['error'][:150]} | | |")
            continue
        step = "-" if r.get("step_s") is None else f"{r['step_s'] * 1e3:.1f}"
        tps = "-" if not r.get("tokens_per_s") else f"{r['tokens_per_s']:.0f}"
        L.append(f"| {r['kind']} | {r['tokens']} | {r['params'] / 1e6:.1f}M | {step} | {tps} | "
                 f"{r['peak_bytes'] / 2**20:.0f} |")
    L += ["", "| tokens | Megalodon / Transformer tokens/s | paper | peak memory ratio |", "|---|---|---|---|"]
    for q in model["ratios"]:
        paper = "-" if q["paper"] is None else f"{q['paper']:.2f}"
        mem = "-" if q["memory"] is None else f"{q['memory']:.2f}"
        L.append(f"| {q['tokens']} | {q['throughput']:.2f} | {paper} | {mem} |")
    L += [""] + [f"- {n}" for n in model["notes"]]
    return L


def step_upstream(run, limit_s: float) -> dict:
    from megalodon_kernels.bench import vs_transformer as vt
    from megalodon_kernels.bench import vs_upstream as vu

    t0 = time.perf_counter()
    end = t0 + limit_s
    dev = run.device
    notes = []
    # 1. ops
    if run.dry:
        ext, note = None, "dry run: upstream's extension is CUDA code, skipped"
        sets, dtypes, providers, reps = ["dry"], ["float32"], ["upstream", "torch", "sdpa"], 1
    else:
        location = vu.upstream_location()
        ext, note = vu.load_upstream(location)
        note = ("upstream: " if ext is not None else "upstream rows skipped: ") + note
        sets, dtypes, providers, reps = ["7b", "probe"], ["bfloat16", "float32"], list(vu.PROVIDERS), 3
    notes.append(note)
    print(f"  {note}", flush=True)
    # a line per case as it ends, so the run's log shows progress (and where a case hangs)
    res = vu.run(sets, dtypes, providers, ext, dev, reps, t0 + OPS_SHARE * limit_s,
                 log=lambda line: print(f"  {time.perf_counter() - t0:5.0f} s  {line[:160]}", flush=True),
                 ext_note=note)
    # 2. the training step at the 7B width
    if run.dry:
        points, layers, steps, width, chunk = (128,), 1, 1, 64, 32
    else:
        points, layers, steps, width, chunk = (4096, 32768), 2, 2, 4096, 4096
    rows, mnotes = [], []
    print(f"  {time.perf_counter() - t0:5.0f} s  training steps at width {width}, {layers} layer(s): {points} tokens",
          flush=True)
    if time.perf_counter() < end:
        try:
            rows = vt.measure_paper(vt.KINDS, points, layers, steps, dev, max(1.0, end - time.perf_counter()),
                                    width=width, chunk=chunk, deadline=end)
        except Exception as exc:
            mnotes.append(f"train: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    done = {(r["kind"], r["tokens"]) for r in rows}
    mnotes += [f"train {k} {n}: not reached in the step's time" for n in points for k in vt.KINDS
               if (k, n) not in done and not any("ERROR" in m for m in mnotes)]
    mnotes.append("upstream's kernels inside the model step: not measured (they would replace this library's ops "
                  "in its model layer, which takes no external kernels)")
    model = dict(rows=rows, ratios=vt.paper_ratios(rows), layers=layers, width=width, notes=mnotes)
    # report
    files = ["upstream.json", "upstream.md"]
    why = vu.plot(res, run.out / "upstream.png")
    if why is None:
        files.append("upstream.png")
    else:
        notes.append(why)
    header = ["## Upstream Megalodon's kernels, cuFFT, SDPA and the 7B-width step", "",
              "bench/gpu_upstream_step.py; the ops as `python bench/vs_upstream.py` (its docstring: the cases and "
              "upstream's calling conventions)."] + [""] + [f"- {n}" for n in notes]
    md = vu.markdown(res, header) + "\n" + ("![upstream.png](upstream.png)\n\n" if why is None else "")
    md += "\n".join(_model_lines(model)) + "\n"
    data = dict(notes=notes, ops=res, model=model, markdown=md)
    (run.out / "upstream.json").write_text(json.dumps({k: v for k, v in data.items() if k != "markdown"}, indent=1,
                                                      default=str))
    (run.out / "upstream.md").write_text(md)
    summary = [note]
    timed = [r for r in res["rows"] if not r.get("error")]
    summary.append(f"ops: {len(timed)} case x dtype points, {len(res['rows']) - len(timed)} failed, "
                   f"{len(res['not_reached'])} not reached")
    for r in timed[:8]:
        summary.append("  " + vu.summary_line(r)[:150])
    for q in model["ratios"]:
        paper = "" if q["paper"] is None else f" (paper {q['paper']:.2f})"
        summary.append(f"model {q['tokens']} tokens: Megalodon / Transformer tokens/s {q['throughput']:.2f}{paper}")
    summary += [n for n in mnotes if "ERROR" in n or "not reached" in n][:3]
    errors = ([r for r in res["rows"] if r.get("error")] + [n for n in mnotes if "ERROR" in n]
              + [r for r in rows if r.get("error")])
    summary += [f"model {r['kind']} {r['tokens']}: ERROR {r['error'][:100]}" for r in rows if r.get("error")]
    return dict(summary=summary, files=files, data=data, failed=bool(errors))
