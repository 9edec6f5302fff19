"""torch.compile and torch.export: every op is a torch.library custom op (ops/_library.py).

* opcheck (schema, fake implementation, autograd registration, AOT dispatch with dynamic shapes)
  for every forward op and every backward op, fp32/bf16/fp64, with and without the optional
  arguments, every output mode;
* each public op compiled with fullgraph=True equals eager, forward and backward;
* the model: compiled (inductor, fullgraph) forward and backward equal eager with DropKey on (same
  seeds, so the same masks), no graph break, a second sequence length recompiles at most once and a
  third not at all, autocast bf16, torch.export round trip, and bad inputs raise the eager errors.

Shapes are tiny: compiling on a shared 2-core CPU is slow. The per-op and most model checks use
the ``aot_eager`` backend (dynamo + AOTAutograd on the fake implementations, which is what a
custom op has to get right); the model's main check runs inductor.
"""
from __future__ import annotations

import math

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.model import Megalodon, get_config
from megalodon_kernels.ops.rotary import rotation_tables
from support import perturb_

OPS = torch.ops.megalodon_kernels
REAL = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _coef(dtype, D=3, N=4, B=2, gen=None):
    """CEMA coefficients in float32/complex64 (float64/complex128 for a float64 model)."""
    rd = torch.float64 if dtype == torch.float64 else torch.float32
    g = gen or torch.Generator().manual_seed(0)
    p = torch.rand(D, N, dtype=rd, generator=g) * 0.5 + 0.25
    log_q = torch.complex(-torch.rand(D, N, dtype=rd, generator=g) * 0.5 - 0.05,
                          torch.rand(D, N, dtype=rd, generator=g) * 3.0)
    gamma = torch.complex(torch.randn(D, N, dtype=rd, generator=g), torch.randn(D, N, dtype=rd, generator=g))
    hx = torch.complex(torch.randn(B, D, N, dtype=rd, generator=g), torch.randn(B, D, N, dtype=rd, generator=g))
    return p, log_q, gamma, hx


def _grad(*ts):
    return [t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex()) if t is not None else None
            for t in ts]


# ---------------------------------------------------------------------------------------------
# opcheck: forward ops (with their registered autograd) and backward ops


def _forward_cases():
    g = torch.Generator().manual_seed(1)
    for name, dt in REAL.items():
        B, D, N, L = 2, 3, 4, 9
        p, lq, gm, hx = _grad(*_coef(dt, D, N, B))
        x = torch.randn(B, D, L, generator=g).to(dt).requires_grad_()
        k = torch.randn(D, L, generator=g).to(torch.float32 if dt != torch.float64 else dt).requires_grad_()
        om = torch.randn(D, generator=g).to(dt).requires_grad_()
        yield f"fftconv-{name}", OPS.fftconv, (x, k, "auto")
        yield f"cema_kernel-{name}-hx", OPS.cema_kernel, (p, lq, gm, L, hx, "auto")
        yield f"cema_kernel-{name}", OPS.cema_kernel, (p, lq, gm, L, None, "auto")
        yield f"ema_hidden-{name}-hx-weighted", OPS.ema_hidden, (x, p, lq, hx, True, "auto")
        yield f"ema_hidden-{name}", OPS.ema_hidden, (x, p, lq, None, False, "auto")
        yield f"cema-{name}-state", OPS.cema, (x, p, lq, gm, om, hx, True, True, "auto")
        yield f"cema-{name}-state-unweighted", OPS.cema, (x, p, lq, gm, om, hx, True, False, "auto")
        yield f"cema-{name}", OPS.cema, (x, p, lq, gm, om, None, False, False, "auto")
        cu, x1, hx3 = torch.tensor([0, 4, 4, 9]), x[:1].detach().requires_grad_(), hx.detach()[[0, 1, 1]].requires_grad_()
        yield f"fftconv-{name}-packed", OPS.fftconv, (x1, k, "auto", cu)
        yield f"ema_hidden-{name}-packed-hx-weighted", OPS.ema_hidden, (x1, p, lq, hx3, True, "auto", cu)
        yield f"ema_hidden-{name}-packed", OPS.ema_hidden, (x1, p, lq, None, False, "auto", cu)
        yield f"cema-{name}-packed-state", OPS.cema, (x1, p, lq, gm, om, hx3, True, True, "auto", cu)
        yield f"cema-{name}-packed", OPS.cema, (x1, p, lq, gm, om, None, False, False, "auto", cu)
        Bt, Lt, Dt, G = 2, 7, 8, 2
        acc = torch.float64 if dt == torch.float64 else torch.float32
        xt = torch.randn(Bt, Lt, Dt, generator=g).to(dt).requires_grad_()
        sc, bi = (torch.randn(Dt, generator=g).to(dt).requires_grad_() for _ in range(2))
        pm = torch.randn(Bt, G, generator=g).to(acc).requires_grad_()
        pv = (torch.rand(Bt, G, generator=g) + 0.5).to(acc).requires_grad_()
        pad = torch.zeros(Bt, Lt, dtype=torch.bool)
        pad[0, 2] = True
        yield f"timestep_norm-{name}-state-pad", OPS.timestep_norm, (xt, sc, bi, torch.tensor([0, 3]), pm, pv, pad, G,
                                                                     1e-5, "auto")
        yield f"timestep_norm-{name}", OPS.timestep_norm, (
            xt, sc, bi, torch.zeros(Bt, dtype=torch.int64), torch.zeros(Bt, G, dtype=acc),
            torch.ones(Bt, G, dtype=acc), torch.zeros(Bt, Lt, dtype=torch.bool), G, 1e-5, "auto")
        x1 = xt[:1].detach().requires_grad_()
        pm3, pv3 = (t.detach()[[0, 1, 1]].requires_grad_() for t in (pm, pv))  # 3 documents
        yield f"timestep_norm-{name}-packed", OPS.timestep_norm, (x1, sc, bi, torch.tensor([0, 2, 1]), pm3, pv3, pad[:1],
                                                                  G, 1e-5, "auto", torch.tensor([0, 3, 3, 7]))
        q = torch.randn(2, 5, 2, 4, generator=g).to(dt).requires_grad_()
        kk = torch.randn(2, 7, 2, 4, generator=g).to(dt).requires_grad_()
        v = torch.randn(2, 7, 2, 3, generator=g).to(dt).requires_grad_()
        yield f"attention-{name}-chunk-dropkey", OPS.attention, (q, kk, v, 0.5, True, 3, False, 0.3, 123, "softmax",
                                                                 "auto")
        yield f"attention-{name}-block-causal", OPS.attention, (q, kk, v, 1.0, True, 3, True, 0.0, 0, "softmax",
                                                                "auto")
        yield f"attention-{name}-laplace", OPS.attention, (q, kk, v, 1.0, False, None, False, 0.0, 0, "laplace",
                                                           "auto")
        q1, k1, v1 = (t[:1, :5].detach().requires_grad_() for t in (q, kk, v))
        for fn in ("softmax", "laplace"):
            yield f"attention-{name}-packed-{fn}", OPS.attention, (q1, k1, v1, 0.5, True, 2, True, 0.3, 123, fn, "auto",
                                                                   torch.tensor([0, 3, 3, 5]))
        s = torch.randn(2, 2, 5, 7, generator=g).to(dt).requires_grad_()
        yield f"dropkey_softmax-{name}", OPS.dropkey_softmax, (s, True, 0.3, 5, "auto")
        yield f"dropkey_softmax-{name}-2d", OPS.dropkey_softmax, (s[0, 0].detach().requires_grad_(), False, 0.0, 0,
                                                                  "auto")
        xr = torch.randn(2, 5, 2, 4, generator=g).to(dt).requires_grad_()
        for xpos in (None, 512.0):
            cos, sin = rotation_tables(torch.arange(5), 4, 10000.0, xpos, False, acc)
            yield f"rotary-{name}-{'xpos' if xpos else 'rope'}", OPS.rotary, (xr, cos, sin, "auto")


FORWARD_CASES = list(_forward_cases())


@pytest.mark.parametrize("op,args", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_opcheck_forward(op, args):
    torch.library.opcheck(op, args)


def _backward_cases():
    """Each backward op on the inputs its forward would hand it (no autograd on these)."""
    torch.manual_seed(2)
    for name, dt in REAL.items():
        B, D, N, L = 2, 3, 4, 9
        p, lq, gm, hx = _coef(dt, D, N, B)
        x, k, om = torch.randn(B, D, L, dtype=dt), torch.randn(D, L, dtype=dt), torch.randn(D, dtype=dt)
        yield f"fftconv_bwd-{name}", OPS.fftconv_bwd, (torch.randn(B, D, L, dtype=dt), x, k, True, True, "auto")
        yield f"fftconv_bwd-{name}-x-only", OPS.fftconv_bwd, (torch.randn(B, D, L, dtype=dt), x, k, True, False,
                                                             "auto")
        yield f"cema_kernel_bwd-{name}", OPS.cema_kernel_bwd, (
            torch.randn(D, L, dtype=dt), torch.randn(B, D, L, dtype=dt), p, lq, gm, L, hx, [True] * 4, "auto")
        yield f"cema_kernel_bwd-{name}-no-hx", OPS.cema_kernel_bwd, (
            torch.randn(D, L, dtype=dt), None, p, lq, gm, L, None, [True, True, False, False], "auto")
        h, V, W = OPS.ema_hidden(x, p, lq, hx, True, "auto")
        yield f"ema_hidden_bwd-{name}", OPS.ema_hidden_bwd, (torch.randn_like(h), x, p, lq, hx, V, W, True, [True] * 4,
                                                             "auto")
        y, h, kk, V, W = OPS.cema(x, p, lq, gm, om, hx, True, True, "auto")
        yield f"cema_bwd-{name}", OPS.cema_bwd, (torch.randn_like(y), torch.randn_like(h), x, p, lq, gm, om, hx, kk, V,
                                                 W, True, [True] * 6, "auto")
        y, h, kk, V, W = OPS.cema(x, p, lq, gm, om, None, False, False, "auto")
        yield f"cema_bwd-{name}-no-state", OPS.cema_bwd, (torch.randn_like(y), None, x, p, lq, gm, om, None, kk, V, W,
                                                          False, [True, True, True, True, True, False], "auto")
        cu, x1, hx3 = torch.tensor([0, 4, 4, 9]), x[:1], hx[[0, 1, 1]]  # 3 documents, one empty
        yield f"fftconv_bwd-{name}-packed", OPS.fftconv_bwd, (torch.randn_like(x1), x1, k, True, True, "auto", cu)
        h, V, W = OPS.ema_hidden(x1, p, lq, hx3, True, "auto", cu)
        yield f"ema_hidden_bwd-{name}-packed", OPS.ema_hidden_bwd, (torch.randn_like(h), x1, p, lq, hx3, V, W,
                                                                    True, [True] * 4, "auto", cu)
        y, h, kk, V, W = OPS.cema(x1, p, lq, gm, om, hx3, True, True, "auto", cu)
        yield f"cema_bwd-{name}-packed", OPS.cema_bwd, (torch.randn_like(y), torch.randn_like(h), x1, p, lq, gm, om, hx3,
                                                        kk, V, W, True, [True] * 6, "auto", cu)
        Bt, Lt, Dt, G = 2, 7, 8, 2
        xt, sc, bi = torch.randn(Bt, Lt, Dt, dtype=dt), torch.randn(Dt, dtype=dt), torch.randn(Dt, dtype=dt)
        pc, pm, pv = torch.tensor([0, 3]), torch.randn(Bt, G, dtype=dt), torch.rand(Bt, G, dtype=dt) + 0.5
        pad = torch.zeros(Bt, Lt, dtype=torch.bool)
        out = OPS.timestep_norm(xt, sc, bi, pc, pm, pv, pad, G, 1e-5, "auto")
        yield f"timestep_norm_bwd-{name}", OPS.timestep_norm_bwd, (
            torch.randn_like(out[0]), torch.randn_like(out[2]), torch.randn_like(out[3]), xt, sc, bi, pc, pm, pv, pad,
            *out[4:], G, "auto")
        cu, pc3, pm3, pv3 = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 3, 1]), pm[[0, 1, 1]], pv[[0, 1, 1]]
        out = OPS.timestep_norm(xt[:1], sc, bi, pc3, pm3, pv3, pad[:1], G, 1e-5, "auto", cu)
        yield f"timestep_norm_bwd-{name}-packed", OPS.timestep_norm_bwd, (
            torch.randn_like(out[0]), torch.randn_like(out[2]), torch.randn_like(out[3]), xt[:1], sc, bi, pc3, pm3, pv3,
            pad[:1], *out[4:], G, "auto", cu)
        q, kq, v = (torch.randn(2, S, 2, d, dtype=dt) for S, d in ((5, 4), (7, 4), (7, 3)))
        for fn in ("softmax", "laplace"):
            o, lse, seed, _ = OPS.attention(q, kq, v, 0.5, True, 3, False, 0.3, 7, fn, "auto")
            yield f"attention_bwd-{name}-{fn}", OPS.attention_bwd, (torch.randn_like(o), q, kq, v, o, lse, seed, 0.5,
                                                                    True, 3, False, 0.3, fn, "auto")
            cu = torch.tensor([0, 3, 3, 5])
            q1, k1, v1 = q[:1], kq[:1, :5], v[:1, :5]
            o, lse, seed, _ = OPS.attention(q1, k1, v1, 0.5, True, 2, True, 0.3, 7, fn, "auto", cu)
            yield f"attention_bwd-{name}-packed-{fn}", OPS.attention_bwd, (
                torch.randn_like(o), q1, k1, v1, o, lse, seed, 0.5, True, 2, True, 0.3, fn, "auto", cu)
        s = torch.randn(2, 2, 5, 7, dtype=dt)
        y, seed = OPS.dropkey_softmax(s, True, 0.3, 5, "auto")
        yield f"dropkey_softmax_bwd-{name}", OPS.dropkey_softmax_bwd, (torch.randn_like(y), y, seed, True, 0.3, "auto")
        acc = torch.float64 if dt == torch.float64 else torch.float32
        cos, sin = rotation_tables(torch.arange(5), 4, 10000.0, 512.0, True, acc)
        yield f"rotary_bwd-{name}", OPS.rotary_bwd, (torch.randn(2, 5, 2, 4, dtype=dt), cos, sin, "auto")


BACKWARD_CASES = list(_backward_cases())


@pytest.mark.parametrize("op,args", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES])
def test_opcheck_backward(op, args):
    torch.library.opcheck(op, args)


def _backend_cases(backend):
    """(name, forward op, its args, backward op, backward args from the forward's outputs), fp32."""
    g = torch.Generator().manual_seed(4)
    B, D, N, L = 2, 3, 4, 9
    p, lq, gm, hx = _coef(torch.float32, D, N, B, g)
    x, k, om = torch.randn(B, D, L, generator=g), torch.randn(D, L, generator=g), torch.randn(D, generator=g)
    yield "fftconv", OPS.fftconv, (x, k, backend), OPS.fftconv_bwd, lambda y: (y, x, k, True, True, backend)
    yield "cema_kernel", OPS.cema_kernel, (p, lq, gm, L, hx, backend), OPS.cema_kernel_bwd, \
        lambda out: (out[0], out[1], p, lq, gm, L, hx, [True] * 4, backend)
    yield "ema_hidden", OPS.ema_hidden, (x, p, lq, hx, True, backend), OPS.ema_hidden_bwd, \
        lambda out: (out[0], x, p, lq, hx, out[1], out[2], True, [True] * 4, backend)
    yield "cema", OPS.cema, (x, p, lq, gm, om, hx, True, True, backend), OPS.cema_bwd, \
        lambda out: (out[0], out[1], x, p, lq, gm, om, hx, *out[2:], True, [True] * 6, backend)
    cu_ema, x1, hx3 = torch.tensor([0, 4, 4, 9]), x[:1], hx[[0, 1, 1]]  # 3 documents, one empty
    yield "fftconv-packed", OPS.fftconv, (x1, k, backend, cu_ema), OPS.fftconv_bwd, \
        lambda y: (y, x1, k, True, True, backend, cu_ema)
    yield "ema_hidden-packed", OPS.ema_hidden, (x1, p, lq, hx3, True, backend, cu_ema), OPS.ema_hidden_bwd, \
        lambda out: (out[0], x1, p, lq, hx3, out[1], out[2], True, [True] * 4, backend, cu_ema)
    yield "cema-packed", OPS.cema, (x1, p, lq, gm, om, hx3, True, True, backend, cu_ema), OPS.cema_bwd, \
        lambda out: (out[0], out[1], x1, p, lq, gm, om, hx3, *out[2:], True, [True] * 6, backend, cu_ema)
    xt, sc, bi = torch.randn(2, 7, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    pc, pm, pv = torch.tensor([0, 3]), torch.randn(2, 2, generator=g), torch.rand(2, 2, generator=g) + 0.5
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 3] = True
    yield "timestep_norm", OPS.timestep_norm, (xt, sc, bi, pc, pm, pv, pad, 2, 1e-5, backend), \
        OPS.timestep_norm_bwd, lambda out: (out[0], out[2], out[3], xt, sc, bi, pc, pm, pv, pad, *out[4:], 2, backend)
    packed = (xt[:1], sc, bi, torch.tensor([0, 3, 1]), pm[[0, 1, 1]], pv[[0, 1, 1]], pad[1:])  # 3 documents
    cu_tsn = torch.tensor([0, 3, 3, 7])
    yield "timestep_norm-packed", OPS.timestep_norm, (*packed, 2, 1e-5, backend, cu_tsn), \
        OPS.timestep_norm_bwd, lambda out: (out[0], out[2], out[3], *packed, *out[4:], 2, backend, cu_tsn)
    q, kq, v = (torch.randn(2, S, 2, d, generator=g) for S, d in ((5, 16), (7, 16), (7, 16)))
    for fn in ("softmax",) if backend == "cuda" else ("softmax", "laplace"):
        args = (0.5, True, 3, False, 0.3, 7, fn, backend)
        yield f"attention-{fn}", OPS.attention, (q, kq, v, *args), OPS.attention_bwd, \
            lambda out, args=args: (out[0], q, kq, v, *out[:3], *args[:4], args[4], args[6], backend)
        q1, k1, v1, cu = q[:1], kq[:1, :5], v[:1, :5], torch.tensor([0, 2, 5])
        yield f"attention-packed-{fn}", OPS.attention, (q1, k1, v1, *args, cu), OPS.attention_bwd, \
            lambda out, args=args: (out[0], q1, k1, v1, *out[:3], *args[:4], args[4], args[6], backend, cu)
    sc2 = torch.randn(2, 2, 5, 7, generator=g)
    yield "dropkey_softmax", OPS.dropkey_softmax, (sc2, True, 0.3, 5, backend), OPS.dropkey_softmax_bwd, \
        lambda out: (out[0], out[0], out[1], True, 0.3, backend)
    cos, sin = rotation_tables(torch.arange(5), 4, 10000.0, 512.0, False, torch.float32)
    xr = torch.randn(2, 5, 2, 4, generator=g)
    yield "rotary", OPS.rotary, (xr, cos, sin, backend), OPS.rotary_bwd, lambda y: (y, cos, sin, backend)


BACKEND_CASES = [(b, *c) for b in ("triton", "cuda") for c in _backend_cases(b)]


@pytest.mark.parametrize("backend,fwd,fwd_args,bwd,bwd_args", [c[:1] + c[2:] for c in BACKEND_CASES],
                         ids=[f"{c[1]}-{c[0]}" for c in BACKEND_CASES])
def test_fake_matches_every_backend(backend, fwd, fwd_args, bwd, bwd_args):
    """The residual contract: each backend's real outputs, forward and backward, have the shapes,
    dtypes and strides the (backend-independent) fake implementations promise (Triton in the
    interpreter, CUDA in the emulator)."""
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(fwd, fwd_args, test_utils=checks)
    out = fwd(*fwd_args)
    torch.library.opcheck(bwd, bwd_args(out), test_utils=checks)


def test_every_public_op_is_a_custom_op_with_a_backward_op():
    for name in ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax",
                 "rotary"):
        for op in (name, f"{name}_bwd"):
            assert hasattr(OPS, op), op
            assert getattr(OPS, op).default._schema.name == f"megalodon_kernels::{op}"


# ---------------------------------------------------------------------------------------------
# each public op: compiled (fullgraph) == eager, forward and backward


def _op_calls():
    g = torch.Generator().manual_seed(3)
    B, D, N, L = 2, 3, 4, 11
    p, lq, gm, hx = _coef(torch.float32, D, N, B, g)
    x, k, om = torch.randn(B, D, L, generator=g), torch.randn(D, L, generator=g), torch.randn(D, generator=g)
    yield "fftconv", lambda x, k: ops.fftconv(x, k), (x, k)
    yield "cema_kernel", lambda p, lq, gm, hx: ops.cema_kernel(p, lq, gm, L, hx), (p, lq, gm, hx)
    yield "cema_kernel-no-hx", lambda p, lq, gm: ops.cema_kernel(p, lq, gm, L)[0], (p, lq, gm)
    yield "ema_hidden", lambda x, p, lq, hx: ops.ema_hidden(x, p, lq, hx), (x, p, lq, hx)
    yield "cema-state", lambda x, p, lq, gm, om, hx: ops.cema(x, p, lq, gm, om, hx, return_state=True), \
        (x, p, lq, gm, om, hx)
    yield "cema", lambda x, p, lq, gm, om: ops.cema(x, p, lq, gm, om)[0], (x, p, lq, gm, om)
    cu3, hx3 = torch.tensor([0, 4, 4, 11]), hx[[0, 1, 1]]  # 3 documents, one empty
    yield "fftconv-packed", lambda x, k: ops.fftconv(x, k, cu_seqlens=cu3), (x[:1], k)
    yield "ema_hidden-packed", lambda x, p, lq, hx: ops.ema_hidden(x, p, lq, hx, cu_seqlens=cu3), (x[:1], p, lq, hx3)
    yield "cema-packed-state", lambda x, p, lq, gm, om, hx: ops.cema(x, p, lq, gm, om, hx, return_state=True,
                                                                     cu_seqlens=cu3), (x[:1], p, lq, gm, om, hx3)
    xt, sc, bi = torch.randn(2, 7, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4] = True
    yield "timestep_norm", lambda x, s, b: ops.timestep_norm(x, s, b, 4, padding_mask=pad), (xt, sc, bi)
    pm, pv = torch.randn(2, 4, generator=g), torch.rand(2, 4, generator=g) + 0.5
    yield "timestep_norm-state", lambda x, s, b, pm, pv: ops.timestep_norm(x, s, b, 4, torch.tensor([2, 0]), pm, pv), \
        (xt, sc, bi, pm, pv)
    cu_tsn, pad_tsn = torch.tensor([0, 3, 3, 7]), pad[1:]
    yield "timestep_norm-packed", lambda x, s, b, pm, pv: ops.timestep_norm(
        x, s, b, 4, torch.tensor([2, 0, 1]), pm[[0, 1, 1]], pv[[0, 1, 1]], pad_tsn, cu_seqlens=cu_tsn), \
        (xt[:1], sc, bi, pm, pv)
    q, kk, v = (torch.randn(2, 9, 2, d, generator=g) for d in (4, 4, 6))
    yield "attention", lambda q, k, v: ops.attention(q, k, v, chunk_size=4, dropkey_p=0.25, seed=11), (q, kk, v)
    yield "attention-lex-laplace", lambda q, k, v: ops.attention(q, k, v, chunk_size=4, block_causal=True,
                                                                 attn_fn="laplace"), (q, kk, v)
    cu = torch.tensor([0, 2, 2, 9])
    yield "attention-packed", lambda q, k, v: ops.attention(q, k, v, chunk_size=4, block_causal=True, dropkey_p=0.25,
                                                            seed=11, cu_seqlens=cu), (q[:1], kk[:1], v[:1])
    s = torch.randn(2, 2, 5, 7, generator=g)
    yield "dropkey_softmax", lambda s: ops.dropkey_softmax(s, True, 0.25, 9), (s,)
    xr = torch.randn(2, 5, 2, 6, generator=g)
    yield "rotary", lambda x: ops.rotary(x, torch.arange(3, 8), xpos_scale_base=64.0, xpos_downscale=True), (xr,)


OP_CALLS = list(_op_calls())


def _run(fn, inputs, seed=0):
    """Outputs and the gradients of a random projection of every real output."""
    ins = _grad(*inputs)
    out = fn(*ins)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((torch.view_as_real(o) if o.is_complex() else o).mul(
        torch.randn((torch.view_as_real(o) if o.is_complex() else o).shape, generator=gen, dtype=torch.float64)
        .to(o.real.dtype)).sum() for o in outs if o.is_floating_point() or o.is_complex())
    grads = torch.autograd.grad(loss, [t for t in ins if t.requires_grad])
    return [o.detach() for o in outs], grads


def _close(actual, expected, rtol):
    for a, e in zip(actual, expected):
        scale = e.abs().max().clamp_min(1e-30)
        err = float((a - e).abs().max() / scale)
        assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("fn,inputs", [c[1:] for c in OP_CALLS], ids=[c[0] for c in OP_CALLS])
def test_op_compiled_equals_eager(fn, inputs):
    eager_out, eager_grads = _run(fn, inputs)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, grads = _run(compiled, inputs)
    _close(out, eager_out, 1e-6)
    _close(grads, eager_grads, 1e-6)


def test_op_compiled_with_inductor_equals_eager():
    """One op through inductor too: the custom op node inside inductor-generated code."""
    fn, inputs = next(c[1:] for c in OP_CALLS if c[0] == "cema-state")
    eager_out, eager_grads = _run(fn, inputs)
    out, grads = _run(torch.compile(fn, fullgraph=True), inputs)
    _close(out, eager_out, 1e-5)
    _close(grads, eager_grads, 1e-4)


def test_dropkey_without_seed_draws_the_same_seeds_compiled():
    """seed=None draws from torch's default generator when the op runs, compiled or not."""
    q, k, v = (torch.randn(1, 6, 1, 4) for _ in range(3))

    def f(q, k, v):
        return ops.attention(q, k, v, dropkey_p=0.5) + ops.attention(q, k, v, dropkey_p=0.5)

    torch.manual_seed(5)
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    assert torch.equal(compiled(q, k, v), eager)
    torch.manual_seed(6)
    assert not torch.equal(compiled(q, k, v), eager)


_COEF = _coef(torch.float32)
BAD_CALLS = [
    ("fftconv k shape", lambda x: ops.fftconv(x, torch.randn(3, 5)), ValueError, "k must have shape"),
    ("fftconv backend", lambda x: ops.fftconv(x, torch.randn(3, 11), backend="gpu"), ValueError, "backend must be"),
    ("attention dropkey_p", lambda x: ops.attention(x[..., None], x[..., None], x[..., None], dropkey_p=1.5),
     ValueError, "dropkey_p must be"),
    ("attention seed type", lambda x: ops.attention(x[..., None], x[..., None], x[..., None], seed=1.5),
     TypeError, "seed must be an int"),
    ("timestep_norm groups", lambda x: ops.timestep_norm(x, torch.ones(11), torch.zeros(11), 4), ValueError,
     "num_groups must divide D"),
    ("rotary odd d", lambda x: ops.rotary(x[..., None], torch.arange(3)), ValueError, "even last dimension"),
    ("cema return_state", lambda x: ops.cema(x, *_COEF[:3], torch.ones(3), return_state=1),
     TypeError, "return_state must be a bool"),
    ("cema hx shape", lambda x: ops.cema(x, *_COEF[:3], torch.ones(3), hx=_COEF[3][:1]), ValueError,
     "hx must have shape"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs_raise_the_eager_errors_under_compile(call, exc, match):
    """torch.compile raises the eager error itself (type and message). With fullgraph=True dynamo
    reports any exception raised while tracing as torch._dynamo.exc.Unsupported ("Observed
    exception"), which names the original one: its type and message (torch 2.13 writes
    ``ValueError('msg')``, torch 2.11 ``ValueError([ConstantVariable(str: 'msg')])``)."""
    x = torch.randn(2, 3, 11)
    with pytest.raises(exc, match=match) as eager:
        call(x)
    with pytest.raises(exc, match=match) as compiled:
        torch.compile(call, backend="aot_eager")(x)
    assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as strict:
        torch.compile(call, fullgraph=True, backend="aot_eager")(x)
    message = str(strict.value)
    assert f"{type(eager.value).__name__}(" in message and str(eager.value) in message, message


def test_bad_values_raise_at_run_time_under_compile():
    """A value check (prev_count >= 0) reads the tensor inside the op, when it runs: compiled
    with fullgraph=True it raises the eager ValueError itself, and a good call still runs."""
    x = torch.randn(2, 5, 4)

    def f(x, count):
        return ops.timestep_norm(x, torch.ones(4), torch.zeros(4), 2, count)[0]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(x, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="prev_count must be >= 0"):
        compiled(x, torch.tensor([-1, 0]))


# ---------------------------------------------------------------------------------------------
# the model


def _model(dtype=torch.float32, **overrides):
    cfg = get_config("tiny", **{"num_layers": 1, "vocab_size": 50, "backend": "auto", **overrides})
    torch.manual_seed(0)
    return perturb_(Megalodon(cfg).to(dtype), 100)


def _step(model, tokens, seed=1, run=None):
    """Logits and parameter gradients of one training step of ``run`` (default: model itself;
    else its compiled form); DropKey draws from seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = (model if run is None else run)(tokens)
    logits.float().square().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_model_compiled_fullgraph_equals_eager_with_dropkey():
    model = _model(dropkey_p=0.3).train()
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(0))
    explain = torch._dynamo.explain(model)(tokens)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    eager_logits, eager_grads = _step(model, tokens)
    logits, grads = _step(model, tokens, run=torch.compile(model, fullgraph=True))
    _close([logits], [eager_logits], 1e-5)
    assert grads.keys() == eager_grads.keys()
    _close([grads[n] for n in grads], [eager_grads[n] for n in grads], 1e-4)
    # another seed: another DropKey mask, so the equality above compared the same masks
    other, _ = _step(model, tokens, seed=2)
    assert not torch.allclose(other, eager_logits)


def test_packed_model_compiled_fullgraph_equals_eager_with_dropkey():
    """A packed row (cu_seqlens, DropKey on) compiles into one graph whose logits and gradients
    equal eager; the step is also not the unpacked one (the documents do not see each other)."""
    model = _model(dropkey_p=0.3).train()
    tokens = torch.randint(0, 50, (1, 45), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 7, 7, 30, 45])
    explain = torch._dynamo.explain(model)(tokens, cu_seqlens=cu)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    packed = lambda m: (lambda t: m(t, cu_seqlens=cu))  # noqa: E731
    eager_logits, eager_grads = _step(model, tokens, run=packed(model))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    logits, grads = _step(model, tokens, run=packed(compiled))
    _close([logits], [eager_logits], 1e-5)
    assert grads.keys() == eager_grads.keys()
    _close([grads[n] for n in grads], [eager_grads[n] for n in grads], 1e-4)
    unpacked, _ = _step(model, tokens)
    assert not torch.allclose(unpacked, eager_logits, atol=1e-3)


def test_model_dynamic_length_recompiles_at_most_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model().train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for L in (20, 29, 41, 16):
        tokens = torch.randint(0, 50, (2, L))
        _close([compiled(tokens).detach()], [model(tokens).detach()], 1e-5)
        if L == 29:
            assert counter.frame_count <= 2
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 4 lengths"


def test_model_autocast_bf16_compiled_equals_eager():
    model = _model().train()
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16):
        eager_logits, eager_grads = _step(model, tokens)
        logits, grads = _step(model, tokens, run=torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert logits.dtype == eager_logits.dtype
    # autocast was on: the result differs from the fp32 model's
    fp32_logits, _ = _step(model, tokens)
    assert float((fp32_logits - eager_logits).abs().max()) > 1e-4
    _close([logits.float()], [eager_logits.float()], 1e-6)
    _close([grads[n] for n in grads], [eager_grads[n] for n in grads], 1e-6)


def test_model_export_round_trip():
    model = _model().eval()
    tokens = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        eager = model(tokens)
        program = torch.export.export(model, (tokens,))
        exported = program.module()(tokens)
    _close([exported], [eager], 1e-6)
    names = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    for op in ("timestep_norm", "cema", "rotary", "attention"):
        assert f"megalodon_kernels.{op}.default" in names, sorted(names)


def test_model_export_dynamic_length():
    model = _model().eval()
    length = torch.export.Dim("length", min=2, max=4096)
    with torch.no_grad():
        program = torch.export.export(model, (torch.randint(0, 50, (2, 21)),), dynamic_shapes=({1: length},))
        for L in (5, 33):
            tokens = torch.randint(0, 50, (2, L))
            _close([program.module()(tokens)], [model(tokens)], 1e-6)


def test_streaming_cache_still_works_eagerly_after_compiling():
    """Compiling one model does not disturb another model's streaming path (eager)."""
    model = _model().eval()
    tokens = torch.randint(0, 50, (1, 30))
    torch.compile(model, fullgraph=True, backend="aot_eager")(tokens)
    with torch.no_grad():
        full = model(tokens)
        cache = model.init_cache(1)
        parts = [model(tokens[:, a:b], cache=cache) for a, b in ((0, 7), (7, 20), (20, 30))]
    _close([torch.cat(parts, 1)], [full], 1e-5)
    assert math.isfinite(float(full.abs().max()))
