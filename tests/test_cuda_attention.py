"""attention on the CUDA backend (cuda/backend.py AttentionBackend), executed by the CPU emulator.

The backend is built over the emulator extension and plugged into the op's dispatcher as
backend "cuda", so the public op (checks, autograd Function, saved o/lse) runs the CUDA
kernels. Every path is compared forward and backward with the float64 reference
(reference/attention.py, DropKey mask from ops.dropkey_rule for the same seed) and with
backend="torch" on the same inputs and seed (the same DropKey mask). Shapes are small: the
emulator runs each CUDA thread as a fiber.
"""
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from megalodon_kernels.ops.attention import attention
from megalodon_kernels.ops.dropkey_rule import dropkey_mask
from megalodon_kernels.reference import attention as ref
from support import as_input, to_np, tol

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")

# fp16 has no row in support.TOLERANCES for "cuda" (the other kernels take fp32/bf16 only): the
# torch backend's fp16 budget, the same input rounding and fp32 accumulation.
TOL = {torch.float32: (tol("cuda", torch.float32, "fwd"), tol("cuda", torch.float32, "bwd")),
       torch.bfloat16: (tol("cuda", torch.bfloat16, "fwd"), tol("cuda", torch.bfloat16, "bwd")),
       torch.float64: (tol("cuda", torch.float64, "fwd"), tol("cuda", torch.float64, "bwd")),
       torch.float16: (tol("torch", torch.float16, "fwd"), tol("torch", torch.float16, "bwd"))}


@pytest.fixture(scope="module")
def emulated():
    from megalodon_kernels.cuda import backend, build

    ext = build.load_emulator()
    return {"attention": backend.AttentionBackend(lambda: ext, "cpu")}


@pytest.fixture
def attention_cuda(use_emulated_cuda):
    """The emulated cuda attention backend, plugged into the dispatcher (conftest.use_emulated_cuda)."""
    return use_emulated_cuda["attention"]


@pytest.fixture(params=["forward", "reverse"])
def fiber_order(request):
    """Run under both fiber orders: a missing barrier shows as a wrong result in one of them."""
    from megalodon_kernels.cuda import build

    ext = build.load_emulator()
    ext.emulator_set_reverse(request.param == "reverse")
    yield request.param
    ext.emulator_set_reverse(False)


def close(name, actual, expected, tolerance):
    """max|actual - expected| <= tolerance * max(max|expected|, 1): inputs are O(1), so rounding is
    O(eps) in absolute terms even where a gradient cancels to ~0 (one visible key: dq = dk = 0)."""
    a, e = to_np(actual), np.asarray(expected)
    assert a.shape == e.shape, (name, a.shape, e.shape)
    err = float(np.max(np.abs(a - e), initial=0.0))
    norm = max(float(np.max(np.abs(e), initial=0.0)), 1.0)
    print(f"{name}: max abs err {err:.3e}, normalised {err / norm:.3e} (tol {tolerance:.1e})")
    assert np.isfinite(a).all() and err <= tolerance * norm, f"{name}: {err / norm:.3e} > {tolerance:.1e}"


def _inputs(B, L, S, H, dh, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: as_input(torch.randn(*shape, generator=gen, dtype=torch.float64), dtype,  # noqa: E731
                                 True, True)
    q, k, v = mk(B, L, H, dh), mk(B, S, H, dh), mk(B, S, H, dv)
    do = torch.randn(B, L, H, dv, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, do


def check_case(B, L, S, H, dh, dv, dtype, *, backend="cuda", against_torch=True, **kw):
    """Forward and backward of backend 'cuda' vs the reference and vs backend 'torch'."""
    kw.setdefault("scale", dh ** -0.5)
    q, k, v, do = _inputs(B, L, S, H, dh, dv, dtype)
    o = attention(q, k, v, backend=backend, **kw)
    assert o.dtype == dtype and o.shape == (B, L, H, dv)
    grads = torch.autograd.grad(o, (q, k, v), do)
    p, seed = kw.get("dropkey_p", 0.0), kw.get("seed", 0)
    keep = dropkey_mask(seed, p, B, H, L, S).numpy() if p > 0 else None
    rk = {n: kw[n] for n in ("scale", "causal", "chunk_size", "block_causal", "attn_fn") if n in kw}
    qn, kn, vn = to_np(q), to_np(k), to_np(v)
    ftol, btol = TOL[dtype]
    close("o", o, ref.attention(qn, kn, vn, keep_mask=keep, **rk), ftol)
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref.attention_bwd(to_np(do), qn, kn, vn, keep_mask=keep, **rk)):
        assert g.dtype == dtype
        close(name, g, e, btol)
    if against_torch:
        ot = attention(q, k, v, backend="torch", **kw)
        gt = torch.autograd.grad(ot, (q, k, v), do)
        close("o vs torch", o, to_np(ot), ftol)
        for name, g, e in zip(("dq", "dk", "dv"), grads, gt):
            close(f"{name} vs torch", g, to_np(e), btol)
    return o, grads


MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "chunk": dict(causal=True, chunk_size=8),
    "chunk-noncausal": dict(causal=False, chunk_size=8),
    "blockcausal": dict(causal=True, chunk_size=8, block_causal=True),
}

# ------------------------------------------------------------------------------------------------
# The matmul + dropkey_softmax path
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def matmul_path(attention_cuda, monkeypatch):
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "matmul")
    return attention_cuda


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("L,S", [(1, 1), (33, 33), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_matmul_path_masks(matmul_path, mask, L, S):
    check_case(2, L, S, 2, 8, 5, torch.float32, **MASKS[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_matmul_path_dropkey(matmul_path, dtype, mask):
    check_case(2, 33, 40, 3, 8, 6, dtype, dropkey_p=0.3, seed=1234, **MASKS[mask])


def test_matmul_path_dropkey_equals_torch_mask(matmul_path):
    # p = 0.9 with one visible key row pattern: a different mask would change o visibly.
    o, _ = check_case(1, 20, 20, 2, 4, 4, torch.float32, dropkey_p=0.9, seed=99, causal=False)
    assert (o == 0).all(dim=-1).any()  # some rows lost every key: the drop really happened


def test_matmul_path_rejects_laplace(matmul_path):
    q = torch.randn(1, 4, 1, 8)
    why = matmul_path.not_supported_reasons(q, q, q, attn_fn="laplace")
    assert any("laplace" in r and "backend='torch'" in r for r in why)


# ------------------------------------------------------------------------------------------------
# float64: always the matmul path (float64 matmuls + the fp64 dropkey_softmax kernel)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def calls(monkeypatch):
    """Names of the cuda/kernels.py attention entry points called, in order."""
    from megalodon_kernels.cuda import kernels as K

    seen = []
    for name in ("attention_flash_fwd", "attention_flash_bwd", "attention_matmul_fwd", "attention_matmul_bwd",
                 "dropkey_softmax_fwd", "dropkey_softmax_bwd"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _fn=fn, _name=name, **kw: (seen.append(_name), _fn(*a, **kw))[1])
    return seen


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "chunk-noncausal", "full"])
def test_float64_matmul_path_dropkey(attention_cuda, fiber_order, calls, mask):
    # path "auto": float64 has no flash configuration, so the matmul path runs, in fp64 end to end
    # (an fp32 step anywhere would show as ~1e-7 against the 1e-10 / 1e-9 budget).
    check_case(2, 33, 40, 2, 8, 6, torch.float64, dropkey_p=0.3, seed=1234, **MASKS[mask])
    assert "attention_flash_fwd" not in calls and "attention_flash_bwd" not in calls
    assert calls[:2] == ["attention_matmul_fwd", "dropkey_softmax_fwd"]
    assert "attention_matmul_bwd" in calls and "dropkey_softmax_bwd" in calls


@pytest.mark.parametrize("L,S", [(1, 1), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_float64_matmul_path_shapes(matmul_path, L, S):
    # S < L: the leading rows see no key (o = 0); one key: P = 1
    check_case(1, L, S, 2, 8, 5, torch.float64, causal=True, dropkey_p=0.2, seed=8)


def test_float64_lse_is_float64(attention_cuda):
    from megalodon_kernels.cuda import kernels as K

    q, k, v, _ = _inputs(1, 9, 12, 2, 8, 4, torch.float64)
    o, lse = K.attention_matmul_fwd(attention_cuda.ext, q.detach(), k.detach(), v.detach(), scale=0.5, causal=True,
                                    chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0)
    _, s, allowed = ref.attention_probs(to_np(q), to_np(k), scale=0.5)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    expected = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    assert o.dtype == lse.dtype == torch.float64
    close("lse", lse, expected, tol("cuda", torch.float64, "fwd"))


def test_float64_forced_flash_gives_the_reason(attention_cuda, monkeypatch):
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    why = attention_cuda.flash_reasons(q, q)
    assert len(why) == 1 and "float64" in why[0] and "tensor-core" in why[0] and "path='matmul'" in why[0]
    # a direct call with path="flash" refuses with that reason ...
    kw = dict(scale=1.0, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax")
    with pytest.raises(ValueError, match="float64"):
        attention_cuda.attention_fwd(q, q, q, path="flash", **kw)
    # ... and a configured path="flash" makes the dispatcher refuse the cuda backend up front
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "flash")
    reasons = attention_cuda.not_supported_reasons(q, q, q)
    assert any("path='flash'" in r and "float64" in r and "backend='torch'" in r for r in reasons)
    with pytest.raises(ValueError, match="float64"):
        attention(q, q, q, backend="cuda")
    # fp32 under the same configuration is accepted (the reason is about the dtype)
    assert attention_cuda.not_supported_reasons(q.float(), q.float(), q.float()) == []


def test_float64_laplace_is_refused_with_a_reason(attention_cuda):
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    why = " ".join(attention_cuda.not_supported_reasons(q, q, q, attn_fn="laplace"))
    assert "laplace" in why and "float64" in why and "backend='torch'" in why
    with pytest.raises(ValueError, match="laplace"):
        attention(q, q, q, attn_fn="laplace", backend="cuda")
    # softmax in float64 is accepted, and an unsupported dtype still names q/k/v
    assert attention_cuda.not_supported_reasons(q, q, q) == []
    qi = torch.zeros(1, 4, 1, 8, dtype=torch.complex64)
    assert any("q/k/v" in r and "complex64" in r for r in attention_cuda.not_supported_reasons(qi, qi, qi))


# ------------------------------------------------------------------------------------------------
# The flash kernel (CuTe; UniversalFMA atoms in the emulator)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def flash_path(attention_cuda, monkeypatch):
    why = attention_cuda.flash_reasons(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    if why:
        pytest.skip(f"flash kernel not built in the emulator: {why}")
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "flash")
    return attention_cuda


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("L,S", [(1, 1), (33, 33), (63, 63), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_flash_masks(flash_path, mask, L, S):
    check_case(2, L, S, 2, 8, 5, torch.float32, **MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
def test_flash_dropkey_both_fiber_orders(flash_path, fiber_order, mask):
    check_case(1, 70, 70, 2, 16, 12, torch.float32, dropkey_p=0.3, seed=1234, **MASKS[mask])


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "full"])
def test_flash_laplace(flash_path, fiber_order, mask):
    check_case(1, 33, 40, 2, 8, 6, torch.float32, attn_fn="laplace", dropkey_p=0.2, seed=5, **MASKS[mask])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_flash_half_types(flash_path, dtype, mask):
    check_case(2, 33, 40, 2, 8, 6, dtype, dropkey_p=0.25, seed=7, **MASKS[mask])


def test_flash_many_tiles_chunks_skip(flash_path):
    # 3 query and key blocks of 64, chunks of 48 straddling block edges, block_causal, DropKey:
    # exercises the key / query ranges that skip fully masked tiles and the partial tiles.
    check_case(1, 150, 150, 1, 8, 4, torch.float32, chunk_size=48, block_causal=True, dropkey_p=0.1, seed=3)


@pytest.mark.parametrize("dh,dv", [(64, 64), (100, 130)], ids=["d64-dv64", "d100pad128-dv130tiled"])
def test_flash_head_dims_and_dv_tiling(flash_path, dh, dv):
    # dh = 100 is zero-padded to the D = 128 kernel; dv = 130 is padded to 256 = 2 tiles of 128.
    check_case(1, 20, 24, 1, dh, dv, torch.float32, dropkey_p=0.2, seed=11, chunk_size=8)


@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_flash_head_dim_256_bf16(flash_path, mask):
    # The 7B head dim: D = 256 runs the 256-thread backward and dv tiles of 128 (dv = 200 -> 256).
    check_case(1, 20, 24, 1, 256, 200, torch.bfloat16, dropkey_p=0.2, seed=13, **MASKS[mask])


def test_flash_lse_matches_reference(flash_path):
    from megalodon_kernels.cuda import kernels as K

    q, k, v, _ = _inputs(1, 33, 40, 2, 8, 4, torch.float32)
    o, lse = K.attention_flash_fwd(flash_path.ext, q.detach(), k.detach(), v.detach(), scale=0.5, causal=True,
                                   chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax")
    _, s, allowed = ref.attention_probs(to_np(q), to_np(k), scale=0.5)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    expected = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    close("lse", lse, expected, 2e-6)


def test_auto_path_picks_flash_and_falls_back(attention_cuda):
    assert attention_cuda.flash_reasons(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 8)) == []
    why = attention_cuda.flash_reasons(torch.zeros(1, 2, 1, 300), torch.zeros(1, 2, 1, 8))
    assert why and "256" in why[0]
    # head dim 300 runs on the matmul path under path="auto"
    check_case(1, 5, 5, 1, 300, 3, torch.float32)


@pytest.mark.parametrize("L,S", [(0, 5), (4, 0)], ids=["L0", "S0"])
def test_flash_empty_lengths(flash_path, L, S):
    # S = 0: every row is empty (o = 0, dq = 0); L = 0: nothing to compute, dk = dv = 0.
    check_case(1, L, S, 2, 8, 3, torch.float32, chunk_size=2, block_causal=True, dropkey_p=0.5, seed=1)


def test_auto_path_runs_the_flash_kernels_and_matmul_fallback_the_softmax_kernel(attention_cuda, monkeypatch):
    from megalodon_kernels.cuda import kernels as K

    calls = []
    for name in ("attention_flash_fwd", "attention_flash_bwd", "attention_matmul_fwd", "attention_matmul_bwd"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _fn=fn, _name=name, **kw: (calls.append(_name), _fn(*a, **kw))[1])
    check_case(1, 9, 9, 1, 8, 4, torch.bfloat16, against_torch=False, dropkey_p=0.2, seed=2)
    assert calls == ["attention_flash_fwd", "attention_flash_bwd"]
    calls.clear()
    check_case(1, 9, 9, 1, 300, 4, torch.float32, against_torch=False)  # head dim 300: matmul path
    assert calls == ["attention_matmul_fwd", "attention_matmul_bwd"]
    launched = " ".join(attention_cuda.ext.emulator_launched_kernels())
    assert all(n in launched for n in ("flash_fwd", "flash_bwd_kv", "flash_bwd_q", "dropkey_softmax"))



# flash_path only patches the dispatcher and the backend's config (the same for every example).
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 80), S=st.integers(1, 80), chunk=st.sampled_from([None, 1, 5, 16, 64, 100]),
       causal=st.booleans(), block_causal=st.booleans(), dropkey_p=st.sampled_from([0.0, 0.3, 0.9]),
       seed=st.integers(0, 2**63 - 1), attn_fn=st.sampled_from(["softmax", "laplace"]))
def test_flash_property(flash_path, L, S, chunk, causal, block_causal, dropkey_p, seed, attn_fn):
    check_case(1, L, S, 2, 8, 3, torch.float32, against_torch=False, causal=causal, chunk_size=chunk,
               block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn)


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "full"])
def test_flash_tensor_core_layouts_emulated(flash_path, monkeypatch, mask):
    # dtype code 3 (emulator only): the kernels with the SM80 TiledMMA (4 warps along M,
    # m16n8k16 bf16 -> fp32) whose atom is an mma.sync stand-in gathering the PTX fragment
    # layout by warp shuffles: checks the tensor-core thread-value layouts end to end.
    from megalodon_kernels.cuda import kernels as K

    monkeypatch.setitem(K.ATTN_DTYPE_CODES, torch.bfloat16, 3)
    check_case(1, 70, 70, 2, 16, 12, torch.bfloat16, dropkey_p=0.2, seed=21, **MASKS[mask])
    check_case(1, 9, 20, 1, 64, 64, torch.bfloat16, attn_fn="laplace", **MASKS[mask])
