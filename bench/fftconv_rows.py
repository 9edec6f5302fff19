"""fftconv at many rows, the case the Triton row-tiled FFT is built for (issue 39): B x D = 8192 rows
at L = 1K, 4K and 16K, in bf16 and fp32, every GPU backend's forward and forward+backward time, its
ratio to the torch and the cuda backends, and the fraction of the measured copy bandwidth it
reaches on the ideal bytes (``roofline.ideal``: inputs read once, outputs written once).

Run by ``bench gpu``'s ops step (``gpu_steps.step_ops``: the rows go to ops.json under
"fftconv_rows" and to the step's summary), within at most 60 s and half the step's limit
(``gpu_steps.FFTCONV_ROWS_S``): a few repetitions per point, since at these sizes one call takes
milliseconds, and Triton's first calls JIT-compile its new tile sizes (hence its points come last). The dry run (``--dry``, CPU) runs the same code
on one tiny shape.
"""
from __future__ import annotations

import statistics

import torch

#: (B, D, L): 8192 rows at each length (D as in the paper-7B model's CEMA width scale)
GPU_CASES = ((8, 1024, 1024), (8, 1024, 4096), (8, 1024, 16384))
DRY_CASES = ((2, 4, 64),)
BACKENDS = ("torch", "cuda", "triton")
#: further providers: a backend forced to one config beside its default, timed in the same run
#: ("cuda b1": the CUDA FFT blocks at one butterfly per thread, the launch before BUTTERFLIES_PER_THREAD)
FORCED = {"cuda b1": ("cuda", {"butterflies_per_thread": 1})}
DTYPES = ("bfloat16", "float32")
#: timed modes (forward alone; forward + backward, the training step's cost)
MODES = ("fwd", "fwd+bwd")


def _case(B, D, L, dtype, device):
    x = torch.randn(B, D, L, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(D, L, device=device, requires_grad=True)  # CEMA's kernel is fp32
    return x, k


def measure(device, peak, end, time_case, no_cuda=None, budget_s=0.05, min_reps=3, max_reps=20):
    """-> (rows, skipped, summary lines). ``time_case(fn, leaves, device, budget_s, min_reps, max_reps)``
    is the ops step's timer; ``end`` its perf_counter deadline; ``peak`` the copy bandwidth (bytes/s)."""
    import time

    import contextlib

    from megalodon_kernels import ops
    from megalodon_kernels.autotune import registry
    from megalodon_kernels.bench import roofline
    from megalodon_kernels.ops.fftconv import BACKENDS as FFTCONV

    cases = GPU_CASES if device.type == "cuda" else DRY_CASES
    rows, skipped = [], {}
    # the library backends at every point first, then Triton's (its first calls JIT-compile the new
    # tile sizes, tens of seconds on the host): a share spent compiling costs Triton points, never
    # the baselines they are compared with
    points = [(backend, B, D, L, dtype_name) for group in (BACKENDS[:-1] + tuple(FORCED), BACKENDS[-1:])
              for B, D, L in cases for dtype_name in DTYPES for backend in group]
    for provider, B, D, L, dtype_name in points:
        backend, knobs = FORCED.get(provider, (provider, None))
        dtype = getattr(torch, dtype_name)
        shp = {"B": B, "D": D, "L": L}
        key = f"fftconv rows={B * D} L={L} {dtype_name} {provider}"
        if time.perf_counter() > end:
            skipped[key] = "not reached in the step's time"
            continue
        torch.manual_seed(0)
        x = k = None
        try:
            x, k = _case(B, D, L, dtype, device)
            why = [no_cuda] if backend == "cuda" and no_cuda else FFTCONV.reasons(backend, {"x": x, "k": k})
            if why:
                skipped[key] = "; ".join(why)
                continue
            pinned = (contextlib.nullcontext() if knobs is None else
                      registry.force("fftconv", backend, {**{n: v[0] for n, v in FFTCONV.config_spaces()[backend].items()},
                                                         **knobs}))
            with pinned:  # the forward and the backward both dispatch under it
                t = time_case(lambda x=x, k=k, b=backend: ops.fftconv(x, k, backend=b), [x, k], device,
                              budget_s, min_reps, max_reps)
        except Exception as exc:
            skipped[key] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
            continue
        finally:
            x = k = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ideal = roofline.ideal("fftconv", shp, dtype_name)
        for mode in MODES:
            med = statistics.median(t[mode])
            nb = ideal["fwd"][0] + (ideal["bwd"][0] if mode == "fwd+bwd" else 0)
            rows.append(dict(op="fftconv", provider=provider, mode=mode, B=B, D=D, L=L, dtype=dtype_name,
                             median=med, reps=len(t[mode]), ideal_bytes=nb, bytes_per_s=nb / med,
                             of_peak=(nb / med / peak) if peak else None))
    return rows, skipped, summarize(rows)


def summarize(rows) -> list[str]:
    """One line per (L, dtype, backend): fwd and fwd+bwd times, the ratio of the torch and cuda
    backends' fwd+bwd time to this one's (> 1: this one is faster), and the copy-peak fraction."""
    at = {(r["L"], r["dtype"], r["provider"], r["mode"]): r for r in rows}
    out = []
    for (L, dt, be, mode), r in sorted(at.items()):
        if mode != "fwd+bwd":
            continue
        f = at.get((L, dt, be, "fwd"))
        ratios = []
        for ref in ("torch", "cuda"):
            o = at.get((L, dt, ref, "fwd+bwd"))
            if o is not None and ref != be:
                ratios.append(f"{ref}/{be} {o['median'] / r['median']:.2f}x")
        peak = f", {r['of_peak'] * 100:.0f}% of copy BW" if r["of_peak"] else ""
        out.append(f"  fftconv rows={r['B'] * r['D']} L={L:<5} {dt:<8} {be:<6} fwd "
                   f"{f['median'] * 1e3 if f else float('nan'):8.3f} ms  fwd+bwd {r['median'] * 1e3:8.3f} ms"
                   f"{peak}{'  ' + ', '.join(ratios) if ratios else ''}")
    return out
