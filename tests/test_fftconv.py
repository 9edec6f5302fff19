"""fftconv (causal long convolution) on every backend against the float64 reference.

* One table of cases run on each backend that implements it (torch: direct and FFT paths; cpu: the
  compiled C++ kernel; Triton in the interpreter: direct, register-tile FFT and workspace
  (three-level) FFT paths, x fp32/bf16; CUDA in the emulator: one block per row and the multi-pass
  four-step FFT, x fp32/bf16/fp64): y and
  both gradients in mixed dtypes (bf16/fp16 x with fp32 k, as CEMA calls it), odd sizes and an
  unpaired batch row, non-contiguous inputs.
* Properties: linearity, causality, direct == FFT, gradcheck; the path each backend picks.
* The reference's own backward against finite differences.
* cpu: channel blocks that fill no vector, an odd block count, recursion depths, one gradient
  alone, any thread count bitwise, the narrower vector builds, no compiler.
* Triton: the tile plan, one gradient alone, the long case L = 2**17 against a float64 FFT.
* The CUDA kernels' launch description (ops/fftconv/cuda_impl.py over cuda/fftconv*.cuh) in the emulator, in both
  fiber orders: one block per row up to L = 16384 in fp32 and bf16, the multi-pass FFT above it
  (float: 8192 in float64) against float64, up to L = 2**20, the twiddles, workspace chunking, the
  float64 instantiations, what the launchers refuse.
* Argument validation and what each backend refuses, naming the fix.

reference/fftconv.py is the O(L^2) definition; it is affordable once at L = 16385 (B = D = 1).
Longer CUDA cases compare with the same convolution computed by float64 NumPy FFTs (exact up to
~1e-15, far below the fp32 budget), with B = D = 1 where possible: the emulator runs every CUDA
thread as a fiber (at N = 2^17 a forward call takes a few seconds).
"""
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.cuda.launch import EmulatorLauncher as emu  # the launch descriptions in the emulator
from megalodon_kernels.ops.fftconv import cuda_impl as C, fftconv
from megalodon_kernels.ops.fftconv import cpu_impl as conv_cpu
from megalodon_kernels.ops.fftconv import torch_impl as conv_torch
from megalodon_kernels.ops.fftconv import triton_impl as conv_triton
from megalodon_kernels.reference import fftconv as ref
from support import (as_input, assert_close, backend_module, finite_difference_grad, knobs, on_backends,
                     to_np, tol, use_cpu_build)

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
#: the reference's backward vs central differences (support.finite_difference_grad): 3.6e-10 worst
#: measured (truncation + rounding of the step), 3x-4x of it
FD_TOL = 1.5e-9


@pytest.fixture(scope="module")
def emulated(ext):
    """The CUDA backend over the emulator (conftest.use_emulated_cuda plugs it in)."""
    return {"fftconv": C.FftconvBackend(lambda launcher=emu(ext): launcher, "cpu")}


def _dt(d):
    return str(d).replace("torch.", "")


# direct_max_len forcing each path of the torch and Triton backends (CUDA has one FFT path). Triton's
# slice path needs L > 2048 (N >= 8192) whatever the knob (test_triton_slice_path lowers it);
# work_bc = 4096 (the widest combine tile) keeps the interpreter fast, the shipped one runs in its own case.
PATHS = {"direct": {"torch": dict(direct_max_len=1 << 30), "triton": dict(direct_max_len=64)},
         "fft": {"torch": dict(direct_max_len=0), "triton": dict(direct_max_len=0)}}
FAST_WORK = dict(direct_max_len=0, work_bc=4096)


# ------------------------------------------------------------------------------------------------
# the case table: y and both gradients on every backend
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    B: int
    D: int
    L: int
    xdtype: torch.dtype
    kdtype: torch.dtype
    path: str = "fft"               # of the torch and Triton backends; CUDA runs only "fft" cases
    contiguous: bool = True
    seed: int = 0
    grads: bool = True
    knobs: dict = field(default_factory=dict)   # {backend: knob values}, over the path's
    only: tuple | None = None       # cases for some backends alone (the reason beside each)


def case(B, D, L, xdtype, kdtype, id, **kw):
    return pytest.param(Case(B, D, L, xdtype, kdtype, **kw), id=id)


# (x dtype, k dtype); arithmetic is fp32 unless one of them is fp64.
DTYPES = [(F32, F32), (BF16, F32), (F16, F32), (BF16, BF16), (F64, F64)]

CASES = [
    # B = 3: an unpaired batch row for Triton's two-rows-per-complex-transform FFT
    *(case(3, 3, L, x, k, f"{path}-L{L}-x_{_dt(x)}-k_{_dt(k)}", path=path)
      for path in PATHS for x, k in DTYPES for L in (1, 31, 33, 63, 129)),
    # the FFT path with 60 features takes ~15 s in the Triton interpreter: its direct path only
    *(case(2, 60, 33, BF16, F32, f"{path}-D60-strided-x_bfloat16", path=path, contiguous=False,
           only=None if path == "direct" else ("torch", "cpu", "cuda")) for path in PATHS),
    *(case(2, 3, 63, BF16, F32, f"{path}-L63-strided-x_bfloat16", path=path, contiguous=False, seed=1)
      for path in PATHS),
    *(case(2, 3, 70, x, F32, f"L70-x_{_dt(x)}", seed=2) for x in (F32, BF16)),
    # float64 x with float32 k (as CEMA passes it) runs in double; L = 8193 is multi-pass in CUDA's double plan
    *(case(2, 2, L, F64, k, f"L{L}-x_float64-k_{_dt(k)}", seed=24) for L in (70, 8193) for k in (F64, F32)),
    # Triton: the largest register tile (N = 4096 = 16 x 16 x 16, three dot levels), odd batch
    case(3, 1, 2048, F32, F32, "L2048", seed=2),
    # Triton: N = 1024 (radix-4 first level) and N = 2048 (block-diagonal 8-point dot)
    case(3, 2, 300, F32, F32, "L300-N1024", seed=5, only=("torch", "triton")),
    case(3, 2, 700, BF16, F32, "L700-N2048-x_bfloat16", seed=6, only=("torch", "triton")),
    # Triton: the slice path, N = 8192 = R C with R = 4 slices of C = 2048 (padded combine dots), one unpaired row
    case(3, 1, 2049, BF16, F32, "L2049-strided-x_bfloat16", contiguous=False, seed=3,
         knobs={"triton": FAST_WORK}),
    # Triton's shipped combine tile (several column tiles per row pair), forward only
    case(1, 1, 2049, F32, F32, "L2049-shipped-work_bc-fwd_only", seed=4, grads=False, only=("triton",)),
    # CUDA's first multi-pass length; the O(L^2) reference and the interpreter take too long for more
    case(1, 2, 16385, BF16, F32, "L16385-x_bfloat16", seed=7, only=("torch", "cpu", "cuda")),
]


def runs_on(backend, c: Case) -> bool:
    if c.only is not None and backend not in c.only:
        return False
    if backend == "triton":
        return c.xdtype in (F32, BF16) and c.kdtype != F64
    if backend == "cuda":
        return c.path == "fft" and c.xdtype != F16 and (c.kdtype != F64 or c.xdtype == F64)
    if backend == "cpu":
        return c.path == "fft"  # one path
    return True


def check_fftconv(backend, B, D, L, xdtype, kdtype, contiguous=True, seed=0, grads=True, **config):
    """y, dx and dk of ``backend`` (run with the knob values ``config``) vs the reference."""
    gen = torch.Generator().manual_seed(seed)
    x = as_input(torch.randn(B, D, L, generator=gen, dtype=F64), xdtype, contiguous, True)
    k = as_input(torch.randn(D, L, generator=gen, dtype=F64) / math.sqrt(L), kdtype, contiguous, True)
    with knobs(backend_module("fftconv", backend), **config):
        y = fftconv(x, k, backend=backend)
        assert y.shape == (B, D, L) and y.dtype == xdtype
        assert_close("y", y, ref.fftconv(to_np(x), to_np(k)), tol(backend, xdtype, "fwd"),
                     ref.fftconv_terms(to_np(x), to_np(k)))
        if not grads:
            return
        dy = torch.randn(y.shape, generator=gen, dtype=F64).to(xdtype)
        dx, dk = torch.autograd.grad(y, (x, k), dy)
    assert dx.dtype == xdtype and dk.dtype == kdtype and dx.shape == x.shape and dk.shape == k.shape
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    dx_terms, dk_terms = ref.fftconv_bwd_terms(to_np(dy), to_np(x), to_np(k))
    assert_close("dx", dx, dx_ref, tol(backend, xdtype, "bwd"), dx_terms)
    # dk is a sum of products of the (rounded) inputs in the arithmetic dtype, rounded to k's dtype:
    # k's budget, or one float32 rounding when the arithmetic is float64 (4.1e-8 measured: 1.5e-7)
    dk_tol = 1.5e-7 if xdtype == F64 and kdtype != F64 else tol(backend, kdtype, "bwd")
    assert_close("dk", dk, dk_ref, dk_tol, dk_terms)


@pytest.mark.parametrize("backend, c", on_backends(CASES, runs_on, ("torch", "cpu", "triton", "cuda")))
def test_matches_reference(backend, c):
    if backend == "triton" and c.path == "fft" and c.L <= 2048:
        assert conv_triton._plan(c.L, 0)[0] == "tile"
    if backend == "triton" and c.L > 2048:
        assert conv_triton._plan(c.L, 0)[0] == "slice"
    config = {**PATHS[c.path].get(backend, {}), **c.knobs.get(backend, {})}
    check_fftconv(backend, c.B, c.D, c.L, c.xdtype, c.kdtype, c.contiguous, c.seed, c.grads, **config)


@given(B=st.integers(1, 3), D=st.integers(1, 6), L=st.integers(1, 300), dtypes=st.sampled_from(DTYPES),
       path=st.sampled_from(list(PATHS)), contiguous=st.booleans(), seed=st.integers(0, 2**31))
def test_property_torch(B, D, L, dtypes, path, contiguous, seed):
    if path == "direct":
        L = min(L, 100)  # O(L^2) by design
    check_fftconv("torch", B, D, L, *dtypes, contiguous, seed, **PATHS[path]["torch"])


# ------------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------------

# (backend, path, dtype, bound): the bound on the relative error of an identity (linearity:
# worst measured 2.2e-7 in fp32, 3.6e-16 in fp64, so 3x-4x of that, as support.budget does)
IDENTITY_BOUND = {F32: 8e-7, F64: 1.5e-15}
IDENTITY_RUNS = [
    pytest.param("torch", "direct", F64, IDENTITY_BOUND[F64], id="torch-direct-float64"),
    pytest.param("torch", "fft", F64, IDENTITY_BOUND[F64], id="torch-fft-float64"),
    pytest.param("triton", "direct", F32, IDENTITY_BOUND[F32], id="triton-direct-float32"),
    pytest.param("triton", "fft", F32, IDENTITY_BOUND[F32], id="triton-fft-float32"),
    pytest.param("cuda", "fft", F32, IDENTITY_BOUND[F32], id="cuda-float32"),
    pytest.param("cuda", "fft", F64, IDENTITY_BOUND[F64], id="cuda-float64"),
    pytest.param("cpu", "fft", F32, IDENTITY_BOUND[F32], id="cpu-float32"),
    pytest.param("cpu", "fft", F64, IDENTITY_BOUND[F64], id="cpu-float64"),
]


@pytest.mark.parametrize("backend, path, dtype, bound", IDENTITY_RUNS)
def test_linearity(backend, path, dtype, bound):
    gen = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(2, 2, 3, 40, generator=gen, dtype=F64).to(dtype)
    k1, k2 = torch.randn(2, 3, 40, generator=gen, dtype=F64).to(dtype)
    a, b = 0.7, -1.9
    with knobs(backend_module("fftconv", backend), **PATHS[path].get(backend, {})):
        f = lambda x, k: fftconv(x, k, backend=backend)  # noqa: E731
        assert_close("linear in x", f(a * x1 + b * x2, k1), to_np(a * f(x1, k1) + b * f(x2, k1)), bound)
        assert_close("linear in k", f(x1, a * k1 + b * k2), to_np(a * f(x1, k1) + b * f(x1, k2)), bound)


@pytest.mark.parametrize("backend, path, dtype, bound", IDENTITY_RUNS)
def test_is_causal(backend, path, dtype, bound):
    # changing x at s must not change y before s (no circular wrap-around in the padded FFT), and
    # must change it from s on
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 100, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(2, 100, generator=gen, dtype=F64).to(dtype)
    x2 = x.clone()
    x2[..., 60:] += 1.0
    with knobs(backend_module("fftconv", backend), **PATHS[path].get(backend, {})):
        a, b = fftconv(x, k, backend=backend), fftconv(x2, k, backend=backend)
    # float64: below 1e-12 absolute, as the values are O(10)
    before = 1e-12 if dtype == F64 else bound * float(a.abs().max())
    assert float((a[..., :60] - b[..., :60]).abs().max()) < before
    assert float((a[..., 60:] - b[..., 60:]).abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [F32, F64], ids=_dt)
@given(L=st.integers(1, 90), seed=st.integers(0, 2**31))
def test_direct_equals_fft_torch(dtype, L, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, L, generator=gen, dtype=dtype)
    k = torch.randn(3, L, generator=gen, dtype=dtype)
    dy = torch.randn(2, 3, L, generator=gen, dtype=dtype)
    outs = {}
    for path, config in PATHS.items():
        limit = config["torch"]["direct_max_len"]
        outs[path] = (conv_torch.forward(x, k, direct_max_len=limit),
                      *conv_torch.backward(dy, x, k, direct_max_len=limit))
    for name, a, b in zip(("y", "dx", "dk"), outs["direct"], outs["fft"]):
        assert_close(f"{name} direct vs fft", a, to_np(b), tol("torch", dtype, "fwd"))


def test_direct_equals_fft_triton():
    gen = torch.Generator().manual_seed(6)
    x, dy = torch.randn(2, 3, 2, 50, generator=gen)
    k = torch.randn(3, 50, generator=gen)
    outs = {}
    for path, config in PATHS.items():
        cfg = dict(conv_triton.DEFAULT_CONFIG, **config["triton"])
        outs[path] = (conv_triton.forward(x, k, **cfg), *conv_triton.backward(dy, x, k, True, True, **cfg))
    for name, a, b in zip(("y", "dx", "dk"), outs["direct"], outs["fft"]):
        assert_close(f"{name} direct vs fft", a, to_np(b), tol("triton", F32, "fwd"))


@pytest.mark.parametrize("backend, path, length, fast_mode", [
    ("torch", "direct", 9, True), ("torch", "fft", 9, True),
    # finite differences through the emulated CUDA kernels in float64, the full Jacobian
    ("cuda", "fft", 19, False),
    ("cpu", "fft", 19, False),  # the full Jacobian: every tap of every lane
], ids=["torch-direct", "torch-fft", "cuda", "cpu"])
def test_gradcheck(backend, path, length, fast_mode):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, length, generator=gen, dtype=F64).requires_grad_()
    k = torch.randn(2, length, generator=gen, dtype=F64).requires_grad_()
    with knobs(backend_module("fftconv", backend), **PATHS[path].get(backend, {})):
        assert torch.autograd.gradcheck(lambda a, b: fftconv(a, b, backend=backend), (x, k), fast_mode=fast_mode)


def test_torch_default_path_choice():
    # the shipped knob sends short sequences to the direct path and long ones to the FFT
    limit = conv_torch.DEFAULT_CONFIG["direct_max_len"]
    for L in (1, limit, limit + 1, 4 * limit):
        path = "direct" if L <= limit else "fft"
        check_fftconv("torch", 1, 2, L, F32, F32, **PATHS[path]["torch"])


def test_triton_default_path_choice():
    limit = conv_triton.DEFAULT_CONFIG["direct_max_len"]
    assert conv_triton._plan(limit, limit)[0] == "direct"
    assert conv_triton._plan(limit + 1, limit)[0] == "tile"
    assert conv_triton._plan(2048, limit)[0] == "tile" and conv_triton._plan(2049, limit) == ("slice", 8, 4, 2)
    # N = 2**18: 128 slices of C = 2048, 64 output blocks per combine program (dots from R = 16 on)
    assert conv_triton._plan(conv_triton.MAX_LENGTH, limit) == ("slice", 8, 128, 64)
    assert conv_triton._plan(8192, limit) == ("slice", 8, 8, 4) and conv_triton._plan(8193, limit)[3] == 16
    # the shipped combine tile loops over several column tiles per row pair (the case "L2049-shipped-work_bc")
    assert conv_triton.combine_cols(16, conv_triton.DEFAULT_CONFIG["work_bc"], conv_triton.SLICE_C) < 2048
    assert conv_triton.combine_cols(2, conv_triton.DEFAULT_CONFIG["work_bc"], conv_triton.SLICE_C) == 1024


# ------------------------------------------------------------------------------------------------
# the reference's backward against central finite differences (float64, tiny shapes)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 9])
def test_reference_bwd_matches_finite_differences(L):
    gen = torch.Generator().manual_seed(3)
    args = dict(x=to_np(torch.randn(2, 3, L, generator=gen, dtype=F64)), k=to_np(torch.randn(3, L, generator=gen,
                                                                                               dtype=F64)))
    dy = to_np(torch.randn(2, 3, L, generator=gen, dtype=F64))

    def loss(v):
        return np.sum(dy * ref.fftconv(v["x"], v["k"]))

    dx, dk = ref.fftconv_bwd(dy, args["x"], args["k"])
    assert_close("x vs finite differences", dx, finite_difference_grad(loss, args, "x"), FD_TOL)
    assert_close("k vs finite differences", dk, finite_difference_grad(loss, args, "k"), FD_TOL)


# ------------------------------------------------------------------------------------------------
# Triton: the tile plan, one gradient alone, the longest length
# ------------------------------------------------------------------------------------------------

def test_triton_tile_sizes():
    # N = 256 A: A = 1 (two dot levels), 2 (radix-2 + two), 4 (radix-4 + two), 8 (block-diagonal
    # dot + two), 16 (three dot levels); N = 2 nextpow2(L), at least 256
    assert conv_triton._plan(2048, 0) == ("tile", 16)
    lengths = (31, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048)
    assert [conv_triton._plan(L, 0)[1] for L in lengths] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_triton_twiddle_table_tiles_are_the_rounded_roots():
    """The tile transform reads its DFT matrices and twiddles as pre-arranged contiguous tiles; each
    entry must be the very fp32 root W_M^e (cos, sin of 2 pi e / M) that the [2, 4096] roots hold."""
    T = conv_triton
    tab = T.twiddle_table(torch.device("cpu"))
    assert tab.numel() == T.TW_SIZE
    roots = tab[:8192].view(2, 4096)
    e = torch.arange(4096, dtype=torch.float64) * (2 * math.pi / 4096)
    assert torch.equal(roots, torch.stack([torch.cos(e), torch.sin(e)]).float())

    def expect(exp, log_m):
        return roots[:, (exp % (1 << log_m)) * (4096 >> log_m)]

    def tile(off, m, k):
        return tab[off:off + 2 * m * k].view(2, m, k)

    o = torch.arange(16)
    assert torch.equal(tile(T.TW_F16, 16, 16), expect(o[:, None] * o[None, :], 4))
    diag = (o[:, None] // 8 == o[None, :] // 8).float()
    assert torch.equal(tile(T.TW_F8, 16, 16), expect((o[:, None] % 8) * (o[None, :] % 8), 3) * diag)
    for a in T.TILE_FACTORS:
        base, log_a = T.TW_PLANES + 1024 * (a - 1), a.bit_length() - 1
        b = torch.arange(256)[:, None] // 16
        assert torch.equal(tile(base, 256, a), expect(b * torch.arange(a)[None, :], log_a + 4)), a
        r = torch.arange(16 * a)[:, None]
        assert torch.equal(tile(base + 512 * a, 16 * a, 16), expect((r // a) * (r % a + a * o[None, :]), log_a + 8)), a


def test_triton_row_chunks():
    """The tile path's grid (D, chunks): enough programs for 4 per SM where the batch allows,
    every row pair in exactly one chunk."""
    rc = conv_triton.row_chunks
    assert rc(2, 256, 132) == (1, 1)                  # one pair per feature: nothing to split
    chunks, per = rc(32, 256, 132)                    # 16 pairs: 3 chunks of 6, 6, 4
    assert 256 * chunks >= 4 * 132 and (chunks - 1) * per < 16 <= chunks * per
    assert rc(64, 1024, 132) == (1, 32)               # 1024 features are enough programs
    assert rc(7, 1, 132) == (1, 4) and rc(0, 4, 132) == (1, 1)   # too few pairs to split
    for B in range(0, 40):
        for D in (1, 3, 256):
            chunks, per = rc(B, D, 132)
            pairs = (B + 1) // 2
            assert chunks >= 1 and per >= 1 and (chunks - 1) * per < max(pairs, 1) <= chunks * per
            assert chunks == 1 or per >= conv_triton.MIN_CHUNK_PAIRS


@pytest.mark.parametrize("xdtype, L", [(F32, 1000), (BF16, 300)], ids=["float32-N2048", "bfloat16-N1024"])
def test_triton_batch_split_over_programs(monkeypatch, xdtype, L):
    """The tile path with the batch split over programs (grid (D, chunks)): every chunk's rows,
    the unpaired last row, and dk / domega added from the chunks' partial sums. One pair per
    chunk here (the shipped minimum is MIN_CHUNK_PAIRS: the interpreter's shapes are small)."""
    monkeypatch.setattr(conv_triton, "MIN_CHUNK_PAIRS", 1)
    assert conv_triton.row_chunks(5, 2, conv_triton.INTERPRETER_SMS) == (2, 2)
    check_fftconv("triton", 5, 2, L, xdtype, F32, seed=8, **PATHS["fft"]["triton"])
    # the fused epilogue (cema's bias and skip terms) and domega's partial sums over the chunks
    gen = torch.Generator().manual_seed(9)
    x, dy, bias = (torch.randn(5, 2, L, generator=gen) for _ in range(3))
    k, om = torch.randn(2, L, generator=gen) / math.sqrt(L), torch.randn(2, generator=gen)
    cfg = dict(conv_triton.DEFAULT_CONFIG, **PATHS["fft"]["triton"])
    y = conv_triton.conv_fwd(x.to(xdtype), k, bias=bias, omega=om, **cfg)
    xs = x.to(xdtype).double()
    y_ref = torch.from_numpy(ref.fftconv(to_np(xs), to_np(k))) + bias.double() + om.double()[:, None] * xs
    assert_close("y fused", y, to_np(y_ref), tol("triton", xdtype, "fwd"))
    dx, dk, dom = conv_triton.conv_bwd(dy.to(xdtype), x.to(xdtype), k, True, True, om, **cfg)
    dys = dy.to(xdtype).double()
    dom_ref = (dys * xs).sum((0, 2))
    assert_close("domega", dom, to_np(dom_ref), tol("triton", F32, "bwd"))
    dx_ref = torch.from_numpy(ref.fftconv_bwd(to_np(dys), to_np(xs), to_np(k))[0]) + om.double()[:, None] * dys
    assert_close("dx fused", dx, to_np(dx_ref), tol("triton", xdtype, "bwd"))


@pytest.mark.parametrize("xdtype, L, dots", [(F32, 200, False), (BF16, 500, False), (F32, 500, True)],
                         ids=["float32-R2", "bfloat16-R4", "float32-R4-combine-dots"])
def test_triton_slice_path(monkeypatch, xdtype, L, dots):
    """The slice path (N > MAX_TILE_FFT) at small sizes: the threshold and the slice tile lowered to
    256 points, so N = 512 / 1024 run R = 2 / 4 slices (R = 4 ... 128 at the shipped sizes: the
    L2049 cases and test_triton_long_length); the batch split over 3 chunks of
    one pair (the unpaired last row in the last), the fused bias and skip terms, domega, and each
    gradient alone. The combine sums the slices with multiply-adds below 8 output blocks (R < 16)
    and with dots from there on (``dots``: that form forced at R = 4)."""
    monkeypatch.setattr(conv_triton, "MAX_TILE_FFT", 256)
    monkeypatch.setattr(conv_triton, "SLICE_C", 256)
    monkeypatch.setattr(conv_triton, "MIN_CHUNK_PAIRS", 1)
    monkeypatch.setattr(conv_triton, "INTERPRETER_SMS", 16)
    if dots:
        monkeypatch.setattr(conv_triton, "COMBINE_DOT_BJ", 1)
    plan = conv_triton._plan(L, 0)
    assert plan[0] == "slice" and plan[2] == conv_triton.fft_size(L) // 256
    assert (plan[3] >= 16) == dots
    assert conv_triton.row_chunks(5, 2 * plan[2], conv_triton.INTERPRETER_SMS)[0] == 3
    check_fftconv("triton", 5, 2, L, xdtype, F32, seed=10, **PATHS["fft"]["triton"])
    gen = torch.Generator().manual_seed(11)
    x, dy, bias = (torch.randn(5, 2, L, generator=gen) for _ in range(3))
    k, om = torch.randn(2, L, generator=gen) / math.sqrt(L), torch.randn(2, generator=gen)
    cfg = dict(conv_triton.DEFAULT_CONFIG, **PATHS["fft"]["triton"])
    xs, dys = x.to(xdtype).double(), dy.to(xdtype).double()
    y = conv_triton.conv_fwd(x.to(xdtype), k, bias=bias, omega=om, **cfg)
    y_ref = torch.from_numpy(ref.fftconv(to_np(xs), to_np(k))) + bias.double() + om.double()[:, None] * xs
    y_terms = _fft_terms(xs, k.double(), dys)[0] + to_np(bias.double().abs() + om.double().abs()[:, None] * xs.abs())
    assert_close("y fused", y, to_np(y_ref), tol("triton", xdtype, "fwd"), y_terms)
    dx, dk, dom = conv_triton.conv_bwd(dy.to(xdtype), x.to(xdtype), k, True, True, om, **cfg)
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dys), to_np(xs), to_np(k))
    _, dx_terms, dk_terms = _fft_terms(xs, k.double(), dys)
    assert_close("dx fused", dx, to_np(torch.from_numpy(dx_ref) + om.double()[:, None] * dys),
                 tol("triton", F32, "bwd"), dx_terms + to_np(om.double().abs()[:, None] * dys.abs()))
    assert_close("dk", dk, dk_ref, tol("triton", F32, "bwd"), dk_terms)
    assert_close("domega", dom, to_np((dys * xs).sum((0, 2))), tol("triton", F32, "bwd"),
                 to_np((dys * xs).abs().sum((0, 2))))
    # each output alone runs its own launches (same arithmetic: identical results)
    dx1, dk1, dom1 = conv_triton.conv_bwd(dy.to(xdtype), x.to(xdtype), k, True, False, om, **cfg)
    dx2, dk2, dom2 = conv_triton.conv_bwd(dy.to(xdtype), x.to(xdtype), k, False, True, None, **cfg)
    assert dk1 is None and dx2 is None and dom2 is None
    assert torch.equal(dx1, dx) and torch.equal(dom1, dom) and torch.equal(dk2, dk)


@pytest.mark.parametrize("need", ["x", "k"])
def test_triton_largest_tile_one_gradient(need):
    # N = 4096 runs the dk pass and the dx pass separately: each alone (the other not computed)
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(2, 3, 1, 2000, generator=gen)
    k = torch.randn(1, 2000, generator=gen) / 40.0
    cfg = dict(conv_triton.DEFAULT_CONFIG, **PATHS["fft"]["triton"])
    dx, dk = conv_triton.backward(dy, x, k, need == "x", need == "k", **cfg)
    dx_ref, dk_ref = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    _, dx_terms, dk_terms = _fft_terms(x, k, dy)
    if need == "x":
        assert dk is None
        assert_close("dx", dx, dx_ref, tol("triton", F32, "bwd"), dx_terms)
    else:
        assert dx is None
        assert_close("dk", dk, dk_ref, tol("triton", F32, "bwd"), dk_terms)


@pytest.mark.stress
def test_triton_long_length(stress):
    # L = 2**17 under --stress: N = 2**18 = 128 slices of 2048 points, 64 output blocks per combine
    # program (~210 s in the interpreter); by default L = 2**14 (N = 2**15, 16 slices). float64 FFT
    # as the oracle (the O(L**2) NumPy reference would take minutes).
    L = 1 << 17 if stress else 1 << 14
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, L, generator=gen, dtype=F64)
    k = torch.randn(1, L, generator=gen, dtype=F64) * torch.exp(-torch.arange(L) / 20000.0)
    dy = torch.randn(1, 1, L, generator=gen, dtype=F64)
    cfg = dict(conv_triton.DEFAULT_CONFIG, **FAST_WORK)
    y = conv_triton.forward(x.float(), k.float(), **cfg)
    dx, dk = conv_triton.backward(dy.float(), x.float(), k.float(), True, True, **cfg)
    xs, ks, dys = x.float().double(), k.float().double(), dy.float().double()   # the inputs as the kernel saw them
    ym, dxm, dkm = _fft_terms(xs, ks, dys)
    assert_close("y", y, to_np(conv_torch.forward(xs, ks, direct_max_len=0)), tol("triton", F32, "fwd"), ym)
    dx_ref, dk_ref = conv_torch.backward(dys, xs, ks, direct_max_len=0)
    assert_close("dx", dx, to_np(dx_ref), tol("triton", F32, "bwd"), dxm)
    assert_close("dk", dk, to_np(dk_ref), tol("triton", F32, "bwd"), dkm)
    # the first samples of y (no error hiding in the max over a long row). Their error is the whole
    # row's FFT rounding (absolute, ~3e-7 max|y|) relative to their own smaller max: 3.3e-6 measured,
    # hence 1e-5 here rather than the fp32 forward budget
    assert_close("y[:64]", y[..., :64], to_np(ref.fftconv(to_np(xs[..., :64]), to_np(ks[..., :64]))), 1e-5)


# ------------------------------------------------------------------------------------------------
# cpu: the compiled kernel (ops/fftconv/cpu_kernel.cpp) directly
# ------------------------------------------------------------------------------------------------

def _cpu_available():
    if isinstance(conv_cpu._library(), Exception):
        pytest.skip(f"the cpu fftconv kernel cannot be built here: {conv_cpu._library()}")


def _cpu_vs_float64(B, D, L, dtype, seed, need_x=True, need_k=True):
    x, k, dy = _inputs64(seed, B, D, L)
    y = conv_cpu.forward(x.to(dtype), k.to(dtype))
    dx, dk = conv_cpu.backward(dy.to(dtype), x.to(dtype), k.to(dtype), need_x, need_k)
    seen = [t.to(dtype).double() for t in (x, k, dy)]   # the inputs as the kernel saw them
    (yr, dxr, dkr), (ym, dxm, dkm) = _fft_ref(*seen), _fft_terms(*seen)
    assert_close("y", y, yr, tol("cpu", dtype, "fwd"), ym)
    assert (dx is None) != need_x and (dk is None) != need_k
    if need_x:
        assert_close("dx", dx, dxr, tol("cpu", dtype, "bwd"), dxm)
    if need_k:
        assert_close("dk", dk, dkr, tol("cpu", dtype, "bwd"), dkm)


# Lanes are channels: 16 float / 8 double lanes with AVX-512 (8 / 4 with AVX2, 4 / 2 with SSE2). D = 1
# and 17 leave lanes empty and make an odd number of channel blocks (a task with one block, the
# imaginary half of its transforms zero); D = 40 is two full blocks and a partial one. L from 1
# (n = 2) through the in-cache leaf (n <= 256) to three levels of recursion (L = 2049, n = 8192).
@pytest.mark.parametrize("dtype", [F32, F64], ids=_dt)
@pytest.mark.parametrize("B,D,L", [(1, 1, 1), (3, 17, 2), (2, 40, 127), (1, 33, 128), (3, 17, 129), (2, 5, 700),
                                   (1, 3, 2049)], ids=lambda v: str(v))
def test_cpu_kernel_vs_float64_fft(dtype, B, D, L):
    _cpu_available()
    _cpu_vs_float64(B, D, L, dtype, seed=B * 1000 + D * 10 + L)


@pytest.mark.parametrize("need", ["x", "k"])
def test_cpu_kernel_one_gradient(need):
    _cpu_available()
    _cpu_vs_float64(3, 20, 300, F32, seed=9, need_x=need == "x", need_k=need == "k")


def test_cpu_kernel_any_thread_count_gives_identical_results():
    # each output is computed by one task, whatever the team size: no sum depends on the split
    _cpu_available()
    x, k, dy = (t.float() for t in _inputs64(11, 3, 70, 200))
    runs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # the kernel's OpenMP team
            runs.append((conv_cpu.forward(x, k), *conv_cpu.backward(dy, x, k)))
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_cpu_kernel_empty_batch_and_auto_choice():
    _cpu_available()
    x, k = torch.zeros(0, 3, 8), torch.randn(3, 8)
    dx, dk = conv_cpu.backward(torch.zeros(0, 3, 8), x, k)
    assert dx.shape == (0, 3, 8) and torch.equal(dk, torch.zeros(3, 8))
    # without a table entry for this shape, auto takes the compiled kernel before the torch backend
    from megalodon_kernels.ops.fftconv import BACKENDS
    x = torch.randn(1, 7, 13)
    assert BACKENDS.select("auto", {"x": x, "k": x[0]}, device=x.device, dtype=x.dtype).name == "cpu"


@pytest.mark.parametrize("vector", [[], ["-march=x86-64-v3"]], ids=["sse2", "avx2"])
def test_cpu_kernel_narrower_vector_builds(monkeypatch, vector):
    # lanes per vector (so channel blocks and their tails) depend on the build
    use_cpu_build(monkeypatch, conv_cpu, vector)
    for dtype in (F32, F64):
        _cpu_vs_float64(3, 13, 77, dtype, seed=4)


def test_cpu_backend_names_its_length_limit_and_auto_falls_back():
    from megalodon_kernels.ops.fftconv import BACKENDS
    x = torch.zeros(1, 1, conv_cpu.MAX_LEN + 1)
    assert any(f"L = {conv_cpu.MAX_LEN + 1} > {conv_cpu.MAX_LEN}" in w and "backend='torch'" in w
               for w in conv_cpu.not_supported_reasons(x))
    assert BACKENDS.select("auto", {"x": x, "k": x[0]}, device=x.device, dtype=x.dtype).name == "torch"
    with pytest.raises(ValueError, match=f"L = {conv_cpu.MAX_LEN + 1} > {conv_cpu.MAX_LEN}"):
        conv_cpu.forward(x, x[0])


def test_cpu_backend_without_a_compiler_says_so_and_auto_falls_back(monkeypatch, tmp_path):
    from megalodon_kernels.ops.fftconv import BACKENDS
    monkeypatch.setattr(conv_cpu, "CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGALODON_KERNELS_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setattr(conv_cpu, "_library", conv_cpu._library.__wrapped__)  # no remembered library
    x = torch.randn(1, 4, 8)
    why = conv_cpu.not_supported_reasons(x)
    assert len(why) == 1 and "could not be built" in why[0] and "backend='torch'" in why[0]
    assert BACKENDS.select("auto", {"x": x, "k": x[0]}, device=x.device, dtype=x.dtype).name == "torch"


# ------------------------------------------------------------------------------------------------
# CUDA: the kernels' tensor API in the emulator
# ------------------------------------------------------------------------------------------------

def _inputs(seed, B, D, L, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=g).to(dtype)
    # a kernel decaying over the whole length, so late taps (the far end of the FFT) matter
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / (L / 4.0))
    dy = torch.randn(B, D, L, generator=g).to(dtype)
    return x, k, dy


def _inputs64(seed, B, D, L):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=g, dtype=F64)
    k = torch.randn(D, L, generator=g, dtype=F64) * torch.exp(-torch.arange(L, dtype=F64) / (L / 4.0))
    dy = torch.randn(B, D, L, generator=g, dtype=F64)
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


def _fft_terms(x, k, dy):
    """The magnitude of the terms of y, dx, dk (reference.terms), by the same float64 FFTs on
    |x|, |k|, |dy|: sums of non-negative terms, accurate to ~1e-16 of their own size."""
    return _fft_ref(*(np.abs(to_np(t)) for t in (x, k, dy)))


def _check_kernels(ext, x, k, dy, dtype, **kw):
    y = C.launch_fwd(emu(ext), x, k, **kw)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k, **kw)
    assert y.dtype == dtype and dx.dtype == dtype and dk.dtype == F32
    (yr, dxr, dkr), (ym, dxm, dkm) = _fft_ref(x, k, dy), _fft_terms(x, k, dy)
    assert_close("y", y, yr, tol("cuda", dtype, "fwd"), ym)
    assert_close("dx", dx, dxr, tol("cuda", dtype, "bwd"), dxm)
    assert_close("dk", dk, dkr, tol("cuda", F32, "bwd"), dkm)  # dk is fp32 whatever x's dtype (k is fp32)
    return y, dx, dk


# float64: double arithmetic throughout, held to the measured fp64 budget (a few 1e-15): anything
# rounded through fp32 anywhere (a twiddle, a spectrum, the workspace) would be ~1e-7.


def _check_kernels64(ext, x, k, dy, refs=None, **kw):
    y = C.launch_fwd(emu(ext), x, k, **kw)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k, **kw)
    assert y.dtype == dx.dtype == dk.dtype == F64
    yr, dxr, dkr = _fft_ref(x, k, dy) if refs is None else refs
    terms = _fft_terms(x, k, dy)
    for name, a, r, t, m in zip(("y", "dx", "dk"), (y, dx, dk), (yr, dxr, dkr), ("fwd", "bwd", "bwd"), terms):
        assert_close(name, a, r, tol("cuda", F64, t), m)
    return y, dx, dk


def test_cuda_kernels_lengths_and_workspace_sizes():
    assert C.ONE_BLOCK_MAX_LEN == 16384 and C.MAX_LEN == 2**27
    assert C.workspace_row_floats(16384, F32) == 0           # one block per row, no workspace
    assert C.workspace_row_floats(16385, F32) == 2 * 32768   # N = 2^15 complex64
    assert C.workspace_row_floats(2**20, F32) == 2 * 2**20
    assert C.fft_size(70001) == 2**17 and C.fft_size(1) == 32


def test_cuda_kernels_fp64_lengths_and_workspace_sizes():
    assert C.FP64_ONE_BLOCK_MAX_LEN == 8192 and C.FP64_MAX_LEN == 2**25
    assert C.max_len(F64) == 2**25 and C.max_len(F32) == C.max_len(BF16) == 2**27
    assert C.workspace_row_floats(8192, F64) == 0            # one block, no workspace
    assert C.workspace_row_floats(8193, F64) == 4 * 16384    # N = 2^14 complex128, in floats
    assert C.workspace_row_floats(8193, F32) == 0            # float: still one block
    assert C.workspace_row_floats(2**20, F64) == 4 * 2**20
    # both one-block configurations ask for 128 KiB (float N = 2^14, double N = 2^13), every
    # multi-pass pass at most that
    assert C.fft_smem_bytes(F32, 14) == C.fft_smem_bytes(F64, 13) == C.one_block_max_smem_bytes() == 128 * 1024
    assert max(C.multi_pass_max_smem_bytes(rows) for rows in (False, True)) <= 128 * 1024


def test_cuda_kernels_launch_descriptions_reject_bad_lengths_and_a_missing_workspace(ext):
    x = torch.zeros(1, 1, 1)
    with pytest.raises(ValueError, match="L <= 134217728"):
        C.log2n_of(2**27 + 1, F32)
    with pytest.raises(ValueError, match="L <= 33554432 in float64"):
        C.log2n_of(2**25 + 1, F64)
    with pytest.raises(ValueError, match="workspace"):  # the multi-pass FFT without its workspace
        C._bwd_dk(emu(ext), x, None, torch.empty(1, 16385), 1, 1, 16385, 15, F32, False, True, None, 0)
    with pytest.raises(ValueError, match="workspace"):  # double: multi-pass from L = 8193 on
        C._bwd_dk(emu(ext), x, None, torch.empty(1, 8193, dtype=F64), 1, 1, 8193, 14, F64, False, True, None, 0)
    assert C.multi_pass(15, F32) and C.multi_pass(14, F64) and not C.multi_pass(14, F32)


def test_cuda_kernels_fp64_refuse_float16_x_naming_it(ext):
    x = torch.zeros(1, 1, 8, dtype=F16)
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        C.launch_fwd(emu(ext), x, torch.zeros(1, 8))
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        C.launch_bwd(emu(ext), x, x, torch.zeros(1, 8))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("B,D,L", [(1, 1, 1), (2, 3, 31), (1, 2, 33), (2, 1, 129)], ids=lambda v: str(v))
def test_cuda_kernels_one_block_vs_direct_reference(ext, order, dtype, B, D, L):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, D, L, generator=g).to(dtype)
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / 20.0)
    y = C.launch_fwd(emu(ext), x, k)
    dy = torch.randn(B, D, L, generator=g).to(dtype)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k)
    ym, dxm, dkm = _fft_terms(x, k, dy)
    assert_close("y", y, ref.fftconv(to_np(x), to_np(k)), tol("cuda", dtype, "fwd"), ym)
    dxr, dkr = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert dx.dtype == dtype and dk.dtype == F32
    assert_close("dx", dx, dxr, tol("cuda", dtype, "bwd"), dxm)
    assert_close("dk", dk, dkr, tol("cuda", F32, "bwd"), dkm)  # dk is fp32 whatever x's dtype (k is fp32)


def test_cuda_kernels_16k_one_block_per_row(ext, order):
    B, D, L = 1, 1, 16384
    assert C.fft_size(L) == 16384
    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, D, L, generator=g)
    k = torch.randn(D, L, generator=g) * torch.exp(-torch.arange(L) / 2000.0)
    dy = torch.randn(B, D, L, generator=g)
    y = C.launch_fwd(emu(ext), x, k)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k)
    (yr, dxr, dkr), (ym, dxm, dkm) = _fft_ref(x, k, dy), _fft_terms(x, k, dy)
    assert_close("y", y, yr, tol("cuda", F32, "fwd"), ym)
    assert_close("dx", dx, dxr, tol("cuda", F32, "bwd"), dxm)
    assert_close("dk", dk, dkr, tol("cuda", F32, "bwd"), dkm)


def test_cuda_kernels_one_block_dk_over_batch_slices(ext):
    # the product-spectrum workspace split over batch slices (accumulate, then finalize)
    B, D, L = 5, 2, 40
    g = torch.Generator().manual_seed(10)
    x, dy = torch.randn(B, D, L, generator=g), torch.randn(B, D, L, generator=g)
    k = torch.randn(D, L, generator=g)
    N = C.fft_size(L)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k, max_workspace_bytes=2 * D * (N + 1) * 8)
    (_, dxr, dkr), (_, dxm, dkm) = _fft_ref(x, k, dy), _fft_terms(x, k, dy)
    assert_close("dx", dx, dxr, tol("cuda", F32, "bwd"), dxm)
    assert_close("dk", dk, dkr, tol("cuda", F32, "bwd"), dkm)
    dx_only, none = C.launch_bwd(emu(ext), dy, x, k, need_k=False)
    assert none is None
    assert_close("dx only", dx_only, dxr, tol("cuda", F32, "bwd"), dxm)


def test_cuda_kernels_just_above_one_block_vs_direct_reference(ext):
    # L = 16385: the first multi-pass length, against the O(L^2) definition itself
    L = 16385
    x, k, dy = _inputs(1, 1, 1, L, F32)
    y = C.launch_fwd(emu(ext), x, k)
    dx, dk = C.launch_bwd(emu(ext), dy, x, k)
    ym, dxm, dkm = _fft_terms(x, k, dy)
    assert_close("y", y, ref.fftconv(to_np(x), to_np(k)), tol("cuda", F32, "fwd"), ym)
    dxr, dkr = ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k))
    assert_close("dx", dx, dxr, tol("cuda", F32, "bwd"), dxm)
    assert_close("dk", dk, dkr, tol("cuda", F32, "bwd"), dkm)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("L", [32768, 70001], ids=lambda v: f"L{v}")
def test_cuda_kernels_multipass_vs_float64(ext, dtype, L):
    # 32768: N = 2^15 exactly (no padding inside the last column); 70001: odd, N = 2^17
    x, k, dy = _inputs(2, 1, 1, L, dtype)
    _check_kernels(ext, x, k, dy, dtype)


def test_cuda_kernels_multipass_batch_and_channels_both_fiber_orders(ext, order):
    # rows b * D + d pick kf[d]; dk sums the batch; a missing barrier shows in one fiber order
    x, k, dy = _inputs(3, 2, 2, 16385, F32)
    _check_kernels(ext, x, k, dy, F32)


def test_cuda_kernels_multipass_2_pow_17_and_beyond(ext):
    # L >= 2^17 with N = 2^18 (plan N1 = N2 = 512): the longest case the test budget allows
    x, k, dy = _inputs(4, 1, 1, 2**17 + 3, BF16)
    _check_kernels(ext, x, k, dy, BF16)


def test_cuda_kernels_forward_at_2_pow_20(ext):
    # the longest length asked for (N = 2^20, plan N1 = N2 = 1024, 8 columns per block); forward
    # only, the backward runs the same passes (see the N = 2^17 and 2^18 cases)
    L = 2**20
    x, k, _ = _inputs(8, 1, 1, L, F32)
    y = C.launch_fwd(emu(ext), x, k)
    n = 2 * L
    xr, kr = to_np(x), to_np(k)
    assert_close("y", y, np.fft.irfft(np.fft.rfft(xr, n) * np.fft.rfft(kr, n), n)[..., :L], tol("cuda", F32, "fwd"))


def test_cuda_kernels_twiddles_exact_angle_also_above_2_pow_24(ext):
    # cispi_frac(a, s) = e^{+-i pi a / 2^s}: a < 2^24 goes straight to sincospif; larger a (only at
    # N >= 2^25, too long to run here) is split into two exactly representable angles.
    g = np.random.default_rng(0)
    s = 26
    a = np.concatenate([g.integers(0, 2**24, 500), g.integers(2**24, 2**27, 1500),
                        [0, 2**24 - 1, 2**24, 2**24 + 1, 2**26, 2**27 - 1]]).astype(np.uint32)
    for sign in (-1.0, 1.0):
        out = torch.view_as_real(C.twiddle_probe(emu(ext), torch.from_numpy(a), s, sign, F32))
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


def test_cuda_kernels_workspace_chunks_give_identical_results(ext):
    # one workspace row at a time (ws_rows = 1) and a product-spectrum slice of one batch
    # element (accumulate, then finalize): the arithmetic per row is the same, so bit-identical,
    # and dk's batch sum stays in a fixed order (deterministic).
    B, D, L = 3, 2, 16385
    x, k, dy = _inputs(5, B, D, L, F32)
    y, dx, dk = _check_kernels(ext, x, k, dy, F32)
    N = C.fft_size(L)
    small = D * (N + 1) * 8  # one batch element of product spectra, and 2 workspace rows
    y1 = C.launch_fwd(emu(ext), x, k, max_workspace_bytes=1)
    dx1, dk1 = C.launch_bwd(emu(ext), dy, x, k, max_workspace_bytes=small)
    assert torch.equal(y1, y) and torch.equal(dx1, dx) and torch.equal(dk1, dk)
    dx_only, none = C.launch_bwd(emu(ext), dy, x, k, need_k=False)
    assert none is None and torch.equal(dx_only, dx)


@pytest.mark.parametrize("L", [1000, 16385])
def test_cuda_kernels_block_size_changes_no_bit(ext, L):
    # butterflies_per_thread only changes how many threads stride over each stage's butterflies
    # (L 1000, N 1024: 512 threads or 128; the multi-pass column and row blocks likewise): every
    # butterfly, split and product is the same arithmetic, so the results are bit-identical.
    x, k, dy = _inputs(6, 2, 2, L, F32)
    assert C.fft_threads(C.log2n_of(1000, F32), 1) == 512 and C.fft_threads(C.log2n_of(1000, F32), 8) == 128
    assert [C.fft_threads(n, 8) for n in (5, 8, 9, 12, 13, 14)] == [32, 128, 128, 256, 512, 1024]
    runs = [(C.launch_fwd(emu(ext), x, k, butterflies=b), *C.launch_bwd(emu(ext), dy, x, k, butterflies=b))
            for b in C.BUTTERFLIES_PER_THREAD]
    assert len(runs) == 2 and all(torch.equal(a, b) for a, b in zip(*runs))
    _check_kernels(ext, x, k, dy, F32)


def test_fftconv_rows_bench_times_the_forced_block_size(use_emulated_cuda, ext, monkeypatch):
    # bench gpu's fftconv_rows: the "cuda b1" provider runs the cuda backend with
    # butterflies_per_thread = 1 for its forward and backward (registry.force raises if the
    # dispatcher never applied it), beside the default; here over the emulator on CPU tensors.
    from megalodon_kernels.bench import fftconv_rows, gpu_steps

    seen = []
    launch = C.launch_fwd
    monkeypatch.setattr(C, "launch_fwd", lambda *a, **kw: seen.append(a[4] if len(a) > 4 else kw) or launch(*a, **kw))
    monkeypatch.setattr(fftconv_rows, "BACKENDS", ("torch", "cuda"))
    monkeypatch.setattr(fftconv_rows, "DTYPES", ("float32",))
    monkeypatch.setattr(fftconv_rows, "DRY_CASES", ((1, 2, 40),))
    rows, skipped, lines = fftconv_rows.measure(torch.device("cpu"), None, float("inf"), gpu_steps._time_case,
                                                min_reps=1, max_reps=1, budget_s=0)
    assert not skipped, skipped
    assert {r["provider"] for r in rows} == {"torch", "cuda", "cuda b1"}
    assert set(seen) == {8, 1}
    assert any("cuda b1" in line and "cuda/cuda b1" in line for line in lines)


def test_cuda_kernels_one_block_boundary_still_one_block(ext):
    # 16384 stays on the one-block kernels (no workspace row), its neighbour 16385 is multi-pass;
    # the two paths meet float64 with the same budget on either side of the switch
    for L, ws_floats in ((16384, 0), (16385, 2 * 32768)):
        assert C.workspace_row_floats(L, F32) == ws_floats
        x, k, dy = _inputs(6, 1, 1, L, F32)
        _check_kernels(ext, x, k, dy, F32)


@pytest.mark.parametrize("L", [1, 2, 33, 100, 257], ids=lambda v: f"L{v}")
def test_cuda_kernels_fp64_one_block_vs_direct_reference(ext, order, L):
    # B = 2: dk sums the batch; D = 3: rows pick kf[d]; the O(L^2) definition in float64
    x, k, dy = _inputs64(10 + L, 2, 3, L)
    refs = (ref.fftconv(to_np(x), to_np(k)), *ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k)))
    y, dx, dk = _check_kernels64(ext, x, k, dy, refs)
    dx_only, none = C.launch_bwd(emu(ext), dy, x, k, need_k=False)
    none2, dk_only = C.launch_bwd(emu(ext), dy, x, k, need_x=False)
    assert none is None and none2 is None
    assert torch.equal(dx_only, dx) and torch.equal(dk_only, dk)


def test_cuda_kernels_fp64_one_block_boundary(ext, order):
    # 8192 is the last one-block length in double (no workspace), 8193 the first multi-pass one
    # (N = 2^14: plan N1 = N2 = 128); the float path keeps one block at 8193
    for L, ws_floats in ((8192, 0), (8193, 4 * 16384)):
        assert C.workspace_row_floats(L, F64) == ws_floats
        x, k, dy = _inputs64(20, 1, 1, L)
        _check_kernels64(ext, x, k, dy)


def test_cuda_kernels_fp64_multipass_batch_channels_and_workspace_chunks(ext, order):
    # rows b * D + d pick kf[d]; dk sums the batch; one workspace row at a time and a product
    # spectrum slice of one batch element give bit-identical results (same per-row arithmetic,
    # same batch order)
    B, D, L = 3, 2, 9000
    x, k, dy = _inputs64(21, B, D, L)
    y, dx, dk = _check_kernels64(ext, x, k, dy)
    N = C.fft_size(L)
    small = D * (N + 1) * 16  # one batch element of complex128 product spectra; 1 ws row
    y1 = C.launch_fwd(emu(ext), x, k, max_workspace_bytes=1)
    dx1, dk1 = C.launch_bwd(emu(ext), dy, x, k, max_workspace_bytes=small)
    assert torch.equal(y1, y) and torch.equal(dx1, dx) and torch.equal(dk1, dk)
    dx_only, none = C.launch_bwd(emu(ext), dy, x, k, need_k=False)
    none2, dk_only = C.launch_bwd(emu(ext), dy, x, k, need_x=False)
    assert none is None and none2 is None and torch.equal(dx_only, dx) and torch.equal(dk_only, dk)


def test_cuda_kernels_fp64_multipass_16385(ext):
    # L = 16385 (N = 2^15, plan N1 = 256, N2 = 128) against the O(L^2) definition itself
    x, k, dy = _inputs64(22, 1, 1, 16385)
    refs = (ref.fftconv(to_np(x), to_np(k)), *ref.fftconv_bwd(to_np(dy), to_np(x), to_np(k)))
    _check_kernels64(ext, x, k, dy, refs)


def test_cuda_kernels_fp64_multipass_2_pow_17_plus_3(ext):
    # N = 2^18 (plan N1 = N2 = 512), forward and backward
    x, k, dy = _inputs64(23, 1, 1, 2**17 + 3)
    _check_kernels64(ext, x, k, dy)


def test_cuda_kernels_fp64_twiddles_accurate_to_double(ext):
    # the multi-pass twiddles e^{+-i pi a / 2^s} in double: a / 2^s is exact for every 32-bit a, so
    # one sincospi. A twiddle rounded through fp32 anywhere (angle or value) would be off by ~1e-8.
    g = np.random.default_rng(1)
    s = 24
    a = np.concatenate([g.integers(0, 2**25, 2000), [0, 1, 2**24 - 1, 2**24, 2**25 - 1]]).astype(np.uint32)
    for sign in (-1.0, 1.0):
        out = torch.view_as_real(C.twiddle_probe(emu(ext), torch.from_numpy(a), s, sign, F64))
        # exact reference: the angle's fraction of a turn is reduced in integers first
        red = (a.astype(np.int64) % 2**(s + 1)).astype(np.float64) / 2.0**s
        want = np.exp(1j * sign * np.pi * red)
        err = np.abs(to_np(out[:, 0]) + 1j * to_np(out[:, 1]) - want).max()
        print(f"double twiddles, sign {sign:+}: max |err| {err:.2e}")
        assert err < 1e-15


# ------------------------------------------------------------------------------------------------
# arguments: validation, and what each backend refuses
# ------------------------------------------------------------------------------------------------

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
    (dict(x=torch.randn(1, 2, 8), k=torch.randn(2, 9), backend="triton"), ValueError, r"k must have shape \(D, L\)"),
])
def test_bad_inputs(bad, exc, match):
    args = dict(x=torch.randn(2, 3, 5), k=torch.randn(3, 5))
    args.update(bad)
    backend = args.pop("backend", "auto")
    with pytest.raises(exc, match=match):
        fftconv(**args, backend=backend)


def test_triton_refuses_what_it_cannot_run():
    with pytest.raises(Exception, match="x has dtype torch.float16"):
        fftconv(torch.randn(1, 2, 8, dtype=F16), torch.randn(2, 8), backend="triton")
    with pytest.raises(Exception, match="x has dtype torch.float64"):
        fftconv(torch.randn(1, 2, 8, dtype=F64), torch.randn(2, 8, dtype=F64), backend="triton")
    L = conv_triton.MAX_LENGTH + 1
    why = conv_triton.not_supported_reasons(x=torch.zeros(1, 1, L), k=torch.zeros(1, L))
    assert any(f"L = {L} > {conv_triton.MAX_LENGTH}" in r for r in why)


def test_cuda_accepts_long_l_and_names_the_limit(emulated):
    impl = emulated["fftconv"]
    assert impl.not_supported_reasons(torch.zeros(1, 1, 20000), torch.zeros(1, 20000)) == []
    huge = torch.zeros(1).expand(1, 1, 2**27 + 1)  # no memory behind it
    why = " ".join(impl.not_supported_reasons(huge, torch.zeros(1).expand(1, 2**27 + 1)))
    assert "L <= 134217728" in why and "backend='torch'" in why


def test_cuda_fp64_reasons(emulated):
    impl = emulated["fftconv"]
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
