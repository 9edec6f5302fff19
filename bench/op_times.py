"""CPU wall time of every op's forward and forward+backward at one shape (torch backend).

    python bench/op_times.py [--B 2 --D 256 --L 4096 --N 16 --H 2 --chunk 256] [--reps 5]

The shape defaults to the Foundation issue's measurement point: B=2, D=256, L=4096, N=16,
TimestepNorm with G=16 and G=32, attention with H=2 heads of dz=D/4/H... (z_dim = D/4 and
value_dim = 2D as in the Megalodon configs) over chunks of 256 with causal masking.
Reports the median and the 20th/80th percentiles of ``reps`` timed runs after one warm-up.
This is a quick table for closing notes; the pytest-benchmark suites are the real benchmarks.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megalodon_kernels import ops


def _time(fn, reps):
    fn()  # warm-up (allocations, lazy imports, one-time tables)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8)


def _fwd_bwd(make):
    def run_fwd():
        with torch.no_grad():
            make()

    def run_both():
        outs = make()
        outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run_fwd, run_both


def cases(B, D, L, N, H, chunk):
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dt=torch.float32: torch.randn(*s, generator=g, dtype=dt)  # noqa: E731
    p = torch.rand(D, N, generator=g).requires_grad_()
    log_q = torch.complex(-torch.rand(D, N, generator=g) * 0.1, torch.rand(D, N, generator=g) * 3).requires_grad_()
    gamma = torch.complex(r(D, N), r(D, N)).requires_grad_()
    hx = torch.complex(r(B, D, N), r(B, D, N)).requires_grad_()
    x_bdl = r(B, D, L).requires_grad_()
    k = r(D, L).requires_grad_()
    omega = r(D).requires_grad_()
    x_bld = (r(B, L, D) + 3).requires_grad_()
    scale, bias = r(D).requires_grad_(), r(D).requires_grad_()
    dz, dv = D // 4 // H, 2 * D // H
    q = r(B, L, H, dz).requires_grad_()
    kk = r(B, L, H, dz).requires_grad_()
    v = r(B, L, H, dv).requires_grad_()
    scores = r(B, H, L // chunk, chunk, chunk).requires_grad_()
    pos = torch.arange(L)
    return {
        "cema_kernel": lambda: ops.cema_kernel(p, log_q, gamma, L, hx),
        "ema_hidden": lambda: ops.ema_hidden(x_bdl, p, log_q, hx),
        "fftconv": lambda: ops.fftconv(x_bdl, k),
        "cema": lambda: ops.cema(x_bdl, p, log_q, gamma, omega, hx, return_state=True),
        "timestep_norm G=16": lambda: ops.timestep_norm(x_bld, scale, bias, 16),
        "timestep_norm G=32": lambda: ops.timestep_norm(x_bld, scale, bias, 32),
        f"attention C={chunk}": lambda: ops.attention(q, kk, v, chunk_size=chunk),
        f"dropkey_softmax C={chunk} p=0.1": lambda: ops.dropkey_softmax(scores, True, 0.1, 0),
        "rotary": lambda: ops.rotary(q, pos),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("B", 2), ("D", 256), ("L", 4096), ("N", 16), ("H", 2), ("chunk", 256), ("reps", 5)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={a.B} D={a.D} L={a.L} N={a.N} "
          f"H={a.H} dz={a.D // 4 // a.H} dv={2 * a.D // a.H} chunk={a.chunk}")
    print(f"{'op':<34} {'fwd ms (p20-p80)':>24} {'fwd+bwd ms (p20-p80)':>26}")
    for name, make in cases(a.B, a.D, a.L, a.N, a.H, a.chunk).items():
        fwd, both = _fwd_bwd(make)
        m1, l1, h1 = _time(fwd, a.reps)
        m2, l2, h2 = _time(both, a.reps)
        print(f"{name:<34} {m1 * 1e3:>9.2f} ({l1 * 1e3:6.2f}-{h1 * 1e3:6.2f}) {m2 * 1e3:>11.2f} ({l2 * 1e3:6.2f}-{h2 * 1e3:6.2f})")


if __name__ == "__main__":
    main()
