"""attention, Triton backend (interpreter) against the float64 reference: forward and dq/dk/dv,
fp32 and bf16, every mask mode, L = S and S > L (KV cache), odd lengths, DropKey bit-identical to
the torch backend's rule, Laplace, empty rows, non-contiguous inputs, dh != dv including the
dv-tiled path, tiling knobs, and no L x S allocation."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.attention import attention
from megalodon_kernels.ops.attention import triton_impl
from megalodon_kernels.ops.dropkey_rule import dropkey_mask
from megalodon_kernels.reference import attention as ref
from support import knobs as support_knobs
from support import as_input, assert_close, to_np, tol
from test_attention import make_qkv
from test_attention import run_case as check_backend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes the kernels discard


def knobs(**config):
    return support_knobs(triton_impl, **config)


def run_case(*args, **kwargs):
    """Triton forward and backward vs the float64 reference. Returns (o, grads)."""
    return check_backend(*args, backend="triton", **kwargs)


# id: (B, L, S, H, dh, dv, options). Default tiles are 64 x 64: most cases are one program per (b, h).
CASES = {
    "L1-S1": (2, 1, 1, 2, 8, 8, {}),
    "causal-L33": (2, 33, 33, 3, 8, 5, {}),
    "full-L31": (2, 31, 31, 2, 8, 5, dict(causal=False)),
    "kvcache-L31-S63": (2, 31, 63, 2, 8, 5, {}),
    "decode-L1-S129": (2, 1, 129, 2, 8, 5, {}),
    "S<L-L33-S17": (2, 33, 17, 2, 8, 5, {}),
    "full-S>L-L33-S63": (1, 33, 63, 2, 8, 5, dict(causal=False)),
    "chunk16-ragged-L63": (2, 63, 63, 2, 8, 5, dict(chunk_size=16)),
    "chunk8-noncausal-L33": (2, 33, 33, 2, 8, 5, dict(chunk_size=8, causal=False)),
    "blockcausal16-L63": (2, 63, 63, 2, 8, 5, dict(chunk_size=16, block_causal=True)),
    "blockcausal32-kv-L31-S129": (1, 31, 129, 2, 8, 5, dict(chunk_size=32, block_causal=True)),
    "chunk-S<L-noncausal": (1, 40, 21, 2, 8, 5, dict(chunk_size=7, causal=False)),
    "dropkey-L33": (2, 33, 33, 2, 8, 5, dict(dropkey_p=0.3)),
    "dropkey-blockcausal-L63": (1, 63, 63, 2, 8, 5, dict(chunk_size=16, block_causal=True, dropkey_p=0.2)),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_attention_matches_reference(dtype, case):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, dtype, **opts)


@pytest.mark.parametrize("case", ["causal-L33", "kvcache-L31-S63", "S<L-L33-S17", "chunk8-noncausal-L33",
                                  "blockcausal16-L63", "dropkey-L33"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_attention_laplace(dtype, case):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, dtype, attn_fn="laplace", **opts)


def test_triton_attention_float16():
    run_case(2, 33, 33, 2, 8, 5, torch.float16, chunk_size=16, block_causal=True, dropkey_p=0.2)


# Small tiles: many query and key blocks, so the visible-range skipping in all three kernels
# (forward and dq walk key blocks, dk/dv walks query blocks) decides which tiles are visited.
SMALL_TILE_CASES = {
    "causal-L63": (1, 63, 63, 2, 8, 5, {}),
    "kvcache-L33-S129": (1, 33, 129, 2, 8, 5, {}),
    "S<L-L63-S33": (1, 63, 33, 2, 8, 5, {}),
    "full-L31-S63": (1, 31, 63, 2, 8, 5, dict(causal=False)),
    "chunk16-L63": (1, 63, 63, 2, 8, 5, dict(chunk_size=16)),
    "chunk20-kv-L40-S100": (1, 40, 100, 2, 8, 5, dict(chunk_size=20)),
    "chunk7-noncausal-S<L": (1, 63, 33, 2, 8, 5, dict(chunk_size=7, causal=False)),
    "blockcausal24-L63": (1, 63, 63, 2, 8, 5, dict(chunk_size=24, block_causal=True, dropkey_p=0.3)),
    "blockcausal16-kv-L33-S129": (1, 33, 129, 2, 8, 5, dict(chunk_size=16, block_causal=True)),
}


@pytest.mark.parametrize("case", list(SMALL_TILE_CASES), ids=str)
def test_triton_attention_small_tiles(case):
    B, L, S, H, dh, dv, opts = SMALL_TILE_CASES[case]
    with knobs(BLOCK_M=16, BLOCK_N=16):
        run_case(B, L, S, H, dh, dv, torch.float32, **opts)


@pytest.mark.parametrize("dtype, dh, dv, opts", [
    (torch.float32, 16, 40, dict(dropkey_p=0.2, chunk_size=16, block_causal=True)),
    (torch.bfloat16, 40, 16, dict(attn_fn="laplace", causal=False)),
    (torch.float32, 24, 200, dict(dropkey_p=0.2, chunk_size=16, block_causal=True)),
    (torch.bfloat16, 33, 300, dict(dropkey_p=0.2)),
    (torch.float32, 20, 136, dict(attn_fn="laplace", causal=False)),
], ids=["fp32-16-40", "bf16-40-16-laplace", "fp32-24-200", "bf16-33-300", "fp32-20-136-laplace"])
def test_triton_attention_head_dims(dtype, dh, dv, opts):
    # dv > MAX_BLOCK_DV (136, 200, 300) runs the dv-tiled path: a dv-tile grid axis in the forward,
    # separate dk and dv launches, dP summed over dv tiles inside the dk and dq kernels.
    assert triton_impl._tiles(dh, dv, 64, 64)["ONE_DV"] == (dv <= triton_impl.MAX_BLOCK_DV)
    run_case(1, 33, 40, 2, dh, dv, dtype, **opts)


def test_triton_attention_head_dim_256():
    # dh = 256, the 7B config's z_dim: the tiles shrink (32 x 32 forward) and dv (256) is tiled.
    t = triton_impl._tiles(256, 256, 64, 64)
    assert (t["fwd"], t["BLOCK_DH"], t["BLOCK_DV"], t["ONE_DV"]) == ((32, 32), 256, triton_impl.MAX_BLOCK_DV, False)
    run_case(1, 40, 40, 1, 256, 256, torch.float32, dropkey_p=0.1)


@pytest.mark.parametrize("case", ["kvcache-L31-S63", "blockcausal16-L63", "dropkey-L33"])
def test_triton_attention_noncontiguous(case):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, torch.float32, contiguous=False, **opts)


@given(
    B=st.integers(1, 2), L=st.integers(1, 50), S=st.integers(1, 50), H=st.integers(1, 2),
    dh=st.integers(1, 20), dv=st.integers(1, 20), causal=st.booleans(),
    chunk=st.sampled_from([None, None, 1, 4, 7, 16, 100]), block_causal=st.booleans(),
    dropkey_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    attn_fn=st.sampled_from(["softmax", "softmax", "laplace"]), square=st.booleans(),
    block=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]), data_seed=st.integers(0, 2**31),
)
def test_triton_attention_property(B, L, S, H, dh, dv, causal, chunk, block_causal, dropkey_p, seed, attn_fn,
                                   square, block, data_seed):
    S = L if square else S
    with knobs(BLOCK_M=block[0], BLOCK_N=block[1]):
        run_case(B, L, S, H, dh, dv, torch.float32, causal=causal, chunk_size=chunk,
                 block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                 data_seed=data_seed, floor=1.0)


# ---------------------------------------------------------------------------------------------
# Agreement with the torch backend, DropKey


def _fwd_bwd(backend, q, k, v, do, **kw):
    o = attention(q, k, v, backend=backend, **kw)
    return o.detach(), torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("opts", [dict(dropkey_p=0.3), dict(chunk_size=8, block_causal=True, dropkey_p=0.5),
                                  dict(causal=False, dropkey_p=0.2, attn_fn="laplace")],
                         ids=["causal", "blockcausal", "laplace"])
def test_dropkey_same_seed_same_result_as_torch_backend(opts):
    q, k, v, do = make_qkv(2, 24, 40, 2, 8, 6, torch.float32)
    o_t, g_t = _fwd_bwd("triton", q, k, v, do, seed=77, **opts)
    o_r, g_r = _fwd_bwd("torch", q, k, v, do, seed=77, **opts)
    assert_close("o triton vs torch", o_t, to_np(o_r), 1e-5)
    assert torch.equal(o_t == 0, o_r == 0)
    for name, a, b in zip(("dq", "dk", "dv"), g_t, g_r):
        assert_close(f"{name} triton vs torch", a, to_np(b), 1e-5)
    o_2, _ = _fwd_bwd("triton", q, k, v, do, seed=77, **opts)
    assert torch.equal(o_t, o_2)  # same seed reproduces bit for bit
    o_3, _ = _fwd_bwd("triton", q, k, v, do, seed=78, **opts)
    assert not torch.equal(o_t, o_3)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropkey_mask_is_the_rule_bit_for_bit(p):
    # Scores all 0 and V = identity: o[b, i, h, j] = 1/#kept where key j is kept, else 0, so the
    # output exposes the exact keep mask the forward kernel used (several query/key blocks).
    B, L, S, H = 2, 40, 48, 2
    q = torch.zeros(B, L, H, 2)
    k = torch.randn(B, S, H, 2)
    v = torch.eye(S).view(1, S, 1, S).expand(B, S, H, S)
    with knobs(BLOCK_M=16, BLOCK_N=16):
        o = attention(q, k, v, causal=False, dropkey_p=p, seed=2024, backend="triton")
    observed = (o > 0).permute(0, 2, 1, 3)  # [B, H, L, S]
    assert torch.equal(observed, dropkey_mask(2024, p, B, H, L, S))


def test_dropkey_backward_regenerates_the_forward_mask():
    # dv = P^T dO: with dO = 1, dv[j] = sum over queries of P_ij, which is 0 exactly for keys that
    # no query kept; the reference fed the rule's mask gives the same gradients.
    B, L, S, H = 1, 20, 20, 2
    q, k, v, do = make_qkv(B, L, S, H, 4, 3, torch.float64)
    qf, kf, vf = (as_input(x, torch.float32, requires_grad=True) for x in (q, k, v))
    o = attention(qf, kf, vf, causal=False, dropkey_p=0.9, seed=5, backend="triton")
    grads = torch.autograd.grad(o, (qf, kf, vf), torch.ones_like(o))
    keep = dropkey_mask(5, 0.9, B, H, L, S).numpy()
    never = ~keep.any(axis=2)  # [B, H, S]: keys dropped for every query
    assert never.any()
    dv = to_np(grads[2]).transpose(0, 2, 1, 3)  # [B, H, S, dv]
    assert np.all(dv[never] == 0)
    expected = ref.attention_bwd(np.ones(o.shape), to_np(qf), to_np(kf), to_np(vf), causal=False, keep_mask=keep)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(name, g, e, tol("triton", torch.float32, "bwd"))


# ---------------------------------------------------------------------------------------------
# Rows with nothing to attend to, Laplace tail, knobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opts, L, S", [
    (dict(), 9, 4),  # S < L: the first 5 rows see no key
    (dict(dropkey_p=0.95), 12, 3),  # most rows lose all 3 keys
    (dict(chunk_size=3, causal=False), 10, 4),  # positions -6..-1 lie in chunks with no key
    (dict(chunk_size=4, block_causal=True, dropkey_p=0.9), 16, 16),
], ids=["S<L", "all-dropped", "chunk-S<L", "blockcausal-dropped"])
def test_empty_rows_output_zero_with_finite_gradients(dtype, opts, L, S):
    o, grads = run_case(2, L, S, 2, 4, 3, dtype, **opts)
    p = opts.get("dropkey_p", 0.0)
    vis = ref.visible_mask(L, S, opts.get("causal", True), opts.get("chunk_size"), opts.get("block_causal", False))
    keep = dropkey_mask(1234, p, 2, 2, L, S).numpy() if p > 0 else np.ones((2, 2, L, S), dtype=bool)
    empty = ~(vis & keep).any(-1)  # [B, H, L]
    assert empty.any()
    assert np.all(to_np(o).transpose(0, 2, 1, 3)[empty] == 0) and np.all(np.isfinite(to_np(o)))
    assert all(np.all(np.isfinite(to_np(g))) for g in grads)
    assert np.all(to_np(grads[0]).transpose(0, 2, 1, 3)[empty] == 0)


def test_softmax_lse_is_minus_inf_on_empty_rows_and_log_sum_exp_elsewhere():
    q, k, v, _ = make_qkv(1, 9, 4, 2, 4, 3, torch.float32)
    o, lse = triton_impl.attention_fwd(q, k, v, scale=0.5, causal=True, chunk_size=None, block_causal=False,
                                       dropkey_p=0.0, seed=0, attn_fn="softmax")
    s = 0.5 * np.einsum("blhd,bshd->bhls", to_np(q), to_np(k))
    vis = ref.visible_mask(9, 4)
    expected = np.log(np.where(vis, np.exp(s), 0.0).sum(-1))  # -inf where nothing is visible
    assert np.array_equal(np.isneginf(to_np(lse)), np.isneginf(expected))
    fin = np.isfinite(expected)
    assert_close("lse", to_np(lse)[fin], expected[fin], 1e-6)
    _, lse_lap = triton_impl.attention_fwd(q, k, v, scale=0.5, causal=True, chunk_size=None, block_causal=False,
                                           dropkey_p=0.0, seed=0, attn_fn="laplace")
    assert lse_lap is None  # laplace is not normalised: nothing to save (as the torch backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_laplace_tail_keeps_relative_accuracy(dtype):
    # Scores around -1.5 put laplace at ~1e-12..1e-9, where 1 + erf(z) would cancel to 0 in fp32.
    gen = torch.Generator().manual_seed(3)
    q = torch.full((1, 6, 2, 4), -0.75, dtype=torch.float64) + 0.05 * torch.randn(1, 6, 2, 4, generator=gen,
                                                                                 dtype=torch.float64)
    k = torch.full((1, 6, 2, 4), 0.5, dtype=torch.float64)
    v = torch.rand(1, 6, 2, 3, generator=gen, dtype=torch.float64) + 0.5
    qd, kd, vd = (as_input(x, dtype, requires_grad=True) for x in (q, k, v))
    o = attention(qd, kd, vd, causal=False, attn_fn="laplace", backend="triton")
    expected = ref.attention(to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    assert expected.max() < 1e-6
    assert_close("o", o, expected, tol("triton", dtype, "fwd"))
    do = torch.ones_like(o)
    grads = torch.autograd.grad(o, (qd, kd, vd), do)
    expected = ref.attention_bwd(to_np(do), to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(name, g, e, tol("triton", dtype, "bwd"))


@pytest.mark.parametrize("opts", [dict(), dict(chunk_size=10, block_causal=True, dropkey_p=0.3),
                                  dict(causal=False, attn_fn="laplace")], ids=["causal", "blockcausal", "laplace"])
def test_knobs_agree(opts):
    q, k, v, do = make_qkv(1, 45, 50, 2, 8, 4, torch.float32)
    results = []
    for cfg in [dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=64),
                dict(BLOCK_M=64, BLOCK_N=64)]:
        with knobs(**cfg):
            results.append(_fwd_bwd("triton", q, k, v, do, seed=9, **opts))
    o0, g0 = results[0]
    for o, g in results[1:]:
        assert_close("o vs 16x16 tiles", o, to_np(o0), 1e-6)
        for name, a, b in zip(("dq", "dk", "dv"), g, g0):
            assert_close(f"{name} vs 16x16 tiles", a, to_np(b), 1e-6)


@pytest.mark.parametrize("B, L, S, H, dh, dv", [(0, 5, 5, 2, 3, 3), (2, 0, 5, 2, 3, 3), (2, 5, 0, 2, 3, 3),
                                                 (2, 5, 5, 0, 3, 3), (2, 5, 5, 2, 0, 3), (2, 5, 5, 2, 3, 0)])
def test_empty_dimensions(B, L, S, H, dh, dv):
    run_case(B, L, S, H, dh, dv, torch.float32)
    run_case(B, L, S, H, dh, dv, torch.float32, chunk_size=2, block_causal=True, dropkey_p=0.5)


def test_inputs_are_not_modified():
    q, k, v = (torch.randn(2, 9, 1, 4, requires_grad=True) for _ in range(3))
    before = [x.detach().clone() for x in (q, k, v)]
    o = attention(q, k, v, scale=3.0, chunk_size=4, backend="triton")
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before))


# ---------------------------------------------------------------------------------------------
# Memory: never an L x S tensor


def test_no_allocation_of_the_score_matrix(monkeypatch):
    # Record every torch allocation the launchers make (the kernels' tiles are BLOCK_M x BLOCK_N
    # constexpr shapes): none may be as large as the B H L S score matrix; the largest is an
    # input-sized output (o, dq, dk, dv) or the [B, H, L] lse / delta.
    B, L, S, H, dh, dv = 1, 96, 96, 2, 4, 4
    q, k, v, do = make_qkv(B, L, S, H, dh, dv, torch.float32)
    sizes = []

    def recording(factory):
        def make(*args, **kwargs):
            t = factory(*args, **kwargs)
            sizes.append(t.numel())
            return t
        return make

    for name in ("empty", "empty_like", "zeros", "zeros_like", "full", "ones", "empty_strided"):
        monkeypatch.setattr(torch, name, recording(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", recording(torch.Tensor.new_empty))
    monkeypatch.setattr(torch.Tensor, "new_zeros", recording(torch.Tensor.new_zeros))
    with knobs(BLOCK_M=32, BLOCK_N=32):
        o = attention(q, k, v, dropkey_p=0.1, seed=3, backend="triton")
        torch.autograd.grad(o, (q, k, v), do)
    print(f"{len(sizes)} allocations, largest {max(sizes)} entries; score matrix {B * H * L * S}")
    assert sizes and max(sizes) <= max(q.numel(), k.numel(), v.numel(), o.numel(), B * H * L) < B * H * L * S


# ---------------------------------------------------------------------------------------------
# Support rules and AOT declarations


def test_not_supported_reasons():
    x = torch.randn(1, 4, 1, 8)
    assert triton_impl.not_supported_reasons(x, x, x) == []
    why = triton_impl.not_supported_reasons(x.double(), x.double(), x.double())
    assert any("float64" in w for w in why)
    wide = torch.randn(1, 4, 1, 300)
    assert any("dh = 300" in w for w in triton_impl.not_supported_reasons(wide, wide, x))
    with pytest.raises(Exception, match="dh = 300"):
        attention(wide, wide, x, backend="triton")


def test_aot_variants_cover_every_kernel_dtype_and_flag():
    vs = triton_impl.aot_variants()
    kernels = {v.kernel for v in vs}
    assert kernels == {"_attn_fwd_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
    for kernel in kernels - {"_attn_bwd_delta_kernel"}:
        combos = {(dict(v.constexprs)["OUT_BF16"], dict(v.constexprs)["PREC"], dict(v.constexprs)["DROP"],
                   dict(v.constexprs)["LAPLACE"]) for v in vs if v.kernel == kernel}
        # fp16 (TF32), bf16 (TF32, bf16 store), fp32 (tf32x3) x DROP x LAPLACE
        assert combos == {(bf, prec, drop, lap) for bf, prec in ((False, "tf32"), (True, "tf32"), (False, "tf32x3"))
                          for drop in (False, True) for lap in (False, True)}, kernel
        assert {dict(v.constexprs)["BLOCK_DH"] for v in vs if v.kernel == kernel} == {64, 128, 256}
        # fp32 on the GPU only up to MAX_EXACT_HEAD_DIM (refused above it, so never compiled)
        assert max(dict(v.constexprs)["BLOCK_DH"] for v in vs
                   if v.kernel == kernel and dict(v.constexprs)["PREC"] == "tf32x3") == triton_impl.MAX_EXACT_HEAD_DIM
    # the launch for each AOT head-dim pair and dtype is among the variants (dk/dv split when dv is tiled)
    for (dh, dv), exact in itertools.product(triton_impl.AOT_HEAD_DIMS, (False, True)):
        if exact and dh > triton_impl.MAX_EXACT_HEAD_DIM:
            continue
        t = triton_impl._tiles(dh, dv, triton_impl.DEFAULT_CONFIG["BLOCK_M"], triton_impl.DEFAULT_CONFIG["BLOCK_N"],
                               exact=exact)
        prec = {("PREC", "tf32x3" if exact else "tf32")}
        tiles = {k: {("BLOCK_M", t[k][0]), ("BLOCK_N", t[k][1]), ("BLOCK_DH", t["BLOCK_DH"]),
                     ("BLOCK_DV", t["BLOCK_DV"])} | prec for k in ("fwd", "dq", "dkdv")}
        assert any(tiles["fwd"] <= set(v.constexprs) and v.kernel == "_attn_fwd_kernel" for v in vs)
        assert any(tiles["dq"] <= set(v.constexprs) and v.kernel == "_attn_bwd_dq_kernel" for v in vs)
        n_dkdv = {dict(v.constexprs)["COMPUTE_DK"] + 2 * dict(v.constexprs)["COMPUTE_DV"] for v in vs
                  if v.kernel == "_attn_bwd_dkdv_kernel" and tiles["dkdv"] <= set(v.constexprs)}
        assert n_dkdv == ({3} if t["ONE_DV"] else {1, 2})


def test_fp32_dots_are_fp32_accurate_and_tiled_for_it():
    # fp32 inputs: tf32x3 dots (TF32 alone would be ~1e-3), with tiles that hold the head/tail split
    assert triton_impl._prec(torch.float32) == "tf32x3"
    assert triton_impl._prec(torch.bfloat16) == triton_impl._prec(torch.float16) == "tf32"
    half, exact = triton_impl._tiles(64, 64, 64, 64), triton_impl._tiles(64, 64, 64, 64, exact=True)
    assert exact["fwd"][0] * exact["fwd"][1] < half["fwd"][0] * half["fwd"][1]
    assert exact["BLOCK_DV"] <= half["BLOCK_DV"]
    # fp32 with dh > 128 is refused on a CUDA device (its tf32x3 backward tiles spill), with the reason;
    # a stand-in for a CUDA tensor, since there is none here
    from types import SimpleNamespace
    fake = lambda dh: SimpleNamespace(device=torch.device("cuda"), is_cuda=True, dtype=torch.float32,  # noqa: E731
                                      shape=(1, 4, 2, dh), dim=lambda: 4)
    why = triton_impl.not_supported_reasons(fake(256), fake(256), fake(256))
    assert len(why) == 1 and "dh = 256 > 128" in why[0] and "float32 q" in why[0]
    assert triton_impl.not_supported_reasons(fake(128), fake(128), fake(128)) == []
