"""Device model of ``tl.dot`` for Triton's interpreter: operands rounded as the tensor cores round them.

Triton's interpreter (``TRITON_INTERPRET=1``) evaluates ``tl.dot`` as an exact fp32 matrix product
whatever ``input_precision`` says, while on the GPU fp32 operands go through the tensor cores:

* ``"tf32"`` (Triton's default for fp32 operands): each operand is rounded to TF32 (8-bit exponent,
  10 stored mantissa bits; modelled as round-to-nearest-even of the fp32 value), the products of
  two TF32 values are exact in fp32, and they accumulate in fp32. Relative error per operand up to
  2**-11, so a product of order-1 values is off by ~1e-3 relative.
* ``"tf32x3"``: each fp32 operand x is split into a TF32 head hi = rna(x) (``cvt.rna.tf32.f32``:
  to nearest, ties away from zero, as Triton emits it) and a tail lo = x - hi (exact in fp32), which
  the next tensor-core product rounds to TF32 again; Triton's F32DotTC pass sums lo_a*hi_b and
  hi_a*lo_b, zeroes a NaN there (the tails of infinite operands), adds hi_a*hi_b, then the
  accumulator, and drops lo_a*lo_b: ~2**-22 relative per product.
* ``"ieee"``: fp32 FMA products, exact as the interpreter computes them.
* fp16 / bf16 operands: exact products, fp32 accumulation (bf16 values, which the interpreter holds
  as raw bits, are widened to fp32 here); fp8 operands as the interpreter converts them.

The model replaces ``InterpreterBuilder.create_dot`` (triton/runtime/interpreter.py). As a pytest
plugin (``pytest_plugins = ["device_model"]`` in tests/conftest.py) it is on for every test; a test
that wants the interpreter's exact dots takes the ``exact_tl_dot`` fixture or carries the
``exact_tl_dot`` marker. Outside pytest::

    python tests/device_model.py bench/accuracy_fftconv.py --backend triton ...

runs a script (with its arguments) under the model. The CUDA emulator has its own device model,
compiled in (cuda/emu/device_math.h and the FMA contraction flags of cuda/build.py).
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

#: the precision names as Triton's IR enum prints them (INPUT_PRECISION.TF32 etc.)
PRECISIONS = ("tf32", "tf32x3", "ieee")


# ------------------------------------------------------------------------------------------------
# TF32 rounding (NumPy, on the fp32 bit pattern)
# ------------------------------------------------------------------------------------------------

_KEEP = np.uint32(0xFFFFE000)   # sign, exponent and the 10 TF32 mantissa bits
_HALF = np.uint32(0xFFF)        # half a TF32 ulp, minus one
_TIE = np.uint32(0x1000)
_SHIFT = np.uint32(13)
_ONE = np.uint32(1)


def tf32_round(x: np.ndarray, mode: str = "rne") -> np.ndarray:
    """fp32 ``x`` rounded to TF32 (10 mantissa bits) and returned as fp32.

    ``mode``: "rne" (to nearest, ties to even), "rna" (to nearest, ties away from zero: PTX
    ``cvt.rna.tf32.f32``) or "rz" (truncation). NaN stays NaN; a value that rounds past the largest
    TF32 value becomes infinite, as a conversion does. (In-place integer steps: the model runs on
    every tl.dot of the test suite.)"""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    if mode == "rne":
        r = u >> _SHIFT
        r &= _ONE
        r += u
        r += _HALF
    elif mode == "rna":
        r = u + _TIE
    elif mode == "rz":
        r = u.copy()
    else:
        raise ValueError(f"mode must be 'rne', 'rna' or 'rz', got {mode!r}")
    r &= _KEEP
    out = r.view(np.float32)
    nan = x != x
    if nan.any():
        out[nan] = x[nan]
    return out


def tf32_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) of the tf32x3 decomposition: hi = rna(x), lo = x - hi (exact in fp32) rounded to TF32
    by the tensor core that consumes it."""
    x = np.asarray(x, dtype=np.float32)
    hi = tf32_round(x, "rna")
    with np.errstate(invalid="ignore"):
        lo = tf32_round((x - hi).astype(np.float32), "rne")
    return hi, lo


def _mm(a, b):
    return np.matmul(a, b, dtype=np.float32)


def device_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray, precision: str) -> np.ndarray:
    """``acc + a @ b`` for fp32 operands as the GPU's tensor cores compute it under ``precision``."""
    if precision == "ieee":
        return _mm(a, b) + acc
    if precision == "tf32":
        return _mm(tf32_round(a), tf32_round(b)) + acc
    if precision == "tf32x3":
        a_hi, a_lo = tf32_split(a)
        b_hi, b_lo = tf32_split(b)
        with np.errstate(invalid="ignore"):
            small = _mm(a_lo, b_hi) + _mm(a_hi, b_lo)
            nan = small != small  # inf operands: inf - inf tails
            if nan.any():
                small[nan] = 0
            return (small + _mm(a_hi, b_hi)) + acc
    raise ValueError(f"unknown input_precision {precision!r} (expected one of {PRECISIONS})")


# ------------------------------------------------------------------------------------------------
# The interpreter hook
# ------------------------------------------------------------------------------------------------

def _precision_name(p) -> str:
    name = getattr(p, "name", None) or str(p).rsplit(".", 1)[-1]
    return name.lower()


def _as_fp32(handle):
    """Operand data as fp32 when its Triton type is fp32 / fp16 / bf16, else None."""
    import triton.language as tl

    dt, data = handle.dtype, handle.data
    if dt == tl.float32:
        return data.astype(np.float32, copy=False)
    if dt == tl.float16:
        return data.astype(np.float32)
    if dt == tl.bfloat16:  # held as raw uint16/int16 bits by the interpreter
        if data.dtype.itemsize == 2 and data.dtype.kind in "ui":
            return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        return data.astype(np.float32)
    return None


#: counts of modelled dots by precision (for tests of the model and for reports)
calls: dict[str, int] = {}


def _make_create_dot(original):
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        fa, fb = _as_fp32(a), _as_fp32(b)
        if fa is None or fb is None or d.dtype != tl.float32 or a.dtype != b.dtype:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        precision = _precision_name(input_precision) if a.dtype == tl.float32 else "ieee"  # half types: exact
        calls[precision] = calls.get(precision, 0) + 1
        out = device_dot(fa, fb, d.data.astype(np.float32, copy=False), precision)
        return TensorHandle(out.astype(np.float32, copy=False), d.dtype.scalar)

    create_dot._device_model = True
    return create_dot


def _builder():
    from triton.runtime.interpreter import InterpreterBuilder

    return InterpreterBuilder


def installed() -> bool:
    return getattr(_builder().create_dot, "_device_model", False)


@contextlib.contextmanager
def tl_dot_model(enabled: bool = True):
    """Within the block, the interpreter's ``tl.dot`` follows the device model (``enabled``) or is
    the interpreter's own exact product (``enabled=False``); restored afterwards."""
    cls = _builder()
    saved = cls.__dict__["create_dot"]
    base = saved
    while getattr(base, "_device_model", False):
        base = base._original
    if enabled:
        patched = _make_create_dot(base)
        patched._original = base
        cls.create_dot = patched
    else:
        cls.create_dot = base
    try:
        yield
    finally:
        cls.create_dot = saved


# ------------------------------------------------------------------------------------------------
# pytest plugin
# ------------------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # used as a script without pytest
    pytest = None

if pytest is not None:
    def pytest_configure(config):
        config.addinivalue_line("markers", "exact_tl_dot: run the test with the Triton interpreter's exact "
                                           "tl.dot instead of the tensor-core device model")

    @pytest.fixture
    def exact_tl_dot():
        """Request this fixture (or mark the test ``exact_tl_dot``) to turn the tl.dot device model off."""
        return True

    @pytest.fixture(autouse=True)
    def _tl_dot_device_model(request):
        try:
            import triton.runtime.interpreter  # noqa: F401
        except ImportError:
            yield
            return
        off = "exact_tl_dot" in request.fixturenames or request.node.get_closest_marker("exact_tl_dot") is not None
        with tl_dot_model(enabled=not off):
            yield


def main(argv: list[str]) -> int:
    """``python tests/device_model.py SCRIPT [ARGS...]``: run SCRIPT under the tl.dot device model."""
    import runpy

    if not argv:
        print(main.__doc__)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script, *args = argv
    sys.argv = [script, *args]
    with tl_dot_model(True):
        print(f"[device model] tl.dot rounds per input_precision (interpreter); CUDA emulator: FMA contraction "
              f"+ device math ({os.path.basename(script)})", file=sys.stderr)
        runpy.run_path(script, run_name="__main__")
        print(f"[device model] modelled tl.dot calls by precision: {calls}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
