"""fp32 accuracy of fftconv and attention (forward and every gradient) against a float64 oracle.

    python bench/accuracy_fp32.py --backend triton [--ops fftconv attention] [--fftconv-lengths 10 14 17]
    python bench/accuracy_fp32.py --backend cuda

On a machine without a GPU, ``--backend triton`` runs in Triton's interpreter: run it through the
tl.dot device model (fp32 operands rounded to TF32 per input_precision, as the tensor cores do)::

    python tests/device_model.py bench/accuracy_fp32.py --backend triton

and ``--backend cuda`` runs the CUDA kernels in the emulator (bench/emulated_cuda.py; FMA
contraction and the device's math-function error bounds built in).

Errors are norm-wise, max|fp32 - f64| / max|f64|, per output; the oracle evaluates the same
fp32-rounded inputs in float64 (fftconv: a zero-padded FFT product; attention: the materialised
softmax(scale q k^T + causal mask) v). fftconv inputs: x ~ N(0, 1), k an EMA-like kernel (random
signs, decaying envelope); attention: q, k, v ~ N(0, 1), scale = 1/sqrt(dh), causal.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import emulated_cuda


def rel(a, r) -> float:
    a, r = a.detach().double(), r.detach().double()
    return float((a - r).abs().max() / r.abs().max())


def fftconv_case(B, D, L, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=g)
    t = torch.arange(L, dtype=torch.float64)
    decay = torch.exp(-t[None, :] / (L / 8 * torch.rand(D, 1, generator=g, dtype=torch.float64) + 1))
    k = (torch.randn(D, L, generator=g, dtype=torch.float64) * decay).float()
    dy = torch.randn(B, D, L, generator=g)
    return x, k, dy


def fftconv_oracle(x, k):
    L = x.shape[-1]
    n = 2 * L
    return torch.fft.irfft(torch.fft.rfft(x, n) * torch.fft.rfft(k, n), n)[..., :L]


def attention_case(B, L, H, dh, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, L, H, dh, generator=g) for _ in range(4))
    return q, k, v, do


def attention_oracle(q, k, v, scale):
    s = torch.einsum("blhd,bshd->bhls", q, k) * scale
    L, S = q.shape[1], k.shape[1]
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)  # bottom-right aligned causal
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhls,bshd->blhd", p, v)


def measure(fn, oracle, inputs, upstream):
    leaves = [t.clone().requires_grad_() for t in inputs]
    t0 = time.perf_counter()
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream)
    sec = time.perf_counter() - t0
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = oracle(*leaves64)
    grads64 = torch.autograd.grad(ref, leaves64, upstream.double())
    return [rel(out, ref)] + [rel(a, r) for a, r in zip(grads, grads64)], sec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch", choices=["torch", "cpu", "triton", "cuda"])
    ap.add_argument("--ops", nargs="+", default=["fftconv", "attention"], choices=["fftconv", "attention"])
    ap.add_argument("--fftconv-lengths", type=int, nargs="+", default=[10, 14, 17], help="log2 of L")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--D", type=int, default=2)
    ap.add_argument("--attention-shapes", nargs="+", default=["1,256,2,64", "1,1024,1,128"],
                    help="B,L,H,dh for each attention case")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    emulated_cuda.use(args.backend, args.ops)
    print(f"backend={args.backend}; norm-wise error max|fp32 - f64| / max|f64|")
    if "fftconv" in args.ops:
        print(f"fftconv B={args.B} D={args.D}")
        print(f"{'L':>8} | {'y':>8} {'dx':>8} {'dk':>8} | time")
        for e in args.fftconv_lengths:
            x, k, dy = fftconv_case(args.B, args.D, 1 << e, args.seed)
            errs, sec = measure(lambda a, b: ops.fftconv(a, b, backend=args.backend), fftconv_oracle, (x, k), dy)
            print(f"{'2^%d' % e:>8} | " + " ".join(f"{v:8.1e}" for v in errs) + f" | {sec:.1f}s", flush=True)
    if "attention" in args.ops:
        print("attention, causal, scale = 1/sqrt(dh)")
        print(f"{'B,L,H,dh':>14} | {'o':>8} {'dq':>8} {'dk':>8} {'dv':>8} | time")
        for shape in args.attention_shapes:
            B, L, H, dh = (int(v) for v in shape.split(","))
            q, k, v, do = attention_case(B, L, H, dh, args.seed)
            scale = 1.0 / np.sqrt(dh)
            errs, sec = measure(lambda a, b, c: ops.attention(a, b, c, scale=scale, causal=True, backend=args.backend),
                                lambda a, b, c: attention_oracle(a, b, c, scale), (q, k, v), do)
            print(f"{shape:>14} | " + " ".join(f"{v:8.1e}" for v in errs) + f" | {sec:.1f}s", flush=True)


if __name__ == "__main__":
    main()
