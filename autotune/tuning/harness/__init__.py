"""Tuning harnesses, one module per op: how the tuner builds inputs for a shape, runs a candidate
forward and backward through the public op, and computes the float64 reference.

Tuning layer: they import the ops and the references, which ops never do (docs/design.md,
"Layering"). The module of op ``<op>`` is ``megalodon_kernels.autotune.tuning.harness.<op>`` and
defines ``HARNESS = registry.Harness(...)``; the tuner finds it by the op's name.
"""
import numpy as np
import torch

from ... import registry

#: Allowed max|err| / max|ref| over every output and gradient, per dtype: the gradient column of
#: tests/support.py's torch table. The check is there to throw out broken candidates; the tests
#: hold each backend to its own, tighter tolerances.
TOLERANCE = {"float64": 1e-9, "float32": 5e-5, "float16": 8e-3, "bfloat16": 4e-2}


def random(shape, dtype: torch.dtype, device, gen: torch.Generator, requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values drawn in float64 on the CPU (same values on every device), then cast."""
    t = torch.randn(shape, dtype=torch.float64, generator=gen).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def to_np(t: torch.Tensor) -> np.ndarray:
    """The float64 (or complex128) NumPy copy the references take; it sees the rounded inputs."""
    t = t.detach().cpu()
    return t.to(torch.complex128 if t.is_complex() else torch.float64).numpy()


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of CEMA coefficients for inputs of ``dtype``: float64 with float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cema_coefficients(D: int, N: int, dtype: torch.dtype, device, gen: torch.Generator):
    """(p r(D N), log_q c(D N), gamma c(D N)) as a Megalodon layer makes them: p = alpha,
    |q| = 1 - alpha * delta with alpha, delta in (0, 1) (slow decays included), arg q in [0, pi),
    gamma ~ complex normal / sqrt(N). Real dtype from :func:`real_dtype`."""
    real = real_dtype(dtype)
    cplx = torch.complex128 if real == torch.float64 else torch.complex64
    alpha = torch.sigmoid(torch.randn(D, N, dtype=torch.float64, generator=gen))
    delta = torch.sigmoid(torch.randn(D, N, dtype=torch.float64, generator=gen))
    theta = torch.rand(D, N, dtype=torch.float64, generator=gen) * np.pi
    log_q = torch.complex(torch.log1p(-alpha * delta), theta)
    gamma = torch.complex(torch.randn(D, N, dtype=torch.float64, generator=gen),
                          torch.randn(D, N, dtype=torch.float64, generator=gen)) / np.sqrt(N)

    def leaf(t, dt):
        return t.to(device=device, dtype=dt).requires_grad_(True)

    return leaf(alpha, real), leaf(log_q, cplx), leaf(gamma, cplx)


def grads(outputs: dict, upstream: dict, wrt: dict) -> dict:
    """Backward of sum over outputs of <upstream, output> into ``wrt`` (name -> leaf); a
    gradient that does not reach a leaf is returned as zeros (the reference says 0 too)."""
    names = [n for n in outputs if outputs[n] is not None]
    got = torch.autograd.grad([outputs[n] for n in names], list(wrt.values()),
                              [upstream[n] for n in names], allow_unused=True)
    return {f"d{name}": torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(wrt.items(), got)}


#: Float64 work (about one multiply-add each) a reference may cost per tuning check. At GPU shapes
#: (the 7B set: D = 4096, L = 32768) a full reference would take hours or more memory than the
#: machine has (fftconv's is O(L^2) per channel), so beyond this budget a harness checks evenly
#: spaced independent rows only (channels, groups, query rows) through :class:`registry.Part`.
#: Read at call time, so tests can lower it.
REFERENCE_BUDGET = 4e8


def sample_rows(n: int, cost_per_row: float, minimum: int = 2) -> np.ndarray | None:
    """Which of ``n`` independent rows the reference computes: None for all of them when
    ``n * cost_per_row`` fits :data:`REFERENCE_BUDGET`, else evenly spaced indices that always
    include the first and the last row (the tiling's edges) and at least ``minimum`` rows."""
    if n * cost_per_row <= REFERENCE_BUDGET:
        return None
    count = int(min(n, max(minimum, REFERENCE_BUDGET // max(cost_per_row, 1.0))))
    return np.unique(np.linspace(0, n - 1, count).round().astype(np.int64))


def part(full: np.ndarray, rows: np.ndarray | None, axis: int):
    """``full`` (the reference of the sampled rows only) as the output's value at ``rows`` along
    ``axis``; plain ``full`` when every row was computed."""
    if rows is None:
        return full
    index = (slice(None),) * axis + (rows,)
    return registry.Part(index, full)


def take(a: np.ndarray | None, rows: np.ndarray | None, axis: int):
    """The sampled rows of a NumPy input along ``axis`` (all of it when ``rows`` is None)."""
    return a if a is None or rows is None else np.take(a, rows, axis=axis)


def triton_prune(op: str):
    """A :attr:`registry.Harness.prune` for an op with a Triton backend: on a CUDA device of a
    known arch (sm_80, sm_90), a Triton config is pruned before it is timed when any kernel it
    launches does not compile, does not fit the per-block shared memory or spills
    (``bench.aot.config_problems``: ahead-of-time compilation, cached per process).
    Other backends and other devices are not pruned here (on CPU the tuner never times the
    Triton interpreter anyway)."""

    def prune(backend, config, shape, dtype_name, ident) -> list[str]:
        if backend != "triton" or ident.get("type") != "cuda":
            return []
        from ....bench import aot  # the Triton compiler toolchain: only when pruning for a GPU

        major, minor = (int(v) for v in str(ident.get("capability", "0.0")).split("."))
        cc = 10 * major + minor
        if cc not in aot.SMEM_LIMIT:
            return []  # no offline limit known for this arch: the timing run decides
        return aot.config_problems(op, dict(config), cc)

    return prune
