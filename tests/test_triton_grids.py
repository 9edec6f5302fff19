"""Every Triton launch keeps grid y and z within CUDA's limit of 65535 (issue 27, item 3).

The interpreter loops over any grid, so a grid that a GPU would refuse runs fine here: the tests
record the grids instead. Every kernel of every ops/*/triton_impl.py is wrapped by a recorder:

* at extreme shapes (100k packed documents x 4 heads, B * H = 200k, 70k groups, ...) the kernels
  are not run, only their launches recorded: each grid within the limits, and the launches of a
  kernel cover its logical y range (Y0 .. Y0 + grid y) evenly, nothing missing or beyond;
* with the limit lowered to 1 (``_triton_common.GRID_YZ_LIMIT``), small inputs run through the
  interpreter split into several launches and give bitwise the results of one launch each.
"""
import collections
import importlib
import inspect

import numpy as np
import pytest
import torch
import triton

from megalodon_kernels import ops
from megalodon_kernels.ops import _triton_common

pytestmark = pytest.mark.usefixtures("one_thread")

OPS = ("attention", "cema", "cema_kernel", "dropkey_softmax", "ema_hidden", "fftconv", "rotary", "timestep_norm")
MAX_X = 2**31 - 1
Launch = collections.namedtuple("Launch", "kernel grid y0 z0")


def _impl(op):
    return importlib.import_module(f"megalodon_kernels.ops.{op}.triton_impl")


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args)`` records the launch, then runs it (or not)."""

    def __init__(self, name, kernel, launches, run):
        self.name, self.kernel, self.launches, self.run = name, kernel, launches, run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args), **kwargs)
            full = tuple(grid) + (1,) * (3 - len(grid))
            self.launches.append(Launch(self.name, full, named.get("Y0", 0), named.get("Z0", 0)))
            if self.run:
                return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def record(monkeypatch):
    """-> start(run: bool) wrapping every Triton kernel of every op; returns the launch list."""
    def start(run):
        launches = []
        for op in OPS:
            mod = _impl(op)
            source = inspect.getsource(mod)
            for name, value in vars(mod).items():
                # kernels, not device functions: what the module launches (``name[grid]``)
                if isinstance(value, triton.runtime.jit.KernelInterface) and f"{name}[" in source:
                    monkeypatch.setattr(mod, name, _Recorder(name, value, launches, run))
        return launches
    return start


def _check_limits(launches, limit=_triton_common.GRID_YZ_LIMIT):
    assert launches, "no Triton launch was recorded"
    for launch in launches:
        x, y, z = launch.grid
        assert 0 < x <= MAX_X and 0 < y <= limit and 0 < z <= limit, launch


def _check_cover(launches, kernel, ny):
    """The launches of ``kernel`` cover planes 0 .. ny - 1 equally often (once per pass)."""
    count = np.zeros(ny + 1, dtype=np.int64)
    for launch in launches:
        if launch.kernel == kernel:
            count[launch.y0] += 1
            count[launch.y0 + launch.grid[1]] -= 1
    cover = np.cumsum(count)
    assert cover[-1] == 0 and cover[0] >= 1 and (cover[:-1] == cover[0]).all(), f"{kernel}: planes covered unevenly"


# ------------------------------------------------------------------------------- extreme shapes

def test_attention_packed_100k_documents(record):
    """A packed row of 100k one-token documents with 4 heads: 400k (document, head) planes."""
    launches = record(run=False)
    n, H, d = 100_000, 4, 16
    q = torch.zeros(1, n, H, d)
    cu = torch.arange(n + 1, dtype=torch.int64)
    kw = dict(scale=1.0, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.1, seed=1,
              attn_fn="softmax", cu_seqlens=cu, max_seqlen=1, batch_index=torch.arange(n))
    impl = _impl("attention")
    o, lse = impl.forward(q, q, q, **kw)
    impl.backward(q, q, q, q, o, lse, **kw)
    _check_limits(launches)
    for kernel in ("_attn_fwd_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        _check_cover(launches, kernel, n * H)
    assert len(launches) > 4, "400k planes need several launches per kernel"


def test_attention_and_dropkey_200k_planes(record):
    """B * H = 200k: attention with wide values (dv tiles on grid z) and dropkey_softmax."""
    launches = record(run=False)
    B, H = 50_000, 4
    q, v = torch.zeros(B, 1, H, 16), torch.zeros(B, 1, H, 256)
    kw = dict(scale=1.0, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax")
    impl = _impl("attention")
    o, lse = impl.forward(q, q, v, **kw)
    impl.backward(o, q, q, v, o, lse, **kw)
    scores = torch.zeros(B, H, 1, 1)
    dk = _impl("dropkey_softmax")
    y = dk.forward(scores, causal=True, dropkey_p=0.1, seed=2)
    dk.backward(scores, y, causal=True, dropkey_p=0.1, seed=2)
    _check_limits(launches)
    assert any(launch.grid[2] > 1 for launch in launches), "the dv tiles should be on grid z"
    for kernel in ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
                   "_dropkey_softmax_fwd_kernel", "_dropkey_softmax_bwd_kernel"):
        _check_cover(launches, kernel, B * H)


def test_groups_pairs_and_length_blocks_beyond_the_limit(record):
    """timestep_norm with 70k groups, rotary with 70k pair blocks, the CEMA kernels with 70k length
    blocks (blocks of 1 x 1 steps: the kernels are not run, only their grids computed)."""
    launches = record(run=False)
    n = 70_000
    tn = _impl("timestep_norm")
    x = torch.zeros(1, 1, n)
    zeros, ones = torch.zeros(1, n), torch.ones(n)
    y, count, mean, var, saved = tn.forward(x, ones, ones * 0, torch.zeros(1, dtype=torch.int64), zeros,
                                                      zeros + 1, torch.zeros(1, 1, dtype=torch.bool), n, 1e-5)
    tn.backward(x, None, None, saved, n)
    ro = _impl("rotary")
    xr = torch.zeros(1, 1, 1, 2 * n)
    ro.forward(xr, torch.ones(1, 1, 1, n), torch.zeros(1, 1, 1, n), block_pairs=1)
    ck, eh = _impl("cema_kernel"), _impl("ema_hidden")
    p = torch.rand(2, 16)
    log_q = torch.complex(-torch.rand(2, 16), torch.rand(2, 16))
    ck.forward(p, log_q, log_q, n, None, block_m=1, block_r=1)
    eh.backward(torch.zeros(1, 2, 16, dtype=torch.complex64), p, log_q, None, None, None, n,
                      (True, False, False, False), block_m=1, block_r=1)
    _check_limits(launches)
    _check_cover(launches, "_timestep_norm_fwd_kernel", n)
    _check_cover(launches, "_timestep_norm_bwd_kernel", n)
    _check_cover(launches, "_rotary_kernel", n)
    _check_cover(launches, "_cema_fwd_kernel", n)
    _check_cover(launches, "_ema_hidden_dx_kernel", n)


# ------------------------------------------------------------ split launches give the same result

def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _grads(out, inputs):
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None and t.requires_grad]
    loss = sum((t.real * _x(*t.shape, seed=7)).sum() for t in outs)
    return [t.detach() for t in outs] + list(torch.autograd.grad(loss, inputs))


def _attention_case():
    q, k = _x(1, 2, 2, 16, seed=1), _x(1, 2, 2, 16, seed=2)
    v = _x(1, 2, 2, 160, seed=3)  # two dv tiles of 128
    inputs = [t.requires_grad_() for t in (q, k, v)]
    return inputs, lambda: ops.attention(*inputs, scale=0.25, dropkey_p=0.2, seed=3, backend="triton")


def _packed_attention_case():
    q, k, v = (_x(1, 7, 1, 16, seed=s).requires_grad_() for s in (1, 2, 3))
    cu = torch.tensor([0, 2, 3, 7])
    return [q, k, v], lambda: ops.attention(q, k, v, scale=0.25, dropkey_p=0.2, seed=3, backend="triton",
                                            cu_seqlens=cu)


def _dropkey_case():
    s = _x(2, 1, 4, 5).requires_grad_()
    return [s], lambda: ops.dropkey_softmax(s, True, 0.2, 5, backend="triton")


def _rotary_case():
    x = _x(1, 3, 1, 256).requires_grad_()  # 128 pairs: 2 blocks of 64
    return [x], lambda: ops.rotary(x, torch.arange(3), backend="triton")


def _timestep_norm_case():
    x, scale, bias = _x(1, 3, 4).requires_grad_(), _x(4, seed=1).requires_grad_(), _x(4, seed=2).requires_grad_()
    return [x, scale, bias], lambda: ops.timestep_norm(x, scale, bias, 2, backend="triton")[0]


def _cema_kernel_case():
    impl = _impl("cema_kernel")
    p = torch.rand(2, 16, generator=torch.Generator().manual_seed(0))
    log_q = torch.complex(-torch.rand(2, 16) - 0.1, torch.rand(2, 16))
    return [], lambda: impl.forward(p, log_q, log_q, 300, None, block_m=16, block_r=16)[0]


def _ema_hidden_case():
    impl = _impl("ema_hidden")
    p = torch.rand(2, 16, generator=torch.Generator().manual_seed(0))
    log_q = torch.complex(-torch.rand(2, 16) - 0.1, torch.rand(2, 16))
    dh = torch.complex(_x(1, 2, 16), _x(1, 2, 16, seed=1))
    return [], lambda: impl.backward(dh, p, log_q, None, None, None, 300, (True, False, False, False),
                                           block_m=16, block_r=16)[0]


CASES = {"attention": _attention_case, "attention packed": _packed_attention_case, "dropkey_softmax": _dropkey_case,
         "rotary": _rotary_case, "timestep_norm": _timestep_norm_case, "cema_kernel": _cema_kernel_case,
         "ema_hidden": _ema_hidden_case}


@pytest.mark.parametrize("case", list(CASES))
def test_split_launches_give_the_same_results(record, monkeypatch, case):
    inputs, run = CASES[case]()
    launches = record(run=True)
    whole = _grads(run(), inputs) if inputs else [run()]
    n_whole = len(launches)
    monkeypatch.setattr(_triton_common, "GRID_YZ_LIMIT", 1)
    launches.clear()
    split = _grads(run(), inputs) if inputs else [run()]
    _check_limits(launches, limit=1)
    assert len(launches) > n_whole, "the lowered limit should have split a launch"
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
