"""The device models the tests run under: tl.dot in Triton's interpreter (tests/device_model.py) and
the CUDA emulator's math library and FMA contraction (cuda/emu/device_math.h, cuda/build.py).

* the TF32 rounding itself (ties, modes, NaN) and the error magnitudes it implies: a TF32 product
  is ~2**-11 relative off per operand, tf32x3 recovers ~fp32, ieee is exact;
* the interpreter hook follows the kernel's actual ``input_precision`` and Triton's default for
  fp32 operands (TF32, checked in the interpreter and in the compiled TTIR for sm_80), and can be
  turned off per test;
* a deliberately wrong kernel (an fp32 ``tl.dot`` left at the default precision) is caught by the
  fp32 tolerance, while the same kernel with "ieee" or "tf32x3" passes;
* the emulator is built with FMA contraction and its math functions stay within (and use) the
  documented error bounds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import device_model as dm
from support import assert_close, tol

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


# ------------------------------------------------------------------------------------------------
# TF32 rounding
# ------------------------------------------------------------------------------------------------

def test_tf32_rounding_modes_and_ties():
    one = np.float32(1.0)
    half_ulp = np.float32(2.0 ** -11)  # half a TF32 ulp at 1
    x = np.array([one + half_ulp, one + 3 * half_ulp, one + half_ulp * np.float32(1.5), -(one + half_ulp),
                  np.float32(2.0 ** -11 * (1 + 2.0 ** -12)), np.nan, np.inf, -np.inf, 0.0], dtype=np.float32)
    rne = dm.tf32_round(x, "rne")
    np.testing.assert_array_equal(rne[:5], [1.0, 1.0 + 2.0 ** -9, 1.0 + 2.0 ** -10, -1.0, 2.0 ** -11])
    assert np.isnan(rne[5]) and rne[6] == np.inf and rne[7] == -np.inf and rne[8] == 0.0
    rna = dm.tf32_round(x[:4], "rna")  # ties away from zero
    np.testing.assert_array_equal(rna, [1.0 + 2.0 ** -10, 1.0 + 2.0 ** -9, 1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10)])
    np.testing.assert_array_equal(dm.tf32_round(x[:3], "rz"), [1.0, 1.0 + 2.0 ** -10, 1.0])
    # every result has at most 10 stored mantissa bits, and the error is at most half a TF32 ulp
    r = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    t = dm.tf32_round(r)
    assert not np.any(t.view(np.uint32) & np.uint32(0x1FFF))
    relerr = np.abs(t.astype(np.float64) - r) / np.abs(r)
    print(f"TF32 RNE: max relative rounding error {relerr.max():.3e} (2**-11 = {2.0 ** -11:.3e})")
    assert 0.9 * 2.0 ** -11 < relerr.max() <= 2.0 ** -11


def test_tf32x3_split_recovers_fp32():
    r = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    hi, lo = dm.tf32_split(r)
    assert not np.any(hi.view(np.uint32) & np.uint32(0x1FFF)) and not np.any(lo.view(np.uint32) & np.uint32(0x1FFF))
    relerr = np.abs((hi.astype(np.float64) + lo) - r) / np.abs(r)
    print(f"tf32x3 split: max relative error of hi + lo {relerr.max():.3e}")
    assert relerr.max() <= 2.0 ** -21  # the tail keeps 11 of the remaining 13 bits


# ------------------------------------------------------------------------------------------------
# The interpreter hook, through real kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                   PREC: tl.constexpr):
    o_m = tl.arange(0, M)
    o_k = tl.arange(0, K)
    o_n = tl.arange(0, N)
    b_a = tl.load(a_ptr + o_m[:, None] * K + o_k[None, :])  # [M, K]
    b_b = tl.load(b_ptr + o_k[:, None] * N + o_n[None, :])  # [K, N]
    if PREC == "default":
        b_c = tl.dot(b_a, b_b)  # no input_precision: Triton's default for fp32 operands
    else:
        b_c = tl.dot(b_a, b_b, input_precision=PREC)
    tl.store(c_ptr + o_m[:, None] * N + o_n[None, :], b_c)


def _matmul(a: torch.Tensor, b: torch.Tensor, prec: str) -> torch.Tensor:
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32)
    _matmul_kernel[(1,)](a, b, c, M, K, N, prec)
    return c


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


@pytest.mark.parametrize("prec", ["default", "tf32", "tf32x3", "ieee"])
def test_dot_rounds_operands_per_input_precision(prec):
    """a @ I through the kernel returns a's operand exactly as the tensor core sees it."""
    a = _randn(32, 16)
    eye = torch.eye(16)
    before = dict(dm.calls)
    out = _matmul(a, eye, prec).numpy()
    expected_prec = "tf32" if prec == "default" else prec
    assert dm.calls.get(expected_prec, 0) == before.get(expected_prec, 0) + 1
    an = a.numpy()
    if expected_prec == "tf32":
        np.testing.assert_array_equal(out, dm.tf32_round(an))
        assert not np.array_equal(out, an)
    elif prec == "tf32x3":
        hi, lo = dm.tf32_split(an)
        np.testing.assert_array_equal(out, (lo + hi).astype(np.float32))
        assert np.max(np.abs(out - an) / np.abs(an)) <= 2.0 ** -21
    else:
        np.testing.assert_array_equal(out, an)


def test_dot_error_magnitudes():
    """Norm-wise error of a 64 x 64 x 64 product against float64: TF32 ~2**-11 relative per operand,
    tf32x3 and ieee at fp32 rounding level."""
    a, b = _randn(64, 64, seed=1), _randn(64, 64, seed=2)
    ref = a.double() @ b.double()
    errs = {}
    for prec in ("tf32", "tf32x3", "ieee"):
        out = _matmul(a, b, prec).double()
        errs[prec] = float((out - ref).abs().max() / ref.abs().max())
    # elementwise: |err| <= sum_k |a_ik b_kj| (2 * 2**-11 + fp32 accumulation)
    bound = float(((a.double().abs() @ b.double().abs()) / ref.abs().max()).max()) * (2 * 2.0 ** -11 + 64 * 2.0 ** -24)
    print({k: f"{v:.2e}" for k, v in errs.items()}, f"TF32 bound {bound:.2e}")
    assert 1e-4 < errs["tf32"] <= bound
    assert errs["tf32x3"] < 2e-6 and errs["ieee"] < 2e-6
    assert errs["tf32"] > 100 * errs["tf32x3"]


def test_half_precision_operands_are_exact_products():
    a, b = _randn(16, 32, seed=3).half(), _randn(32, 16, seed=4).half()
    out = _matmul(a, b, "tf32")  # input_precision does not apply to fp16 operands
    ref = a.double() @ b.double()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_default_fp32_dot_precision_is_tf32_in_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    seen = []
    from triton.runtime.interpreter import InterpreterBuilder

    modelled = InterpreterBuilder.create_dot

    def spy(self, a, b, d, input_precision, max_num_imprecise_acc):
        seen.append(dm._precision_name(input_precision))
        return modelled(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", spy)
    _matmul(_randn(16, 16), _randn(16, 16, seed=1), "default")
    assert seen == ["tf32"]


_AOT_SCRIPT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def k(a_ptr, b_ptr, c_ptr):
    o = tl.arange(0, 16)
    b_a = tl.load(a_ptr + o[:, None] * 16 + o[None, :])
    b_b = tl.load(b_ptr + o[:, None] * 16 + o[None, :])
    tl.store(c_ptr + o[:, None] * 16 + o[None, :], tl.dot(b_a, b_b))

src = ASTSource(k, signature={"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32"})
print(triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}).asm["ttir"])
"""


def test_default_fp32_dot_precision_is_tf32_on_the_gpu(tmp_path):
    """What the GPU compiler does with a tl.dot that names no precision: the TTIR for sm_80 says tf32
    (compiled in a fresh process: kernels defined under TRITON_INTERPRET=1 cannot be compiled)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "aot_default_dot.py"
    script.write_text(_AOT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_F32_DEFAULT")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"cannot compile for sm_80 here: {proc.stderr[-500:]}")
    dots = [line.strip() for line in proc.stdout.splitlines() if "tt.dot" in line]
    print("\n".join(dots))
    assert dots and all("inputPrecision = tf32 " in line + " " for line in dots)


def test_model_can_be_turned_off(exact_tl_dot):
    a = _randn(32, 16)
    out = _matmul(a, torch.eye(16), "tf32").numpy()
    np.testing.assert_array_equal(out, a.numpy())  # the interpreter's exact product


@pytest.mark.exact_tl_dot
def test_model_can_be_turned_off_by_marker():
    a = _randn(32, 16)
    np.testing.assert_array_equal(_matmul(a, torch.eye(16), "default").numpy(), a.numpy())


# ------------------------------------------------------------------------------------------------
# A deliberately wrong kernel is caught
# ------------------------------------------------------------------------------------------------

@triton.jit
def _scores_kernel(q_ptr, k_ptr, o_ptr, scale, L: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """Softmax-normalised attention scores of one [L, D] block, the kind of fp32 kernel that
    forgets input_precision: exact in the interpreter, TF32 on every GPU."""
    o_l = tl.arange(0, L)
    o_d = tl.arange(0, D)
    b_q = tl.load(q_ptr + o_l[:, None] * D + o_d[None, :])  # [L, D]
    b_k = tl.load(k_ptr + o_l[:, None] * D + o_d[None, :])  # [L, D]
    if PREC == "default":
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [L, L]  the bug: fp32 operands, no input_precision
    else:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    b_s = b_s - tl.max(b_s, axis=1)[:, None]
    b_p = tl.exp(b_s)
    b_p = b_p / tl.sum(b_p, axis=1)[:, None]
    tl.store(o_ptr + o_l[:, None] * L + o_l[None, :], b_p)


def _scores(prec):
    L, D = 64, 64
    q, k = _randn(L, D, seed=5) * 2, _randn(L, D, seed=6) * 2
    out = torch.empty(L, L)
    _scores_kernel[(1,)](q, k, out, 1.0 / np.sqrt(D), L, D, prec)
    s = (q.double() @ k.double().T) / np.sqrt(D)
    ref = torch.softmax(s, dim=-1)
    return out, ref


def test_wrong_kernel_is_caught_by_the_fp32_tolerance():
    out, ref = _scores("default")
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    print(f"default-precision fp32 tl.dot: error {err:.2e} relative to max|ref|")
    assert err > 1e-4  # the TF32 error the GPU would make: orders of magnitude above fp32
    with pytest.raises(AssertionError, match="relative error"):
        assert_close("scores (default precision)", out, ref, tol("triton", torch.float32, "fwd", op="attention"))


@pytest.mark.parametrize("prec", ["ieee", "tf32x3"])
def test_fixed_kernel_passes(prec):
    out, ref = _scores(prec)
    assert_close(f"scores ({prec})", out, ref, tol("triton", torch.float32, "fwd", op="attention"))


def test_wrong_kernel_passes_without_the_model(exact_tl_dot):
    """Why the model exists: with the interpreter's exact dots the bug is invisible."""
    out, ref = _scores("default")
    assert_close("scores (default precision, exact interpreter)", out, ref,
                 tol("triton", torch.float32, "fwd", op="attention"))


# ------------------------------------------------------------------------------------------------
# The CUDA emulator's device model
# ------------------------------------------------------------------------------------------------

def test_emulator_is_built_with_fma_contraction():
    from megalodon_kernels.cuda import build

    assert "-ffp-contract=fast" in build.CXXFLAGS
    if " fma " in open("/proc/cpuinfo").read().replace("\n", " "):
        assert "-mfma" in build.CXXFLAGS


_MATH_PROBE = r"""
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include "emu/device_math.h"

static long ulps(float a, float b) {  // signed distance in representable steps (same sign, finite)
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = INT32_MIN - ia;
  if (ib < 0) ib = INT32_MIN - ib;
  return static_cast<long>(ia) - static_cast<long>(ib);
}
static long ulps_d(double a, double b) {
  std::int64_t ia, ib;
  std::memcpy(&ia, &a, 8);
  std::memcpy(&ib, &b, 8);
  if (ia < 0) ia = INT64_MIN - ia;
  if (ib < 0) ib = INT64_MIN - ib;
  return static_cast<long>(ia - ib);
}
struct Stat { long max = 0, moved = 0, n = 0; };
static void add(Stat& s, long d) { d = d < 0 ? -d : d; s.max = d > s.max ? d : s.max; s.moved += d != 0; s.n += 1; }

int main() {
  Stat e, l, ec, r, sp, cp, ed, sd, fd;
  std::uint32_t state = 12345u;
  auto uni = [&]() { state = state * 1664525u + 1013904223u; return (state >> 8) * (1.0f / 16777216.0f); };
  for (int i = 0; i < 200000; ++i) {
    const float x = (uni() * 2 - 1) * 80.0f, p = uni() * 1e4f + 1e-3f, t = (uni() * 2 - 1) * 8.0f;
    add(e, ulps(mk::expf(x), static_cast<float>(std::exp(static_cast<double>(x)))));
    add(l, ulps(mk::logf(p), static_cast<float>(std::log(static_cast<double>(p)))));
    add(ec, ulps(mk::erfcf(t), static_cast<float>(std::erfc(static_cast<double>(t)))));
    add(r, ulps(rsqrtf(p), static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)))));
    float s, c;
    sincospif(t, &s, &c);
    add(sp, ulps(s, static_cast<float>(mk_emu::devmath::sinpi_exact(t))));
    add(cp, ulps(c, static_cast<float>(mk_emu::devmath::cospi_exact(t))));
    add(fd, ulps(__fdividef(x, p), static_cast<float>(static_cast<double>(x) / p)));
    const double xd = static_cast<double>(x) * 1.000000123;
    add(ed, ulps_d(mk::exp(xd), static_cast<double>(std::exp(static_cast<long double>(xd)))));
    double sdv, cdv;
    const double td = static_cast<double>(t) * 1.000000123;
    sincospi(td, &sdv, &cdv);
    add(sd, ulps_d(sdv, static_cast<double>(mk_emu::devmath::sinpi_exact(td))));
  }
  std::printf("expf %ld %ld %ld\nlogf %ld %ld %ld\nerfcf %ld %ld %ld\nrsqrtf %ld %ld %ld\n", e.max, e.moved, e.n,
              l.max, l.moved, l.n, ec.max, ec.moved, ec.n, r.max, r.moved, r.n);
  std::printf("sinpif %ld %ld %ld\ncospif %ld %ld %ld\n__fdividef %ld %ld %ld\nexp %ld %ld %ld\nsinpi %ld %ld %ld\n",
              sp.max, sp.moved, sp.n, cp.max, cp.moved, cp.n, fd.max, fd.moved, fd.n, ed.max, ed.moved, ed.n,
              sd.max, sd.moved, sd.n);
  float s, c;
  sincospif(0.5f, &s, &c);
  // the exact reduction: sin(pi x) at x = 1 - 2^-20 is sin(pi 2^-20) (the zero of sin is not lost)
  const double near1 = static_cast<double>(mk_emu::devmath::sinpi_exact(1.0 - 0x1.0p-20));
  const double small = static_cast<double>(std::sin(3.14159265358979323846264338327950288L * 0x1.0p-20L));
  const bool exact = mk::expf(0.0f) == 1.0f && mk::logf(1.0f) == 0.0f && s == 1.0f && c == 0.0f &&
                     mk::expf(1.5f) == mk::expf(1.5f) && near1 == small;
  std::printf("exact_cases %d\n", exact ? 1 : 0);
}
"""

#: documented maximum ulp errors (CUDA C++ Programming Guide, Mathematical Functions appendix)
_MATH_BOUNDS = {"expf": 2, "logf": 1, "erfcf": 4, "rsqrtf": 2, "sinpif": 1, "cospif": 1, "__fdividef": 2,
                "exp": 1, "sinpi": 1}


def test_emulator_math_within_documented_bounds_and_used(tmp_path):
    """Every modelled function differs from the correctly rounded result by at most its documented
    bound, uses that room (a model that never perturbs would hide nothing), and keeps the exact cases."""
    import shutil
    import subprocess

    from megalodon_kernels.cuda import build

    cxx = shutil.which(build.CXX)
    if cxx is None:
        pytest.skip(f"no {build.CXX}")
    src, exe = tmp_path / "probe.cpp", tmp_path / "probe"
    src.write_text(_MATH_PROBE)
    subprocess.run([cxx, "-std=c++20", "-O1", *build.FMA_FLAGS, f"-I{build.CUDA_DIR}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    rows = dict(line.split(" ", 1) for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                              text=True).stdout.splitlines())
    print(rows)
    assert rows.pop("exact_cases") == "1"
    for name, bound in _MATH_BOUNDS.items():
        worst, moved, n = (int(v) for v in rows[name].split())
        assert worst <= bound, f"{name}: {worst} ulp > documented {bound}"
        assert worst == bound and moved > n // 4, f"{name}: the model is not perturbing ({worst} ulp, {moved}/{n})"
