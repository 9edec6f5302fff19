"""Side by side on one GPU: upstream Megalodon's CUDA kernels against this library's backends.

    python bench/vs_upstream.py [--upstream DIR_OR_SO] [--sets 7b probe] [--dtypes bfloat16 float32]
                                [--budget-s 60] [--out DIR] [--dry]

For each op of upstream's extension (XuezheMax/megalodon, built by bench/upstream_build.py) and its
counterpart here, on the same inputs in one process: forward (no grad), backward alone and
forward + backward time of ``upstream``, ``cuda``, ``triton`` and ``torch`` (and ``sdpa``: torch's
scaled_dot_product_attention on the attention case), the ratio to upstream,
and the agreement of each with a float64 reference (the torch backend in float64 on the same
inputs rounded to the tested dtype, so the figure is the kernel's error, not the input rounding;
at the 7B shapes the reference runs on a slice of the independent rows -- channels or heads -- and
every provider's output is compared on that slice).

=========================  ======================================  =========================================
case                       upstream (megalodon_extension.ops)      here (megalodon_kernels.ops)
=========================  ======================================  =========================================
cema_kernel                ema_parameters_fwd/bwd, hx None         cema_kernel(p, log_q, gamma, L)
cema_kernel_hx             ema_parameters_fwd/bwd with hx          cema_kernel(p, log_q, gamma, L, hx)
ema_hidden                 ema_hidden_fwd/bwd                      ema_hidden(x, p, log_q)
fftconv                    fftconv_fwd/bwd + rfft of k (cuFFT)     fftconv(x, k); torch backend = torch.fft
timestep_norm              group_timestep_norm_fwd/bwd             timestep_norm(x, scale, bias, G)
attention                  attention_fwd/bwd (chunks as batch)     attention(q, k, v, chunk_size=C); sdpa
attention_dropkey          attention_fwd/bwd, dropout 0.1          attention(..., dropkey_p=0.1): time only
softmax_dropkey            attention_softmax_fwd/bwd, dropout 0.1  dropkey_softmax(s, True, 0.1): time only
=========================  ======================================  =========================================

Upstream's conventions, from its Python wrappers (megalodon/modules/fused_ops): p is r(D N 1), the
kernels take log q and return the gradient with respect to q (the wrappers here pass log q straight
in, as ours take it, and multiply that gradient by conj(q) to get the one with respect to log q);
ema_parameters serves float32 only; fftconv's
fused path serves 32 <= L <= 16384 and falls back to torch.fft outside (as upstream's wrapper does:
those rows say so); timestep_norm takes gamma (with upstream's +1 already added) and beta in x's
dtype (the inputs are generated exactly representable in it); attention takes (B', C, H, d) chunks
with the full C x C probabilities saved; DropKey masks differ by construction (upstream draws them
with a thread-layout-dependent Philox mapping), so those rows are timed but not compared.

Shape sets: ``probe`` = the model-sized cases of bench/gpu_cases.py; ``7b`` = the paper's 7B layer
(D 4096, N 16, G 64, 4 heads of z 256 / v 2048, chunk 4096) at L 4096 and 32768, batch 1. Timing:
CUDA events, one warm-up call then ``--reps`` calls (median); a case that would exceed the budget is
listed as not reached. ``--dry`` runs tiny shapes on the CPU against the torch backend and SDPA only
(the upstream extension is CUDA code: skipped with a note), so CI keeps this script working.

The upstream module is found at ``--upstream``, else ``$MEGALODON_UPSTREAM``, else ``.upstream/`` in
the checkout root. It must be built for this Python and this torch (upstream_build.py's
BUILD_INFO.json says which): when it is absent or does not load, the upstream rows are skipped with
the reason and the other providers still run.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megalodon_kernels import ops
from megalodon_kernels.bench.gpu_cases import _randn, as_dtype, cema_coeffs, outputs, rel
from megalodon_kernels.bench.gpu_steps import sync as _sync

ROOT = Path(__file__).resolve().parent.parent
ENV_VAR = "MEGALODON_UPSTREAM"
PROVIDERS = ("upstream", "cuda", "triton", "torch", "sdpa")
#: this library's backends; other providers are a case's ``extra`` (torch's SDPA on the attention cases)
BACKENDS = ("cuda", "triton", "torch")
MODES = ("fwd", "bwd", "fwd+bwd")
DROPKEY_P = 0.1


# ------------------------------------------------------------------------------------ the upstream module
def upstream_location(arg: Optional[str] = None) -> Path:
    return Path(arg or os.environ.get(ENV_VAR) or ROOT / ".upstream")


def load_upstream(location: Path):
    """(``megalodon_extension.ops`` or None, a note: what was loaded, or why not)."""
    location = Path(location)
    if location.is_dir():
        found = sorted(location.glob("megalodon_extension*.so"))
        if not found:
            return None, f"no megalodon_extension*.so in {location} (build it: bench/upstream_build.py)"
        so = found[0]
    elif location.is_file():
        so = location
    else:
        return None, f"{location} does not exist (build upstream's extension: bench/upstream_build.py --out {location})"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if not so.name.endswith(suffix):
        return None, (f"{so.name} is not built for this Python ({sys.version.split()[0]}, modules end in {suffix}): "
                      "rebuild it with this interpreter")
    info_path = so.parent / "BUILD_INFO.json"
    built_for = json.loads(info_path.read_text()).get("torch") if info_path.exists() else None
    if built_for and built_for != torch.__version__:
        return None, f"{so.name} was built against torch {built_for}, this is torch {torch.__version__}: rebuild it"
    try:
        spec = importlib.util.spec_from_file_location("megalodon_extension", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules.setdefault("megalodon_extension", mod)
    except Exception as exc:  # an ABI mismatch shows as an ImportError naming the missing symbol
        return None, f"{so} does not load: {type(exc).__name__}: {str(exc)[:300]}"
    return mod.ops, f"{so} ({so.stat().st_size / 2**20:.1f} MiB" + (f", torch {built_for})" if built_for else ")")


# ------------------------------------------------------------------------------------ upstream's calls
# Thin autograd wrappers written from upstream's documented calling conventions (see the module
# docstring); each calls the extension exactly as upstream's own Python wrapper does.
def _c(t):
    return None if t is None else t.contiguous()


class _EMAParameters(torch.autograd.Function):
    """Takes log q (the kernels' own input; upstream's wrapper computes it from q) and turns the
    kernels' gradient with respect to q into one with respect to log q: dq = q dlog_q, so in torch's
    convention grad_log_q = grad_q * conj(q) (one elementwise product over D x N)."""

    @staticmethod
    def forward(ctx, ext, p, log_q, gamma, hx, length):
        w, b, vander = ext.ema_parameters_fwd(p, log_q, gamma, hx, length)
        ctx.save_for_backward(p, log_q, gamma, hx, vander)
        ctx.ext = ext
        return w, b

    @staticmethod
    def backward(ctx, dw, db):
        p, log_q, gamma, hx, vander = ctx.saved_tensors
        dp, dq, dgamma, dhx = ctx.ext.ema_parameters_bwd(_c(dw), _c(db) if hx is not None else None, p, log_q, gamma,
                                                          hx, vander)
        return None, dp, dq * log_q.exp().conj(), dgamma, dhx, None


class _EMAHidden(torch.autograd.Function):
    """log q in, gradient with respect to log q out, as _EMAParameters."""

    @staticmethod
    def forward(ctx, ext, x, p, log_q, hx):
        h, v = ext.ema_hidden_fwd(x, p, log_q, hx)
        ctx.save_for_backward(x, p, log_q, hx, v)
        ctx.ext = ext
        return h

    @staticmethod
    def backward(ctx, dh):
        x, p, log_q, hx, v = ctx.saved_tensors
        dx, dp, dq, dhx = ctx.ext.ema_hidden_bwd(_c(dh), x, p, log_q, hx, v)
        return None, dx, dp, dq * log_q.exp().conj(), dhx


def _fused_fftconv(x) -> bool:
    return x.is_cuda and 32 <= x.shape[-1] <= 16384


def _fft_size(L: int) -> int:
    return L if L & (L - 1) == 0 else 1 << L.bit_length()


class _FFTConv(torch.autograd.Function):
    """Upstream's fused path where it serves the length, its torch.fft fallback elsewhere."""

    @staticmethod
    def forward(ctx, ext, x, k):
        L = x.shape[-1]
        n = _fft_size(L)
        if _fused_fftconv(x):
            k_f = torch.fft.rfft(k, 2 * n) if k.dtype in (torch.float32, torch.float64) else ext.rfft(k, False)
            y, x_f = ext.fftconv_fwd(x, k_f)
        else:
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            x_f = torch.fft.rfft(xf, n=2 * n)
            k_f = torch.fft.rfft(k, n=2 * n, norm="forward")
            y = torch.fft.irfft(x_f * k_f, n=2 * n, norm="forward")[..., :L].to(x.dtype)
        ctx.save_for_backward(x_f, k_f)
        ctx.ext, ctx.k_dtype, ctx.fused = ext, k.dtype, _fused_fftconv(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_f, k_f = ctx.saved_tensors
        if ctx.fused:
            dx, dk = ctx.ext.fftconv_bwd(_c(dy), x_f, k_f, ctx.k_dtype)
            return None, dx, dk
        L = dy.shape[-1]
        n = _fft_size(L)
        g = dy.float() if dy.dtype in (torch.float16, torch.bfloat16) else dy
        g_f = torch.fft.rfft(g.flip(-1), n=2 * n)
        dx = torch.fft.irfft(g_f * k_f, n=2 * n, norm="forward")[..., :L].flip(-1).to(dy.dtype)
        dk = torch.fft.irfft((g_f * x_f).sum(0), n=2 * n)[..., :L].flip(-1)
        return None, dx, dk


class _TimestepNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ext, x, prev_count, prev_mean, prev_var, gamma, beta, groups, eps):
        y, count, mean, var, cummean, cumrstd = ext.group_timestep_norm_fwd(
            x, prev_count, prev_mean, prev_var, gamma, beta, None, groups, eps)
        ctx.save_for_backward(x, prev_mean, count, cummean, cumrstd, gamma)
        ctx.ext, ctx.groups = ext, groups
        return y, count, mean, var

    @staticmethod
    def backward(ctx, dy, _dcount, dmean, dvar):
        x, prev_mean, count, cummean, cumrstd, gamma = ctx.saved_tensors
        dx, dpm, dpv, dgamma, dbeta = ctx.ext.group_timestep_norm_bwd(
            _c(dy), _c(dmean), _c(dvar), x, prev_mean, count, cummean, cumrstd, gamma, None, ctx.groups)
        return None, dx, None, dpm, dpv, dgamma, dbeta, None, None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ext, q, k, v, scale, dropout, causal):
        y, w = ext.attention_fwd(q, k, v, scale, dropout, causal)
        ctx.save_for_backward(q, k, v, w)
        ctx.ext, ctx.scale, ctx.causal = ext, scale, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, w = ctx.saved_tensors
        dq, dk, dv = ctx.ext.attention_bwd(_c(dy), q, k, v, w, ctx.scale, ctx.causal)
        return None, dq, dk, dv, None, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ext, x, dropout, causal):
        y = ext.attention_softmax_fwd(x, dropout, causal)
        ctx.save_for_backward(y)
        ctx.ext, ctx.causal = ext, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensors
        return None, ctx.ext.attention_softmax_bwd(_c(dy), y, ctx.causal), None, None


# ------------------------------------------------------------------------------------ the cases
@dataclasses.dataclass
class Case:
    """``make(device)`` -> float64 inputs (the first ``n_main`` take the tested dtype, the others stay
    float32 / complex64 side inputs, or with ``side_in_dtype`` are rounded to the tested dtype's values);
    ``ours(inputs, backend)`` and ``upstream(inputs, ext)`` -> outputs in the same layout; ``narrow``:
    for each input, the dim of its independent rows (None: shared), with ``out_dims`` the same for the
    outputs, so the reference can run on rows [0, ``ref_rows``) only."""
    name: str
    shape: dict
    make: Callable
    n_main: int
    dtypes: tuple
    ours: Callable
    upstream: Optional[Callable]
    narrow: tuple
    out_dims: tuple
    ref_rows: Optional[int] = None
    compare: bool = True
    side_in_dtype: bool = False
    note: str = ""
    upstream_dtypes: tuple = ("float32", "bfloat16")
    extra: dict = dataclasses.field(default_factory=dict)


def _cema_kernel_case(D, N, L, B_hx, ref_rows=None):
    hx = B_hx is not None

    def make(dev):
        c = cema_coeffs(D, N, dev)
        return c + ([torch.complex(_randn(B_hx, D, N, device=dev), _randn(B_hx, D, N, device=dev))] if hx else [])

    def ours(a, b):
        return ops.cema_kernel(a[0], a[1], a[2], L, a[3] if hx else None, backend=b)

    def up(a, ext):
        return _EMAParameters.apply(ext, a[0].unsqueeze(-1), a[1].unsqueeze(-1), a[2], a[3] if hx else None, L)

    return Case("cema_kernel_hx" if hx else "cema_kernel", dict(D=D, N=N, L=L, **({"B": B_hx} if hx else {})),
                make, 0, ("float32",), ours, up, (0, 0, 0) + ((1,) if hx else ()), (0, 1) if hx else (0,), ref_rows,
                note="float32 only: upstream's ema_parameters serves float32 and float64",
                upstream_dtypes=("float32",))


def _ema_hidden_case(B, D, N, L, ref_rows=None):
    def make(dev):
        return [_randn(B, D, L, device=dev)] + cema_coeffs(D, N, dev)[:2]

    return Case("ema_hidden", dict(B=B, D=D, N=N, L=L), make, 1, ("bfloat16", "float32"),
                lambda a, b: ops.ema_hidden(a[0], a[1], a[2], backend=b),
                lambda a, ext: _EMAHidden.apply(ext, a[0], a[1].unsqueeze(-1), a[2].unsqueeze(-1), None),
                (1, 0, 0), (1,), ref_rows)


def _fftconv_case(B, D, L, ref_rows=None):
    return Case("fftconv", dict(B=B, D=D, L=L),
                lambda dev: [_randn(B, D, L, device=dev), _randn(D, L, device=dev) / math.sqrt(L)], 1,
                ("bfloat16", "float32"), lambda a, b: ops.fftconv(a[0], a[1], backend=b),
                lambda a, ext: _FFTConv.apply(ext, a[0], a[1]), (1, 0), (1,), ref_rows,
                note="the torch backend is torch.fft (cuFFT)" + ("" if L <= 16384 else
                     "; L > 16384: upstream's wrapper falls back to torch.fft too (its fused kernel stops at 16384)"))


def _timestep_norm_case(B, L, D, G, ref_rows=None):
    Dg = D // G

    def make(dev):
        return [_randn(B, L, D, device=dev) * 2 + 3, 1 + 0.1 * _randn(D, device=dev), 0.1 * _randn(D, device=dev)]

    def ours(a, b):
        return ops.timestep_norm(a[0], a[1], a[2], a[0].shape[-1] // Dg, backend=b)[0]

    def up(a, ext):
        x = a[0]
        Bx, g = x.shape[0], x.shape[-1] // Dg
        zeros = torch.zeros(Bx, g, device=x.device, dtype=x.dtype)
        count = torch.zeros(Bx, device=x.device, dtype=torch.int64)
        return _TimestepNorm.apply(ext, x, count, zeros, torch.ones_like(zeros), a[1].to(x.dtype), a[2].to(x.dtype),
                                   g, 1e-5)[0]

    return Case("timestep_norm", dict(B=B, L=L, D=D, G=G), make, 1, ("bfloat16", "float32"), ours, up,
                (2, 0, 0), (2,), ref_rows, side_in_dtype=True,
                note="scale and bias drawn exactly representable in the tested dtype "
                     "(upstream reads them in x's dtype)")


def _attention_case(B, L, H, dz, dv, chunk, dropkey, ref_rows=None):
    scale = dz ** -0.5

    def make(dev):
        return [_randn(B, L, H, dz, device=dev), _randn(B, L, H, dz, device=dev), _randn(B, L, H, dv, device=dev)]

    def ours(a, b):
        return ops.attention(a[0], a[1], a[2], scale=scale, chunk_size=chunk, dropkey_p=DROPKEY_P if dropkey else 0.0,
                             seed=5 if dropkey else None, backend=b)

    def up(a, ext):
        q, k, v = a
        Bq, Lq = q.shape[:2]
        c = min(chunk, Lq)
        split = lambda t: t.reshape(Bq * (Lq // c), c, *t.shape[2:])  # noqa: E731  (chunks as batch)
        y = _Attention.apply(ext, split(q), split(k), split(v), scale, DROPKEY_P if dropkey else 0.0, True)
        return y.reshape(Bq, Lq, *y.shape[2:])

    def sdpa(a):
        q, k, v = a
        Bq, Lq, Hq = q.shape[:3]
        c = min(chunk, Lq)
        split = lambda t: t.reshape(Bq * (Lq // c), c, Hq, t.shape[-1]).transpose(1, 2)  # noqa: E731
        y = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=scale)
        return y.transpose(1, 2).reshape(Bq, Lq, Hq, y.shape[-1])

    return Case("attention_dropkey" if dropkey else "attention", dict(B=B, L=L, H=H, dz=dz, dv=dv, chunk=chunk),
                make, 3, ("bfloat16", "float32"), ours, up, (2, 2, 2), (2,), ref_rows, compare=not dropkey,
                note="time only: DropKey masks differ by construction" if dropkey else
                "sdpa = torch.nn.functional.scaled_dot_product_attention on the chunks (torch picks flash, "
                "memory-efficient or math by dtype and head dims)", extra={} if dropkey else {"sdpa": sdpa})


def _softmax_case(B, H, C, ref_rows=None):
    return Case("softmax_dropkey", dict(B=B, H=H, L1=C, L2=C), lambda dev: [3 * _randn(B, H, C, C, device=dev)], 1,
                ("bfloat16", "float32"), lambda a, b: ops.dropkey_softmax(a[0], True, DROPKEY_P, 7, backend=b),
                lambda a, ext: _Softmax.apply(ext, a[0].reshape(B * H, C, C), DROPKEY_P, True).reshape(B, H, C, C),
                (1,), (1,), ref_rows, compare=False, note="time only: DropKey masks differ by construction")


def cases(set_name: str) -> list:
    """The cases of a shape set, most wanted first (the 7B set in the order of the issue's goals)."""
    if set_name == "7b":
        D, N, G, H, dz, dv, C = 4096, 16, 64, 4, 256, 2048, 4096
        out = []
        for L in (4096, 32768):
            out += [_cema_kernel_case(D, N, L, None, ref_rows=256), _cema_kernel_case(D, N, L, 1, ref_rows=256),
                    _ema_hidden_case(1, D, N, L, ref_rows=256), _fftconv_case(1, D, L, ref_rows=256),
                    _timestep_norm_case(1, L, D, G, ref_rows=256),
                    _attention_case(1, L, H, dz, dv, C, False, ref_rows=1),
                    _attention_case(1, L, H, dz, dv, C, True), _softmax_case(L // C, H, C)]
        return out
    if set_name == "probe":  # bench/gpu_cases.py's model-sized shapes
        return [_cema_kernel_case(256, 16, 16384, None), _cema_kernel_case(256, 16, 16384, 2),
                _ema_hidden_case(2, 256, 16, 4096), _fftconv_case(2, 256, 4096), _fftconv_case(1, 64, 16384),
                _timestep_norm_case(2, 4096, 1024, 32), _attention_case(2, 4096, 4, 64, 64, 1024, False),
                _attention_case(2, 4096, 4, 64, 64, 1024, True), _softmax_case(2, 4, 512)]
    if set_name == "dry":
        return [_cema_kernel_case(8, 4, 64, None), _cema_kernel_case(8, 4, 64, 2, ref_rows=4),
                _ema_hidden_case(2, 8, 4, 64), _fftconv_case(2, 8, 64, ref_rows=4), _timestep_norm_case(2, 64, 8, 2),
                _attention_case(1, 64, 2, 16, 16, 32, False, ref_rows=1), _attention_case(1, 64, 2, 16, 16, 32, True),
                _softmax_case(1, 2, 32)]
    raise ValueError(f"shape set must be '7b', 'probe' or 'dry', got {set_name!r}")


# ------------------------------------------------------------------------------------ measuring
class _Clock:
    """Seconds of the work between start() and stop(): CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, dev):
        self.dev = dev

    def start(self):
        if self.dev.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.dev.type == "cuda":
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        return time.perf_counter() - self.t


def _grad_outputs(outs, leaves, cot):
    pairs = [(o, c) for o, c in zip(outs, cot) if o.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [c.to(o.dtype) for o, c in pairs], allow_unused=True)


def time_provider(fn, leaves, cot, dev, reps: int) -> dict:
    """{mode: median seconds}; the caller has made one forward + backward call first (compiles,
    allocates). Each mode gets ``reps`` calls, or one when a forward + backward call takes over
    ``SLOW_S`` seconds (the float64-speed paths of a backend at the 7B shapes would eat the budget)."""
    clock = _Clock(dev)

    def once(mode):
        if mode == "fwd":
            _sync(dev)
            clock.start()
            with torch.no_grad():
                fn()
            return clock.stop()
        if mode == "bwd":
            outs = outputs(fn())
            _sync(dev)
            clock.start()
            _grad_outputs(outs, leaves, cot)
            t = clock.stop()
            del outs
            return t
        _sync(dev)
        clock.start()
        _grad_outputs(outputs(fn()), leaves, cot)
        return clock.stop()

    ts = {"fwd+bwd": [once("fwd+bwd")]}
    n = reps if ts["fwd+bwd"][0] < SLOW_S else 1
    ts["fwd+bwd"] += [once("fwd+bwd") for _ in range(n - 1)]
    for mode in ("fwd", "bwd"):
        ts[mode] = [once(mode) for _ in range(n)]
    return {m: statistics.median(ts[m]) for m in MODES}


#: a provider whose first forward + backward took longer than this many seconds is timed with fewer calls
SLOW_S = 0.25


def _narrow(t, dim, rows):
    return t if dim is None or rows is None or t is None else t.narrow(dim, 0, min(rows, t.shape[dim]))


def run_case(case: Case, dtype_name: str, providers, ext, dev, reps: int, seed: int = 0,
             ext_note: str = "upstream extension not loaded") -> dict:
    """One case in one dtype: {case, dtype, shape, providers: {name: {fwd, bwd, fwd+bwd, err_fwd, err_bwd}
    or {skipped: reason}}, reference}."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    raw = case.make(dev)
    base = []
    for i, t in enumerate(raw):
        main = i < case.n_main
        if case.side_in_dtype and not main and not t.is_complex():
            t = t.to(dtype).to(torch.float64)
        base.append(as_dtype(t, dtype, main))
    del raw
    row = dict(case=case.name, dtype=dtype_name, shape=case.shape, note=case.note, providers={})
    leaves = [t.detach().requires_grad_() for t in base]
    ref = ref_grads = None
    cot = None
    if case.compare:
        rows = case.ref_rows
        ref_in = [_narrow(t.detach(), d, rows).to(torch.complex128 if t.is_complex() else torch.float64)
                  .requires_grad_() for t, d in zip(base, case.narrow)]
        t0 = time.perf_counter()
        ref = outputs(case.ours(ref_in, "torch"))
        full_shapes = [_full_shape(o, d, base, case) for o, d in zip(ref, case.out_dims)]
        cot = [torch.randn(s, device=dev, dtype=o.dtype) for s, o in zip(full_shapes, ref)]
        ref_grads = torch.autograd.grad(ref, ref_in, [_narrow(c, d, rows) for c, d in zip(cot, case.out_dims)],
                                        allow_unused=True)
        _sync(dev)
        row["reference"] = dict(seconds=time.perf_counter() - t0, rows=rows,
                                what="torch backend, float64" + (f", rows [0, {rows}) of dim {case.narrow}"
                                                                  if rows else ""))
    for prov in providers:
        if prov == "upstream":
            if ext is None:
                row["providers"][prov] = dict(skipped=ext_note)
                continue
            if dtype_name not in case.upstream_dtypes:
                row["providers"][prov] = dict(skipped=f"upstream serves {', '.join(case.upstream_dtypes)} only")
                continue
            fn = lambda: case.upstream(leaves, ext)  # noqa: E731
        elif prov in case.extra:
            fn = (lambda f: lambda: f(leaves))(case.extra[prov])
        elif prov in BACKENDS:
            fn = (lambda b: lambda: case.ours(leaves, b))(prov)
        else:
            continue
        try:
            _sync(dev)
            t0 = time.perf_counter()
            outs = outputs(fn())
            if cot is None:
                cot = [torch.randn_like(o) for o in outs]
            grads = _grad_outputs(outs, leaves, cot)  # the warm-up call: compiles, allocates
            _sync(dev)
            first = time.perf_counter() - t0
            rec = {"first_call_s": first}
            if case.compare:
                rec["err_fwd"] = max(rel(_narrow(o, d, case.ref_rows), r) for o, d, r in zip(outs, case.out_dims, ref))
                rec["err_bwd"] = max((rel(_narrow(g, d, case.ref_rows), r)
                                      for g, d, r in zip(grads, case.narrow, ref_grads)
                                      if g is not None and r is not None), default=None)
            del outs, grads
            rec.update(time_provider(fn, leaves, cot, dev, reps))
            row["providers"][prov] = rec
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            row["providers"][prov] = dict(skipped=msg)
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    up = row["providers"].get("upstream", {})
    for rec in row["providers"].values():
        for m in MODES:
            if m in rec and up.get(m):
                rec[f"ratio_{m}"] = rec[m] / up[m]
    return row


def _full_shape(ref_out, dim, base, case):
    """The shape of a provider's output whose reference ``ref_out`` ran on a slice of rows."""
    shape = list(ref_out.shape)
    if dim is not None and case.ref_rows is not None:
        sizes = [t.shape[d] for t, d in zip(base, case.narrow) if d is not None]
        shape[dim] = sizes[0] if sizes else shape[dim]
    return shape


def plan(sets, dtypes, names=None) -> list:
    """(set, case, dtype) in the order they run: per set, first every case in its first dtype (bfloat16
    where the case serves it: the training precision), then the other dtypes, so that a budget that
    runs out cuts the least wanted points. ``names``: only the cases of these names (None: all)."""
    out = []
    for set_name in sets:
        cs = [c for c in cases(set_name) if names is None or c.name in names]
        firsts = [(c, next((d for d in c.dtypes if d in dtypes), None)) for c in cs]
        out += [(set_name, c, d) for c, d in firsts if d]
        out += [(set_name, c, d) for c, first in firsts for d in c.dtypes if d in dtypes and d != first]
    return out


def run(sets, dtypes, providers, ext, dev, reps: int, deadline: float, log=print,
        ext_note: str = "upstream extension not loaded", names=None) -> dict:
    rows, not_reached = [], []
    for set_name, case, dt in plan(sets, dtypes, names):
        label = f"{set_name} {case.name} {dt} " + " ".join(f"{k}={v}" for k, v in case.shape.items())
        if time.perf_counter() > deadline:
            not_reached.append(label)
            continue
        t0 = time.perf_counter()
        try:
            r = run_case(case, dt, providers, ext, dev, reps, ext_note=ext_note)
        except Exception as exc:  # the reference or the inputs did not fit: the case, not the run
            r = dict(case=case.name, dtype=dt, shape=case.shape, note=case.note,
                     error=f"{type(exc).__name__}: {str(exc)[:300]}", providers={})
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        r["set"], r["seconds"] = set_name, time.perf_counter() - t0
        rows.append(r)
        log(summary_line(r))
    return dict(rows=rows, not_reached=not_reached)


# ------------------------------------------------------------------------------------ reporting
def _ms(x):
    return "-" if x is None else f"{x * 1e3:.3f}"


def _err(x):
    return "-" if x is None else f"{x:.1e}"


def summary_line(r: dict) -> str:
    if r.get("error"):
        return f"{r['set']:<5} {r['case']:<17} {r['dtype']:<8} ERROR {r['error'][:120]}"
    parts = []
    for p, rec in r["providers"].items():
        if "fwd+bwd" in rec:
            ratio = f" ({rec['ratio_fwd+bwd']:.2f}x)" if rec.get("ratio_fwd+bwd") and p != "upstream" else ""
            parts.append(f"{p} {rec['fwd+bwd'] * 1e3:.2f} ms{ratio}")
        else:
            parts.append(f"{p} -")
    length = r["shape"].get("L", r["shape"].get("L2", ""))
    return f"{r['set']:<5} {r['case']:<17} {r['dtype']:<8} L={length}: fwd+bwd " + ", ".join(parts)


def markdown(res: dict, header: list) -> str:
    L = header + ["", "Times are medians of timed calls after a warm-up (ms; CUDA events on a GPU, wall clock on "
                  "the CPU; "
                  f"one call per mode where a forward + backward takes over {SLOW_S} s); ratio = time / upstream's "
                  "(< 1: faster than upstream); err = max|out - ref| / max|ref| against the float64 torch "
                  "reference (fwd: outputs, bwd: input gradients), '-' where not compared.", "",
                  "| set | case | dtype | shape | provider | fwd ms | bwd ms | fwd+bwd ms | ratio fwd / bwd / f+b | "
                  "err fwd | err bwd |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = {}
    for r in res["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        if r.get("error"):
            L.append(f"| {r['set']} | {r['case']} | {r['dtype']} | {shape} | all | ERROR: {r['error'][:200]} "
                     "| | | | | |")
            continue
        if r.get("note"):
            notes[r["case"] + (" L=" + str(r["shape"].get("L")) if "L > 16384" in r["note"] else "")] = r["note"]
        for p, rec in r["providers"].items():
            if "skipped" in rec:
                L.append(f"| {r['set']} | {r['case']} | {r['dtype']} | {shape} | {p} | not run: "
                         f"{rec['skipped'][:160].replace('|', '/')} | | | | | |")
                continue
            ratio = " / ".join("-" if rec.get(f"ratio_{m}") is None else f"{rec[f'ratio_{m}']:.2f}" for m in MODES)
            L.append(f"| {r['set']} | {r['case']} | {r['dtype']} | {shape} | {p} | {_ms(rec['fwd'])} | "
                     f"{_ms(rec['bwd'])} | {_ms(rec['fwd+bwd'])} | {ratio} | {_err(rec.get('err_fwd'))} | "
                     f"{_err(rec.get('err_bwd'))} |")
    if notes:
        L += ["", "Notes:", ""] + [f"- {k}: {v}" for k, v in notes.items()]
    if res["not_reached"]:
        L += ["", "Not reached within the time budget: " + "; ".join(res["not_reached"])]
    return "\n".join(L) + "\n"


def plot(res: dict, path: Path) -> Optional[str]:
    """Bars of forward and forward+backward time per case and provider relative to upstream's (upstream = 1;
    without any upstream time, relative to the torch backend, and the title says so). None if drawn, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc})"
    base = "upstream" if any(r["providers"].get("upstream", {}).get("fwd+bwd") for r in res["rows"]) else "torch"
    rows = [r for r in res["rows"] if r["providers"].get(base, {}).get("fwd+bwd")]
    if not rows:
        return f"no plot: no case has a {base} time"
    colors = {"upstream": "tab:red", "cuda": "tab:green", "triton": "tab:blue", "torch": "tab:orange",
              "sdpa": "tab:gray"}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.45 * len(rows) + 3), 8), sharex=True)
    width = 0.8 / len(PROVIDERS)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for j, p in enumerate(PROVIDERS):
            xs, ys = [], []
            for i, r in enumerate(rows):
                rec, ref = r["providers"].get(p, {}), r["providers"][base]
                if rec.get(mode) and ref.get(mode):
                    xs.append(i + (j - (len(PROVIDERS) - 1) / 2) * width)
                    ys.append(rec[mode] / ref[mode])
            if xs:
                ax.bar(xs, ys, width, color=colors[p], label=p)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"time / {base}'s")
        ax.set_title(f"{mode}: time relative to {base} = 1 (< 1: faster)", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=4)
    axes[1].set_xticks(range(len(rows)))
    axes[1].set_xticklabels([f"{r['case']} {r['dtype'][:4]} L{r['shape'].get('L', r['shape'].get('L2', ''))}"
                             for r in rows], rotation=75, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", default=None,
                    help=f"the built module or its folder (default ${ENV_VAR}, else <checkout>/.upstream)")
    ap.add_argument("--sets", nargs="+", default=["7b", "probe"], choices=("7b", "probe", "dry"))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--cases", nargs="+", default=None,
                    help="only the cases of these names (e.g. attention attention_dropkey); default: all")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per mode after the warm-up (median)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="no new case starts after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="folder for vs_upstream.md/.json/.png")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, torch backend only, upstream skipped")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    notes = []
    if a.dry:
        dev, sets, providers, ext = torch.device("cpu"), ["dry"], ["upstream", "torch", "sdpa"], None
        notes.append("dry run: upstream's extension is CUDA code, skipped; tiny shapes, torch backend and SDPA only")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run it on a GPU, or --dry for the CPU rehearsal", file=sys.stderr)
            return 2
        dev, sets, providers = torch.device("cuda"), a.sets, a.providers
        ext, note = load_upstream(upstream_location(a.upstream)) if "upstream" in providers else (None, "not asked")
        notes.append(("upstream: " if ext is not None else "upstream skipped: ") + note)
    for n in notes:
        print(n, flush=True)
    known = {c.name for name in sets for c in cases(name)}
    unknown = sorted(set(a.cases or ()) - known)
    if unknown:
        ap.error(f"--cases: no case named {', '.join(unknown)} in the sets {sets} (they have: {', '.join(sorted(known))})")
    res = run(sets, a.dtypes, providers, ext, dev, 1 if a.dry else a.reps, t_start + a.budget_s,
              ext_note=notes[0], names=a.cases)
    res["notes"] = notes
    cmd = "python bench/vs_upstream.py " + " ".join(argv if argv is not None else sys.argv[1:])
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = [f"# Upstream Megalodon's CUDA kernels vs megalodon_kernels{' (dry run)' if a.dry else ''}", "",
              f"`{cmd}`, {time.strftime('%Y-%m-%d %H:%M %Z')}, {dev_name}, torch {torch.__version__}.", ""]
    header += [f"- {n}" for n in notes]
    text = markdown(res, header)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "vs_upstream.md").write_text(text)
        (a.out / "vs_upstream.json").write_text(json.dumps(dict(command=cmd, **res), indent=1, default=str))
        why = plot(res, a.out / "vs_upstream.png")
        if why:
            print(why)
    else:
        print(text)
    return 0 if all(not r.get("error") for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
