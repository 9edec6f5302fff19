"""Accuracy of the fp32 composed cema, FFT form against chunked form, at long L against float64.

    python bench/accuracy_cema_forms.py [--lengths 16 18 20] [--gaps 1e-5 1e-3] [--chunk 64]

For every length 2**e and gap 1-|q| (the coefficients of bench/accuracy_cema.py, D = 2, N = 16,
with an initial state hx), runs ``ops.cema`` on the torch backend in fp32 with ``chunk=0`` (the
FFT form) and ``chunk=C`` (the chunked form: Toeplitz matmuls and a two-level scan over chunk
states) and reports each output's norm-wise error max|y - y64| / max|y64| against the float64
evaluation of the same fp32 inputs (the FFT form in float64, ~1e-13 accurate).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megalodon_kernels.ops import cema
from megalodon_kernels.ops.cema import torch_impl

sys.path.insert(0, str(Path(__file__).parent))
from accuracy_cema import make_inputs  # noqa: E402


def run(x, p, log_q, gamma, omega, hx, chunk):
    saved = dict(torch_impl.DEFAULT_CONFIG)
    torch_impl.DEFAULT_CONFIG["chunk"] = chunk
    try:
        return cema(x, p, log_q, gamma, omega, hx, backend="torch")[0]
    finally:
        torch_impl.DEFAULT_CONFIG.update(saved)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 18, 20], help="log2 of L")
    ap.add_argument("--gaps", type=float, nargs="+", default=[1e-5, 1e-3], help="1 - |q|")
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| L | 1-abs(q) | FFT form | chunked form |\n|---|---|---|---|")
    for e in args.lengths:
        for gap in args.gaps:
            p, log_q, gamma, hx = make_inputs(2, 16, 1, gap)
            gen = torch.Generator().manual_seed(e)
            x, omega = torch.randn(1, 2, 1 << e, generator=gen), torch.randn(2, generator=gen)
            wide = [t.to(torch.complex128) if t.is_complex() else t.double() for t in (x, p, log_q, gamma, omega, hx)]
            ref = run(*wide, 0)
            err = [float((run(x, p, log_q, gamma, omega, hx, c).double() - ref).abs().max() / ref.abs().max())
                   for c in (0, args.chunk)]
            print(f"| 2^{e} | {gap:g} | {err[0]:.2e} | {err[1]:.2e} |")


if __name__ == "__main__":
    main()
