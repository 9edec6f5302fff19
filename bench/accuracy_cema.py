"""Accuracy of the fp32 CEMA kernel (forward and backward) at long L against a float64 oracle.

    python bench/accuracy_cema.py [--lengths 18 20] [--gaps 1e-5 1e-6] [--D 4] [--N 16] [--B 2] [--backend torch]

``--backend triton`` runs the Triton kernels (on CPU: in the interpreter, under the tl.dot device
model with ``python tests/device_model.py bench/accuracy_cema.py --backend triton``); ``--backend
cuda`` the CUDA kernels (on CPU: in the emulator, bench/emulated_cuda.py, with its device model).

For every length 2**e and gap 1-|q|, draws fp32 coefficients (|q| = 1-gap, phases uniform in
(-pi, pi]), runs ``ops.cema_kernel`` in fp32 (k, b and all four gradients with random upstream
gradients) and compares, norm-wise (max|err| / max|ref|), with a float64 evaluation of the same
fp32 inputs. The oracle is exact: the exponent j*log_q is formed in float64 (exact for fp32 log_q),
every power is its own np.exp of it, and the j axis is processed in chunks to bound memory.
"k tail" is the error on j >= L/2 relative to max|k| there (where |q|**j has decayed; nan when
that tail is below fp32's range, i.e. underflows), and
for contrast the script also reports the "naive fp32" kernel that forms j*log_q and the exp in fp32.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from megalodon_kernels.bench import emulated_cuda
from megalodon_kernels.ops.cema_kernel import cema_kernel

CHUNK = 1 << 16


def make_inputs(D, N, B, gap, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(D, N, generator=gen)
    theta = (torch.rand(D, N, generator=gen, dtype=torch.float64) * 2 - 1) * np.pi
    log_q = torch.complex(torch.full((D, N), np.log1p(-gap), dtype=torch.float64), theta).to(torch.complex64)
    gamma = (torch.randn(D, N, generator=gen, dtype=torch.complex64)) / np.sqrt(N)
    hx = torch.randn(B, D, N, generator=gen, dtype=torch.complex64)
    return p, log_q, gamma, hx


def oracle(p, log_q, gamma, hx, L, dk, db):
    """float64 k, b and (dp, dlog_q, dgamma, dhx), chunked over j; every power a direct exp."""
    p, lq, g, hx = (t.numpy().astype(np.complex128 if t.is_complex() else np.float64) for t in (p, log_q, gamma, hx))
    dk, db = dk.numpy().astype(np.float64), db.numpy().astype(np.float64)
    D, N = p.shape
    B = hx.shape[0]
    k = np.zeros((D, L))
    b = np.zeros((B, D, L))
    S = np.zeros((D, N), complex)
    S1 = np.zeros((D, N), complex)
    T = np.zeros((B, D, N), complex)
    T1 = np.zeros((B, D, N), complex)
    u = p * g
    for j0 in range(0, L, CHUNK):
        j = np.arange(j0, min(j0 + CHUNK, L), dtype=np.float64)
        qj = np.exp(lq[:, :, None] * j)                      # [D, N, C]  exact exponent, direct exp
        qj1 = np.exp(lq[:, :, None] * (j + 1))               # q**(t+1)
        k[:, j0:j0 + len(j)] = np.einsum("dn,dnc->dc", u, qj).real
        b[:, :, j0:j0 + len(j)] = np.einsum("bdn,dnc->bdc", g * hx, qj1).real
        S += np.einsum("dc,dnc->dn", dk[:, j0:j0 + len(j)], qj)
        S1 += np.einsum("dc,dnc->dn", dk[:, j0:j0 + len(j)] * j, qj)
        T += np.einsum("bdc,dnc->bdn", db[:, :, j0:j0 + len(j)], qj1)
        T1 += np.einsum("bdc,dnc->bdn", db[:, :, j0:j0 + len(j)] * (j + 1), qj1)
    dp = (S * g).real
    dgamma = np.conj(S * p) + np.conj((T * hx).sum(0))
    dlq = np.conj(S1 * u) + np.conj((T1 * hx).sum(0) * g)
    dhx = np.conj(T * g)
    return k, b, (dp, dlq, dgamma, dhx)


def naive_fp32_k(p, log_q, gamma, L):
    out = torch.zeros(p.shape[0], L)
    u = (p * gamma)[:, :, None]
    for j0 in range(0, L, CHUNK):
        j = torch.arange(j0, min(j0 + CHUNK, L), dtype=torch.float32)
        out[:, j0:j0 + len(j)] = (u * torch.exp(log_q[:, :, None] * j)).real.sum(1)
    return out.numpy()


def rel(a, r):
    a = a.detach().resolve_conj().numpy() if isinstance(a, torch.Tensor) else a
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[18, 20], help="log2 of L")
    ap.add_argument("--gaps", type=float, nargs="+", default=[1e-5, 1e-6], help="1 - |q|")
    ap.add_argument("--D", type=int, default=4)
    ap.add_argument("--N", type=int, default=16)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "cuda"])
    args = ap.parse_args()
    emulated_cuda.use(args.backend, ["cema_kernel"])
    print(f"backend={args.backend} D={args.D} N={args.N} B={args.B}; norm-wise error max|fp32 - f64| / max|f64|")
    print(f"{'L':>8} {'1-|q|':>7} | {'k':>8} {'b':>8} {'dp':>8} {'dlog_q':>8} {'dgamma':>8} {'dhx':>8} | "
          f"{'k tail':>8} | {'naive k':>8} | time")
    for e in args.lengths:
        L = 1 << e
        for gap in args.gaps:
            p, lq, g, hx = make_inputs(args.D, args.N, args.B, gap)
            ins = [t.requires_grad_() for t in (p, lq, g, hx)]
            t0 = time.perf_counter()
            k, b = cema_kernel(*ins[:3], L, ins[3], backend=args.backend)
            gen = torch.Generator().manual_seed(1)
            dk, db = torch.randn(k.shape, generator=gen), torch.randn(b.shape, generator=gen)
            grads = torch.autograd.grad((k, b), ins, (dk, db))
            dt = time.perf_counter() - t0
            kr, br, gr = oracle(*(t.detach() for t in ins), L, dk, db)
            errs = [rel(k, kr), rel(b, br)] + [rel(a, r) for a, r in zip(grads, gr)]
            # the second half on its own scale: precision must not degrade with j
            # (meaningless where the reference tail is below fp32's range: |q|**j underflows)
            tail_ref = kr[:, L // 2:]
            tail = rel(k.detach()[:, L // 2:], tail_ref) if np.abs(tail_ref).max() > 1e-30 else float("nan")
            naive = rel(naive_fp32_k(*(t.detach() for t in ins[:3]), L), kr)
            print(f"{'2^%d' % e:>8} {gap:>7.0e} | " + " ".join(f"{x:8.1e}" for x in errs)
                  + f" | {tail:8.1e} | {naive:8.1e} | {dt:.2f}s")


if __name__ == "__main__":
    main()
