"""Every CUDA kernel, forward and backward, EXECUTED on the CPU through the SIMT emulator.

The kernel sources in cuda/ are compiled as C++ with cuda/emu/emu.cuh into a CPU extension
(cached; see cuda/build.py) and run against the float64 NumPy references, in fp32 and bf16 (and
fp64 for rotary, dropkey_softmax and timestep_norm, whose kernels accumulate in double), in
both fiber orders (a missing __syncthreads shows in one of them; shared memory is poisoned
per block). The DropKey mask must be bit-identical to ops.dropkey_rule. Shapes are small:
the emulator runs every CUDA thread as a fiber.
"""
import os
import shutil

import numpy as np
import pytest
import torch

from megalodon_kernels.ops.dropkey_rule import dropkey_mask
from megalodon_kernels.reference import fftconv as fftconv_ref
from megalodon_kernels.reference import rotary as rotary_ref
from megalodon_kernels.reference import timestep_norm as tsn_ref
from megalodon_kernels.reference.attention import _masked_softmax, visible_mask
from support import assert_close, to_np, tol

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")

# The CUDA kernels compute in fp32 with one rounding on store: the torch backend's budget.
# fp64 inputs (rotary, dropkey_softmax, timestep_norm) run in double: support.TOLERANCES' cuda row.
TOL = {torch.float32: {"fwd": 2e-5, "bwd": 5e-5}, torch.bfloat16: {"fwd": 2e-2, "bwd": 4e-2},
       torch.float64: {"fwd": tol("cuda", torch.float64, "fwd"), "bwd": tol("cuda", torch.float64, "bwd")}}
DTYPES = [torch.float32, torch.bfloat16]
DTYPES_FP64 = [*DTYPES, torch.float64]  # the ops whose kernels have a double instantiation


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# dropkey_softmax
# ------------------------------------------------------------------------------------------------

def _softmax_ref(x, causal, p, seed):
    Bf, Hf, L, S = x.shape
    allowed = visible_mask(L, S, causal=causal)[None, None]
    if p > 0:
        allowed = allowed & dropkey_mask(seed, p, Bf, Hf, L, S).numpy()
    return _masked_softmax(to_np(x), allowed), allowed


@pytest.mark.parametrize("dtype", DTYPES_FP64, ids=str)
@pytest.mark.parametrize("shape,causal,p", [
    ((2, 3, 5, 7), True, 0.0),        # S > L: KV-cache alignment
    ((1, 2, 33, 33), True, 0.3),
    ((1, 1, 9, 6), True, 0.5),        # S < L: leading rows fully masked -> 0
    ((2, 1, 4, 300), False, 0.2),     # several items per thread
    ((1, 1, 2, 4500), True, 0.1),     # beyond the register cache (8 x 512): streamed pass
], ids=["kvcache", "square", "short_S", "wide", "streamed"])
def test_dropkey_softmax(ext, kernels, order, dtype, shape, causal, p):
    seed = 2**40 + 12345
    x = (torch.randn(shape, generator=_gen(1)) * 3).to(dtype)
    y = kernels.dropkey_softmax_fwd(ext, x, causal=causal, dropkey_p=p, seed=seed)
    want, allowed = _softmax_ref(x, causal, p, seed)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close("y", y, want, TOL[dtype]["fwd"])
    # the keep/drop decisions are bit-identical: exactly the allowed entries are non-zero
    np.testing.assert_array_equal(to_np(y) != 0, (want != 0) & allowed)
    dy = torch.randn(shape, generator=_gen(2)).to(dtype)
    dx = kernels.dropkey_softmax_bwd(ext, dy, y, causal=causal)
    yr, dyr = to_np(y), to_np(dy)
    assert_close("dx", dx, yr * (dyr - (yr * dyr).sum(-1, keepdims=True)), TOL[dtype]["bwd"])


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32 + 7, 2**63 - 1])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.999])
def test_dropkey_mask_bit_identical_to_the_package_rule(ext, kernels, seed, p):
    # zero scores, no causal mask: y > 0 exactly where the rule keeps the logit
    Bf, Hf, L, S = 2, 3, 4, 70
    y = kernels.dropkey_softmax_fwd(ext, torch.zeros(Bf, Hf, L, S), causal=False, dropkey_p=p, seed=seed)
    keep = dropkey_mask(seed, p, Bf, Hf, L, S)
    np.testing.assert_array_equal((y > 0).numpy(), keep.numpy())


def test_dropkey_p0_is_plain_softmax(ext, kernels):
    x = torch.randn(2, 2, 6, 6, generator=_gen(3))
    y = kernels.dropkey_softmax_fwd(ext, x, causal=False, dropkey_p=0.0, seed=5)
    assert_close("y", y, torch.softmax(x.double(), -1), 2e-6)


def test_dropkey_softmax_rank_2_and_5(ext, kernels):
    for shape in [(5, 8), (2, 2, 2, 3, 4)]:
        x = torch.randn(shape, generator=_gen(4))
        y = kernels.dropkey_softmax_fwd(ext, x, causal=True, dropkey_p=0.25, seed=9)
        flat = x.reshape(-1, shape[-3] if len(shape) >= 3 else 1, *shape[-2:])
        want, _ = _softmax_ref(flat, True, 0.25, 9)
        assert_close("y", y.reshape(flat.shape), want, 2e-5)


# ------------------------------------------------------------------------------------------------
# rotary
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES_FP64, ids=str)
@pytest.mark.parametrize("xpos,per_batch", [(None, False), (512.0, False), (None, True)],
                         ids=["rope", "xpos", "per_batch"])
def test_rotary(ext, kernels, order, dtype, xpos, per_batch):
    from megalodon_kernels.ops.rotary import rotation_tables

    B, L, H, d = 2, 33, 3, 8
    x = torch.randn(B, L, H, d, generator=_gen(5)).to(dtype)
    pos = torch.randint(0, 1000, (B, L), generator=_gen(6)) if per_batch else torch.arange(7, 7 + L)
    # fp32 tables for fp32/bf16 x; float64 x gets float64 tables (fp32 ones would cap it at ~1e-7)
    tables = torch.float64 if dtype == torch.float64 else torch.float32
    for downscale in (False, True):
        cos, sin = rotation_tables(pos, d, 10000.0, xpos, downscale, tables)
        y = kernels.rotary_fwd(ext, x, cos, sin)
        assert y.dtype == dtype
        assert_close("y", y, rotary_ref.rotary(to_np(x), pos.numpy(), 10000.0, xpos, downscale), TOL[dtype]["fwd"])
        dx = kernels.rotary_bwd(ext, x, cos, sin)
        assert_close("dx", dx, rotary_ref.rotary_bwd(to_np(x), pos.numpy(), 10000.0, xpos, downscale),
                     TOL[dtype]["bwd"])


# ------------------------------------------------------------------------------------------------
# timestep_norm
# ------------------------------------------------------------------------------------------------

def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tsn_case(B, L, D, G, dtype, pad_kind, prev_count, seed=0):
    g = _gen(seed)
    x = (torch.randn(B, L, D, generator=g) * 2 + 3).to(dtype)
    # side inputs in the kernel's accumulation type: genuine float64 values for float64 x, so a
    # kernel that rounded them through fp32 would show
    side = dict(generator=g, dtype=_acc_dtype(dtype))
    scale = torch.randn(D, **side)
    bias = torch.randn(D, **side)
    pc = torch.tensor(prev_count, dtype=torch.int64)
    pm = torch.randn(B, G, **side)
    pv = torch.rand(B, G, **side) + 0.5
    mask = torch.zeros(B, L, dtype=torch.bool)
    if pad_kind == "left":
        mask[0, : L // 2] = True
    elif pad_kind == "mixed":
        mask[0, : L // 3] = True
        mask[-1, L // 4: L // 2] = True
        mask[-1, -3:] = True
    elif pad_kind == "all":
        mask[:] = True
    return x, scale, bias, pc, pm, pv, mask


@pytest.mark.parametrize("dtype", DTYPES_FP64, ids=str)
@pytest.mark.parametrize("B,L,D,G,pad_kind,prev_count", [
    (2, 1, 4, 1, "none", [0, 0]),
    (2, 31, 12, 3, "mixed", [0, 5]),
    (1, 129, 6, 6, "none", [0]),           # G = D (Dg = 1)
    (2, 700, 8, 2, "left", [0, 3]),        # 64 chunks; leading chunks fully padded (spec 8.4)
    (1, 40, 64, 2, "all", [4]),            # nothing observed: the prior comes back unchanged
], ids=["L1", "L31_mixed_pad", "L129_G_eq_D", "L700_left_pad", "all_padded"])
def test_timestep_norm(ext, kernels, order, dtype, B, L, D, G, pad_kind, prev_count):
    x, scale, bias, pc, pm, pv, mask = _tsn_case(B, L, D, G, dtype, pad_kind, prev_count)
    y, count, mean, var, saved = kernels.timestep_norm_fwd(ext, x, scale, bias, pc, pm, pv, mask, G, 1e-5)
    args = (to_np(x), scale.numpy(), bias.numpy(), G, pc.numpy(), pm.numpy(), pv.numpy(), mask.numpy())
    yr, cr, mr, vr = tsn_ref.timestep_norm(*args)
    assert y.dtype == dtype
    # the statistics and state come back in the accumulation type: float64 only for float64 x
    acc = _acc_dtype(dtype)
    assert mean.dtype == var.dtype == saved[5].dtype == acc
    stat_tol = TOL[dtype]["fwd"] if dtype == torch.float64 else 2e-5
    assert_close("y", y, yr, TOL[dtype]["fwd"])
    np.testing.assert_array_equal(count.numpy(), cr)
    assert_close("mean", mean, mr, stat_tol)
    assert_close("var", var, vr, stat_tol)
    g = _gen(7)
    dy = torch.randn(B, L, D, generator=g).to(dtype)
    dm, dv = torch.randn(B, G, generator=g, dtype=acc), torch.randn(B, G, generator=g, dtype=acc)
    dx, dscale, dbias, dpm, dpv = kernels.timestep_norm_bwd(ext, dy, dm, dv, saved, G)
    want = tsn_ref.timestep_norm_bwd(to_np(dy), dm.numpy(), dv.numpy(), *args[:3], G, *args[4:])
    for name, got, ref in zip(("dx", "dscale", "dbias", "dprev_mean", "dprev_var"),
                              (dx, dscale, dbias, dpm, dpv), want):
        assert np.isfinite(to_np(got)).all(), name
        assert got.dtype == (dtype if name == "dx" else acc), name
        assert_close(name, got, ref, TOL[dtype]["bwd"] if name == "dx" or dtype == torch.float64 else 5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_timestep_norm_streaming_and_large_common_mean(ext, kernels, dtype):
    # two halves with the carried state == one call; a large common offset does not cancel
    B, L, D, G = 2, 300, 8, 2
    x, scale, bias, pc, pm, pv, mask = _tsn_case(B, L, D, G, dtype, "none", [0, 0], seed=3)
    x = x + 1000.0
    y, *_ = kernels.timestep_norm_fwd(ext, x, scale, bias, pc, pm, pv, mask, G, 1e-5)
    y1, c1, m1, v1, _ = kernels.timestep_norm_fwd(ext, x[:, :111], scale, bias, pc, pm, pv, mask[:, :111], G, 1e-5)
    y2, *_ = kernels.timestep_norm_fwd(ext, x[:, 111:], scale, bias, c1, m1, v1, mask[:, 111:], G, 1e-5)
    # fp64: the offset of 1000 costs ~1e-13 relative in the group variances, far below 1e-10
    streamed_tol, ref_tol = (2e-5, 1e-4) if dtype == torch.float32 else (TOL[dtype]["fwd"],) * 2
    assert_close("streamed", torch.cat([y1, y2], 1), to_np(y), streamed_tol)
    yr, *_ = tsn_ref.timestep_norm(to_np(x), scale.numpy(), bias.numpy(), G, pc.numpy(), pm.numpy(), pv.numpy(),
                                   mask.numpy())
    assert_close("y", y, yr, ref_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_timestep_norm_infinities_propagate(ext, kernels, dtype):
    x, scale, bias, pc, pm, pv, mask = _tsn_case(1, 20, 4, 1, dtype, "none", [0])
    x[0, 5, 1] = float("inf")
    x[0, 12, :] = float("nan")
    mask[0, 12] = True  # NaN in a padded step reaches nothing
    y, *_ = kernels.timestep_norm_fwd(ext, x, scale, bias, pc, pm, pv, mask, 1, 1e-5)
    yr, *_ = tsn_ref.timestep_norm(to_np(x), scale.numpy(), bias.numpy(), 1, pc.numpy(), pm.numpy(), pv.numpy(),
                                   mask.numpy())
    assert np.isfinite(to_np(y)[0, :5]).all()
    np.testing.assert_array_equal(np.isfinite(to_np(y)), np.isfinite(yr))
    assert (to_np(y)[0, 12] == 0).all()


# ------------------------------------------------------------------------------------------------
# fftconv
# ------------------------------------------------------------------------------------------------

def _fft_ref(x, k, dy):
    """float64 FFT versions of reference/fftconv.py (the O(L^2) loops are too slow for 16K)."""
    x, k, dy = to_np(x), to_np(k), to_np(dy)
    L = x.shape[-1]
    n = 2 * L
    rf, irf = np.fft.rfft, np.fft.irfft
    y = irf(rf(x, n) * rf(k, n), n)[..., :L]
    flip = lambda a: a[..., ::-1]  # noqa: E731
    dx = flip(irf(rf(flip(dy), n) * rf(k, n), n)[..., :L])
    dk = flip(irf((rf(flip(dy), n) * rf(x, n)).sum(0), n)[..., :L])
    return y, dx, dk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,D,L", [(1, 1, 1), (2, 3, 31), (1, 2, 33), (2, 1, 129)], ids=lambda v: str(v))
def test_fftconv(ext, kernels, order, dtype, B, D, L):
    g = _gen(8)
    x = torch.randn(B, D, L, generator=g).to(dtype)
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / 20.0)
    y = kernels.fftconv_fwd(ext, x, k)
    dy = torch.randn(B, D, L, generator=g).to(dtype)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k)
    # the direct O(L^2) reference at these sizes
    assert_close("y", y, fftconv_ref.fftconv(to_np(x), to_np(k)), TOL[dtype]["fwd"])
    dxr, dkr = fftconv_ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert dx.dtype == dtype and dk.dtype == torch.float32
    assert_close("dx", dx, dxr, TOL[dtype]["bwd"])
    assert_close("dk", dk, dkr, 5e-5)


def test_fftconv_16k_one_block_per_row(ext, kernels, order):
    B, D, L = 1, 1, 16384
    assert ext.fftconv_fft_size(L) == 16384
    g = _gen(9)
    x = torch.randn(B, D, L, generator=g)
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / 2000.0)
    dy = torch.randn(B, D, L, generator=g)
    y = kernels.fftconv_fwd(ext, x, k)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k)
    yr, dxr, dkr = _fft_ref(x, k, dy)
    assert_close("y", y, yr, 2e-5)
    assert_close("dx", dx, dxr, 5e-5)
    assert_close("dk", dk, dkr, 5e-5)


def test_fftconv_dk_over_batch_slices(ext, kernels):
    # the product-spectrum workspace split over batch slices (accumulate, then finalize)
    B, D, L = 5, 2, 40
    g = _gen(10)
    x, dy = torch.randn(B, D, L, generator=g), torch.randn(B, D, L, generator=g)
    k = torch.randn(D, L, generator=g)
    N = ext.fftconv_fft_size(L)
    dx, dk = kernels.fftconv_bwd(ext, dy, x, k, max_workspace_bytes=2 * D * (N + 1) * 8)
    _, dxr, dkr = _fft_ref(x, k, dy)
    assert_close("dx", dx, dxr, 5e-5)
    assert_close("dk", dk, dkr, 5e-5)
    dx_only, none = kernels.fftconv_bwd(ext, dy, x, k, need_k=False)
    assert none is None
    assert_close("dx only", dx_only, dxr, 5e-5)


# ------------------------------------------------------------------------------------------------
# coverage: every kernel defined in cuda/*.cuh was launched by the tests above
# ------------------------------------------------------------------------------------------------

def test_every_kernel_ran_in_the_emulator(ext, request):
    # conftest.py moves this test to the end of the session: the launches of every CUDA test
    # file accumulate in the emulator extension.
    import re
    from pathlib import Path

    from megalodon_kernels.cuda import build

    files = {Path(str(item.fspath)).name for item in request.session.items}
    needed = {p.name for p in Path(__file__).parent.glob("test_cuda_*.py")} - {"test_cuda_nvcc.py"}
    if not needed <= files:
        pytest.skip(f"kernel coverage needs every CUDA test file in the run; missing {sorted(needed - files)}")

    defined = set()
    for p in build.CUDA_DIR.glob("*.cuh"):
        defined |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)_kernel\s*\(",
                                  p.read_text()))
    assert defined, "no kernels found"
    launched = set(ext.emulator_launched_kernels())  # MK_LAUNCH names: <base> or <base>_fwd/_bwd
    missing = sorted(d for d in defined if not any(n == d or n.startswith(d + "_") for n in launched))
    assert not missing, f"kernels never executed in the emulator: {missing}"
