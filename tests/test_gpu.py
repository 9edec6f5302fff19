"""Checks that need a real NVIDIA GPU (marker ``gpu``; skipped where torch sees no CUDA device).

    TRITON_INTERPRET=0 python -m pytest -m gpu          (bench/gpu_session.sh runs them)

What the CPU suite cannot see: the driver's context on autograd's device thread, torch's current
stream, the tensors' device, grid limits, CUDA-graph capture, and the compiled Triton and NVRTC
kernels against the torch backend at model-sized shapes (the case table of bench/gpu_cases.py,
which bench/gpu_probe.py prints, with its float32 tolerances) and at the paper's A100/H100 shapes
in bfloat16, packed rows, and the model's forward + backward.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.bench import gpu_cases
from megalodon_kernels.ops._dispatch import NoBackendError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ("cuda", "triton")


@pytest.fixture(autouse=True)
def _compiled_triton():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("TRITON_INTERPRET=1 (tests/conftest.py's default): run with TRITON_INTERPRET=0 for the GPU tests")


_rel = gpu_cases.rel


#: The script of the fresh-process test (tests/test_gpu_offline.py checks on the CPU that it parses).
FRESH_PROCESS_SCRIPT = """\
import torch
from megalodon_kernels import ops
d = torch.device("cuda")
p = torch.rand(8, 4, device=d, requires_grad=True)
log_q = torch.complex(-0.1 * torch.rand(8, 4, device=d), torch.rand(8, 4, device=d)).requires_grad_()
gamma = torch.randn(8, 4, device=d, dtype=torch.complex64, requires_grad=True)
k, _ = ops.cema_kernel(p, log_q, gamma, 100, backend="cuda")
k.square().sum().backward()
torch.cuda.synchronize()
assert torch.isfinite(p.grad).all() and torch.isfinite(gamma.grad).all()
print("ok")
"""


def test_backward_runs_on_autograd_device_thread_in_a_fresh_process():
    """The first CUDA-backend launch of a process can be a backward, on autograd's device thread,
    where torch has not made the driver context current (seen on an H100: cema_kernel's backward
    failed with CUDA_ERROR_INVALID_CONTEXT). A fresh process makes that launch the first one."""
    code = FRESH_PROCESS_SCRIPT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd="/tmp", env={**os.environ, "TRITON_INTERPRET": "0"})
    print(out.stdout, out.stderr[-3000:])
    assert out.returncode == 0 and "ok" in out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(gpu_cases.CASES))
def test_matches_torch_float64_at_model_shapes(name, backend):
    case = gpu_cases.CASES[name]
    if backend not in case.tols:
        pytest.skip(f"{name} has no {backend} backend on a GPU (bench/gpu_cases.py)")
    try:
        fwd, bwd, out, _ = gpu_cases.errors(case, backend, torch.float32, torch.device("cuda"))
    except NoBackendError as e:  # a refusal with its reason (e.g. a Triton release it cannot serve)
        pytest.skip(str(e))
    ftol, btol = case.tols[backend]
    print(f"{name} {backend}: fwd {fwd:.2e} (tol {ftol:.1e}), bwd {bwd:.2e} (tol {btol:.1e})")
    assert all(o.device.type == "cuda" for o in out)
    assert fwd <= ftol and bwd <= btol


def _paper_set() -> str:
    return "h100" if torch.cuda.get_device_capability()[0] >= 9 else "a100"


def _bf16_valued(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16 values, kept in its dtype (a complex tensor part by part: ema_hidden's
    state is complex, and a real gradient for it is refused)."""
    if t.is_complex():
        return torch.complex(t.real.to(torch.bfloat16).float(), t.imag.to(torch.bfloat16).float()).to(t.dtype)
    return t.to(torch.bfloat16).to(t.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention",
                                "dropkey_softmax", "rotary"])
def test_backends_agree_with_torch_at_the_paper_shape_in_bfloat16(op, backend):
    """The paper's 7B shape (bench/shapes.py a100/h100 set, shortest length) in bfloat16, the inputs of the
    bench suite (bench/test_<op>.py): the backend against the torch backend in float32 on the same
    bf16 values. Tolerance 3e-2 of the largest value: a few bf16 roundings (2^-8 each) of the outputs
    and gradients, far below what a wrong index or a missing tile gives (errors of order 1)."""
    import importlib

    from megalodon_kernels.bench.shapes import BENCH_SETS, shape

    set_name = _paper_set()
    s = shape(op, set_name, BENCH_SETS[set_name].lengths[0])
    make = importlib.import_module(f"megalodon_kernels.bench.test_{op}").make
    torch.manual_seed(0)
    low = make(s, torch.bfloat16, torch.device("cuda"))
    why = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS.reasons(backend, low.inputs)
    if why:
        pytest.skip(f"{op} {backend} refuses the {set_name} shape: {'; '.join(why)}")
    ref = make(s, torch.float32, torch.device("cuda"))
    with torch.no_grad():
        for r, lo in zip(ref.leaves, low.leaves):
            r.copy_(lo)
    out_ref = gpu_cases.outputs(ref.call["torch"]())
    out_ref = [o for o in out_ref if o.requires_grad]
    ups = [_bf16_valued(torch.randn_like(o)) for o in out_ref]
    g_ref = torch.autograd.grad(out_ref, ref.leaves, ups, allow_unused=True)
    out = [o for o in gpu_cases.outputs(low.call[backend]()) if o.requires_grad]
    g = torch.autograd.grad(out, low.leaves, [u.to(o.dtype) for u, o in zip(ups, out)], allow_unused=True)
    fwd = max(_rel(o, r) for o, r in zip(out, out_ref))
    bwd = max(_rel(a, b) for a, b in zip(g, g_ref) if a is not None and b is not None)
    print(f"{op} {backend} {set_name}: fwd {fwd:.2e}, bwd {bwd:.2e}")
    assert all(o.device == low.leaves[0].device for o in out)
    assert fwd <= 3e-2 and bwd <= 3e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_planes_than_the_grid_y_limit(backend):
    """B x H = 200k planes: more than CUDA's 65535 blocks in grid y, so the launches must split or fold them."""
    torch.manual_seed(0)
    scores = torch.randn(50_000, 4, 2, 2, device="cuda")
    y = ops.dropkey_softmax(scores, True, 0.0, 0, backend=backend)
    assert torch.allclose(y, ops.dropkey_softmax(scores, True, 0.0, 0, backend="torch"), atol=1e-6)
    q = torch.randn(50_000, 2, 4, 16, device="cuda")
    o = ops.attention(q, q, q, scale=0.25, backend=backend)
    assert torch.allclose(o, ops.attention(q, q, q, scale=0.25, backend="torch"), atol=1e-5)


def _fftconv_inputs():
    g = torch.Generator(device="cuda").manual_seed(1)
    return (torch.randn(2, 64, 1000, device="cuda", generator=g),
            torch.randn(64, 1000, device="cuda", generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_on_the_current_side_stream(backend):
    """An op issued under a side stream runs there: its input is written on that stream just
    before, with no synchronisation, so a kernel on another stream could read it unwritten."""
    x, k = _fftconv_inputs()
    expected = ops.fftconv(x, k, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x2 = torch.empty_like(x)
            torch.cuda._sleep(2_000_000)  # keep the side stream busy so a wrong stream would race ahead
            x2.copy_(x)
            y = ops.fftconv(x2, k, backend=backend)
    side.synchronize()
    assert torch.equal(y, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_capture_and_replay(backend):
    x, k = _fftconv_inputs()
    q = torch.randn(1, 256, 2, 64, device="cuda")
    eager = (ops.fftconv(x, k, backend=backend), ops.attention(q, q, q, scale=0.125, backend=backend),
             ops.rotary(q, torch.arange(256, device="cuda"), backend=backend))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (allocator, first-use compiles)
        for _ in range(2):
            ops.fftconv(x, k, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = (ops.fftconv(x, k, backend=backend), ops.attention(q, q, q, scale=0.125, backend=backend),
                    ops.rotary(q, torch.arange(256, device="cuda"), backend=backend))
    for c in captured:
        c.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        assert torch.equal(e, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_tables_cached_by_identity_on_the_gpu(backend):
    """GPU calls with the same positions tensor share one table build (issue 41), per stream; an
    in-place write rebuilds; a captured graph computes its own tables from its static positions at
    every replay (a later write to them is seen), and so do timestep_norm's captured defaults."""
    from megalodon_kernels.ops.rotary import rotary_op, rotation_tables
    from megalodon_kernels.ops.rotary.table_cache import TABLES

    TABLES.clear()
    d = torch.device("cuda")
    x = torch.randn(2, 64, 2, 32, device=d)
    pos = torch.arange(64, device=d) + 1000

    def fresh(positions):
        return rotary_op(x, *rotation_tables(positions, 32, 10000.0, None, False, torch.float32), backend)

    for _ in range(3):
        assert torch.equal(ops.rotary(x, pos, backend=backend), fresh(pos))
    assert len([e for e in TABLES.entries() if e.positions is pos]) == 1
    pos.add_(7)  # in place: rebuilt
    assert torch.equal(ops.rotary(x, pos, backend=backend), fresh(pos))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ops.rotary(x, pos, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, fresh(pos)) and len([e for e in TABLES.entries() if e.positions is pos]) == 2
    static = torch.arange(64, device=d)
    xs = torch.randn(2, 64, 8, device=d)
    ops.rotary(x, static, backend=backend)  # warm-up (cached eagerly; the capture must not use it)
    ops.timestep_norm(xs, torch.ones(8, device=d), torch.zeros(8, device=d), 2, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.rotary(x, static, backend=backend)
        normed = ops.timestep_norm(xs, torch.ones(8, device=d), torch.zeros(8, device=d), 2, backend=backend)[0]
    static.copy_(torch.arange(64, device=d) + 5000)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fresh(static))
    assert torch.equal(normed, ops.timestep_norm(xs, torch.ones(8, device=d), torch.zeros(8, device=d), 2,
                                                 backend=backend)[0])
    TABLES.clear()


def test_packed_attention_matches_per_document():
    torch.manual_seed(3)
    lengths = [37, 500, 3, 1200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(1, sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for backend in BACKENDS:
        packed = ops.attention(q, k, v, scale=0.125, chunk_size=256, cu_seqlens=cu, backend=backend)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = ops.attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.125, chunk_size=256, backend=backend)
            assert _rel(packed[:, a:b], alone) <= 1e-2, (backend, a, b)  # two bf16 roundings apart at most


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_on_the_tensors_device_not_the_current_one(backend):
    x, k = (t.to("cuda:1") for t in _fftconv_inputs())
    with torch.cuda.device(0):
        y = ops.fftconv(x, k, backend=backend)
    with torch.cuda.device(1):
        expected = ops.fftconv(x, k, backend=backend)
    assert y.device == x.device and torch.equal(y, expected)


def test_model_forward_backward_auto_matches_torch_backend():
    from megalodon_kernels.model import Megalodon, get_config

    torch.manual_seed(0)
    model = Megalodon(get_config("tiny")).cuda()
    tokens = torch.randint(0, 256, (2, 513), device="cuda")
    losses, grads = [], []
    for backend in ("auto", "torch"):
        os.environ["MEGALODON_KERNELS_BACKEND"] = backend
        try:
            model.zero_grad()
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            loss.backward()
        finally:
            os.environ.pop("MEGALODON_KERNELS_BACKEND")
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    print("losses", losses)
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    assert _rel(grads[0], grads[1]) <= 1e-4
