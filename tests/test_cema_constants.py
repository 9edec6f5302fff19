"""The Python mirror of cuda/cema.cuh's sizes (ops/cema_kernel/cuda_impl.py plans every launch
from it) equals the C++: each constant is pinned by a ``static_assert`` that NVRTC compiles
against the header itself, so a change on one side alone fails here."""
import pytest
import torch

from megalodon_kernels.cuda import nvrtc
from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda


def _pins() -> dict[str, int]:
    """C++ constant expression -> the value the Python side uses for it."""
    pins = {
        "mk::cema::kThreads": cema_cuda.THREADS,
        "mk::cema::kFinishThreads": cema_cuda.FINISH_THREADS,
        "mk::cema::kMaxN": cema_cuda.MAX_N,
        "mk::cema::kTableSize": cema_cuda.TABLE_SIZE,
        "mk::cema::kSynRowsMax": cema_cuda.SYN_ROWS_MAX,
    }
    for real, (cpp, ana_rows, syn_q2) in cema_cuda.REAL.items():
        pins[f"mk::cema::Real<{cpp}>::kAnaRows"] = ana_rows
        pins[f"mk::cema::Real<{cpp}>::kSynQ2"] = syn_q2
    return pins


def _compile(pins: dict[str, int]) -> None:
    """Compile cema.cuh with one static_assert per pin (NvrtcError names the failing ones)."""
    try:
        binding = nvrtc.nvrtc_binding()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC is not available here: {exc}")
    source = f'#include "{cema_cuda.HEADER}"\n' + "".join(
        f'static_assert({expr} == {value}, "{expr} != {value} (the Python mirror)");\n' for expr, value in pins.items())
    opts = [f"-arch=sm_{min(nvrtc.supported_archs(), key=lambda a: abs(a - 80))}", "-std=c++20", "-default-device",
            f"-I{nvrtc.CUDA_DIR}", *(f"-I{d}" for d in nvrtc.include_dirs())]
    prog = binding.createProgram(source, "cema_constants.cu", [], [])
    try:
        try:
            binding.compileProgram(prog, opts)
        except binding.NVRTCError:
            raise nvrtc.NvrtcError(binding.getProgramLog(prog)) from None
    finally:
        binding.destroyProgram(prog)


def test_python_sizes_equal_the_header():
    _compile(_pins())


def test_a_wrong_mirror_fails():
    # the check can fail: one constant off by one
    pins = _pins()
    pins["mk::cema::kThreads"] += 1
    with pytest.raises(nvrtc.NvrtcError, match="kThreads"):
        _compile(pins)


def test_every_real_type_is_pinned():
    assert {cpp for cpp, *_ in cema_cuda.REAL.values()} == {"float", "double"}
    assert set(cema_cuda.REAL) == {torch.float32, torch.float64}
