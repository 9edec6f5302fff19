"""cema_kernel, backend "triton" (interpreter): forward and every gradient against the float64
reference at odd sizes, one-output-used cases, and the fp32 long-length accuracy contract
(L = 2**18, 1-|q| = 1e-5) against the exact float64 oracle, with few large programs."""
import math

import pytest
import torch

from megalodon_kernels.ops.cema_kernel import cema_kernel
from megalodon_kernels.ops.cema_kernel import triton_impl
from support import assert_close, knobs
from test_cema_kernel import _oracle_long, check_cema_kernel, random_coefficients


def _check(D, N, B, L, contiguous=True, seed=0, use=("k", "b"), **config):
    check_cema_kernel(D, N, B, L, torch.float32, contiguous, seed, use, backend="triton", **config)


@pytest.mark.parametrize("L", [1, 31, 129])
@pytest.mark.parametrize("B", [None, 2], ids=["no_hx", "hx"])
def test_triton_cema_kernel_matches_reference(L, B):
    _check(3, 4, B, L)


def test_triton_cema_kernel_odd_sizes_noncontiguous_several_tiles():
    # N = 19 pads to a 32-wide n tile; L = 333 with 16 x 16 tiles spans two row blocks and a partial tile
    _check(2, 19, 2, 333, contiguous=False, block_m=16, block_r=16)


@pytest.mark.parametrize("use", [("k",), ("b",)], ids=["k_only", "b_only"])
def test_triton_cema_kernel_one_output_used(use):
    _check(2, 3, 2, 40, use=use)


def test_triton_cema_kernel_fp32_float64_rejected():
    c = random_coefficients(torch.Generator().manual_seed(0), 2, 3, None, torch.float64)
    with pytest.raises(Exception, match="float32 coefficients"):
        cema_kernel(c["p"], c["log_q"], c["gamma"], 8, backend="triton")


def test_triton_cema_kernel_fp32_accuracy_at_long_length():
    # The numerical contract at L = 2**18, 1-|q| = 1e-5: within 1e-5 of float64, forward and
    # backward, also on the second half (no loss of precision with j). Two programs per kernel
    # (D = 2) with 256 x 256 tiles each loop over the whole length.
    gap, L, D, N, B = 1e-5, 1 << 18, 2, 4, 1
    gen = torch.Generator().manual_seed(7)
    c = random_coefficients(gen, D, N, B, torch.float32)
    c["log_q"] = torch.complex(torch.full((D, N), math.log1p(-gap), dtype=torch.float64),
                               c["log_q"].imag.double()).to(torch.complex64)
    ins = [c[n].requires_grad_() for n in ("p", "log_q", "gamma", "hx")]
    with knobs(triton_impl, block_m=256, block_r=256):
        k, b = cema_kernel(*ins[:3], L, ins[3], backend="triton")
        dk = torch.randn(k.shape, generator=gen)
        db = torch.randn(b.shape, generator=gen)
        grads = torch.autograd.grad((k, b), ins, (dk, db))
    k_ref, b_ref, grads_ref = _oracle_long(*ins, L, dk, db)
    assert_close("k", k, k_ref, 1e-5)
    assert_close("b", b, b_ref, 1e-5)
    assert_close("k[L/2:]", k[:, L // 2:], k_ref[:, L // 2:], 1e-5)
    for name, got, want in zip(("dp", "dlog_q", "dgamma", "dhx"), grads, grads_ref):
        assert_close(name, got, want, 1e-5)


def test_triton_phase_fraction_is_exact_mod_one():
    # F / 2**64 == arg(q) / (2 pi) mod 1 to float64 precision, and e * F wraps exactly
    lq = torch.complex(torch.zeros(5), torch.tensor([-3.1, -1e-7, 0.0, 0.5, 3.14159]))
    f = triton_impl.phase_fraction(lq)
    turns = (f.double() / 2.0 ** 64) % 1.0
    want = (lq.imag.double() / (2 * math.pi)) % 1.0
    assert torch.allclose(turns, want, atol=1e-15, rtol=0)
