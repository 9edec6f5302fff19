"""Roofline: ideal bytes moved and FLOPs per call of every op, and the implied lower-bound time.

    python -m megalodon_kernels.bench.roofline [--sets a100 h100] [--triton]

Datasheet numbers used (dense, no sparsity):

* A100-80GB SXM: HBM2e 2.039 TB/s; 19.5 TFLOP/s fp32 (CUDA cores); 312 TFLOP/s bf16 tensor cores.
* H100 SXM5: HBM3 3.35 TB/s; 67 TFLOP/s fp32; 989 TFLOP/s bf16 tensor cores.

Lower bound per call = max(bytes / bandwidth, FLOPs / peak). Only attention's two matmuls may use the
tensor-core peak (bf16 inputs); every other op computes in fp32 whatever its I/O dtype (docs/design.md, The ops),
so it is held to the fp32 peak. These are bounds, not predictions: no GPU time is measured here.

Byte conventions ("ideal": every input read once, every output written once, nothing else; es =
element size of the I/O dtype; complex64 = 8 bytes; CEMA coefficients are always fp32):

  op               fwd bytes                                   bwd bytes (reads dy + inputs, writes grads)
  cema_kernel      20 D N + 4 D L      (p, log_q, gamma -> k)  4 D L + 40 D N
  ema_hidden       es B D L + 12 D N + 8 B D N                  2 es B D L + 8 B D N + 24 D N
  fftconv          2 es B D L + 4 D L                           3 es B D L + 8 D L
  cema             2 es B D L + 20 D N + 4 D   (k stays on-chip) 3 es B D L + 40 D N + 8 D
  timestep_norm    2 es B L D + 2 es D + 8 B + 8 B G            3 es B L D + 4 es D
  attention        es B L H (2 dh + 2 dv)                       es B L H (4 dh + 4 dv)
  dropkey_softmax  2 es B H L S                                 3 es B H L S
  rotary           2 es B L H d + 4 L d (cos, sin fp32)         same

FLOP conventions (a multiply or an add is one FLOP; complex multiply 6, real x complex MAC 4;
a real FFT of size M costs 2.5 M log2 M; exp/erf/rsqrt count 1):

  cema_kernel      fwd 10 D N L (power 6 + real-part MAC 4);  bwd 16 D N L (two weighted sums)
  ema_hidden       fwd 4 B D N L + 6 D N L;                   bwd 8 B D N L + 6 D N L
  fftconv          fwd (2B+1) D F + 6 B D (L+1), F = 2.5 M log2 M with M = 2L (x, k, inverse);
                   bwd (3B+2) D F + 12 B D (L+1)
  cema             cema_kernel + fftconv + 2 B D L (fwd) / 3 B D L (bwd)
  timestep_norm    fwd 7 B L D + 12 B L G;                    bwd 12 B L D + 12 B L G
  attention        P = B H (L/C) C (C+1)/2 visible pairs (causal, chunk C):
                   fwd 2 P (dh + dv) + 5 P;                   bwd 2 P (3 dh + 2 dv) + 5 P
  dropkey_softmax  fwd 5 B H L S;                             bwd 4 B H L S
  rotary           fwd 3 B L H d;                             bwd 3 B L H d

Where a Triton kernel exists (ops/<op>/triton_impl.py), ``--triton`` runs the interpreter byte
counter (bench/triton_bytes.py) at its medium shape, checks the fwd formula above against the
counter's own ideal there, and reports kernel bytes / ideal bytes; the kernel-bytes lower bound at
the paper shape is that ratio times the ideal bytes (the kernel's access pattern is shape-generic).
The counter's case can differ from the benchmarked call (cema_kernel's counted bwd carries a state hx,
ema_hidden's counts the dx kernel only): the ratio then describes the counted kernel, and the check
column says the formulas differ rather than pretending they agree.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

__all__ = ["DEVICES", "ideal", "lower_bound_us", "table_rows", "markdown", "measure_triton"]

DEVICES = {
    "A100-80GB": {"bw": 2.039e12, "fp32": 19.5e12, "bf16_tensor": 312e12},
    "H100 SXM": {"bw": 3.35e12, "fp32": 67e12, "bf16_tensor": 989e12},
}

ES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def _fft(M):
    return 2.5 * M * math.log2(M)


def ideal(op: str, s: dict, dtype: str = "float32") -> dict:
    """{"fwd": (bytes, flops), "bwd": (bytes, flops)} of one call at shape ``s`` (op argument letters)."""
    es = ES[dtype]
    g = s.get
    B, D, N, L = g("B", 1), g("D", 1), g("N", 1), g("L", 1)
    if op == "cema_kernel":
        return {"fwd": (20 * D * N + 4 * D * L, 10 * D * N * L), "bwd": (4 * D * L + 40 * D * N, 16 * D * N * L)}
    if op == "ema_hidden":
        return {"fwd": (es * B * D * L + 12 * D * N + 8 * B * D * N, 4 * B * D * N * L + 6 * D * N * L),
                "bwd": (2 * es * B * D * L + 8 * B * D * N + 24 * D * N, 8 * B * D * N * L + 6 * D * N * L)}
    if op == "fftconv":
        F = _fft(2 * L)
        return {"fwd": (2 * es * B * D * L + 4 * D * L, (2 * B + 1) * D * F + 6 * B * D * (L + 1)),
                "bwd": (3 * es * B * D * L + 8 * D * L, (3 * B + 2) * D * F + 12 * B * D * (L + 1))}
    if op == "cema":
        k, c = ideal("cema_kernel", s, dtype), ideal("fftconv", s, dtype)
        return {"fwd": (2 * es * B * D * L + 20 * D * N + 4 * D, k["fwd"][1] + c["fwd"][1] + 2 * B * D * L),
                "bwd": (3 * es * B * D * L + 40 * D * N + 8 * D, k["bwd"][1] + c["bwd"][1] + 3 * B * D * L)}
    if op == "timestep_norm":
        G = s["G"]
        return {"fwd": (2 * es * B * L * D + 2 * es * D + 8 * B + 8 * B * G, 7 * B * L * D + 12 * B * L * G),
                "bwd": (3 * es * B * L * D + 4 * es * D, 12 * B * L * D + 12 * B * L * G)}
    if op == "attention":
        H, dh, dv = s["H"], s["dh"], s["dv"]
        C = min(s["chunk"], L)
        P = B * H * (L // C) * C * (C + 1) // 2
        return {"fwd": (es * B * L * H * (2 * dh + 2 * dv), 2 * P * (dh + dv) + 5 * P),
                "bwd": (es * B * L * H * (4 * dh + 4 * dv), 2 * P * (3 * dh + 2 * dv) + 5 * P)}
    if op == "dropkey_softmax":
        n = B * s["H"] * L * s["S"]
        return {"fwd": (2 * es * n, 5 * n), "bwd": (3 * es * n, 4 * n)}
    if op == "rotary":
        H, d = s["H"], s["d"]
        n = B * L * H * d
        return {"fwd": (2 * es * n + 4 * L * d, 3 * n), "bwd": (2 * es * n + 4 * L * d, 3 * n)}
    raise KeyError(op)


def uses_tensor_cores(op: str, dtype: str) -> bool:
    return op == "attention" and dtype in ("bfloat16", "float16")


def lower_bound_us(op: str, nbytes: float, flops: float, dtype: str, device: str) -> tuple[float, str]:
    dev = DEVICES[device]
    peak = dev["bf16_tensor"] if uses_tensor_cores(op, dtype) else dev["fp32"]
    t_mem, t_flop = nbytes / dev["bw"], flops / peak
    return max(t_mem, t_flop) * 1e6, ("memory" if t_mem >= t_flop else "compute")


# ------------------------------------------------------------------ Triton byte counter
_MEASURE_SNIPPET = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"
from megalodon_kernels.bench.triton_bytes import measure
from megalodon_kernels.bench.aot import TRITON_OPS
out = []
for op in TRITON_OPS:
    for name, shape, c, ideal in measure(op):
        out.append(dict(op=op, kernel=name, shape=shape, total=c.total, unique=c.loaded_unique + c.stored_unique,
                        counter_ideal=ideal))
print("JSON" + json.dumps(out))
"""


def measure_triton() -> list[dict]:
    """Run the interpreter byte counter on every Triton kernel (in a subprocess: TRITON_INTERPRET
    must be set before triton is imported). Empty list if triton is unavailable."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _MEASURE_SNIPPET], capture_output=True, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("JSON"):
            return json.loads(line[4:])
    return []


def _counter_shape(row: dict) -> dict:
    """Parse the counter's shape text ("B=2 L=256 H=4 d=64 fp32") into op letters."""
    s = {}
    for tok in row["shape"].split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            try:
                s[k] = int(v)
            except ValueError:
                pass
    return s


def triton_ratios(measured: list[dict]) -> dict[str, dict]:
    """"op mode" -> counter row + formula check + kernel/ideal ratio, for each counted kernel.

    The mode (fwd/bwd) is read from the kernel's name. The ratio is the counter's total bytes over the
    counter's own ideal for its case; the formula check compares that ideal with this file's formula
    at the counter's shape (the counter's case may differ, e.g. carry a state hx or count one of
    several backward kernels: then they differ and the table says so). When an op has several
    kernels for one mode, the first counted one gives the ratio.
    """
    out = {}
    for row in measured:
        s = _counter_shape(row)
        mode = "bwd" if "bwd" in row["kernel"] else "fwd"
        dt = "bfloat16" if "bf16" in row["shape"] else ("float16" if "fp16" in row["shape"] else "float32")
        try:
            formula = ideal(row["op"], s, dt)[mode][0]
        except (KeyError, TypeError):
            formula = None
        key = f"{row['op']} {mode}"
        item = dict(row, mode=mode, formula_ideal=formula, formula_ok=formula == row["counter_ideal"],
                    ratio=row["total"] / row["counter_ideal"])
        out.setdefault(key, item)
        out.setdefault("_all", []).append(item)
    return out


def table_rows(set_names=("a100", "h100"), ratios: dict | None = None) -> list[dict]:
    from .shapes import BENCH_SETS, shape

    rows = []
    ratios = ratios or {}
    for set_name in set_names:
        device = {"a100": "A100-80GB", "h100": "H100 SXM"}[set_name]
        dtype = BENCH_SETS[set_name].dtypes[0]
        for op in ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax",
                   "rotary"):
            for L in BENCH_SETS[set_name].lengths:
                s = shape(op, set_name, L)
                for mode, (nb, fl) in ideal(op, s, dtype).items():
                    t, bound = lower_bound_us(op, nb, fl, dtype, device)
                    r = ratios.get(f"{op} {mode}")
                    kb = nb * r["ratio"] if r else None
                    tk = lower_bound_us(op, kb, fl, dtype, device)[0] if r else None
                    rows.append(dict(set=set_name, device=device, dtype=dtype, op=op, L=L, mode=mode, shape=s,
                                     bytes=nb, flops=fl, intensity=fl / nb, lb_us=t, bound=bound,
                                     kernel_bytes=kb, kernel_over_ideal=(r["ratio"] if r else None), lb_kernel_us=tk))
    return rows


def _fmt(x, unit=""):
    if x is None:
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {suf}{unit}"
    return f"{x:.3g} {unit}"


def markdown(rows: list[dict], ratios: dict | None = None) -> str:
    lines = ["| device | op | L | mode | shape | ideal bytes | FLOPs | FLOP/B | lower bound | bound | "
             "kernel/ideal bytes (Triton counter) | lower bound at kernel bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shp = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        ratio = "-" if r["kernel_over_ideal"] is None else f"{r['kernel_over_ideal']:.3f}"
        lbk = "-" if r["lb_kernel_us"] is None else f"{r['lb_kernel_us']:.1f} us"
        lines.append(f"| {r['device']} {r['dtype']} | {r['op']} | {r['L']} | {r['mode']} | {shp} | {_fmt(r['bytes'], 'B')} | "
                     f"{_fmt(r['flops'])} | {r['intensity']:.2f} | {r['lb_us']:.1f} us | {r['bound']} | "
                     f"{ratio} | {lbk} |")
    if ratios:
        lines += ["", "Triton byte counter (interpreter, medium shape; formula = this file's ideal-bytes formula for the kernel's mode):", "",
                  "| op | kernel | shape | counted bytes (total) | unique | counter ideal | formula ideal | "
                  "formula matches | kernel/ideal |", "|---|---|---|---|---|---|---|---|---|"]
        for r in ratios.get("_all", []):
            lines.append(f"| {r['op']} | {r['kernel']} | {r['shape']} | {r['total']} | {r['unique']} | "
                         f"{r['counter_ideal']} | {r['formula_ideal']} | "
                         f"{'yes' if r['formula_ok'] else 'no (counter case differs, see roofline.py)'} | "
                         f"{r['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="ideal bytes/FLOPs and lower-bound times on A100/H100")
    ap.add_argument("--sets", nargs="*", default=["a100", "h100"], choices=["a100", "h100"])
    ap.add_argument("--triton", action="store_true", help="run the Triton interpreter byte counter too")
    a = ap.parse_args(argv)
    ratios = triton_ratios(measure_triton()) if a.triton else None
    print(markdown(table_rows(a.sets, ratios), ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
