"""Accuracy of TimestepNorm in fp32 at long L, against float64, and against the naive cumsum form.

Input (the hard case for running statistics): x = 1e3 + N(0, 1) everywhere, and an outlier first
step x[:, 0] = 1e3 + 1e4 * N(0, 1). A large common mean makes E[x^2] - E[x]^2 cancel (fp32 keeps
~7 digits of a sum of squares ~1e6 n, while the variance is ~1 n); the outlier first step makes
every later statistic a small correction to a huge first summary. scale = 1 + 0.1 N(0,1),
bias = 0.1 N(0,1), prev_count = 0 (or --prior: prev_count = 1000, prev_mean = 1e3, prev_var = 2).

The oracle is float64 on the SAME fp32-rounded inputs: the NumPy loop reference
(``--oracle reference``, about a minute at L = 2^18) or the torch backend run in float64
(``--oracle torch64``; the tests check it against the loop reference at small L, and
``--oracle both`` compares the two here).

Errors are norm-wise: max|fp32 - oracle| / max|oracle|, per output. "per-step" rows compare the
running mean and rstd = 1/sqrt(var + eps) at every step (not only the final state).

The naive baseline forms per-step sums S1 = cumsum(gmu), S2 = cumsum(gvar + gmu^2) in fp32 and
mean = S1/n, var = S2/n - mean^2. NOTE: torch.cumsum on CPU accumulates fp32 in double internally
(GPU cumsum does not), so on CPU the baseline only shows the E[x^2] - E[x]^2 cancellation, not the
accumulation error on top of it.

Run::

    python bench/accuracy_timestep_norm.py                  # L = 2^18, B = 1, D = 64, G = 4
    python bench/accuracy_timestep_norm.py --log2-length 14 --oracle both
    python bench/accuracy_timestep_norm.py --log2-length 20 --oracle torch64 --backend cuda

``--backend`` picks the fp32 run's backend (the oracle stays float64 torch / NumPy): triton runs in
the interpreter on CPU, cuda in the emulator (bench/emulated_cuda.py, with its device model). The
emulator is slow: cuda fwd+bwd took 9 s at L = 2^14, 88 s at 2^17 and 11 minutes at 2^20 on the
2-core development machine (the float64 oracle: 8 s at 2^20).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from megalodon_kernels.bench import emulated_cuda
from megalodon_kernels.ops.timestep_norm import timestep_norm, torch_impl
from megalodon_kernels.reference import timestep_norm as ref


def rel(actual, expected) -> float:
    a = actual.detach().double().cpu().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual)
    e = expected.detach().double().cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def naive_cumsum(x, scale, bias, G, eps):
    """Cumulative moments from running sums of mean and mean square, in x's dtype."""
    B, L, D = x.shape
    xg = x.reshape(B, L, G, D // G)
    gmu = xg.mean(-1)
    gsq = (xg - gmu[..., None]).square().mean(-1) + gmu * gmu  # per-step E[x^2]
    n = torch.arange(1, L + 1, dtype=x.dtype)[None, :, None]
    mean = gmu.cumsum(1) / n
    var = (gsq.cumsum(1) / n - mean * mean).clamp_min(0.0)
    y = (xg - mean[..., None]) * torch.rsqrt(var + eps)[..., None] * scale.reshape(G, -1) + bias.reshape(G, -1)
    return y.reshape(B, L, D), mean, var


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log2-length", type=int, default=18)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--chunk", type=int, default=torch_impl.DEFAULT_CONFIG["chunk"])
    p.add_argument("--oracle", choices=["reference", "torch64", "both"], default="reference")
    p.add_argument("--prior", action="store_true", help="start from prev_count=1000, prev_mean=1e3, prev_var=2")
    p.add_argument("--outlier", type=float, default=1e4, help="std of the first step around 1e3 (0: no outlier)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="torch", choices=["torch", "cpu", "triton", "cuda"],
                   help="backend of the fp32 run (the float64 oracle is torch or the NumPy reference)")
    args = p.parse_args()
    emulated_cuda.use(args.backend, ["timestep_norm"])
    torch_impl.DEFAULT_CONFIG["chunk"] = args.chunk

    B, L, D, G, eps = args.batch, 2 ** args.log2_length, args.features, args.groups, 1e-5
    gen = torch.Generator().manual_seed(args.seed)
    x = 1e3 + torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    if args.outlier:
        x[:, 0] = 1e3 + args.outlier * torch.randn(B, D, generator=gen, dtype=torch.float64)
    scale = 1.0 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    bias = 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    dmean = torch.randn(B, G, generator=gen, dtype=torch.float64)
    dvar = torch.randn(B, G, generator=gen, dtype=torch.float64)
    if args.prior:
        n0 = torch.full((B,), 1000, dtype=torch.int64)
        pm, pv = torch.full((B, G), 1e3, dtype=torch.float64), torch.full((B, G), 2.0, dtype=torch.float64)
    else:
        n0 = torch.zeros(B, dtype=torch.int64)
        pm, pv = torch.zeros(B, G, dtype=torch.float64), torch.ones(B, G, dtype=torch.float64)
    # Everything rounded to fp32 once; every oracle sees exactly these values in float64.
    inputs32 = [t.float() for t in (x, scale, bias, pm, pv)]
    inputs64 = [t.double() for t in inputs32]
    up32 = [t.float() for t in (dy, dmean, dvar)]
    up64 = [t.double() for t in up32]
    print(f"B={B} L=2^{args.log2_length}={L} D={D} G={G} chunk={args.chunk} eps={eps} prior={args.prior} "
          f"seed={args.seed}")
    print(f"x = 1e3 + randn, x[:, 0] = 1e3 + {args.outlier:g}*randn (fp32-rounded); "
          "scale = 1+0.1 randn, bias = 0.1 randn")

    def run(inputs, ups, backend="torch"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        t0 = time.perf_counter()
        y, count, mean, var = timestep_norm(leaves[0], leaves[1], leaves[2], G, n0, leaves[3], leaves[4],
                                            backend=backend)
        grads = torch.autograd.grad((y, mean, var), leaves, ups)
        sec = time.perf_counter() - t0
        with torch.no_grad():  # the running per-step stats, for the per-step rows
            *_, saved = torch_impl.forward(inputs[0], inputs[1], inputs[2], n0, inputs[3], inputs[4],
                                                     torch.zeros(B, L, dtype=torch.bool), G, eps, chunk=args.chunk)
            step_mu, step_rstd = saved[2] + saved[8][:, None], saved[3]  # mu is stored relative to the shift K
        return dict(y=y, mean=mean, var=var, step_mean=step_mu, step_rstd=step_rstd, dx=grads[0], dscale=grads[1],
                    dbias=grads[2], dprev_mean=grads[3], dprev_var=grads[4]), sec

    out32, sec32 = run(inputs32, up32, args.backend)
    print(f"{args.backend} backend fp32 fwd+bwd: {sec32:.2f} s")
    oracles = {}
    if args.oracle in ("torch64", "both"):
        oracles["torch64"], sec = run(inputs64, up64)
        print(f"torch backend float64 fwd+bwd: {sec:.2f} s")
    if args.oracle in ("reference", "both"):
        t0 = time.perf_counter()
        npin = [t.numpy() for t in inputs64]
        y, count, mean, var = ref.timestep_norm(npin[0], npin[1], npin[2], G, n0.numpy(), npin[3], npin[4], None, eps)
        grads = ref.timestep_norm_bwd(*[t.numpy() for t in up64], npin[0], npin[1], npin[2], G, n0.numpy(),
                                      npin[3], npin[4], None, eps)
        s = ref._scan(npin[0], G, n0.numpy(), npin[3], npin[4], np.zeros((B, L), dtype=bool))
        oracles["reference"] = dict(y=y, mean=mean, var=var, step_mean=s["mu"],
                                    step_rstd=1.0 / np.sqrt(s["var"] + eps), dx=grads[0], dscale=grads[1],
                                    dbias=grads[2], dprev_mean=grads[3], dprev_var=grads[4])
        print(f"NumPy loop reference fwd+bwd: {time.perf_counter() - t0:.1f} s")
    name = "reference" if "reference" in oracles else "torch64"
    oracle = oracles[name]
    if len(oracles) == 2:
        print("\ntorch float64 vs loop reference:")
        for k in oracle:
            if k in ("dprev_mean", "dprev_var") and not args.prior:
                continue  # exactly 0 with prev_count = 0
            print(f"  {k:11s} {rel(oracles['torch64'][k], oracle[k]):.2e}")
    ny, nmean, nvar = naive_cumsum(inputs32[0], inputs32[1], inputs32[2], G, eps) if not args.prior else (None,) * 3
    print(f"\nfp32 norm-wise relative error vs {name} (float64):")
    print(f"  {'output':11s} {'welford-scan':>12s} {'naive cumsum':>13s}")
    naive = dict(y=ny, mean=None if nmean is None else nmean[:, -1], var=None if nvar is None else nvar[:, -1],
                 step_mean=nmean, step_rstd=None if nvar is None else torch.rsqrt(nvar + eps))
    for k in oracle:
        if k in ("dprev_mean", "dprev_var") and not args.prior:
            continue  # exactly 0 with prev_count = 0
        if k.startswith("step_") and args.backend != "torch":
            continue  # the per-step rows read the torch backend's saved statistics
        nv = naive.get(k)
        ns = f"{rel(nv, oracle[k]):13.2e}" if nv is not None else f"{'-':>13s}"
        print(f"  {k:11s} {rel(out32[k], oracle[k]):12.2e} {ns}")


if __name__ == "__main__":
    main()
