"""The model glue's fused forms (model/layers.py) against the plain compositions they replace.

* RMSNorm's autograd Function (fewer passes, hand-written backward) against
  x * rsqrt(mean(x^2) + eps) * (w + 1) composed from torch ops: values and gradients, float64
  (plus gradcheck), float32, bf16 input, with and without the affine weight;
* the gate a * silu(u) (attention gate, SwiGLU) as a Function against the two ops;
* the residual sums taken into the output projections' GEMMs (MegalodonAttention's
  x + wh1(mx) + wh2(attn), NormalizedFFN's residual + fc2(h) and residual + alpha * out) against
  the unfused path the module takes when they cannot be fused (dropout, autocast), forced here.
"""
from __future__ import annotations

import pytest
import torch

from megalodon_kernels.model import MegalodonBlock, RMSNorm, get_config
from megalodon_kernels.model import layers as layers_mod
from support import perturb_


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def _rel(a, e):
    a, e = a.detach().double(), e.detach().double()
    return float((a - e).abs().max()) / max(float(e.abs().max()), 1e-30)


def _composed_rms(x, weight, eps):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(y.dtype) + 1.0)
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_rmsnorm_equals_the_composed_ops(dtype, tol, affine):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-5, affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(0.3 * torch.randn(24, generator=g))
    x = (torch.randn(3, 7, 24, generator=g) * 2).to(dtype).requires_grad_()
    gy = torch.randn(3, 7, 24, generator=g).to(dtype)
    params = [x] + ([norm.weight] if affine else [])
    y = norm(x)
    expected = _composed_rms(x, norm.weight, norm.eps)
    assert y.dtype == expected.dtype == dtype
    assert _rel(y, expected) <= tol
    for a, e in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(expected, params, gy)):
        assert a.dtype == e.dtype and _rel(a, e) <= tol, _rel(a, e)


def test_rmsnorm_gradcheck_and_partial_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    s = (1 + 0.3 * torch.randn(6, dtype=torch.float64, generator=g)).requires_grad_()
    fn = layers_mod._RMSNormFn.apply
    assert torch.autograd.gradcheck(lambda x, s: fn(x, s, 1e-5), (x, s))
    assert torch.autograd.gradcheck(lambda x: fn(x, None, 1e-5), (x,))
    # one input frozen: the other's gradient alone, still right
    gy = torch.randn(5, 6, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(_composed_rms(x, s - 1, 1e-5), (x, s), gy)
    (dx,) = torch.autograd.grad(fn(x, s.detach(), 1e-5), (x,), gy)
    (ds,) = torch.autograd.grad(fn(x.detach(), s, 1e-5), (s,), gy)
    assert _rel(dx, expected[0]) <= 1e-13 and _rel(ds, expected[1]) <= 1e-13


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp64", "fp32", "bf16"])
def test_silu_gate_equals_the_composed_ops(dtype, tol):
    g = torch.Generator().manual_seed(3)
    a, u, gy = (torch.randn(2, 9, 12, generator=g).to(dtype) for _ in range(3))
    a.requires_grad_()
    u.requires_grad_()
    y = layers_mod._silu_gate(a, u)
    expected = a * torch.nn.functional.silu(u)
    assert y.dtype == dtype and _rel(y, expected) <= tol
    for got, want in zip(torch.autograd.grad(y, (a, u), gy), torch.autograd.grad(expected, (a, u), gy)):
        assert got.dtype == dtype and _rel(got, want) <= tol, _rel(got, want)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(layers_mod._SiluGateFn.apply, (a, u))
        (du,) = torch.autograd.grad(layers_mod._silu_gate(a.detach(), u), (u,), gy)  # a frozen
        (want,) = torch.autograd.grad(a.detach() * torch.nn.functional.silu(u), (u,), gy)
        assert _rel(du, want) <= tol


def _block(dtype, **overrides):
    cfg = get_config("tiny", **{"model_dim": 32, "z_dim": 16, "value_dim": 24, "ffn_hidden_dim": 40,
                                "num_heads": 2, "chunk_size": 8, "norm_num_groups": 4, "cema_ndim": 4,
                                "dropout": 0.0, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                                **overrides})
    torch.manual_seed(0)
    return perturb_(MegalodonBlock(cfg, 1).to(dtype), 5).train()


def _run(block, x, gy):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = block(x)
    y.backward(gy)
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("variant", [{}, {"rescale_nffn": True}, {"swiglu": True}], ids=["plain", "rescale", "swiglu"])
def test_residual_sums_in_the_gemms_equal_the_separate_adds(dtype, tol, variant, monkeypatch):
    block = _block(dtype, **variant)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 19, 32, generator=g).to(dtype)
    gy = torch.randn(2, 19, 32, generator=g).to(dtype)
    assert layers_mod._fuse_residual(0.0, True, x)
    fused = _run(block, x, gy)
    monkeypatch.setattr(layers_mod, "_fuse_residual", lambda *a: False)
    separate = _run(block, x, gy)
    assert _rel(fused[0], separate[0]) <= tol and _rel(fused[1], separate[1]) <= tol
    assert fused[2].keys() == separate[2].keys()
    for name in fused[2]:
        assert _rel(fused[2][name], separate[2][name]) <= tol, name


def test_residual_not_fused_under_dropout_or_autocast():
    x = torch.zeros(2, 3)
    assert not layers_mod._fuse_residual(0.1, True, x)
    assert layers_mod._fuse_residual(0.1, False, x)  # eval: dropout is the identity
    with torch.autocast("cpu", torch.bfloat16):
        assert not layers_mod._fuse_residual(0.0, True, x)
