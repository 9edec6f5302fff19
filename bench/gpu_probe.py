"""GPU probe: each op x backend (cuda, triton, torch) x dtype at model-sized shapes on a GPU.

    python bench/gpu_probe.py [name filter ...]      (PROBE_DEVICE=cpu: a small CPU dry run)

Errors are max|out - ref| / max|ref| against the torch backend in float64 on the same device, fed the
inputs rounded to the tested dtype (so the figure is the kernel's error, not the input rounding);
side inputs (CEMA coefficients, norm scale, fftconv's kernel) are float32 as the model passes them.
Times are CUDA-event means over a few calls after one warm-up (indicative; bench/ has the real
benchmarks). Then: an op on a side stream equals the default stream, and CUDA-graph capture per backend.
Output: one line per case; bench/results/gpu/ holds the runs."""
import os, time, sys, traceback
import torch
from megalodon_kernels import ops

dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
CUDA = dev.type == "cuda"
torch.manual_seed(0)
BACKENDS = ("cuda", "triton", "torch") if CUDA else ("torch", "cpu")

def rel(a, b):
    if a.is_complex() or b.is_complex():
        a = torch.view_as_real(a.detach().to(torch.complex128)); b = torch.view_as_real(b.detach().to(a.device, torch.complex128))
    a = a.detach().double(); b = b.detach().to(a.device).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

def timeit(fn, n=10):
    if not CUDA:
        fn(); t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

def conv(l, dtype, main):
    if l.is_complex():
        return l.detach().to(torch.complex64).requires_grad_()
    return l.detach().to(dtype if main else torch.float32).requires_grad_()

def run_case(name, make, call, dtypes, n_main=1):
    for dtype in dtypes:
        # the oracle runs in float64 on the inputs rounded to the tested dtype (kernel error only)
        leaves64 = [conv(l, dtype, i < n_main).detach().to(torch.complex128 if l.is_complex() else torch.float64).requires_grad_()
                    for i, l in enumerate(make(torch.float64))]
        ref_out = call(leaves64, "torch")
        ref_out = tuple(o for o in ref_out if o is not None) if isinstance(ref_out, tuple) else (ref_out,)
        ups = [torch.randn_like(o) for o in ref_out]
        ref_g = torch.autograd.grad(ref_out, leaves64, ups, allow_unused=True)
        for backend in BACKENDS:
            leaves = [conv(l, dtype, i < n_main) for i, l in enumerate(leaves64)]
            try:
                out = call(leaves, backend)
                out = tuple(o for o in out if o is not None) if isinstance(out, tuple) else (out,)
                g = torch.autograd.grad(out, leaves, [u.to(o.dtype) for u, o in zip(ups, out)], allow_unused=True)
                CUDA and torch.cuda.synchronize()
                fe = max(rel(o, r) for o, r in zip(out, ref_out))
                be = max((rel(a, b) for a, b in zip(g, ref_g) if a is not None and b is not None), default=0.0)
                fwd_ms = timeit(lambda: call(leaves, backend))
                def fb():
                    o = call(leaves, backend); o = tuple(x for x in o if x is not None) if isinstance(o, tuple) else (o,)
                    torch.autograd.grad(o, leaves, [u.to(x.dtype) for u, x in zip(ups, o)], allow_unused=True)
                fb_ms = timeit(fb, 5)
                print(f"{name:16s} {backend:7s} {str(dtype)[6:]:9s} fwd_err {fe:.2e} bwd_err {be:.2e}  fwd {fwd_ms:8.3f} ms  fwd+bwd {fb_ms:8.3f} ms", flush=True)
            except Exception as exc:
                msg = str(exc).replace("\n", " | ")[:400]
                print(f"{name:16s} {backend:7s} {str(dtype)[6:]:9s} ERROR {type(exc).__name__}: {msg}", flush=True)

B, D, N, L, H, dh = (2, 256, 16, 4096, 4, 64) if CUDA else (1, 16, 4, 256, 2, 16)
def mk(*s, dtype=torch.float64, cplx=False):
    t = torch.randn(*s, device=dev, dtype=torch.float64)
    if cplx: t = torch.complex(t, torch.randn(*s, device=dev, dtype=torch.float64))
    return t.requires_grad_()

def coeffs():
    p = torch.rand(D, N, device=dev, dtype=torch.float64).requires_grad_()
    lq = torch.complex(-0.05 * torch.rand(D, N, device=dev, dtype=torch.float64), 3 * torch.rand(D, N, device=dev, dtype=torch.float64)).requires_grad_()
    g = mk(D, N, cplx=True)
    return p, lq, g

F32 = (torch.float32, torch.bfloat16)
cases = [
  ("fftconv L4096", lambda d: [mk(B, D, L), mk(D, L)], lambda a, b: ops.fftconv(a[0], a[1], backend=b), F32),
  ("fftconv L16384", lambda d: [mk(1, 64, 16384), mk(64, 16384)], lambda a, b: ops.fftconv(a[0], a[1], backend=b), (torch.float32,)),
  ("fftconv L65536", lambda d: [mk(1, 16, 65536), mk(16, 65536)], lambda a, b: ops.fftconv(a[0], a[1], backend=b), (torch.float32,)),
  ("timestep_norm", lambda d: [mk(B, L, 1024) * 2 + 3, mk(1024), mk(1024)], lambda a, b: ops.timestep_norm(a[0], a[1], a[2], 32, backend=b)[0], F32),
  ("attention c1024", lambda d: [mk(B, L, H, dh), mk(B, L, H, dh), mk(B, L, H, dh)], lambda a, b: ops.attention(a[0], a[1], a[2], scale=dh**-0.5, chunk_size=1024, backend=b), F32, 3),
  ("attention d256", lambda d: [mk(1, 2048, 2, 256), mk(1, 2048, 2, 256), mk(1, 2048, 2, 256)], lambda a, b: ops.attention(a[0], a[1], a[2], scale=256**-0.5, chunk_size=2048, backend=b), F32, 3),
  ("attention dropkey", lambda d: [mk(B, 1024, H, dh), mk(B, 1024, H, dh), mk(B, 1024, H, dh)], lambda a, b: ops.attention(a[0], a[1], a[2], scale=dh**-0.5, dropkey_p=0.1, seed=5, backend=b), F32, 3),
  ("dropkey_softmax", lambda d: [mk(B, H, 512, 512) * 3], lambda a, b: ops.dropkey_softmax(a[0], True, 0.2, 7, backend=b), F32),
  ("rotary xpos", lambda d: [mk(B, L, H, dh)], lambda a, b: ops.rotary(a[0], torch.arange(L, device=dev), xpos_scale_base=512.0, backend=b), F32),
]
def cema_case():
    def make(d):
        p, lq, g = coeffs(); return [mk(B, D, L), p, lq, g, mk(D)]
    return ("cema L4096", make, lambda a, b: ops.cema(a[0], a[1], a[2], a[3], a[4], backend=b), F32)
def ck_case():
    def make(d):
        p, lq, g = coeffs(); return [p, lq, g]
    return ("cema_kernel L16k", make, lambda a, b: ops.cema_kernel(a[0], a[1], a[2], 16384, backend=b)[0], (torch.float32,))
def eh_case():
    def make(d):
        p, lq, g = coeffs(); return [mk(B, D, L), p, lq]
    return ("ema_hidden", make, lambda a, b: ops.ema_hidden(a[0], a[1], a[2], backend=b), F32)
cases += [cema_case(), ck_case(), eh_case()]

print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0)) if CUDA else None
only = sys.argv[1:] 
for c in cases:
    if only and not any(o in c[0] for o in only): continue
    t = time.perf_counter()
    try:
        run_case(*c)
    except Exception:
        traceback.print_exc()
    print(f"-- {c[0]} {time.perf_counter()-t:.1f}s", flush=True)

if not CUDA: sys.exit(0)
# side stream: an op on a non-default stream equals the default stream's result
x, k = torch.randn(2, 64, 1000, device=dev), torch.randn(64, 1000, device=dev)
for b in BACKENDS:
    y0 = ops.fftconv(x, k, backend=b)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y1 = ops.fftconv(x, k, backend=b)
    s.synchronize()
    print("side stream", b, "equal" if torch.equal(y0, y1) else f"DIFFERS {rel(y1, y0):.2e}")
# CUDA graph capture of one op per backend
for b in BACKENDS:
    try:
        y = ops.fftconv(x, k, backend=b); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = ops.fftconv(x, k, backend=b)
        g.replay(); torch.cuda.synchronize()
        print("graph capture", b, "equal" if torch.equal(y, yg) else f"DIFFERS {rel(yg, y):.2e}")
    except Exception as exc:
        print("graph capture", b, "ERROR", type(exc).__name__, str(exc)[:300])
