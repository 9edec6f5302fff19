"""The model-sized cases that tests/test_gpu.py checks and bench/gpu_probe.py prints, in one table.

``CASES[name] = Case(make, call, n_main, dtypes, tols)``:

* ``make(device)`` -> the inputs in float64 (complex128 for complex ones);
* ``call(inputs, backend)`` -> the op's output (or tuple of outputs);
* ``n_main``: the first ``n_main`` inputs take the tested dtype; the others are side inputs kept in
  float32 (complex64), as the model passes them (CEMA coefficients, the norm's scale, fftconv's kernel);
* ``dtypes``: the dtypes the probe runs;
* ``tols[backend] = (forward, backward)``: the float32 tolerance of max|out - ref| / max|ref| against the
  torch backend in float64 on the same (float32-rounded) inputs: 4x the error measured on an H100
  (torch 2.11, Triton 3.6, bench/results/gpu/h100_run1_probe.txt); cema_kernel and ema_hidden (not
  reached in that run) at 4x the figures of docs/verification.md. A backend without an entry has no
  implementation of the op or refuses the case on every GPU.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from megalodon_kernels import ops


class Case(NamedTuple):
    make: Callable
    call: Callable
    n_main: int
    dtypes: tuple
    tols: dict


F32_BF16 = (torch.float32, torch.bfloat16)
F32 = (torch.float32,)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected| in float64 (complex as (re, im) pairs)."""
    a, e = actual.detach(), expected.detach().to(actual.device)
    if a.is_complex() or e.is_complex():
        a, e = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(e.to(torch.complex128))
    a, e = a.double(), e.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def as_dtype(t: torch.Tensor, dtype: torch.dtype, main: bool) -> torch.Tensor:
    """A float64 input in the tested dtype (main input) or in the side inputs' float32 / complex64."""
    if t.is_complex():
        return t.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
    return t.to(dtype if main else torch.float32)


def outputs(o) -> tuple:
    return tuple(x for x in o if x is not None) if isinstance(o, tuple) else (o,)


def _randn(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.float64)


def cema_coeffs(D: int, N: int, device) -> list:
    p = torch.rand(D, N, device=device, dtype=torch.float64)
    log_q = torch.complex(-0.05 * torch.rand(D, N, device=device, dtype=torch.float64),
                          3 * torch.rand(D, N, device=device, dtype=torch.float64))
    gamma = torch.complex(_randn(D, N, device=device), _randn(D, N, device=device))
    return [p, log_q, gamma]


def _fftconv(a, b):
    return ops.fftconv(a[0], a[1], backend=b)


def _attention(chunk, scale=0.125, **kw):
    return lambda a, b: ops.attention(a[0], a[1], a[2], scale=scale, chunk_size=chunk, backend=b, **kw)


CASES: dict[str, Case] = {
    "fftconv": Case(lambda d: [_randn(2, 256, 4096, device=d), _randn(256, 4096, device=d)], _fftconv, 1, F32_BF16,
                    {"cuda": (9.1e-7, 9.6e-7), "triton": (2.6e-6, 2.8e-6)}),
    # the Triton tile path at N = 2048 (block-diagonal first level; issue 39), first checked on a GPU
    # here: the workspace path's bound (under the interpreter's TF32 device model this size passes the
    # fp32 test budgets, ~3e-7 of the terms: tests/test_fftconv.py test_triton_batch_split_over_programs),
    # cuda's L4096 bound
    "fftconv_L1000": Case(lambda d: [_randn(8, 64, 1000, device=d), _randn(64, 1000, device=d)], _fftconv, 1, F32,
                          {"cuda": (9.1e-7, 9.6e-7), "triton": (2.6e-6, 2.8e-6)}),
    "fftconv_L16384": Case(lambda d: [_randn(1, 64, 16384, device=d), _randn(64, 16384, device=d)], _fftconv, 1, F32,
                           {"cuda": (1.0e-6, 1.0e-6), "triton": (3.1e-6, 2.9e-6)}),
    "fftconv_L65536": Case(lambda d: [_randn(1, 16, 65536, device=d), _randn(16, 65536, device=d)], _fftconv, 1, F32,
                           {"cuda": (1.2e-6, 1.2e-6), "triton": (3.3e-6, 3.3e-6)}),
    "timestep_norm": Case(lambda d: [_randn(2, 4096, 1024, device=d) * 2 + 3, _randn(1024, device=d),
                                     _randn(1024, device=d)],
                          lambda a, b: ops.timestep_norm(a[0], a[1], a[2], 32, backend=b)[0], 1, F32_BF16,
                          {"cuda": (6.3e-7, 8.2e-7), "triton": (7.8e-7, 8e-7)}),
    "attention": Case(lambda d: [_randn(2, 4096, 4, 64, device=d) for _ in range(3)], _attention(1024), 3, F32_BF16,
                      {"cuda": (8.4e-7, 8.4e-6), "triton": (9.9e-7, 2.2e-6)}),
    # Triton refuses fp32 at head dim 256 (its fp32-accurate backward tiles would spill): cuda only
    "attention_d256": Case(lambda d: [_randn(1, 2048, 2, 256, device=d) for _ in range(3)],
                           _attention(2048, scale=256 ** -0.5), 3, F32_BF16, {"cuda": (1.8e-6, 9e-6)}),
    "attention_dropkey": Case(lambda d: [_randn(2, 1024, 4, 64, device=d) for _ in range(3)],
                              _attention(None, dropkey_p=0.1, seed=5), 3, F32_BF16,
                              {"cuda": (1.3e-6, 1.2e-5), "triton": (9.6e-7, 2.4e-6)}),
    "dropkey_softmax": Case(lambda d: [3 * _randn(2, 4, 512, 512, device=d)],
                            lambda a, b: ops.dropkey_softmax(a[0], True, 0.2, 7, backend=b), 1, F32_BF16,
                            {"cuda": (8.9e-7, 1.5e-6), "triton": (7.5e-7, 1.3e-6)}),
    "rotary_xpos": Case(lambda d: [_randn(2, 4096, 4, 64, device=d)],
                        lambda a, b: ops.rotary(a[0], torch.arange(4096, device=a[0].device), xpos_scale_base=512.0,
                                                backend=b), 1, F32_BF16,
                        {"cuda": (3.3e-7, 3.2e-7), "triton": (3.3e-7, 3.2e-7)}),
    "cema_kernel": Case(lambda d: cema_coeffs(256, 16, d),
                        lambda a, b: ops.cema_kernel(a[0], a[1], a[2], 16384, backend=b)[0], 0, F32,
                        {"cuda": (1e-6, 2e-6), "triton": (1e-6, 2e-6)}),
    "ema_hidden": Case(lambda d: [_randn(2, 256, 4096, device=d), *cema_coeffs(256, 16, d)[:2]],
                       lambda a, b: ops.ema_hidden(a[0], a[1], a[2], backend=b), 1, F32_BF16,
                       {"cuda": (1e-6, 2e-6), "triton": (1e-6, 2e-6)}),
    "cema": Case(lambda d: [_randn(2, 256, 4096, device=d), *cema_coeffs(256, 16, d), _randn(256, device=d)],
                 lambda a, b: ops.cema(a[0], a[1], a[2], a[3], a[4], backend=b), 1, F32_BF16,
                 # cuda: the composition of the cuda cema_kernel, fftconv and ema_hidden above (each within
                 # 2e-6 here), first run on a GPU in h200_run4: the Triton bound until measured
                 {"triton": (3.1e-6, 3.3e-6), "cuda": (3.1e-6, 3.3e-6)}),
}


def errors(case: Case, backend: str, dtype: torch.dtype, device, seed: int = 0):
    """(forward error, backward error, inputs, call) of ``backend`` in ``dtype`` against the torch
    backend in float64 on exactly the inputs rounded to ``dtype`` (so the figure is the kernel's error,
    not the input rounding). ``call`` reruns the backend on the same inputs (for timing)."""
    torch.manual_seed(seed)
    base = [as_dtype(t, dtype, i < case.n_main) for i, t in enumerate(case.make(device))]
    ref_in = [t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_() for t in base]
    ref = outputs(case.call(ref_in, "torch"))
    ups = [torch.randn_like(o) for o in ref]
    ref_grads = torch.autograd.grad(ref, ref_in, ups, allow_unused=True)
    inputs = [t.detach().requires_grad_() for t in base]
    ups = [u.to(o.dtype) for u, o in zip(ups, ref)]

    def run():
        out = outputs(case.call(inputs, backend))
        return out, torch.autograd.grad(out, inputs, [u.to(o.dtype) for u, o in zip(ups, out)], allow_unused=True)

    out, grads = run()
    fwd = max(rel(o, r) for o, r in zip(out, ref))
    bwd = max((rel(g, r) for g, r in zip(grads, ref_grads) if g is not None and r is not None), default=0.0)
    return fwd, bwd, out, run
