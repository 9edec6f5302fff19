"""fftconv, backend "triton" (interpreter): forward and both gradients against the float64 reference
on the direct path, the register-tile FFT path and the workspace (three-level) FFT path, fp32 and bf16
x, odd batch (an unpaired row), non-contiguous inputs, linearity, causality, direct == FFT, the long
case L = 2**17 (N = 2**18) against a float64 FFT, and inputs the backend must refuse."""
import math

import pytest
import torch

from megalodon_kernels.ops.fftconv import fftconv
from megalodon_kernels.ops.fftconv import torch_impl as conv_torch
from megalodon_kernels.ops.fftconv import triton_impl as conv_impl
from megalodon_kernels.reference import fftconv as ref
from support import as_input, assert_close, knobs as config, to_np, tol

# direct_max_len forcing each path; the workspace path needs L > 2048 (N >= 8192) whatever the knob.
# work_bc = 4096 (one column tile per pass) keeps the interpreter fast; the shipped tile is run below.
PATHS = {"direct": dict(direct_max_len=64), "fft": dict(direct_max_len=0)}
FAST_WORK = dict(direct_max_len=0, work_bc=4096)


def _ids(d):
    return str(d).replace("torch.", "")


def _check(B, D, L, xdtype, knobs, contiguous=True, seed=0, grads=True):
    gen = torch.Generator().manual_seed(seed)
    x = as_input(torch.randn(B, D, L, generator=gen, dtype=torch.float64), xdtype, contiguous, True)
    k = as_input(torch.randn(D, L, generator=gen, dtype=torch.float64) / math.sqrt(L), torch.float32, contiguous,
                 True)
    with config(conv_impl, **knobs):
        y = fftconv(x, k, backend="triton")
        assert y.shape == (B, D, L) and y.dtype == xdtype
        assert_close("y", y, ref.fftconv(to_np(x), to_np(k)), tol("triton", xdtype, "fwd"))
        if not grads:
            return
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(xdtype)
        dx, dk = torch.autograd.grad(y, (x, k), dy)
    assert dx.dtype == xdtype and dk.dtype == torch.float32 and dx.shape == x.shape and dk.shape == k.shape
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert_close("dx", dx, dx_ref, tol("triton", xdtype, "bwd"))
    # dk is an fp32 sum of products of the (rounded) inputs: the fp32 budget whatever x's dtype
    assert_close("dk", dk, dk_ref, tol("triton", torch.float32, "bwd"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
def test_triton_fftconv_matches_reference(path, xdtype, L):
    if path == "fft":
        assert conv_impl._plan(L, 0)[0] == "tile"
    _check(3, 2, L, xdtype, PATHS[path])


@pytest.mark.parametrize("path", list(PATHS))
def test_triton_fftconv_noncontiguous(path):
    _check(2, 3, 63, torch.bfloat16, PATHS[path], contiguous=False, seed=1)


def test_triton_fftconv_largest_tile():
    # L = 2048: the largest register tile (N = 4096 = 16 x 16 x 16, three dot levels), odd batch
    assert conv_impl._plan(2048, 0) == ("tile", 16)
    _check(3, 1, 2048, torch.float32, PATHS["fft"], seed=2)


def test_triton_fftconv_tile_sizes():
    # N = 256 (A = 1: two dot levels), 512 / 1024 (A = 4: radix-4 + two levels), 4096 (A = 16: three)
    assert [conv_impl._plan(L, 0) for L in (31, 128, 129, 512, 513, 2048)] == [
        ("tile", 1), ("tile", 1), ("tile", 4), ("tile", 4), ("tile", 16), ("tile", 16)]


@pytest.mark.parametrize("need", ["x", "k"])
def test_triton_fftconv_largest_tile_one_gradient(need):
    # N = 4096 runs the dk pass and the dx pass separately: each alone (the other not computed)
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(2, 3, 1, 2000, generator=gen)
    k = torch.randn(1, 2000, generator=gen) / 40.0
    cfg = dict(conv_impl.DEFAULT_CONFIG, **PATHS["fft"])
    dx, dk = conv_impl.fftconv_bwd(dy, x, k, need == "x", need == "k", **cfg)
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    if need == "x":
        assert dk is None
        assert_close("dx", dx, dx_ref, tol("triton", torch.float32, "bwd"))
    else:
        assert dx is None
        assert_close("dk", dk, dk_ref, tol("triton", torch.float32, "bwd"))


def test_triton_fftconv_workspace_path():
    # L = 2049 -> N = 8192 = R C with R = 2 (padded column tile), 3 batch rows (one unpaired), bf16,
    # non-contiguous (fp32 runs in the long case below and in test_triton_cema's workspace case)
    assert conv_impl._plan(2049, 0)[0] == "work"
    _check(3, 1, 2049, torch.bfloat16, FAST_WORK, contiguous=False, seed=3)


def test_triton_fftconv_workspace_path_shipped_column_tile():
    # the shipped column tiles (the loop over column tiles of every pass), forward only
    assert conv_impl.DEFAULT_CONFIG["work_bc"] < 4096
    _check(1, 1, 2049, torch.float32, dict(direct_max_len=0), seed=4, grads=False)


def test_triton_fftconv_long_length():
    # L = 2**17, N = 2**18 = 64 x 64 x 64: every level at its largest; float64 FFT as the oracle
    # (the O(L**2) NumPy reference would take minutes). ~60 s in the interpreter.
    L = 1 << 17
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, L, generator=gen, dtype=torch.float64)
    k = torch.randn(1, L, generator=gen, dtype=torch.float64) * torch.exp(-torch.arange(L) / 20000.0)
    dy = torch.randn(1, 1, L, generator=gen, dtype=torch.float64)
    cfg = dict(conv_impl.DEFAULT_CONFIG, **FAST_WORK)
    y = conv_impl.fftconv_fwd(x.float(), k.float(), **cfg)
    dx, dk = conv_impl.fftconv_bwd(dy.float(), x.float(), k.float(), True, True, **cfg)
    xs, ks, dys = x.float().double(), k.float().double(), dy.float().double()   # the inputs as the kernel saw them
    assert_close("y", y, to_np(conv_torch.fftconv_fwd(xs, ks, direct_max_len=0)), tol("triton", torch.float32, "fwd"))
    dx_ref, dk_ref = conv_torch.fftconv_bwd(dys, xs, ks, direct_max_len=0)
    assert_close("dx", dx, to_np(dx_ref), tol("triton", torch.float32, "bwd"))
    assert_close("dk", dk, to_np(dk_ref), tol("triton", torch.float32, "bwd"))
    # the first and last samples of y (no error hiding in the max over a long row)
    assert_close("y[:64]", y[..., :64], to_np(ref.fftconv(to_np(xs[..., :64]), to_np(ks[..., :64]))),
                 tol("triton", torch.float32, "fwd"))


def test_triton_fftconv_direct_equals_fft():
    gen = torch.Generator().manual_seed(6)
    x, dy = torch.randn(2, 3, 2, 50, generator=gen)
    k = torch.randn(3, 50, generator=gen)
    outs = {}
    for path, knobs in PATHS.items():
        cfg = dict(conv_impl.DEFAULT_CONFIG, **knobs)
        outs[path] = (conv_impl.fftconv_fwd(x, k, **cfg), *conv_impl.fftconv_bwd(dy, x, k, True, True, **cfg))
    for name, a, b in zip(("y", "dx", "dk"), outs["direct"], outs["fft"]):
        assert_close(f"{name} direct vs fft", a, to_np(b), tol("triton", torch.float32, "fwd"))


@pytest.mark.parametrize("path", list(PATHS))
def test_triton_fftconv_linearity(path):
    gen = torch.Generator().manual_seed(7)
    x1, x2 = torch.randn(2, 2, 3, 40, generator=gen)
    k1, k2 = torch.randn(2, 3, 40, generator=gen)
    a, b = 0.7, -1.9
    with config(conv_impl, **PATHS[path]):
        f = lambda x, k: fftconv(x, k, backend="triton")  # noqa: E731
        assert_close("linear in x", f(a * x1 + b * x2, k1), to_np(a * f(x1, k1) + b * f(x2, k1)), 1e-5)
        assert_close("linear in k", f(x1, a * k1 + b * k2), to_np(a * f(x1, k1) + b * f(x1, k2)), 1e-5)


def test_triton_fftconv_is_causal():
    # no wrap-around in the padded transform: y before s does not see x from s on
    x = torch.randn(1, 2, 100)
    k = torch.randn(2, 100)
    x2 = x.clone()
    x2[..., 60:] += 1.0
    for knobs in PATHS.values():
        with config(conv_impl, **knobs):
            a, b = fftconv(x, k, backend="triton"), fftconv(x2, k, backend="triton")
        assert float((a[..., :60] - b[..., :60]).abs().max()) < 1e-5 * float(a.abs().max())
        assert float((a[..., 60:] - b[..., 60:]).abs().max()) > 1e-2


def test_triton_fftconv_default_path_choice():
    limit = conv_impl.DEFAULT_CONFIG["direct_max_len"]
    assert conv_impl._plan(limit, limit)[0] == "direct"
    assert conv_impl._plan(limit + 1, limit)[0] == "tile"
    assert conv_impl._plan(2048, limit)[0] == "tile" and conv_impl._plan(2049, limit)[0] == "work"
    assert conv_impl._plan(conv_impl.MAX_LENGTH, limit) == ("work", 64, 64)


def test_triton_fftconv_rejects_what_it_cannot_run():
    with pytest.raises(Exception, match="x has dtype torch.float16"):
        fftconv(torch.randn(1, 2, 8, dtype=torch.float16), torch.randn(2, 8), backend="triton")
    with pytest.raises(Exception, match="x has dtype torch.float64"):
        fftconv(torch.randn(1, 2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64), backend="triton")
    L = conv_impl.MAX_LENGTH + 1
    why = conv_impl.not_supported_reasons(x=torch.zeros(1, 1, L), k=torch.zeros(1, L))
    assert any(f"L = {L} > {conv_impl.MAX_LENGTH}" in r for r in why)
    with pytest.raises(ValueError, match=r"k must have shape \(D, L\)"):
        fftconv(torch.randn(1, 2, 8), torch.randn(2, 9), backend="triton")
