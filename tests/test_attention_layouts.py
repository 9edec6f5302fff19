"""The facts attention states in more than one language, pinned to one another:

* the Laplace constants: ops/attention/laplace.py (torch and Triton read it), their copies in
  cuda/flash_attention.cuh (kLaplace*) and reference/attention.py (a reference imports NumPy only);
* the Python mirrors of the flash kernels' C++ in ops/attention/cuda_impl.py: ``FlashParams``
  against ``mk::flash::Params`` (sizeof, every field's offsetof), ``fwd/bwd_smem_bytes``
  against ``FwdSmem/BwdSmem::bytes``, and the tile and thread counts against ``FwdCfg/BwdCfg``,
  for every instantiated (element, head dim);
* ops/dropkey_softmax/cuda_impl.py's ITEMS and MAX_THREADS (its launch plan) against
  cuda/dropkey_softmax.cuh's kSoftmaxItems and kSoftmaxMaxThreads (the kernels' registers and
  __launch_bounds__).

The C++ side is checked by the host compiler with the emulator build's flags: a probe source of
static_asserts generated from the Python values, compiled with -fsyntax-only (a failure names the
fact and shows both values). The probe's outcome is a pure function of its text, the cuda/
headers, the flags and the compiler, so a pass is remembered under their digest in the emulator
build's cache directory and not recompiled until one of them changes.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import subprocess

import numpy as np
import pytest

from megalodon_kernels.ops.attention import cuda_impl, laplace
from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda
from megalodon_kernels.reference import attention as ref

LAPLACE_CPP = {"kLaplaceMu": laplace.MU, "kLaplaceInv": laplace.INV, "kLaplacePdf": laplace.PDF,
               "kLaplaceHalfInvVar": laplace.HALF_INV_VAR}


def test_reference_laplace_constants_are_the_ops():
    assert ref.LAPLACE_MU == laplace.MU and ref.LAPLACE_SIGMA == laplace.SIGMA
    x = np.linspace(-3.0, 3.0, 13)
    np.testing.assert_allclose(ref.laplace(x), [0.5 * math.erfc(-(t - laplace.MU) * laplace.INV) for t in x],
                               rtol=1e-13)  # erfc's far tail: its argument computed two ways
    np.testing.assert_allclose(ref.laplace_grad(x), laplace.PDF * np.exp(-(x - laplace.MU) ** 2 * laplace.HALF_INV_VAR),
                               rtol=1e-14)


def _f32(x: float) -> str:
    """x rounded to float32, as a C++ float literal that reads back to exactly that float."""
    return f"{float(np.float32(x))!r}f"


def probe_source() -> str:
    """static_asserts of every mirrored fact, generated from the Python values."""
    lines = ['#include "flash_attention.cuh"', '#include "dropkey_softmax.cuh"', "#include <cstddef>",
             "namespace F = mk::flash;", "",
             f'static_assert(mk::kSoftmaxItems == {dropkey_cuda.ITEMS}, "dropkey_softmax ITEMS");',
             f'static_assert(mk::kSoftmaxMaxThreads == {dropkey_cuda.MAX_THREADS}, "dropkey_softmax MAX_THREADS");']
    for name, value in LAPLACE_CPP.items():
        lines.append(f'static_assert(F::{name} == {_f32(value)}, "{name} != ops/attention/laplace.py");')
    lines.append(f"static_assert(sizeof(F::Params) == {ctypes.sizeof(cuda_impl.FlashParams)}, "
                 f'"sizeof(Params) != ctypes.sizeof(FlashParams)");')
    for field, _ in cuda_impl.FlashParams._fields_:
        offset = getattr(cuda_impl.FlashParams, field).offset
        lines.append(f'static_assert(offsetof(F::Params, {field}) == {offset}, "offsetof(Params, {field})");')
    for element, D in [*cuda_impl.FLASH, *cuda_impl.EMULATOR_FLASH]:
        fwd, bwd = f"F::FwdCfg<{element}, {D}>", f"F::BwdCfg<{element}, {D}>"
        where = f"{element}, D = {D}"
        lines += [
            f'static_assert(F::FwdSmem<{fwd}>::bytes == {cuda_impl.fwd_smem_bytes(element, D)}, '
            f'"fwd_smem_bytes({where})");',
            f'static_assert(F::BwdSmem<{bwd}>::bytes == {cuda_impl.bwd_smem_bytes(element, D)}, '
            f'"bwd_smem_bytes({where})");',
            f'static_assert({fwd}::DV == {cuda_impl.fwd_dv_tile(D)}, "fwd_dv_tile({where})");',
            f'static_assert({bwd}::DV == {cuda_impl.bwd_dv_tile(D)}, "bwd_dv_tile({where})");',
            f'static_assert({fwd}::NT == {cuda_impl.FWD_THREADS}, "FWD_THREADS ({where})");',
            f'static_assert({bwd}::NT == {cuda_impl.bwd_threads(D)}, "bwd_threads({where})");',
            f'static_assert({fwd}::BM == {cuda_impl.BM} && {fwd}::BN == {cuda_impl.BN} && {bwd}::BM == {cuda_impl.BM} '
            f'&& {bwd}::BN == {cuda_impl.BN}, "BM, BN ({where})");',
        ]
    return "\n".join(lines) + "\n"


def test_probe_covers_every_field_and_instantiation():
    src = probe_source()
    assert src.count("offsetof(F::Params,") == len(cuda_impl.FlashParams._fields_) == 22
    assert src.count("F::FwdSmem<") == len(cuda_impl.FLASH) + len(cuda_impl.EMULATOR_FLASH) == 9


def test_python_mirrors_match_the_cpp(tmp_path):
    from megalodon_kernels.cuda import build

    flags = build._emulator_cute_flags()  # CuTe and CCCL headers, as the emulator build finds them
    if not flags:
        pytest.skip("no CuTe/CCCL headers here: the emulator cannot build the flash kernels either")
    source = probe_source()
    cmd = [build.CXX, *build.CXXFLAGS, "-x", "c++", f"-I{build.CUDA_DIR}", *flags, "-fsyntax-only"]
    digest = hashlib.sha256(source.encode())
    for path in sorted(build.CUDA_DIR.rglob("*")):
        if path.is_file() and path.suffix in (".cuh", ".h", ".hpp"):
            digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(cmd).encode())
    digest.update(subprocess.run([build.CXX, "--version"], capture_output=True, text=True).stdout.encode())
    stamp = build.cache_dir() / f"attention-layouts-{digest.hexdigest()[:24]}.passed"
    if stamp.exists():
        return
    probe = tmp_path / "probe.cpp"
    probe.write_text(source)
    done = subprocess.run([*cmd, str(probe)], capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line or "reduces to" in line]
    assert done.returncode == 0, "\n".join(errors) or done.stderr[-4000:]
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(source)
