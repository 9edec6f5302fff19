"""attention (torch backend) against the float64 reference: forward, dq/dk/dv, every mask mode,
Laplace, DropKey, the tiling knobs, empty rows and bad inputs."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from megalodon_kernels.ops.attention import attention
from megalodon_kernels.ops.attention import torch_impl
from megalodon_kernels.ops.dropkey_rule import dropkey_mask, resolve_seed
from megalodon_kernels.ops.dropkey_softmax import dropkey_softmax
from megalodon_kernels.reference import attention as ref
from support import knobs as support_knobs
from support import as_input, assert_close, err_ratio, to_np, tol

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def knobs(**config):
    return support_knobs(torch_impl, **config)


def close(name, actual, expected, tolerance, floor=0.0):
    """assert_close, with the error normalised by max(max|expected|, floor) instead of max|expected|.

    Inputs are O(1), so the op's rounding errors are O(eps) in absolute terms even where a
    gradient cancels to almost 0 (one visible key: softmax is constant and dq = dk = 0 up to
    rounding). ``floor`` > 0 keeps such degenerate draws from failing on pure rounding; an
    all-zero reference is always compared in absolute terms.
    """
    max_abs = float(np.max(np.abs(expected), initial=0.0))
    if max_abs >= floor and max_abs > 0.0:
        assert_close(name, actual, expected, tolerance)
        return
    max_err, _ = err_ratio(actual, expected)
    norm = max(floor, 1.0) if max_abs == 0.0 else floor
    print(f"{name}: max|ref| {max_abs:.3e} below floor {norm:.1e}, max abs err {max_err:.3e} (tol {tolerance:.1e})")
    assert max_err <= tolerance * norm


def make_qkv(B, L, S, H, dh, dv, dtype, contiguous=True, data_seed=0):
    """q, k, v (leaves) and an upstream gradient do, drawn in float64 from one seeded generator."""
    gen = torch.Generator().manual_seed(data_seed)
    q = as_input(torch.randn(B, L, H, dh, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    k = as_input(torch.randn(B, S, H, dh, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    v = as_input(torch.randn(B, S, H, dv, generator=gen, dtype=torch.float64), dtype, contiguous, True)
    do = torch.randn(B, L, H, dv, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, do


def run_case(B, L, S, H, dh, dv, dtype=torch.float32, *, causal=True, chunk_size=None, block_causal=False,
             dropkey_p=0.0, seed=1234, attn_fn="softmax", scale=None, contiguous=True, data_seed=0, floor=0.0,
             backend="torch"):
    """Run the op on ``backend`` forward and backward and compare both with the reference (shared
    with tests/test_triton_attention.py). Returns (o, grads)."""
    scale = max(dh, 1) ** -0.5 if scale is None else scale
    q, k, v, do = make_qkv(B, L, S, H, dh, dv, dtype, contiguous, data_seed)
    kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, attn_fn=attn_fn)
    o = attention(q, k, v, dropkey_p=dropkey_p, seed=seed, backend=backend, **kw)
    assert o.dtype == dtype and o.shape == (B, L, H, dv) and o.is_contiguous()
    keep = dropkey_mask(seed, dropkey_p, B, H, L, S).numpy() if dropkey_p > 0 else None
    qn, kn, vn = to_np(q), to_np(k), to_np(v)  # the reference sees the rounded inputs
    close("o", o, ref.attention(qn, kn, vn, keep_mask=keep, **kw), tol(backend, dtype, "fwd"), floor)
    grads = torch.autograd.grad(o, (q, k, v), do)
    expected = ref.attention_bwd(to_np(do), qn, kn, vn, keep_mask=keep, **kw)
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
        close(name, g, e, tol(backend, dtype, "bwd"), floor)
    return o, grads


# id: (B, L, S, H, dh, dv, options)
CASES = {
    "L1-S1": (2, 1, 1, 2, 8, 8, {}),
    "causal-L33": (2, 33, 33, 3, 8, 5, {}),
    "full-L31": (2, 31, 31, 3, 8, 5, dict(causal=False)),
    "kvcache-L31-S63": (2, 31, 63, 2, 8, 5, {}),
    "decode-L1-S129": (2, 1, 129, 2, 8, 5, {}),
    "S<L-L33-S17": (2, 33, 17, 2, 8, 5, {}),
    "full-S>L-L33-S63": (1, 33, 63, 2, 8, 5, dict(causal=False)),
    "chunk16-ragged-L63": (2, 63, 63, 2, 8, 5, dict(chunk_size=16)),
    "chunk32-L129": (1, 129, 129, 2, 8, 5, dict(chunk_size=32)),
    "chunk8-noncausal-L33": (2, 33, 33, 2, 8, 5, dict(chunk_size=8, causal=False)),
    "blockcausal16-L63": (2, 63, 63, 2, 8, 5, dict(chunk_size=16, block_causal=True)),
    "blockcausal32-kv-L31-S129": (1, 31, 129, 2, 8, 5, dict(chunk_size=32, block_causal=True)),
    "chunk-S<L-noncausal": (1, 40, 21, 2, 8, 5, dict(chunk_size=7, causal=False)),
    "dropkey-L33": (2, 33, 33, 2, 8, 5, dict(dropkey_p=0.3)),
    "dropkey-blockcausal-L129": (1, 129, 129, 2, 8, 5, dict(chunk_size=32, block_causal=True, dropkey_p=0.2)),
}


@pytest.mark.parametrize("attn_fn", ["softmax", "laplace"])
@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_matches_reference(dtype, case, attn_fn):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, dtype, attn_fn=attn_fn, **opts)


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
@pytest.mark.parametrize("case", ["causal-L33", "blockcausal16-L63", "dropkey-L33"])
def test_attention_float16(dtype, case):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, dtype, **opts)


@pytest.mark.parametrize("case", ["kvcache-L31-S63", "blockcausal16-L63", "dropkey-L33"])
def test_attention_noncontiguous(case):
    B, L, S, H, dh, dv, opts = CASES[case]
    run_case(B, L, S, H, dh, dv, torch.float32, contiguous=False, **opts)


@given(
    B=st.integers(1, 2), L=st.integers(1, 70), S=st.integers(1, 70), H=st.integers(1, 3),
    dh=st.integers(1, 9), dv=st.integers(1, 9), causal=st.booleans(),
    chunk=st.sampled_from([None, None, 1, 4, 7, 16, 100]), block_causal=st.booleans(),
    dropkey_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    attn_fn=st.sampled_from(["softmax", "softmax", "laplace"]), contiguous=st.booleans(),
    square=st.booleans(), block_q=st.sampled_from([1, 3, 16, 128]), chunks_per_step=st.sampled_from([0, 1, 2, 16]),
    data_seed=st.integers(0, 2**31),
)
def test_attention_property(B, L, S, H, dh, dv, causal, chunk, block_causal, dropkey_p, seed, attn_fn, contiguous,
                            square, block_q, chunks_per_step, data_seed):
    S = L if square else S  # make the chunk-batched path (L == S) common
    with knobs(block_q=block_q, chunks_per_step=chunks_per_step):
        run_case(B, L, S, H, dh, dv, torch.float32, causal=causal, chunk_size=chunk,
                 block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
                 contiguous=contiguous, data_seed=data_seed, floor=1.0)


# ---------------------------------------------------------------------------------------------
# Knobs and paths


@pytest.mark.parametrize("opts", [dict(), dict(chunk_size=16), dict(chunk_size=16, block_causal=True, dropkey_p=0.3),
                                  dict(chunk_size=10, causal=False, attn_fn="laplace")],
                         ids=["causal", "chunk", "blockcausal-dropkey", "chunk-laplace"])
def test_knobs_agree(opts):
    B, L, H = 2, 61, 2
    results = []
    for cfg in [dict(block_q=1, chunks_per_step=0), dict(block_q=5, chunks_per_step=0),
                dict(block_q=16, chunks_per_step=0), dict(block_q=1000, chunks_per_step=0),
                dict(block_q=128, chunks_per_step=0, max_block_elems=100),
                dict(chunks_per_step=1), dict(chunks_per_step=3), dict(chunks_per_step=64),
                dict(chunks_per_step=64, max_block_elems=2 * H * 16 * 32)]:
        with knobs(**cfg):
            print(cfg, "chunk path:", torch_impl.use_chunk_path(L, L, B, H, chunk_size=opts.get("chunk_size"),
                  block_causal=opts.get("block_causal", False), **torch_impl.DEFAULT_CONFIG))
            results.append(run_case(B, L, L, H, 8, 4, torch.float32, **opts))
    o0, g0 = results[0]
    for o, g in results[1:]:
        assert_close("o vs block_q=1", o, to_np(o0), 1e-5)
        for name, a, b in zip(("dq", "dk", "dv"), g, g0):
            assert_close(f"{name} vs block_q=1", a, to_np(b), 1e-5)


@pytest.mark.parametrize("block_causal", [False, True])
def test_chunk_path_is_taken_and_matches_general_path(block_causal):
    B, L, H, C = 2, 100, 2, 8  # ragged: 100 = 12 * 8 + 4
    assert torch_impl.use_chunk_path(L, L, B, H, C, block_causal, chunks_per_step=4, max_block_elems=1 << 22)
    assert not torch_impl.use_chunk_path(L, L, B, H, C, block_causal, chunks_per_step=0, max_block_elems=1 << 22)
    assert not torch_impl.use_chunk_path(L, L + 1, B, H, C, block_causal, chunks_per_step=4, max_block_elems=1 << 22)
    with knobs(chunks_per_step=4):
        batched = run_case(B, L, L, H, 8, 8, torch.float64, chunk_size=C, block_causal=block_causal, dropkey_p=0.2)
    with knobs(chunks_per_step=0, block_q=13):
        general = run_case(B, L, L, H, 8, 8, torch.float64, chunk_size=C, block_causal=block_causal, dropkey_p=0.2)
    assert_close("o batched vs general", batched[0], to_np(general[0]), 1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), batched[1], general[1]):
        assert_close(f"{name} batched vs general", a, to_np(b), 1e-12)


@pytest.mark.parametrize("opts", [dict(causal=False), dict(), dict(chunk_size=32, block_causal=True)],
                         ids=["full", "causal", "blockcausal"])
def test_tiles_never_hold_the_full_score_matrix(opts, monkeypatch):
    B, L, H = 2, 256, 2
    budget = B * H * 64 * 64
    largest = [0]
    matmul = torch.matmul

    def recording_matmul(a, b, *args, **kwargs):
        out = matmul(a, b, *args, **kwargs)
        largest[0] = max(largest[0], out.numel())
        return out

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    with knobs(block_q=64, max_block_elems=budget):
        run_case(B, L, L, H, 4, 4, torch.float32, dropkey_p=0.1, **opts)
    print(f"largest matmul output {largest[0]} entries; full score matrix {B * H * L * L}; budget {budget}")
    assert largest[0] <= budget < B * H * L * L


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_laplace_tail_keeps_relative_accuracy(dtype):
    # Scores around -1.5 put laplace at ~1e-12..1e-9, where 1 + erf(z) would cancel to 0 in fp32.
    q = torch.full((1, 6, 2, 4), -0.75, dtype=torch.float64) + 0.05 * torch.randn(1, 6, 2, 4, dtype=torch.float64)
    k = torch.full((1, 6, 2, 4), 0.5, dtype=torch.float64)
    v = torch.rand(1, 6, 2, 3, dtype=torch.float64) + 0.5
    qd, kd, vd = (as_input(x, dtype, requires_grad=True) for x in (q, k, v))
    o = attention(qd, kd, vd, causal=False, attn_fn="laplace", backend="torch")
    expected = ref.attention(to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    print(f"reference output range [{expected.min():.2e}, {expected.max():.2e}]")
    assert expected.max() < 1e-6
    assert_close("o", o, expected, tol("torch", dtype, "fwd"))
    do = torch.ones_like(o)
    grads = torch.autograd.grad(o, (qd, kd, vd), do)
    expected = ref.attention_bwd(to_np(do), to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(name, g, e, tol("torch", dtype, "bwd"))


@pytest.mark.parametrize("B, L, S, H, dh, dv", [(0, 5, 5, 2, 3, 3), (2, 0, 5, 2, 3, 3), (2, 5, 0, 2, 3, 3),
                                                 (2, 5, 5, 0, 3, 3), (2, 5, 5, 2, 0, 3), (0, 8, 8, 2, 3, 3)])
def test_empty_dimensions(B, L, S, H, dh, dv):
    # Nothing to attend to is not an error: S = 0 gives o = 0, other empty dims give empty outputs.
    run_case(B, L, S, H, dh, dv, torch.float64)
    run_case(B, L, S, H, dh, dv, torch.float64, chunk_size=2, block_causal=True, dropkey_p=0.5)


def test_inputs_are_not_modified():
    # H = 1 makes (B, L, H, d) -> (B, H, L, d) a no-copy view: scaling q must not write through it.
    q, k, v = (torch.randn(2, 9, 1, 4, requires_grad=True) for _ in range(3))
    before = [x.detach().clone() for x in (q, k, v)]
    o = attention(q, k, v, scale=3.0, chunk_size=4, backend="torch")
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before))


# ---------------------------------------------------------------------------------------------
# DropKey


def _qkv(B=2, L=20, S=24, H=3, d=4, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, dd: torch.randn(B, n, H, dd, generator=gen, dtype=dtype).requires_grad_(True)  # noqa: E731
    return make(L, d), make(S, d), make(S, d + 1)


def _fwd_bwd(q, k, v, **kw):
    o = attention(q, k, v, backend="torch", **kw)
    do = torch.ones_like(o)
    return o.detach(), torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("opts", [dict(), dict(chunk_size=8, block_causal=True)], ids=["causal", "blockcausal"])
def test_dropkey_same_seed_reproduces_and_other_seed_differs(opts):
    q, k, v = _qkv(L=24)
    o1, g1 = _fwd_bwd(q, k, v, dropkey_p=0.3, seed=5, **opts)
    o2, g2 = _fwd_bwd(q, k, v, dropkey_p=0.3, seed=5, **opts)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    o3, g3 = _fwd_bwd(q, k, v, dropkey_p=0.3, seed=6, **opts)
    assert not torch.equal(o1, o3) and not torch.equal(g1[0], g3[0])


def test_dropkey_seed_none_draws_from_torch_generator_and_backward_reuses_it():
    q, k, v = _qkv()
    torch.manual_seed(11)
    drawn = resolve_seed(None)  # what the op will draw after the same manual_seed
    torch.manual_seed(11)
    o = attention(q, k, v, dropkey_p=0.4, seed=None, backend="torch")
    torch.manual_seed(12345)  # moving the global generator must not change the backward's mask
    do = torch.randn(o.shape, dtype=o.dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    keep = dropkey_mask(drawn, 0.4, 2, 3, 20, 24).numpy()
    qn, kn, vn = to_np(q), to_np(k), to_np(v)
    assert_close("o", o, ref.attention(qn, kn, vn, keep_mask=keep), 1e-10)
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref.attention_bwd(to_np(do), qn, kn, vn, keep_mask=keep)):
        assert_close(name, g, e, 1e-9)
    torch.manual_seed(11)
    assert torch.equal(attention(q, k, v, dropkey_p=0.4, backend="torch"), o)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropkey_mask_matches_rule_and_drop_fraction_is_binomial(p):
    # Scores all 0 and V = identity: o[b, i, h, j] = P_ij = 1/#kept where key j is kept, else 0,
    # so the output exposes the exact keep mask the op used.
    B, L, S, H = 2, 48, 160, 3
    q = torch.zeros(B, L, H, 2, dtype=torch.float64)
    k = torch.randn(B, S, H, 2, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).view(1, S, 1, S).expand(B, S, H, S)
    o = attention(q, k, v, causal=False, dropkey_p=p, seed=2024, backend="torch")
    observed = (o > 0).permute(0, 2, 1, 3)  # [B, H, L, S]
    expected = dropkey_mask(2024, p, B, H, L, S)
    assert torch.equal(observed, expected)
    n = observed.numel()
    frac = 1.0 - observed.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    print(f"p={p}: dropped fraction {frac:.5f}, {abs(frac - p) / sigma:.2f} sigma over n={n}")
    assert abs(frac - p) <= 5 * sigma


def test_dropkey_p0_is_plain_softmax_and_ignores_seed():
    q, k, v = _qkv(dtype=torch.float32)
    state = torch.get_rng_state()
    o_none = attention(q, k, v, scale=0.5, backend="torch")
    assert torch.equal(torch.get_rng_state(), state)  # p = 0 draws no seed
    o_seed = attention(q, k, v, scale=0.5, dropkey_p=0.0, seed=77, backend="torch")
    assert torch.equal(o_none, o_seed)
    # Plain PyTorch softmax attention with the bottom-right causal mask (S - L = 4).
    s = 0.5 * torch.einsum("blhd,bshd->bhls", q, k)
    mask = torch.ones(20, 24, dtype=torch.bool).tril(diagonal=4)
    plain = torch.einsum("bhls,bshd->blhd", torch.softmax(s.masked_fill(~mask, -math.inf), -1), v)
    assert_close("o vs torch.softmax", o_none, to_np(plain), 2e-6)


@given(B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 40), S=st.integers(1, 40), causal=st.booleans(),
       p=st.sampled_from([0.0, 0.2, 0.6]), seed=st.integers(0, 2**63 - 1), scale=st.floats(0.1, 2.0),
       data_seed=st.integers(0, 2**31))
def test_attention_equals_dropkey_softmax_times_v(B, H, L, S, causal, p, seed, scale, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    q = torch.randn(B, L, H, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, S, H, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, S, H, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(B, L, H, 3, generator=gen, dtype=torch.float64)
    o = attention(q, k, v, scale=scale, causal=causal, dropkey_p=p, seed=seed, backend="torch")
    scores = scale * torch.einsum("blhd,bshd->bhls", q, k)
    o2 = torch.einsum("bhls,bshd->blhd", dropkey_softmax(scores, causal, p, seed, backend="torch"), v)
    assert_close("o vs dropkey_softmax @ v", o, to_np(o2), 1e-12)
    g1 = torch.autograd.grad(o, (q, k, v), do)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        close(name, a, to_np(b), 1e-11, floor=1.0)


# ---------------------------------------------------------------------------------------------
# Rows with nothing to attend to


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opts, L, S", [
    (dict(), 9, 4),  # S < L: the first 5 rows see no key
    (dict(dropkey_p=0.95), 12, 3),  # most rows lose all 3 keys
    (dict(chunk_size=3, causal=False), 10, 4),  # positions -6..-1 lie in chunks with no key
    (dict(chunk_size=4, block_causal=True, dropkey_p=0.9), 16, 16),  # chunk-batched path
], ids=["S<L", "all-dropped", "chunk-S<L", "blockcausal-dropped"])
def test_empty_rows_output_zero_with_finite_gradients(dtype, opts, L, S):
    o, grads = run_case(2, L, S, 2, 4, 3, dtype, **opts)
    seed, p = 1234, opts.get("dropkey_p", 0.0)
    vis = ref.visible_mask(L, S, opts.get("causal", True), opts.get("chunk_size"), opts.get("block_causal", False))
    keep = dropkey_mask(seed, p, 2, 2, L, S).numpy() if p > 0 else np.ones((2, 2, L, S), dtype=bool)
    empty = ~(vis & keep).any(-1)  # [B, H, L]
    assert empty.any()
    o_bhl = to_np(o).transpose(0, 2, 1, 3)
    assert np.all(o_bhl[empty] == 0) and np.all(np.isfinite(to_np(o)))
    assert all(np.all(np.isfinite(to_np(g))) for g in grads)
    assert np.all(to_np(grads[0]).transpose(0, 2, 1, 3)[empty] == 0)


# ---------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize("bad, exc, match", [
    (dict(q=torch.randn(2, 3, 4)), ValueError, r"q must have rank 4 \(B, L, H, dh\)"),
    (dict(k=torch.randn(2, 5, 2)), ValueError, r"k must have rank 4 \(B, S, H, dh\)"),
    (dict(k=torch.randn(3, 5, 2, 4)), ValueError, r"k must have shape \(B, S, H, dh\)"),
    (dict(k=torch.randn(2, 5, 3, 4)), ValueError, r"k must have shape \(B, S, H, dh\)"),
    (dict(k=torch.randn(2, 5, 2, 8)), ValueError, r"k must have shape \(B, S, H, dh\)"),
    (dict(v=torch.randn(2, 6, 2, 3)), ValueError, r"v must have shape \(B, S, H, dv\)"),
    (dict(v=torch.randn(2, 5, 3, 3)), ValueError, r"v must have shape \(B, S, H, dv\)"),
    (dict(q=torch.randn(2, 3, 2, 4, dtype=torch.float64)), TypeError, "k has dtype"),
    (dict(v=torch.randn(2, 5, 2, 3, dtype=torch.bfloat16)), TypeError, "v has dtype"),
    (dict(q=torch.ones(2, 3, 2, 4, dtype=torch.int64)), TypeError, "q must have dtype"),
    (dict(k=torch.randn(2, 5, 2, 4, device="meta")), ValueError, "k is on meta"),
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(scale=float("inf")), ValueError, "scale must be finite"),
    (dict(scale=float("nan")), ValueError, "scale must not be NaN"),
    (dict(scale="1"), TypeError, "scale must be a float"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
    (dict(chunk_size=2.0), TypeError, "chunk_size must be an int"),
    (dict(block_causal=True), ValueError, "block_causal=True needs chunk_size"),
    (dict(block_causal="yes", chunk_size=2), TypeError, "block_causal must be a bool"),
    (dict(dropkey_p=-0.1), ValueError, "dropkey_p must be >= 0"),
    (dict(dropkey_p=1.0), ValueError, "dropkey_p must be < 1"),
    (dict(dropkey_p=0.1, seed=-1), ValueError, "seed must be in"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(attn_fn="relu"), ValueError, "attn_fn must be one of"),
    (dict(backend="cuDNN"), ValueError, "backend must be one of"),
])
def test_attention_bad_inputs(bad, exc, match):
    args = dict(q=torch.randn(2, 3, 2, 4), k=torch.randn(2, 5, 2, 4), v=torch.randn(2, 5, 2, 3))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=match):
        attention(q, k, v, **args)
