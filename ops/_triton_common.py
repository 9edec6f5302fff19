"""Shared pieces of every Triton backend: availability rules, interpreter-safe bf16 stores, and the
device functions more than one op's kernels call (complex multiply, short-range sin/cos, the
DropKey hash).

Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` (how the test
suite executes them here). In the interpreter bf16 values are raw uint16 bits, so kernels convert
to fp32 right after ``tl.load``, compute in fp32, and round to bf16 once, on store, with
round-to-nearest-even done in integer arithmetic (the interpreter's own ``.to(tl.bfloat16)``
truncates). On a GPU the same code compiles to the same rounding.
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

from ..cuda import device as cuda_device
from .dropkey_rule import MIX_M1, MIX_M2

# Pin fp fusion (Triton 3.9 warns that its default flips in 3.10; the flip changes numerics).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:  # triton is an optional dependency of the package
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAVE_TRITON = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def quiet_masked_lanes():
    """Around a launch whose kernel computes ``-inf - -inf`` or ``1 / 0`` in lanes it then discards
    with ``tl.where`` (fully masked softmax rows): on a GPU that is silent, but the interpreter
    evaluates every lane with NumPy, which warns. Silences those NumPy warnings for the launch,
    under the interpreter only."""
    if not interpreting():
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(divide="ignore", invalid="ignore")


#: What each op's Triton kernels need from a GPU, from compiling every declared variant
#: (bench/triton_variants.py) ahead of time with Triton 3.9 (bench/aot.py; the committed reports
#: bench/results/aot_sm80.json, aot_sm90.json and aot_archs.json, which tests/test_triton_aot.py
#: checks this table against). Per op: whether its dots use TF32 tensor cores (input_precision
#: "tf32" / "tf32x3": sm_80 and newer; on sm_75 Triton lowers them to FMA loops that spill
#: 0.2-4.4 KB per thread and need more shared memory than the 64 KB a T4 block may have), and the
#: most shared memory (bytes) one block of any of its kernels asks for, per code-generation family.
TRITON_NEEDS = {
    "attention": (True, {80: 82944, 90: 98304, 100: 131104}),
    "cema": (True, {80: 30720, 90: 30720, 100: 34824}),
    "cema_kernel": (False, {75: 16384, 80: 16384, 90: 16384, 100: 16384}),
    "dropkey_softmax": (False, {75: 128, 80: 128, 90: 128, 100: 128}),
    "ema_hidden": (False, {75: 16384, 80: 16640, 90: 16640, 100: 16640}),
    "fftconv": (True, {80: 20480, 90: 20480, 100: 34824}),
    "rotary": (False, {75: 2048, 80: 2048, 90: 2048, 100: 2048}),
    "timestep_norm": (False, {75: 4096, 80: 4096, 90: 4096, 100: 4096}),
}
#: Triton's code-generation family of each architecture: sm_86/87/89/120/121 get sm_80's pipelines
#: (stages - 1 shared buffers, mma.sync) and the same shared memory figures; sm_103/110 get sm_100's.
TRITON_FAMILY = {75: 75, 80: 80, 86: 80, 87: 80, 89: 80, 90: 90, 100: 100, 103: 100, 110: 100, 120: 80, 121: 80}
#: the oldest architecture with TF32 tensor cores
TF32_ARCH = 80


def arch_reasons(op: str, device: torch.device) -> list[str]:
    """Why ``op``'s Triton kernels cannot run on CUDA ``device`` (its capabilities from
    cuda/device.py: real, or a faked profile), from :data:`TRITON_NEEDS`."""
    caps = cuda_device.caps(device)
    tf32, smem = TRITON_NEEDS[op]
    family = TRITON_FAMILY.get(caps.arch)
    if family is None:
        return [f"{caps.name} ({caps.sm}): the {op} Triton kernels were not compiled and checked for this "
                f"architecture (checked: {', '.join(f'sm_{a}' for a in TRITON_FAMILY)}); use backend='cuda' or 'torch'"]
    if tf32 and caps.arch < TF32_ARCH:
        return [f"{caps.name} ({caps.sm}) has no TF32 tensor cores: Triton compiles the {op} kernels' dots to "
                f"FMA loops that spill registers and exceed its {caps.smem_per_block_optin} B of shared memory "
                "per block; use backend='cuda' or 'torch'"]
    need = smem.get(family)
    if need is None or need > caps.smem_per_block_optin:
        return [f"{caps.name} ({caps.sm}) allows {caps.smem_per_block_optin} B of shared memory per block; the {op} "
                f"Triton kernels need up to {need} B there; use backend='cuda' or 'torch'"]
    return []


class ReleasePrune(NamedTuple):
    """Launches that an older Triton release compiles to code that spills registers (or overflows
    shared memory) on a GPU, where the newest tested release compiles them clean; refused on the
    releases before ``below``. Either a config value (``config``: knob -> value, dropped from the
    op's candidate space by :func:`release_config_space`) or a launch of every config (``launch``:
    what :func:`release_reasons` is called with, e.g. the dtype and tile width)."""

    op: str
    below: tuple  # (major, minor): the first Triton release that compiles these launches clean
    variants: tuple  # (kernel, label) rows of the older release's AOT report that spill there
    why: str  # what spills, in words a user reads in not_supported_reasons / the candidate space
    config: dict | None = None
    launch: dict | None = None
    families: tuple = ()  # launch prunes: the code-generation families (TRITON_FAMILY) it spills on


_SPILL_36 = "spills registers to local memory on sm_90 (H100/H200) with Triton 3.6"
_SPILL_36_80 = ("spills registers to local memory on the sm_80 family (A100, A10, L4, RTX 30/40/50) with "
                "Triton 3.6")


#: From the committed AOT reports of each tested Triton release (bench/results/aot_sm80*.json,
#: aot_sm90*.json; tests/test_triton_aot.py checks this table against them): every variant that
#: spills or overflows with a tested release is pruned here for that release, and nothing else.
#: Triton 3.6 spills on sm_90 in the first three and on the sm_80 family in the last one (config
#: prunes cannot see the device, so direct_max_len=64 is left out everywhere on 3.6; each launch
#: prune applies to the families it spills on).
RELEASE_PRUNES: tuple = (
    ReleasePrune("fftconv", (3, 7), config={"direct_max_len": 64},
                 variants=(("_direct_bwd_kernel", "direct bwd x=fp32 L<=64"),
                           ("_direct_bwd_kernel", "direct bwd x=bf16 L<=64")),
                 why=f"the direct path's backward for 32 < L <= 64 {_SPILL_36} (128 B per thread); those "
                     "lengths take the FFT path instead"),
    ReleasePrune("timestep_norm", (3, 7), launch={"dtype": "bf16", "BLOCK_D": 256, "packed": True}, families=(90,),
                 variants=(("_timestep_norm_fwd_kernel", "fwd bf16 T=16 D=256 warps=8 packed"),),
                 why=f"the packed (cu_seqlens) bf16 forward for group sizes 65-256 {_SPILL_36} (8 B per thread)"),
    ReleasePrune("timestep_norm", (3, 7), launch={"dtype": "fp32", "BLOCK_D": 1024, "packed": True}, families=(90,),
                 variants=(("_timestep_norm_fwd_kernel", "fwd fp32 T=4 D=1024 warps=8 packed"),),
                 why=f"the packed (cu_seqlens) fp32 forward for group sizes 257-1024 {_SPILL_36} (8 B per thread)"),
    ReleasePrune("fftconv", (3, 7), launch={"path": "tile", "N": 2048, "dtype": "bf16"}, families=(80,),
                 variants=(("_tile_bwd_kernel", "tile bwd x=bf16 N=2048 warps=4"),),
                 why=f"the bf16 backward of the 2048-point FFT tile (512 < L <= 1024) {_SPILL_36_80} "
                     "(8 B per thread: one element of k's spectrum)"),
)


def triton_release() -> tuple | None:
    """(major, minor) of the installed Triton; None without Triton."""
    if not HAVE_TRITON:
        return None
    from .._versions import parse

    v = parse(triton.__version__)
    return v[:2] if v else None


def _applies(prune: ReleasePrune, op: str, release) -> bool:
    return prune.op == op and release is not None and tuple(release) < prune.below


def release_config_space(op: str, space: dict, release=None) -> dict:
    """``space`` ({knob: values}) without the values the running (or given) Triton release must
    not launch (:data:`RELEASE_PRUNES`); the first remaining value stays the default."""
    release = triton_release() if release is None else release
    out = {k: tuple(v) for k, v in space.items()}
    for p in RELEASE_PRUNES:
        if p.config and _applies(p, op, release):
            for knob, value in p.config.items():
                out[knob] = tuple(v for v in out[knob] if v != value)
    return out


def release_pruned_configs(op: str, release=None) -> list[str]:
    """Sentences: the config values of ``op`` this Triton release leaves out of the candidate
    space, and why (for the autotuner's and ``show``'s listing)."""
    release = triton_release() if release is None else release
    return [f"{op}: {', '.join(f'{k}={v}' for k, v in p.config.items())} left out on Triton "
            f"{release[0]}.{release[1]}: {p.why}" for p in RELEASE_PRUNES if p.config and _applies(p, op, release)]


def release_reasons(op: str, device: torch.device, release=None, **launch) -> list[str]:
    """Why the running (or given) Triton release must not run this launch of ``op`` on the CUDA
    ``device`` (``launch``: the values the op's launch code picks, e.g. dtype="bf16",
    BLOCK_D=256). The interpreter (CPU tensors) runs every launch."""
    if device.type != "cuda":
        return []
    release = triton_release() if release is None else release
    family = TRITON_FAMILY.get(cuda_device.caps(device).arch)
    why = []
    for p in RELEASE_PRUNES:
        if (p.launch and _applies(p, op, release) and family in p.families
                and all(launch.get(k) == v for k, v in p.launch.items())):
            why.append(f"{op} on Triton {release[0]}.{release[1]}: {p.why}; Triton >= {p.below[0]}.{p.below[1]} "
                       f"compiles it without spills (pip install 'triton>={p.below[0]}.{p.below[1]}'), or use "
                       "backend='cuda' or 'torch'")
    return why


def _interpreter_problem() -> str | None:
    """Why the installed Triton's interpreter cannot run the kernels with the installed NumPy."""
    import numpy

    from .._versions import interpreter_problem

    return interpreter_problem(triton.__version__, numpy.__version__)


#: the interpreter's verdict for the installed versions (fixed for the process)
INTERPRETER_PROBLEM = _interpreter_problem() if HAVE_TRITON else None


def device_reasons(*tensors: torch.Tensor, op: str | None = None) -> list[str]:
    """Why Triton cannot run on these tensors' device (empty list: it can); with ``op``, also
    whether that op's kernels fit the CUDA device (:func:`arch_reasons`)."""
    if not HAVE_TRITON:
        return ["triton is not installed: pip install triton"]
    dev = tensors[0].device
    if dev.type == "cuda":
        return arch_reasons(op, dev) if op is not None else []
    if dev.type == "cpu" and interpreting():
        return [INTERPRETER_PROBLEM] if INTERPRETER_PROBLEM else []
    return [f"tensors are on {dev.type}: Triton needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            "(the interpreter; slow, for testing)"]


#: CUDA's limit on a launch grid's y and z extents (every architecture; x goes to 2**31 - 1). Tests
#: lower it to run the split launches of :func:`grid_launches` on small tensors.
GRID_YZ_LIMIT = 65535


def grid_launches(nx: int, ny: int, nz: int = 1) -> list[tuple[tuple[int, int, int], int, int]]:
    """The launches that cover a logical (nx, ny, nz) grid: [(grid, y0, z0)], each grid's y and z
    at most :data:`GRID_YZ_LIMIT`; the kernel adds ``y0`` / ``z0`` to ``tl.program_id(1)`` / ``(2)``.
    One launch unless y or z is above the limit (e.g. attention's rows * heads of a packed row
    of 100k documents, or dropkey_softmax's B * H); none when the grid is empty."""
    lim = GRID_YZ_LIMIT
    return [((nx, min(lim, ny - y0), min(lim, nz - z0)), y0, z0)
            for y0 in range(0, ny, lim) for z0 in range(0, nz, lim) if nx > 0]


def dtype_reasons(name: str, t: torch.Tensor, allowed=SUPPORTED_DTYPES) -> list[str]:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        return [f"{name} has dtype {t.dtype}; the Triton kernels take {names} (use backend='torch' for others)"]
    return []


if HAVE_TRITON:

    @triton.jit
    def fp32_to_bf16_rne(x):
        """Round fp32 -> bf16 to nearest even via the bit pattern (interpreter-safe)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        hi = (bits >> 16).to(tl.uint16)
        # NaN stays a quiet NaN (rounding could carry a signalling-NaN payload into inf).
        hi = tl.where(x != x, 0x7FC0, hi).to(tl.uint16)
        return hi.to(tl.bfloat16, bitcast=True)

    @triton.jit
    def store_rounded(ptr, x, mask, OUT_BF16: tl.constexpr):
        """Store fp32 ``x`` into ``ptr``'s element type, rounding once (RNE for bf16)."""
        if OUT_BF16:
            tl.store(ptr, fp32_to_bf16_rne(x), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def cmul(ar, ai, br, bi):
        """(ar + i ai) (br + i bi) as (re, im)."""
        return ar * br - ai * bi, ar * bi + ai * br

    @triton.jit
    def sincos_quarter(x):
        """(sin x, cos x) for |x| <= pi/4: Taylor polynomials, truncation < 2e-9 (no libdevice, whose
        full-range reduction is unneeded here and costs local memory)."""
        x2 = x * x
        s = x * (1.0 + x2 * (-1.6666666666666666e-01 + x2 * (8.333333333333333e-03 + x2 * (
            -1.984126984126984e-04 + x2 * 2.7557319223985893e-06))))
        c = 1.0 + x2 * (-0.5 + x2 * (4.1666666666666664e-02 + x2 * (-1.388888888888889e-03 + x2 * (
            2.48015873015873e-05 + x2 * -2.755731922398589e-07))))
        return s, c

    MIX_M1_C = tl.constexpr(MIX_M1)
    MIX_M2_C = tl.constexpr(MIX_M2)

    @triton.jit
    def mix32(x):
        """``dropkey_rule.mix32`` on uint32 values: the multiplies wrap mod 2**32, exactly the
        rule's ``& MASK32``."""
        x = x ^ (x >> 16)
        x = x * MIX_M1_C
        x = x ^ (x >> 15)
        x = x * MIX_M2_C
        return x ^ (x >> 15)

    @triton.jit
    def dropkey_row_keys(seed_k, bh, Hf, o_i):
        """The DropKey rule's per-query-row keys (uint32) of plane ``bh = b * Hf + h`` for rows
        ``o_i``; ``seed_k`` is ``dropkey_rule.seed_key(seed)`` as int32 bits."""
        b = (bh // Hf).to(tl.uint32)
        h = (bh % Hf).to(tl.uint32)
        s = seed_k.to(tl.uint32, bitcast=True)
        hk = mix32(mix32(s ^ b) ^ h)
        return mix32(hk ^ o_i.to(tl.uint32))

else:  # pragma: no cover - exercised where triton is absent (.ci/minimal_install.sh)
    # The device functions' names still exist, so every op's triton_impl imports and its backend
    # reports "triton is not installed" (device_reasons) like the others, not an ImportError.
    fp32_to_bf16_rne = store_rounded = cmul = sincos_quarter = mix32 = dropkey_row_keys = None
