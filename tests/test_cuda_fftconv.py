"""The CUDA fftconv beyond one block per row: the multi-pass four-step FFT (cuda/fftconv_long.cuh)
for L > 16384, EXECUTED by the CPU SIMT emulator, forward and backward, against float64; and the
float64 instantiations (double arithmetic throughout: one block up to L = 8192, multi-pass above).

reference/fftconv.py is the O(L^2) definition; it is affordable once at L = 16385 (B = D = 1).
Longer cases compare with the same convolution computed by float64 NumPy FFTs here (exact up to
~1e-15, far below the fp32 budget). Shapes are B = D = 1 where possible: the emulator runs
every CUDA thread as a fiber (at N = 2^17 a forward call takes a few seconds).
"""
import importlib
import os
import shutil

import numpy as np
import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.reference import fftconv as fftconv_ref
from support import assert_close, to_np

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")

# fp32 arithmetic with one rounding on store: the CUDA backend's budget (tests/support.py).
TOL = {torch.float32: {"fwd": 2e-5, "bwd": 5e-5}, torch.bfloat16: {"fwd": 2e-2, "bwd": 4e-2}}


def _inputs(seed, B, D, L, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=g).to(dtype)
    # a kernel decaying over the whole length, so late taps (the far end of the FFT) matter
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / (L / 4.0))
    dy = torch.randn(B, D, L, generator=g).to(dtype)
    return x, k, dy


def _fft_ref(x, k, dy):
    """float64 FFT forms of reference/fftconv.py: y = x * k, dx = k (correlated with) dy,
    dk = sum_b x_b (correlated with) dy_b, all truncated to L."""
    x, k, dy = to_np(x), to_np(k), to_np(dy)
    L = x.shape[-1]
    n = 2 * L
    rf, irf = np.fft.rfft, np.fft.irfft
    flip = lambda a: a[..., ::-1]  # noqa: E731
    y = irf(rf(x, n) * rf(k, n), n)[..., :L]
    dx = flip(irf(rf(flip(dy), n) * rf(k, n), n)[..., :L])
    dk = flip(irf((rf(flip(dy), n) * rf(x, n)).sum(0), n)[..., :L])
    return y, dx, dk


def _check(kernels, ext, x, k, dy, dtype, **kw):
    y = kernels.fftconv_fwd(ext, x, k, **kw)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k, **kw)
    assert y.dtype == dtype and dx.dtype == dtype and dk.dtype == torch.float32
    yr, dxr, dkr = _fft_ref(x, k, dy)
    assert_close("y", y, yr, TOL[dtype]["fwd"])
    assert_close("dx", dx, dxr, TOL[dtype]["bwd"])
    assert_close("dk", dk, dkr, 5e-5)  # dk is fp32 whatever x's dtype (k is fp32)
    return y, dx, dk


# ------------------------------------------------------------------------------------------------
# the plan and the limits
# ------------------------------------------------------------------------------------------------

def test_lengths_and_workspace_sizes(ext, kernels):
    assert ext.fftconv_one_block_max_length() == kernels.FFTCONV_ONE_BLOCK_MAX_LEN == 16384
    assert ext.fftconv_max_length() == kernels.FFTCONV_MAX_LEN == 2**27
    assert ext.fftconv_workspace_row_floats(16384) == 0           # one block per row, no workspace
    assert ext.fftconv_workspace_row_floats(16385) == 2 * 32768   # N = 2^15 complex64
    assert ext.fftconv_workspace_row_floats(2**20) == 2 * 2**20
    assert ext.fftconv_fft_size(70001) == 2**17


def test_launchers_reject_bad_lengths_and_a_missing_workspace(ext):
    with pytest.raises(ValueError, match="L <= 134217728"):
        ext.fftconv_fwd(0, 0, 0, 0, 1, 1, 2**27 + 1, 0, 0, 0)
    with pytest.raises(ValueError, match="workspace"):
        ext.fftconv_fwd(0, 0, 0, 0, 1, 1, 16385, 0, 0, 0)
    dk = torch.empty(1, 16385)  # finalize needs dk: the workspace check is what must fire
    with pytest.raises(ValueError, match="workspace"):
        ext.fftconv_bwd_dk(0, 0, 0, dk.data_ptr(), 1, 1, 16385, False, True, 0, 0, 0)
    dk64 = torch.empty(1, 8193, dtype=torch.float64)  # double: multi-pass from L = 8193 on
    with pytest.raises(ValueError, match="workspace"):
        ext.fftconv_bwd_dk(4, 0, 0, dk64.data_ptr(), 1, 1, 8193, False, True, 0, 0, 0)
    with pytest.raises(ValueError, match="L <= 33554432 in float64"):
        ext.fftconv_fwd(4, 0, 0, 0, 1, 1, 2**25 + 1, 0, 0, 0)
    with pytest.raises(ValueError, match="float32 or float64"):  # bf16 is a storage type, not an arithmetic one
        ext.fftconv_bwd_dk(1, 0, 0, dk.data_ptr(), 1, 1, 100, False, True, 0, 0, 0)


# ------------------------------------------------------------------------------------------------
# numerics
# ------------------------------------------------------------------------------------------------

def test_just_above_one_block_vs_direct_reference(ext, kernels):
    # L = 16385: the first multi-pass length, against the O(L^2) definition itself
    L = 16385
    x, k, dy = _inputs(1, 1, 1, L, torch.float32)
    y = kernels.fftconv_fwd(ext, x, k)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k)
    assert_close("y", y, fftconv_ref.fftconv(to_np(x), to_np(k)), TOL[torch.float32]["fwd"])
    dxr, dkr = fftconv_ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert_close("dx", dx, dxr, TOL[torch.float32]["bwd"])
    assert_close("dk", dk, dkr, 5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L", [32768, 70001], ids=lambda v: f"L{v}")
def test_multipass_vs_float64(ext, kernels, dtype, L):
    # 32768: N = 2^15 exactly (no padding inside the last column); 70001: odd, N = 2^17
    x, k, dy = _inputs(2, 1, 1, L, dtype)
    _check(kernels, ext, x, k, dy, dtype)


def test_multipass_batch_and_channels_both_fiber_orders(ext, kernels, order):
    # rows b * D + d pick kf[d]; dk sums the batch; a missing barrier shows in one fiber order
    B, D, L = 2, 2, 16385
    x, k, dy = _inputs(3, B, D, L, torch.float32)
    _check(kernels, ext, x, k, dy, torch.float32)


def test_multipass_2_pow_17_and_beyond(ext, kernels):
    # L >= 2^17 with N = 2^18 (plan N1 = N2 = 512): the longest case the test budget allows
    L = 2**17 + 3
    x, k, dy = _inputs(4, 1, 1, L, torch.bfloat16)
    _check(kernels, ext, x, k, dy, torch.bfloat16)


def test_forward_at_2_pow_20(ext, kernels):
    # the length the design asks for (N = 2^20, plan N1 = N2 = 1024, 8 columns per block);
    # forward only, the backward runs the same passes (see the N = 2^17 and 2^18 cases)
    L = 2**20
    x, k, _ = _inputs(8, 1, 1, L, torch.float32)
    y = kernels.fftconv_fwd(ext, x, k)
    n = 2 * L
    xr, kr = to_np(x), to_np(k)
    assert_close("y", y, np.fft.irfft(np.fft.rfft(xr, n) * np.fft.rfft(kr, n), n)[..., :L], TOL[torch.float32]["fwd"])


def test_twiddles_exact_angle_also_above_2_pow_24(ext):
    # cispi_frac(a, s) = e^{+-i pi a / 2^s}: a < 2^24 goes straight to sincospif; larger a (only at
    # N >= 2^25, too long to run here) is split into two exactly representable angles.
    g = np.random.default_rng(0)
    s = 26
    a = np.concatenate([g.integers(0, 2**24, 500), g.integers(2**24, 2**27, 1500),
                        [0, 2**24 - 1, 2**24, 2**24 + 1, 2**26, 2**27 - 1]]).astype(np.uint32)
    for sign in (-1.0, 1.0):
        out = torch.empty(len(a), 2)
        ext.fftconv_long_twiddle_probe(torch.from_numpy(a).data_ptr(), out.data_ptr(), len(a), s, sign, 0)
        want = np.exp(1j * sign * np.pi * a.astype(np.float64) / 2.0**s)
        got = to_np(out[:, 0]) + 1j * to_np(out[:, 1])
        err = np.abs(got - want)
        print(f"sign {sign:+}: max |err| {err.max():.2e} (a < 2^24: {err[:500].max():.2e})")
        # The device's sincospif is within 1 ulp of the correctly rounded value (the emulator models
        # that bound), so a component is within 1.5 * 2^-24 of exact and a direct twiddle within
        # sqrt(2) * 1.5 * 2^-24 = 1.3e-7; a split one is the product of two such factors plus one
        # complex-product rounding: 2 * 1.3e-7 + sqrt(2) * 2^-24 = 3.4e-7. (Rounding a itself to fp32
        # first, a >= 2^26 having an ulp of 8, would add up to pi * 4 / 2^26 = 1.9e-7 of angle.)
        direct = np.sqrt(2) * 1.5 * 2.0**-24
        assert err[:500].max() <= direct
        assert err.max() <= 2 * direct + np.sqrt(2) * 2.0**-24


def test_workspace_chunks_give_identical_results(ext, kernels):
    # one workspace row at a time (ws_rows = 1) and a product-spectrum slice of one batch
    # element (accumulate, then finalize): the arithmetic per row is the same, so bit-identical,
    # and dk's batch sum stays in a fixed order (deterministic).
    B, D, L = 3, 2, 16385
    x, k, dy = _inputs(5, B, D, L, torch.float32)
    y, dx, dk = _check(kernels, ext, x, k, dy, torch.float32)
    N = ext.fftconv_fft_size(L)
    small = D * (N + 1) * 8  # one batch element of product spectra, and 2 workspace rows
    y1 = kernels.fftconv_fwd(ext, x, k, max_workspace_bytes=1)
    dx1, dk1 = kernels.fftconv_bwd(ext, dy, x, k, max_workspace_bytes=small)
    # acc + prod per slice adds in the same order as one pass over the batch: bit-identical
    assert torch.equal(y1, y) and torch.equal(dx1, dx) and torch.equal(dk1, dk)
    dx_only, none = kernels.fftconv_bwd(ext, dy, x, k, need_k=False)
    assert none is None and torch.equal(dx_only, dx)


def test_one_block_boundary_still_one_block(ext, kernels):
    # 16384 stays on the one-block kernels (no workspace row), its neighbour 16385 is multi-pass;
    # the two paths meet float64 with the same budget on either side of the switch
    for L, ws_floats in ((16384, 0), (16385, 2 * 32768)):
        assert ext.fftconv_workspace_row_floats(L) == ws_floats
        x, k, dy = _inputs(6, 1, 1, L, torch.float32)
        _check(kernels, ext, x, k, dy, torch.float32)


# ------------------------------------------------------------------------------------------------
# the op through the CUDA backend class (autograd Function end to end)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def use_emulated_cuda(ext, monkeypatch):
    from megalodon_kernels.cuda import backend

    impl = backend.FftconvBackend(lambda: ext, "cpu")
    backends = importlib.import_module("megalodon_kernels.ops.fftconv").BACKENDS
    monkeypatch.setitem(backends._modules, "cuda", "(emulated) megalodon_kernels.cuda.backend.fftconv")
    monkeypatch.setitem(backends._loaded, "cuda", impl)
    return impl


def test_op_long_sequence_matches_torch_backend(use_emulated_cuda):
    L = 16385
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2, L, generator=g).to(torch.bfloat16).requires_grad_()
    k = (torch.randn(2, L, generator=g) * torch.exp(-torch.arange(L) / 3000.0)).requires_grad_()
    dy = torch.randn(1, 2, L, generator=g)
    outs = {}
    for b in ("cuda", "torch"):
        y = ops.fftconv(x, k, backend=b)
        outs[b] = (y, *torch.autograd.grad(y, [x, k], dy.to(y.dtype)))
    for name, a, r in zip(("y", "dx", "dk"), outs["cuda"], outs["torch"]):
        assert a.dtype == r.dtype
        assert_close(name, a, to_np(r), 4e-2 if name != "dk" else 5e-5)


def test_backend_accepts_long_l_and_names_the_limit(use_emulated_cuda):
    impl = use_emulated_cuda
    assert impl.not_supported_reasons(torch.zeros(1, 1, 20000), torch.zeros(1, 20000)) == []
    huge = torch.zeros(1).expand(1, 1, 2**27 + 1)  # no memory behind it
    why = " ".join(impl.not_supported_reasons(huge, torch.zeros(1).expand(1, 2**27 + 1)))
    assert "L <= 134217728" in why and "backend='torch'" in why


# ------------------------------------------------------------------------------------------------
# float64: the same kernels instantiated for double (double2 values, double twiddles, complex128
# spectra and workspace). One block per row up to L = 8192 (N = 8192 complex128 = 128 KiB of
# shared memory), the multi-pass plan above. Measured errors are ~1e-15 relative to max|ref|;
# FP64_TOL (support.TOLERANCES) is 1e-10 / 1e-9, so the tests also assert a much tighter 1e-13:
# anything rounded through fp32 anywhere (a twiddle, a spectrum, the workspace) would be ~1e-7.
# ------------------------------------------------------------------------------------------------
from support import tol as _tol  # noqa: E402

F64 = torch.float64
FP64_TOL = {"fwd": _tol("cuda", F64, "fwd"), "bwd": _tol("cuda", F64, "bwd")}
FP64_TIGHT = 1e-13


def _inputs64(seed, B, D, L):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=g, dtype=F64)
    k = torch.randn(D, L, generator=g, dtype=F64) * torch.exp(-torch.arange(L, dtype=F64) / (L / 4.0))
    dy = torch.randn(B, D, L, generator=g, dtype=F64)
    return x, k, dy


def _check64(kernels, ext, x, k, dy, refs=None, **kw):
    y = kernels.fftconv_fwd(ext, x, k, **kw)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k, **kw)
    assert y.dtype == dx.dtype == dk.dtype == F64
    yr, dxr, dkr = _fft_ref(x, k, dy) if refs is None else refs
    for name, a, r, t in (("y", y, yr, "fwd"), ("dx", dx, dxr, "bwd"), ("dk", dk, dkr, "bwd")):
        assert_close(name, a, r, min(FP64_TOL[t], FP64_TIGHT))
    return y, dx, dk


def test_fp64_lengths_and_workspace_sizes(ext, kernels):
    assert ext.fftconv_one_block_max_length(4) == kernels.FFTCONV_FP64_ONE_BLOCK_MAX_LEN == 8192
    assert ext.fftconv_max_length(4) == kernels.FFTCONV_FP64_MAX_LEN == 2**25
    assert kernels.fftconv_max_len(F64) == 2**25 and kernels.fftconv_max_len(torch.float32) == 2**27
    assert ext.fftconv_workspace_row_floats(8192, 4) == 0            # one block, no workspace
    assert ext.fftconv_workspace_row_floats(8193, 4) == 4 * 16384    # N = 2^14 complex128, in floats
    assert ext.fftconv_workspace_row_floats(8193, 0) == 0            # float: still one block
    assert ext.fftconv_workspace_row_floats(2**20, 4) == 4 * 2**20
    # both one-block configurations ask for 128 KiB (float N = 2^14, double N = 2^13)
    table = dict(ext.dynamic_smem_table())
    assert table["fftconv_fwd_kernel"] == 16384 * 8 == 8192 * 16
    assert max(table[f] for f in ("fft4_col_fwd_kernel", "fft4_row_conv_kernel")) <= 128 * 1024


@pytest.mark.parametrize("L", [1, 2, 33, 100, 257], ids=lambda v: f"L{v}")
def test_fp64_one_block_vs_direct_reference(ext, kernels, order, L):
    # B = 2: dk sums the batch; D = 3: rows pick kf[d]; the O(L^2) definition in float64
    x, k, dy = _inputs64(10 + L, 2, 3, L)
    refs = (fftconv_ref.fftconv(to_np(x), to_np(k)), *fftconv_ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k)))
    y, dx, dk = _check64(kernels, ext, x, k, dy, refs)
    dx_only, none = kernels.fftconv_bwd(ext, dy, x, k, need_k=False)
    none2, dk_only = kernels.fftconv_bwd(ext, dy, x, k, need_x=False)
    assert none is None and none2 is None
    assert torch.equal(dx_only, dx) and torch.equal(dk_only, dk)


def test_fp64_one_block_boundary(ext, kernels, order):
    # 8192 is the last one-block length in double (no workspace), 8193 the first multi-pass one
    # (N = 2^14: plan N1 = N2 = 128); the float path keeps one block at 8193
    for L, ws_floats in ((8192, 0), (8193, 4 * 16384)):
        assert ext.fftconv_workspace_row_floats(L, 4) == ws_floats
        x, k, dy = _inputs64(20, 1, 1, L)
        _check64(kernels, ext, x, k, dy)


def test_fp64_multipass_batch_channels_and_workspace_chunks(ext, kernels, order):
    # rows b * D + d pick kf[d]; dk sums the batch; one workspace row at a time and a product
    # spectrum slice of one batch element give bit-identical results (same per-row arithmetic,
    # same batch order)
    B, D, L = 3, 2, 9000
    x, k, dy = _inputs64(21, B, D, L)
    y, dx, dk = _check64(kernels, ext, x, k, dy)
    N = ext.fftconv_fft_size(L)
    small = D * (N + 1) * 16  # one batch element of complex128 product spectra; 1 ws row
    y1 = kernels.fftconv_fwd(ext, x, k, max_workspace_bytes=1)
    dx1, dk1 = kernels.fftconv_bwd(ext, dy, x, k, max_workspace_bytes=small)
    assert torch.equal(y1, y) and torch.equal(dx1, dx) and torch.equal(dk1, dk)
    dx_only, none = kernels.fftconv_bwd(ext, dy, x, k, need_k=False)
    none2, dk_only = kernels.fftconv_bwd(ext, dy, x, k, need_x=False)
    assert none is None and none2 is None and torch.equal(dx_only, dx) and torch.equal(dk_only, dk)


def test_fp64_multipass_16385(ext, kernels):
    # L = 16385 (N = 2^15, plan N1 = 256, N2 = 128) against the O(L^2) definition itself
    x, k, dy = _inputs64(22, 1, 1, 16385)
    refs = (fftconv_ref.fftconv(to_np(x), to_np(k)), *fftconv_ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k)))
    _check64(kernels, ext, x, k, dy, refs)


def test_fp64_multipass_2_pow_17_plus_3(ext, kernels):
    # N = 2^18 (plan N1 = N2 = 512), forward and backward
    x, k, dy = _inputs64(23, 1, 1, 2**17 + 3)
    _check64(kernels, ext, x, k, dy)


def test_fp64_twiddles_accurate_to_double(ext):
    # the multi-pass twiddles e^{+-i pi a / 2^s} in double: a / 2^s is exact for every 32-bit a, so
    # one sincospi. A twiddle rounded through fp32 anywhere (angle or value) would be off by ~1e-8.
    g = np.random.default_rng(1)
    s = 24
    a = np.concatenate([g.integers(0, 2**25, 2000), [0, 1, 2**24 - 1, 2**24, 2**25 - 1]]).astype(np.uint32)
    for sign in (-1.0, 1.0):
        out = torch.empty(len(a), 2, dtype=F64)
        ext.fftconv_long_twiddle_probe(torch.from_numpy(a).data_ptr(), out.data_ptr(), len(a), s, sign, 0, 4)
        # exact reference: the angle's fraction of a turn is reduced in integers first
        red = (a.astype(np.int64) % 2**(s + 1)).astype(np.float64) / 2.0**s
        want = np.exp(1j * sign * np.pi * red)
        err = np.abs(to_np(out[:, 0]) + 1j * to_np(out[:, 1]) - want).max()
        print(f"double twiddles, sign {sign:+}: max |err| {err:.2e}")
        assert err < 1e-15


def test_fp64_kernels_refuse_float16_x_naming_it(ext, kernels):
    x = torch.zeros(1, 1, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        kernels.fftconv_fwd(ext, x, torch.zeros(1, 8))
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        kernels.fftconv_bwd(ext, x, x, torch.zeros(1, 8))


def test_fp64_backend_reasons(use_emulated_cuda):
    impl = use_emulated_cuda
    x64, k64 = torch.zeros(1, 1, 20000, dtype=F64), torch.zeros(1, 20000, dtype=F64)
    assert impl.not_supported_reasons(x64, k64) == []
    assert impl.not_supported_reasons(x64, k64.float()) == []
    why = " ".join(impl.not_supported_reasons(x64.half(), k64.float()))
    assert "float64 x, got torch.float16" in why and "backend='torch'" in why
    why = " ".join(impl.not_supported_reasons(x64.float(), k64))  # fp64 k would be rounded to fp32
    assert "float64 k needs float64 x" in why
    huge = torch.zeros(1, dtype=F64).expand(1, 1, 2**25 + 1)  # no memory behind it
    why = " ".join(impl.not_supported_reasons(huge, torch.zeros(1, dtype=F64).expand(1, 2**25 + 1)))
    assert "L <= 33554432 = 2^25 in float64" in why and "backend='torch'" in why
    # the same length in float32 is within the float plan
    assert impl.not_supported_reasons(huge.float(), torch.zeros(1).expand(1, 2**25 + 1)) == []


@pytest.mark.parametrize("L", [70, 8193], ids=lambda v: f"L{v}")
def test_fp64_op_matches_torch_backend(use_emulated_cuda, L):
    # the autograd Function end to end; k float32 (as CEMA passes it) with float64 x runs in double
    g = torch.Generator().manual_seed(24)
    x = torch.randn(2, 2, L, generator=g, dtype=F64).requires_grad_()
    for kdt in (F64, torch.float32):
        k = (torch.randn(2, L, generator=g, dtype=F64) * torch.exp(-torch.arange(L) / (L / 5.0))).to(kdt)
        k.requires_grad_()
        dy = torch.randn(2, 2, L, generator=g, dtype=F64)
        outs = {}
        for b in ("cuda", "torch"):
            y = ops.fftconv(x, k, backend=b)
            outs[b] = (y, *torch.autograd.grad(y, [x, k], dy))
        for name, a, r in zip(("y", "dx", "dk"), outs["cuda"], outs["torch"]):
            assert a.dtype == r.dtype
            t = FP64_TOL["fwd" if name == "y" else "bwd"]
            # dk in k's dtype: a float32 k gets its gradient rounded to float32 by both backends
            assert_close(f"{name} (k {kdt})", a, to_np(r), t if a.dtype == F64 else 1e-6)


def test_fp64_gradcheck(use_emulated_cuda):
    # torch.autograd.gradcheck in float64 through the emulated CUDA kernels (finite differences)
    g = torch.Generator().manual_seed(25)
    x = torch.randn(2, 2, 19, generator=g, dtype=F64).requires_grad_()
    k = torch.randn(2, 19, generator=g, dtype=F64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.fftconv(a, b, backend="cuda"), (x, k))
