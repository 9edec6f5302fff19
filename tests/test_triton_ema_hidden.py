"""ema_hidden, backend "triton" (interpreter): forward and every gradient against the float64
reference in fp32/bf16/fp16 x, odd sizes, non-contiguous inputs, several row blocks, and the
long-length fp32 accuracy at L = 2**18 with 1-|q| = 1e-5."""
import math

import pytest
import torch

from megalodon_kernels.ops.ema_hidden import ema_hidden
from megalodon_kernels.ops.ema_hidden import triton_impl
from support import assert_close, knobs, to_np, tol
from test_cema_kernel import random_coefficients
from test_ema_hidden import check_ema_hidden


def _check(B, D, N, L, xdtype, with_hx=True, contiguous=True, seed=0, **config):
    check_ema_hidden(B, D, N, L, xdtype, torch.float32, with_hx, contiguous, seed, backend="triton", **config)


# every x dtype, both hx cases and L in {1, 33, 129}, without the full cross product (interpreter time)
CASES = [(torch.float32, 1, False), (torch.float32, 33, True), (torch.float32, 129, False),
         (torch.bfloat16, 129, True), (torch.bfloat16, 1, False), (torch.float16, 33, False),
         (torch.float16, 129, True)]


@pytest.mark.parametrize("xdtype,L,with_hx", CASES,
                         ids=[f"{str(d).replace('torch.', '')}-L{L}-{'hx' if h else 'no_hx'}" for d, L, h in CASES])
def test_triton_ema_hidden_matches_reference(xdtype, L, with_hx):
    _check(2, 3, 4, L, xdtype, with_hx)


def test_triton_ema_hidden_odd_sizes_noncontiguous_several_tiles():
    # N = 19 pads to 32; L = 333 with 16 x 16 tiles: front padding, two row blocks, bf16 x
    _check(2, 2, 19, 333, torch.bfloat16, contiguous=False, block_m=16, block_r=16)


def test_triton_ema_hidden_streaming():
    gen = torch.Generator().manual_seed(11)
    c = random_coefficients(gen, 3, 4, 2, torch.float32)
    x = torch.randn(2, 3, 300, generator=gen)
    whole = ema_hidden(x, c["p"], c["log_q"], c["hx"], backend="triton")
    h1 = ema_hidden(x[..., :97], c["p"], c["log_q"], c["hx"], backend="triton")
    h2 = ema_hidden(x[..., 97:], c["p"], c["log_q"], h1, backend="triton")
    assert_close("streamed h", h2, to_np(whole), tol("triton", torch.float32, "fwd"))


def test_triton_ema_hidden_fp32_accuracy_at_long_length():
    # h and its gradients at L = 2**18, 1-|q| = 1e-5, against float64 (exact powers, chunked);
    # one program per d for the forward, 256 x 256 tiles (few, large programs).
    gap, L, D, N, B = 1e-5, 1 << 18, 2, 4, 1
    gen = torch.Generator().manual_seed(7)
    c = random_coefficients(gen, D, N, B, torch.float32)
    log_q = torch.complex(torch.full((D, N), math.log1p(-gap), dtype=torch.float64),
                          c["log_q"].imag.double()).to(torch.complex64)
    x = torch.randn(B, D, L, generator=gen)
    ins = [x.requires_grad_(), c["p"].requires_grad_(), log_q.requires_grad_(), c["hx"].requires_grad_()]
    with knobs(triton_impl, block_m=256, block_r=256):
        h = ema_hidden(*ins, backend="triton")
        dh = torch.complex(torch.randn(h.shape, generator=gen), torch.randn(h.shape, generator=gen))
        grads = torch.autograd.grad(h, ins, dh)
    # float64 oracle: every power a direct exp of an exact float64 exponent
    lq = log_q.detach().to(torch.complex128)
    p, hx, xd = c["p"].detach().double(), c["hx"].detach().to(torch.complex128), x.detach().double()
    e = torch.arange(L - 1, -1, -1, dtype=torch.float64)
    qe = torch.exp(lq[..., None] * e)                                   # [D, N, L]
    qL = torch.exp(lq * L)
    V = torch.einsum("bdl,dnl->bdn", xd.to(qe.dtype), qe)
    W = torch.einsum("bdl,dnl->bdn", (xd * e).to(qe.dtype), qe)
    dhd = dh.to(torch.complex128)
    want_h = p * V + qL * hx
    want = (torch.einsum("bdn,dnl->bdl", dhd.conj() * p, qe).real, (dhd.conj() * V).real.sum(0),
            (dhd * (p * W + L * qL * hx).conj()).sum(0), dhd * qL.conj())
    assert_close("h", h, want_h, 1e-5)
    for name, got, exp in zip(("dx", "dp", "dlog_q", "dhx"), grads, want):
        assert_close(name, got, exp, 1e-5)
    assert_close("dx[L/2:]", grads[0][..., : L // 2], want[0][..., : L // 2], 1e-5)


def test_triton_ema_hidden_rejects_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    c = random_coefficients(gen, 2, 33, None, torch.float32)          # N = 33 > the largest n tile
    with pytest.raises(Exception, match="N = 33 > 32"):
        ema_hidden(torch.randn(1, 2, 8), c["p"], c["log_q"], backend="triton")
    c = random_coefficients(gen, 2, 3, None, torch.float64)
    with pytest.raises(Exception, match="float32 coefficients"):
        ema_hidden(torch.randn(1, 2, 8, dtype=torch.float64), c["p"], c["log_q"], backend="triton")
