"""The CUDA attention's two paths side by side: the fused flash kernels against cuBLAS matmuls around
the dropkey_softmax kernels, at the paper-7B attention shape (B 1, L 4096, H 4, dz 256, chunk 4096)
over the value width dv, in bf16 and fp32: forward and forward+backward milliseconds per path and
the ratio flash / matmul.

Why: the flash kernels tile v in column blocks and recompute q k^T once per block, so their cost
grows with dv / block while the matmul path forms the scores once; the H200 run showed flash 12.7x
behind upstream at dv 2048 in bf16. This measures where the crossover lies, so ``path="auto"``
can choose by measurement.

    python -m megalodon_kernels.bench.attention_paths --out DIR        # on a GPU (about 20 s)
    python -m megalodon_kernels.bench.attention_paths --out DIR --dry  # CPU: the torch backend, tiny
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

#: (B, L, H, dz, chunk) and the value widths swept
GPU_SHAPE, GPU_DVS = (1, 4096, 4, 256, 4096), (256, 1024, 2048)
DRY_SHAPE, DRY_DVS = (1, 32, 2, 16, 16), (16, 32)
DTYPES = ("bfloat16", "float32")


def _median_ms(fn, device, reps: int) -> float:
    from megalodon_kernels.bench.gpu_steps import sync

    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def measure(device, shape, dvs, paths, reps: int) -> list[dict]:
    from megalodon_kernels.autotune import registry
    from megalodon_kernels.ops.attention import attention

    B, L, H, dz, chunk = shape
    rows = []
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for dv in dvs:
            gen = torch.Generator(device="cpu").manual_seed(0)
            q, k = (torch.randn(B, L, H, dz, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
            v = torch.randn(B, L, H, dv, generator=gen).to(device, dtype).requires_grad_()
            do = torch.randn(B, L, H, dv, generator=gen).to(device, dtype)
            for backend, config in paths:
                row = {"dtype": dtype_name, "B": B, "L": L, "H": H, "dz": dz, "dv": dv, "chunk": chunk,
                       "backend": backend, "path": config.get("path", "-")}

                def fwd():
                    with registry.force("attention", backend, config):
                        return attention(q, k, v, scale=dz ** -0.5, causal=True, chunk_size=chunk, backend=backend)

                def step():
                    torch.autograd.grad(fwd(), (q, k, v), do)

                try:
                    with torch.no_grad():
                        row["fwd_ms"] = _median_ms(fwd, device, reps)
                    row["fwd+bwd_ms"] = _median_ms(step, device, reps)
                except Exception as exc:  # a refused path is a row, not the end of the sweep
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
            del q, k, v, do
    return rows


def table(rows: list[dict]) -> str:
    out = ["| dtype | dv | backend | path | fwd ms | fwd+bwd ms | flash/matmul fwd | flash/matmul fwd+bwd |",
           "|---|---|---|---|---|---|---|---|"]
    by = {(r["dtype"], r["dv"], r["path"]): r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['dtype']} | {r['dv']} | {r['backend']} | {r['path']} | {r['error']} | | | |")
            continue
        m = by.get((r["dtype"], r["dv"], "matmul"))
        ratio = (lambda key: f"{r[key] / m[key]:.2f}" if m and r["path"] != "matmul" else "-")
        out.append(f"| {r['dtype']} | {r['dv']} | {r['backend']} | {r['path']} | {r['fwd_ms']:.3f} | "
                   f"{r['fwd+bwd_ms']:.3f} | {ratio('fwd_ms')} | {ratio('fwd+bwd_ms')} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for attention_paths.json / .md")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, the torch backend only")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median)")
    args = ap.parse_args(argv)
    if args.dry:
        device, shape, dvs, paths = torch.device("cpu"), DRY_SHAPE, DRY_DVS, [("torch", {})]
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run with --dry on a CPU")
        device, shape, dvs = torch.device("cuda"), GPU_SHAPE, GPU_DVS
        paths = [("cuda", {"path": "flash"}), ("cuda", {"path": "matmul"})]
    rows = measure(device, shape, dvs, paths, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (args.out / "attention_paths.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    text = f"# attention: flash vs matmul path ({name})\n\n" + table(rows)
    (args.out / "attention_paths.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
