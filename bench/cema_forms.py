"""cema's two torch forms, FFT and chunked: fp32 accuracy at long L, and CPU time per shape.

    python bench/cema_forms.py accuracy [--lengths 16 18 20] [--gaps 1e-5 1e-3] [--chunk 64] [--triton]
    python bench/cema_forms.py time [--shapes 8,128,256 4,128,512 2,256,4096] [--chunk 64] [--reps 7] [--cpu]

``accuracy``: for every length 2**e and gap 1-|q| (the coefficients of bench/accuracy_cema.py,
D = 2, N = 16, with an initial state hx), runs ``ops.cema`` on the torch backend in fp32 in each
form and reports its output's norm-wise error max|y - y64| / max|y64| against the float64
evaluation of the same fp32 inputs (the FFT form in float64, ~1e-13 accurate). ``--triton`` adds
the Triton backend's chunked kernels (ops/cema/triton_chunked.py, its default chunk; y of the
forward kernel) on the same inputs: on a CPU run it with TRITON_INTERPRET=1 (the interpreter,
minutes at L = 2**20).

``time``: for every B,D,L (N = 16, no hx, float32), the median thread CPU time of the forward
(no grad) and of forward+backward of each form, one thread. Thread CPU time, not wall time, so
that a second job on the other core disturbs it less. ``--cpu`` adds the cpu backend's FFT form
(the torch composition with fftconv's compiled kernel; the chunked form beyond that kernel's
longest L), the comparison behind that backend's chunk_min_len.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from megalodon_kernels.ops import cema
from megalodon_kernels.ops.cema import cpu_impl, torch_impl

sys.path.insert(0, str(Path(__file__).parent))
from accuracy_cema import make_inputs  # noqa: E402


@contextlib.contextmanager
def form(chunk: int, module=torch_impl):
    """A backend (the torch one by default) in the FFT form (chunk 0) or the chunked form with
    chunks of ``chunk`` at every length."""
    saved = dict(module.DEFAULT_CONFIG)
    module.DEFAULT_CONFIG.update(chunk=chunk, chunk_min_len=0)
    try:
        yield
    finally:
        module.DEFAULT_CONFIG.update(saved)


@contextlib.contextmanager
def cpu_fft_form():
    """The cpu backend's FFT form at every length its convolution takes (the recurrence for the
    shortest calls stays, as in its default)."""
    saved = dict(cpu_impl.DEFAULT_CONFIG)
    cpu_impl.DEFAULT_CONFIG.update(chunk_min_len=1 << 62)
    try:
        yield
    finally:
        cpu_impl.DEFAULT_CONFIG.update(saved)


def accuracy(args):
    head = "| L | 1-abs(q) | FFT form | chunked form |" + (" Triton chunked |" if args.triton else "")
    print(head + "\n|---|---|---|---|" + ("---|" if args.triton else ""))
    for e in args.lengths:
        for gap in args.gaps:
            p, log_q, gamma, hx = make_inputs(2, 16, 1, gap)
            gen = torch.Generator().manual_seed(e)
            x, omega = torch.randn(1, 2, 1 << e, generator=gen), torch.randn(2, generator=gen)
            wide = [t.to(torch.complex128) if t.is_complex() else t.double() for t in (x, p, log_q, gamma, omega, hx)]
            with form(0):
                ref = cema(*wide, backend="torch")[0]
            err = []
            for chunk in (0, args.chunk):
                with form(chunk):
                    y = cema(x, p, log_q, gamma, omega, hx, backend="torch")[0]
                err.append(float((y.double() - ref).abs().max() / ref.abs().max()))
            if args.triton:
                from megalodon_kernels.ops.cema import triton_chunked, triton_impl

                cfg = {k: triton_impl.DEFAULT_CONFIG[k] for k in triton_impl.CHUNK_SPACE}
                y = triton_chunked.conv_fwd(x, p, log_q, gamma, omega, hx, **cfg)
                err.append(float((y.double() - ref).abs().max() / ref.abs().max()))
            print(f"| 2^{e} | {gap:g} | " + " | ".join(f"{v:.2e}" for v in err) + " |")


def _median_ms(fn, reps):
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e3


def speed(args):
    forms = [("FFT", "torch", lambda: form(0)), ("chunked", "torch", lambda: form(args.chunk))]
    if args.cpu:
        forms.append(("cpu FFT", "cpu", cpu_fft_form))
    print("| B, D, L | " + " | ".join(f"{name} fwd ms | {name} fwd+bwd ms" for name, _, _ in forms) + " |")
    print("|---|" + "---|---|" * len(forms))
    for shape in args.shapes:
        B, D, L = (int(v) for v in shape.split(","))
        gen = torch.Generator().manual_seed(0)
        p, log_q, gamma, _ = make_inputs(D, 16, 1, 1e-2)
        coef = [t.clone().requires_grad_(True) for t in (p, log_q, gamma, torch.randn(D, generator=gen))]
        x = torch.randn(B, D, L, generator=gen, requires_grad=True)
        dy = torch.randn(B, D, L, generator=gen)

        row = []
        for _, backend, context in forms:
            def fwd():
                with torch.no_grad():
                    cema(x, *coef, backend=backend)

            def fwd_bwd():
                cema(x, *coef, backend=backend)[0].backward(dy)

            with context():
                row += [_median_ms(fwd, args.reps), _median_ms(fwd_bwd, args.reps)]
        print(f"| {B}, {D}, {L} | " + " | ".join(f"{t:.1f}" for t in row) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--lengths", type=int, nargs="+", default=[16, 18, 20], help="log2 of L")
    a.add_argument("--gaps", type=float, nargs="+", default=[1e-5, 1e-3], help="1 - |q|")
    a.add_argument("--chunk", type=int, default=64)
    a.add_argument("--triton", action="store_true", help="also the Triton chunked kernels (TRITON_INTERPRET=1 on a CPU)")
    t = sub.add_parser("time")
    t.add_argument("--shapes", nargs="+", default=["8,128,256", "4,128,512", "2,128,1024", "1,128,2048",
                                                   "2,256,4096"], help="B,D,L")
    t.add_argument("--chunk", type=int, default=64)
    t.add_argument("--reps", type=int, default=7)
    t.add_argument("--cpu", action="store_true", help="also the cpu backend's FFT form (compiled convolution)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    accuracy(args) if args.what == "accuracy" else speed(args)


if __name__ == "__main__":
    main()
