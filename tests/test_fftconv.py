"""fftconv (causal long convolution): forward and both gradients against the float64 reference on
the FFT path and the direct (Toeplitz) path, mixed dtypes (bf16/fp16 x with fp32 k, as CEMA calls
it), odd sizes, non-contiguous inputs; linearity; direct == FFT; argument validation."""
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.fftconv import fftconv
from megalodon_kernels.ops.fftconv import torch_impl as conv_impl
from megalodon_kernels.reference import fftconv as ref
from support import as_input, assert_close, knobs as config, to_np, tol

# (x dtype, k dtype); arithmetic is fp32 unless one of them is fp64.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
          (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)]
PATHS = {"direct": 1 << 30, "fft": 0}   # direct_max_len forcing each path


def _ids(d):
    return str(d).replace("torch.", "")


def _check(B, D, L, xdtype, kdtype, path, contiguous=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = as_input(torch.randn(B, D, L, generator=gen, dtype=torch.float64), xdtype, contiguous, True)
    k = as_input(torch.randn(D, L, generator=gen, dtype=torch.float64), kdtype, contiguous, True)
    with config(conv_impl, direct_max_len=PATHS[path]):
        y = fftconv(x, k, backend="torch")
        assert y.shape == (B, D, L) and y.dtype == xdtype
        assert_close("y", y, ref.fftconv(to_np(x), to_np(k)), tol("torch", xdtype, "fwd"))
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(xdtype)
        dx, dk = torch.autograd.grad(y, (x, k), dy)
    assert dx.dtype == xdtype and dk.dtype == kdtype
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert_close("dx", dx, dx_ref, tol("torch", xdtype, "bwd"))
    assert_close("dk", dk, dk_ref, tol("torch", kdtype, "bwd"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("xdtype,kdtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("L", [1, 31, 33, 63, 129])
def test_fftconv_matches_reference(path, xdtype, kdtype, L):
    _check(2, 3, L, xdtype, kdtype, path)


@pytest.mark.parametrize("path", list(PATHS))
def test_fftconv_wide_features(path):
    _check(2, 60, 33, torch.bfloat16, torch.float32, path, contiguous=False)


@given(B=st.integers(1, 3), D=st.integers(1, 6), L=st.integers(1, 300), dtypes=st.sampled_from(DTYPES),
       path=st.sampled_from(list(PATHS)), contiguous=st.booleans(), seed=st.integers(0, 2**31))
def test_fftconv_property(B, D, L, dtypes, path, contiguous, seed):
    if path == "direct":
        L = min(L, 100)  # O(L^2) by design
    _check(B, D, L, *dtypes, path, contiguous, seed)


def test_fftconv_default_path_choice():
    # the shipped knob sends short sequences to the direct path and long ones to the FFT
    limit = conv_impl.DEFAULT_CONFIG["direct_max_len"]
    for L in (1, limit, limit + 1, 4 * limit):
        _check(1, 2, L, torch.float32, torch.float32, "direct" if L <= limit else "fft")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_ids)
@given(L=st.integers(1, 90), seed=st.integers(0, 2**31))
def test_fftconv_direct_equals_fft(dtype, L, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, L, generator=gen, dtype=dtype)
    k = torch.randn(3, L, generator=gen, dtype=dtype)
    dy = torch.randn(2, 3, L, generator=gen, dtype=dtype)
    outs = {}
    for path, limit in PATHS.items():
        outs[path] = (conv_impl.fftconv_fwd(x, k, direct_max_len=limit),
                      *conv_impl.fftconv_bwd(dy, x, k, direct_max_len=limit))
    for name, a, b in zip(("y", "dx", "dk"), outs["direct"], outs["fft"]):
        assert_close(f"{name} direct vs fft", a, to_np(b), tol("torch", dtype, "fwd"))


@pytest.mark.parametrize("path", list(PATHS))
def test_fftconv_linearity(path):
    gen = torch.Generator().manual_seed(2)
    f64 = torch.float64
    x1, x2 = torch.randn(2, 2, 3, 40, generator=gen, dtype=f64)
    k1, k2 = torch.randn(2, 3, 40, generator=gen, dtype=f64)
    a, b = 0.7, -1.9
    with config(conv_impl, direct_max_len=PATHS[path]):
        in_x = fftconv(a * x1 + b * x2, k1)
        assert_close("linear in x", in_x, to_np(a * fftconv(x1, k1) + b * fftconv(x2, k1)), 1e-13)
        in_k = fftconv(x1, a * k1 + b * k2)
        assert_close("linear in k", in_k, to_np(a * fftconv(x1, k1) + b * fftconv(x1, k2)), 1e-13)


def test_fftconv_is_causal():
    # changing x at s must not change y before s (no circular wrap-around in the padded FFT)
    x = torch.randn(1, 2, 64, dtype=torch.float64)
    k = torch.randn(2, 64, dtype=torch.float64)
    x2 = x.clone()
    x2[..., 40:] += 1.0
    for limit in PATHS.values():
        with config(conv_impl, direct_max_len=limit):
            assert float((fftconv(x, k)[..., :40] - fftconv(x2, k)[..., :40]).abs().max()) < 1e-12


@pytest.mark.parametrize("path", list(PATHS))
def test_fftconv_gradcheck(path):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 9, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(2, 9, generator=gen, dtype=torch.float64).requires_grad_()
    with config(conv_impl, direct_max_len=PATHS[path]):
        assert torch.autograd.gradcheck(lambda a, b: fftconv(a, b), (x, k), fast_mode=True)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(x=torch.randn(3, 5)), ValueError, r"x must have rank 3 \(B, D, L\)"),
    (dict(x=torch.randn(2, 3, 0), k=torch.randn(3, 0)), ValueError, "x must have length L >= 1"),
    (dict(x=torch.zeros(2, 3, 5, dtype=torch.complex64)), TypeError, "x must have dtype"),
    (dict(k=torch.randn(3, 6)), ValueError, r"k must have shape \(D, L\)"),
    (dict(k=torch.randn(4, 5)), ValueError, r"k must have shape \(D, L\)"),
    (dict(k=torch.randn(1, 3, 5)), ValueError, r"k must have rank 2 \(D, L\)"),
    (dict(k=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "k must have dtype"),
    (dict(k=None), TypeError, "k must be a torch.Tensor"),
    (dict(k=torch.randn(3, 5, device="meta")), ValueError, "k is on meta"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
])
def test_fftconv_bad_inputs(bad, exc, match):
    args = dict(x=torch.randn(2, 3, 5), k=torch.randn(3, 5))
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        fftconv(**args, backend=backend)
