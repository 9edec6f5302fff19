"""Every kernel instantiation of the package, as NVRTC name expressions.

* :func:`described_kernels`: the ``KERNELS`` lists of the ops whose CUDA path is a launch
  description (``ops/<op>/cuda_impl.py``); the emulator build (cuda/build.py) registers them for
  launch by name and the GPU runtime compiles them with NVRTC on first use.
* :data:`LAUNCHER_KERNELS`: the instantiations the compiled launchers of the other ops
  (``*.cu``, through ``megalodon_kernels.cuda._C``) select, as the ``MK_DISPATCH`` /
  ``flash::dispatch`` switches there give them; listed here so that
  ``python -m megalodon_kernels.cuda compile`` checks every kernel with NVRTC too.
"""
from __future__ import annotations

import importlib

from .launch import Kernel

#: the ops whose CUDA path is a launch description (ops/<op>/cuda_impl.py with KERNELS)
DESCRIBED_OPS = ("rotary", "timestep_norm", "cema_kernel", "ema_hidden", "fftconv", "dropkey_softmax")


def _launcher_kernels() -> list[Kernel]:
    out = []
    add = lambda header, names: out.extend(Kernel(header, n) for n in names)  # noqa: E731
    for e in ("cutlass::bfloat16_t", "cutlass::half_t"):
        for d in (64, 128, 256):
            fwd, bwd = f"mk::flash::FwdCfg<{e}, {d}>", f"mk::flash::BwdCfg<{e}, {d}>"
            add("flash_attention.cuh", [f"mk::flash::flash_fwd_kernel<{fwd}>",
                                        f"mk::flash::flash_bwd_kv_kernel<{bwd}, mk::flash::Grad::kDV>",
                                        f"mk::flash::flash_bwd_kv_kernel<{bwd}, mk::flash::Grad::kDK>",
                                        f"mk::flash::flash_bwd_q_kernel<{bwd}>"])
    return out


LAUNCHER_KERNELS = _launcher_kernels()


def described_kernels() -> list[Kernel]:
    """[Kernel] over DESCRIBED_OPS, in order, without duplicates."""
    out = []
    for op in DESCRIBED_OPS:
        for k in importlib.import_module(f"megalodon_kernels.ops.{op}.cuda_impl").KERNELS:
            if k not in out:
                out.append(k)
    return out


def all_kernels() -> list[Kernel]:
    """Every instantiation: the launch descriptions' and the compiled launchers'."""
    return described_kernels() + LAUNCHER_KERNELS
