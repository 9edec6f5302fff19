"""attention on every backend against the float64 reference: forward and dq/dk/dv for one table of
cases (torch, Triton in the interpreter, CUDA in the emulator) over every mask mode (causal
bottom-right, full, chunked, block-causal), L = S, S > L (KV cache) and S < L, softmax and Laplace,
DropKey with the package rule's mask; then each backend's own paths and knobs (torch tiling and the
chunk-batched path, Triton tiles and head dims, the CUDA flash and matmul paths in both fiber
orders and float64), empty rows, memory, the reference's own backward, and bad inputs."""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from megalodon_kernels.ops.attention import attention
from megalodon_kernels.ops.attention import torch_impl, triton_impl
from megalodon_kernels.ops.dropkey_rule import dropkey_mask, resolve_seed
from megalodon_kernels.ops.dropkey_softmax import dropkey_softmax
from megalodon_kernels.reference import attention as ref
from support import knobs as support_knobs
from support import as_input, assert_close, err_ratio, log_accuracy, to_np, tol
from support import attention_inputs as make_qkv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes the Triton kernels discard

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

#: (backend, dtype) pairs every case runs on; float16 runs on the FP16_CASES only
BACKEND_DTYPES = [(b, d) for b, d in [
    ("torch", F32), ("torch", BF16), ("torch", F64),
    ("triton", F32), ("triton", BF16),
    ("cuda", F32), ("cuda", BF16), ("cuda", F64),
]]

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
    "dropkey-blockcausal16-L33": (2, 33, 33, 2, 8, 5, dict(chunk_size=16, block_causal=True, dropkey_p=0.2)),
    "dropkey-blockcausal16-L63": (1, 63, 63, 2, 8, 5, dict(chunk_size=16, block_causal=True, dropkey_p=0.2)),
    "dropkey-blockcausal32-L129": (1, 129, 129, 2, 8, 5, dict(chunk_size=32, block_causal=True, dropkey_p=0.2)),
}
FP16_CASES = ["causal-L33", "blockcausal16-L63", "dropkey-L33", "dropkey-blockcausal16-L33"]
NONCONTIGUOUS_CASES = ["kvcache-L31-S63", "blockcausal16-L63", "dropkey-L33"]
# Triton runs in the interpreter at seconds per case: it takes the cases with at most 63 queries
# and Laplace on one case per mask mode.
TRITON_CASES = [c for c in CASES
                if c not in ("chunk32-L129", "dropkey-blockcausal16-L33", "dropkey-blockcausal32-L129")]
TRITON_LAPLACE_CASES = ["causal-L33", "kvcache-L31-S63", "S<L-L33-S17", "chunk8-noncausal-L33", "blockcausal16-L63",
                        "dropkey-L33"]


def runs(case, backend, dtype, attn_fn):
    """Which (case, backend, dtype, attn_fn) combinations run. The CUDA backend refuses Laplace in
    float64 with a reason (test_cuda_float64_laplace_is_refused_with_a_reason)."""
    if backend == "triton":
        return case in (TRITON_LAPLACE_CASES if attn_fn == "laplace" else TRITON_CASES)
    return not (backend == "cuda" and dtype == F64 and attn_fn == "laplace")


def close(name, actual, expected, tolerance, floor=0.0, terms=None):
    """assert_close, with the error normalised by max(max(terms), floor) (the magnitude of the
    terms: reference.attention's *_terms), or without terms by max(max|expected|, floor).

    Inputs are O(1), so the op's rounding errors are O(eps) in absolute terms even where a
    gradient cancels to almost 0 (one visible key: softmax is constant and dq = dk = 0 up to
    rounding). ``floor`` > 0 keeps such degenerate draws from failing on pure rounding; an
    all-zero reference is always compared in absolute terms.
    """
    assert np.isfinite(to_np(actual)).all(), f"{name}: non-finite values"
    max_abs = float(np.max(np.abs(expected), initial=0.0))
    if terms is not None and float(np.max(terms, initial=0.0)) >= max(floor, 1e-300):
        assert_close(name, actual, expected, tolerance, terms)
        return
    if max_abs >= floor and max_abs > 0.0:
        assert_close(name, actual, expected, tolerance)
        return
    max_err, _ = err_ratio(actual, expected)
    norm = max(floor, 1.0) if max_abs == 0.0 else floor
    log_accuracy(name, max_err, max_err / norm, tolerance)
    print(f"{name}: max|ref| {max_abs:.3e} below floor {norm:.1e}, max abs err {max_err:.3e} (tol {tolerance:.1e})")
    assert max_err <= tolerance * norm


def check(B, L, S, H, dh, dv, dtype=F32, *, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.0,
          seed=1234, attn_fn="softmax", scale=None, contiguous=True, data_seed=0, floor=0.0, backend="torch",
          against_torch=False):
    """Run the op on ``backend`` forward and backward and compare both with the reference (and,
    ``against_torch``, with backend="torch" on the same inputs and seed). Returns (o, grads)."""
    scale = max(dh, 1) ** -0.5 if scale is None else scale
    q, k, v, do = make_qkv(B, L, S, H, dh, dv, dtype, contiguous, data_seed)
    kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, attn_fn=attn_fn)
    o = attention(q, k, v, dropkey_p=dropkey_p, seed=seed, backend=backend, **kw)
    assert o.dtype == dtype and o.shape == (B, L, H, dv) and o.is_contiguous()
    keep = dropkey_mask(seed, dropkey_p, B, H, L, S).numpy() if dropkey_p > 0 else None
    qn, kn, vn = to_np(q), to_np(k), to_np(v)  # the reference sees the rounded inputs
    ftol, btol = tol(backend, dtype, "fwd"), tol(backend, dtype, "bwd")
    close("o", o, ref.attention(qn, kn, vn, keep_mask=keep, **kw), ftol, floor,
          ref.attention_terms(qn, kn, vn, keep_mask=keep, **kw))
    grads = torch.autograd.grad(o, (q, k, v), do)
    expected = ref.attention_bwd(to_np(do), qn, kn, vn, keep_mask=keep, **kw)
    terms = ref.attention_bwd_terms(to_np(do), qn, kn, vn, keep_mask=keep, **kw)
    for name, g, e, x, m in zip(("dq", "dk", "dv"), grads, expected, (q, k, v), terms):
        assert g.dtype == dtype and g.shape == x.shape
        close(name, g, e, btol, floor, m)
    if against_torch:
        ot = attention(q, k, v, dropkey_p=dropkey_p, seed=seed, backend="torch", **kw)
        close("o vs torch", o, to_np(ot), ftol, floor)
        for name, g, e in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ot, (q, k, v), do)):
            close(f"{name} vs torch", g, to_np(e), btol, floor)
    return o, grads


def torch_knobs(**config):
    return support_knobs(torch_impl, **config)


def triton_knobs(**config):
    return support_knobs(triton_impl, **config)


@pytest.mark.parametrize("case, backend, dtype, attn_fn", [
    pytest.param(c, b, d, fn, id=f"{c}-{b}-{str(d)[6:]}-{fn}")
    for c in CASES for b, d in BACKEND_DTYPES for fn in ("softmax", "laplace") if runs(c, b, d, fn)])
def test_attention_matches_reference(case, backend, dtype, attn_fn):
    B, L, S, H, dh, dv, opts = CASES[case]
    check(B, L, S, H, dh, dv, dtype, attn_fn=attn_fn, backend=backend, **opts)


@pytest.mark.parametrize("case, backend", [
    pytest.param(c, b, id=f"{c}-{b}") for c in FP16_CASES for b in ("torch", "triton", "cuda")
    if b != "triton" or c == "dropkey-blockcausal16-L33"])
def test_attention_float16(case, backend):
    B, L, S, H, dh, dv, opts = CASES[case]
    check(B, L, S, H, dh, dv, F16, backend=backend, **opts)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("case", NONCONTIGUOUS_CASES)
def test_attention_noncontiguous(case, backend):
    B, L, S, H, dh, dv, opts = CASES[case]
    check(B, L, S, H, dh, dv, F32, contiguous=False, backend=backend, **opts)


@given(
    B=st.integers(1, 2), L=st.integers(1, 70), S=st.integers(1, 70), H=st.integers(1, 3),
    dh=st.integers(1, 9), dv=st.integers(1, 9), causal=st.booleans(),
    chunk=st.sampled_from([None, None, 1, 4, 7, 16, 100]), block_causal=st.booleans(),
    dropkey_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    attn_fn=st.sampled_from(["softmax", "softmax", "laplace"]), contiguous=st.booleans(),
    square=st.booleans(), block_q=st.sampled_from([1, 3, 16, 128]), chunks_per_step=st.sampled_from([0, 1, 2, 16]),
    data_seed=st.integers(0, 2**31),
)
def test_torch_property(B, L, S, H, dh, dv, causal, chunk, block_causal, dropkey_p, seed, attn_fn, contiguous,
                        square, block_q, chunks_per_step, data_seed):
    S = L if square else S  # make the chunk-batched path (L == S) common
    with torch_knobs(block_q=block_q, chunks_per_step=chunks_per_step):
        check(B, L, S, H, dh, dv, F32, causal=causal, chunk_size=chunk,
              block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
              contiguous=contiguous, data_seed=data_seed, floor=1.0)


@given(
    B=st.integers(1, 2), L=st.integers(1, 50), S=st.integers(1, 50), H=st.integers(1, 2),
    dh=st.integers(1, 20), dv=st.integers(1, 20), causal=st.booleans(),
    chunk=st.sampled_from([None, None, 1, 4, 7, 16, 100]), block_causal=st.booleans(),
    dropkey_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**63 - 1),
    attn_fn=st.sampled_from(["softmax", "softmax", "laplace"]), square=st.booleans(),
    block=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]), data_seed=st.integers(0, 2**31),
)
def test_triton_property(B, L, S, H, dh, dv, causal, chunk, block_causal, dropkey_p, seed, attn_fn,
                         square, block, data_seed):
    S = L if square else S
    with triton_knobs(BLOCK_M=block[0], BLOCK_N=block[1]):
        check(B, L, S, H, dh, dv, F32, causal=causal, chunk_size=chunk,
              block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn,
              data_seed=data_seed, floor=1.0, backend="triton")


# ---------------------------------------------------------------------------------------------
# Every backend: Laplace tail, empty rows and dimensions, inputs left alone


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_laplace_tail_keeps_relative_accuracy(dtype, backend):
    # Scores around -1.5 put laplace at ~1e-12..1e-9, where 1 + erf(z) would cancel to 0 in fp32.
    gen = torch.Generator().manual_seed(3)
    q = torch.full((1, 6, 2, 4), -0.75, dtype=F64) + 0.05 * torch.randn(1, 6, 2, 4, generator=gen, dtype=F64)
    k = torch.full((1, 6, 2, 4), 0.5, dtype=F64)
    v = torch.rand(1, 6, 2, 3, generator=gen, dtype=F64) + 0.5
    qd, kd, vd = (as_input(x, dtype, requires_grad=True) for x in (q, k, v))
    o = attention(qd, kd, vd, causal=False, attn_fn="laplace", backend=backend)
    expected = ref.attention(to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    print(f"reference output range [{expected.min():.2e}, {expected.max():.2e}]")
    assert expected.max() < 1e-6
    # fp32: the tail value (1 + erf(z)) / 2 at z ~ -5 moves by ~2 z^2 = 50 ulp per ulp of the rounded
    # score, so its relative error is ~5x the op's elsewhere: its own budget, 3x-4x the measured
    # (torch 2.1e-6 / 1.7e-6, Triton 3.5e-6 / 2.6e-6 forward / gradients)
    tail_f32 = {"torch": {"fwd": 8e-6, "bwd": 6e-6}, "triton": {"fwd": 1.2e-5, "bwd": 8e-6}}[backend]
    budget = (lambda kind: tail_f32[kind]) if dtype == F32 else (lambda kind: tol(backend, dtype, kind))
    assert_close("o", o, expected, budget("fwd"))
    do = torch.ones_like(o)
    grads = torch.autograd.grad(o, (qd, kd, vd), do)
    expected = ref.attention_bwd(to_np(do), to_np(qd), to_np(kd), to_np(vd), causal=False, attn_fn="laplace")
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(name, g, e, budget("bwd"))


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("opts, L, S", [
    (dict(), 9, 4),  # S < L: the first 5 rows see no key
    (dict(dropkey_p=0.95), 12, 3),  # most rows lose all 3 keys
    (dict(chunk_size=3, causal=False), 10, 4),  # positions -6..-1 lie in chunks with no key
    (dict(chunk_size=4, block_causal=True, dropkey_p=0.9), 16, 16),  # torch: the chunk-batched path
], ids=["S<L", "all-dropped", "chunk-S<L", "blockcausal-dropped"])
def test_empty_rows_output_zero_with_finite_gradients(dtype, opts, L, S, backend):
    o, grads = check(2, L, S, 2, 4, 3, dtype, backend=backend, **opts)
    seed, p = 1234, opts.get("dropkey_p", 0.0)
    vis = ref.visible_mask(L, S, opts.get("causal", True), opts.get("chunk_size"), opts.get("block_causal", False))
    keep = dropkey_mask(seed, p, 2, 2, L, S).numpy() if p > 0 else np.ones((2, 2, L, S), dtype=bool)
    empty = ~(vis & keep).any(-1)  # [B, H, L]
    assert empty.any()
    o_bhl = to_np(o).transpose(0, 2, 1, 3)
    assert np.all(o_bhl[empty] == 0) and np.all(np.isfinite(to_np(o)))
    assert all(np.all(np.isfinite(to_np(g))) for g in grads)
    assert np.all(to_np(grads[0]).transpose(0, 2, 1, 3)[empty] == 0)


@pytest.mark.parametrize("backend, dtype", [("torch", F64), ("triton", F32)])
@pytest.mark.parametrize("B, L, S, H, dh, dv", [(0, 5, 5, 2, 3, 3), (2, 0, 5, 2, 3, 3), (2, 5, 0, 2, 3, 3),
                                                 (2, 5, 5, 0, 3, 3), (2, 5, 5, 2, 0, 3), (2, 5, 5, 2, 3, 0),
                                                 (0, 8, 8, 2, 3, 3)])
def test_empty_dimensions(B, L, S, H, dh, dv, backend, dtype):
    # Nothing to attend to is not an error: S = 0 gives o = 0, other empty dims give empty outputs.
    check(B, L, S, H, dh, dv, dtype, backend=backend)
    check(B, L, S, H, dh, dv, dtype, chunk_size=2, block_causal=True, dropkey_p=0.5, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inputs_are_not_modified(backend):
    # H = 1 makes (B, L, H, d) -> (B, H, L, d) a no-copy view: scaling q must not write through it.
    q, k, v = (torch.randn(2, 9, 1, 4, requires_grad=True) for _ in range(3))
    before = [x.detach().clone() for x in (q, k, v)]
    o = attention(q, k, v, scale=3.0, chunk_size=4, backend=backend)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before))


# ---------------------------------------------------------------------------------------------
# DropKey


def _qkv(B=2, L=20, S=24, H=3, d=4, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, dd: torch.randn(B, n, H, dd, generator=gen, dtype=dtype).requires_grad_(True)  # noqa: E731
    return make(L, d), make(S, d), make(S, d + 1)


def _fwd_bwd(q, k, v, do=None, backend="torch", **kw):
    o = attention(q, k, v, backend=backend, **kw)
    do = torch.ones_like(o) if do is None else do
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
    assert_close("o", o, ref.attention(qn, kn, vn, keep_mask=keep), tol("torch", q.dtype, "fwd"))
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref.attention_bwd(to_np(do), qn, kn, vn, keep_mask=keep)):
        assert_close(name, g, e, tol("torch", q.dtype, "bwd"))
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
    assert_close("o vs dropkey_softmax @ v", o, to_np(o2), tol("torch", torch.float64, "fwd"))
    g1 = torch.autograd.grad(o, (q, k, v), do)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        close(name, a, to_np(b), 1e-11, floor=1.0)


@pytest.mark.parametrize("opts", [dict(dropkey_p=0.3), dict(chunk_size=8, block_causal=True, dropkey_p=0.5),
                                  dict(causal=False, dropkey_p=0.2, attn_fn="laplace")],
                         ids=["causal", "blockcausal", "laplace"])
def test_triton_dropkey_same_seed_same_result_as_torch_backend(opts):
    q, k, v, do = make_qkv(2, 24, 40, 2, 8, 6, F32)
    o_t, g_t = _fwd_bwd(q, k, v, do, "triton", seed=77, **opts)
    o_r, g_r = _fwd_bwd(q, k, v, do, "torch", seed=77, **opts)
    assert_close("o triton vs torch", o_t, to_np(o_r), 1e-5)
    assert torch.equal(o_t == 0, o_r == 0)
    for name, a, b in zip(("dq", "dk", "dv"), g_t, g_r):
        assert_close(f"{name} triton vs torch", a, to_np(b), 1e-5)
    o_2, _ = _fwd_bwd(q, k, v, do, "triton", seed=77, **opts)
    assert torch.equal(o_t, o_2)  # same seed reproduces bit for bit
    o_3, _ = _fwd_bwd(q, k, v, do, "triton", seed=78, **opts)
    assert not torch.equal(o_t, o_3)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_dropkey_mask_is_the_rule_bit_for_bit(p):
    # Scores all 0 and V = identity: o[b, i, h, j] = 1/#kept where key j is kept, else 0, so the
    # output exposes the exact keep mask the forward kernel used (several query/key blocks).
    B, L, S, H = 2, 40, 48, 2
    q = torch.zeros(B, L, H, 2)
    k = torch.randn(B, S, H, 2)
    v = torch.eye(S).view(1, S, 1, S).expand(B, S, H, S)
    with triton_knobs(BLOCK_M=16, BLOCK_N=16):
        o = attention(q, k, v, causal=False, dropkey_p=p, seed=2024, backend="triton")
    observed = (o > 0).permute(0, 2, 1, 3)  # [B, H, L, S]
    assert torch.equal(observed, dropkey_mask(2024, p, B, H, L, S))


def test_triton_dropkey_backward_regenerates_the_forward_mask():
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
# torch backend: tiling knobs and the chunk-batched path


@pytest.mark.parametrize("opts", [dict(), dict(chunk_size=16), dict(chunk_size=16, block_causal=True, dropkey_p=0.3),
                                  dict(chunk_size=10, causal=False, attn_fn="laplace")],
                         ids=["causal", "chunk", "blockcausal-dropkey", "chunk-laplace"])
def test_torch_knobs_agree(opts):
    B, L, H = 2, 61, 2
    results = []
    for cfg in [dict(block_q=1, chunks_per_step=0), dict(block_q=5, chunks_per_step=0),
                dict(block_q=16, chunks_per_step=0), dict(block_q=1000, chunks_per_step=0),
                dict(block_q=128, chunks_per_step=0, max_block_elems=100),
                dict(chunks_per_step=1), dict(chunks_per_step=3), dict(chunks_per_step=64),
                dict(chunks_per_step=64, max_block_elems=2 * H * 16 * 32)]:
        with torch_knobs(**cfg):
            print(cfg, "chunk path:", torch_impl.use_chunk_path(L, L, B, H, chunk_size=opts.get("chunk_size"),
                  block_causal=opts.get("block_causal", False), **torch_impl.DEFAULT_CONFIG))
            results.append(check(B, L, L, H, 8, 4, torch.float32, **opts))
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
    with torch_knobs(chunks_per_step=4):
        batched = check(B, L, L, H, 8, 8, torch.float64, chunk_size=C, block_causal=block_causal, dropkey_p=0.2)
    with torch_knobs(chunks_per_step=0, block_q=13):
        general = check(B, L, L, H, 8, 8, torch.float64, chunk_size=C, block_causal=block_causal, dropkey_p=0.2)
    assert_close("o batched vs general", batched[0], to_np(general[0]), tol("torch", torch.float64, "fwd"))
    for name, a, b in zip(("dq", "dk", "dv"), batched[1], general[1]):
        assert_close(f"{name} batched vs general", a, to_np(b), tol("torch", torch.float64, "bwd"))


@pytest.mark.parametrize("opts", [dict(causal=False), dict(), dict(chunk_size=32, block_causal=True)],
                         ids=["full", "causal", "blockcausal"])
def test_torch_tiles_never_hold_the_full_score_matrix(opts, monkeypatch):
    B, L, H = 2, 256, 2
    budget = B * H * 64 * 64
    largest = [0]
    matmul = torch.matmul

    def recording_matmul(a, b, *args, **kwargs):
        out = matmul(a, b, *args, **kwargs)
        largest[0] = max(largest[0], out.numel())
        return out

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    with torch_knobs(block_q=64, max_block_elems=budget):
        check(B, L, L, H, 4, 4, torch.float32, dropkey_p=0.1, **opts)
    print(f"largest matmul output {largest[0]} entries; full score matrix {B * H * L * L}; budget {budget}")
    assert largest[0] <= budget < B * H * L * L


# ---------------------------------------------------------------------------------------------
# Triton backend: tiles, head dims, lse, memory, support rules and AOT declarations


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
def test_triton_small_tiles(case):
    B, L, S, H, dh, dv, opts = SMALL_TILE_CASES[case]
    with triton_knobs(BLOCK_M=16, BLOCK_N=16):
        check(B, L, S, H, dh, dv, F32, backend="triton", **opts)


@pytest.mark.parametrize("dtype, dh, dv, opts", [
    (torch.float32, 16, 40, dict(dropkey_p=0.2, chunk_size=16, block_causal=True)),
    (torch.bfloat16, 40, 16, dict(attn_fn="laplace", causal=False)),
    (torch.float32, 24, 200, dict(dropkey_p=0.2, chunk_size=16, block_causal=True)),
    (torch.bfloat16, 33, 300, dict(dropkey_p=0.2)),
    (torch.float32, 20, 136, dict(attn_fn="laplace", causal=False)),
], ids=["fp32-16-40", "bf16-40-16-laplace", "fp32-24-200", "bf16-33-300", "fp32-20-136-laplace"])
def test_triton_head_dims(dtype, dh, dv, opts):
    # dv > MAX_BLOCK_DV (136, 200, 300) runs the dv-tiled path: a dv-tile grid axis in the forward,
    # separate dk and dv launches, dP summed over dv tiles inside the dk and dq kernels.
    assert triton_impl._tiles(dh, dv, 64, 64)["ONE_DV"] == (dv <= triton_impl.MAX_BLOCK_DV)
    check(1, 33, 40, 2, dh, dv, dtype, backend="triton", **opts)


def test_triton_head_dim_256():
    # dh = 256, the 7B config's z_dim: the tiles shrink (32 x 32 forward) and dv (256) is tiled.
    t = triton_impl._tiles(256, 256, 64, 64)
    assert (t["fwd"], t["BLOCK_DH"], t["BLOCK_DV"], t["ONE_DV"]) == ((32, 32), 256, triton_impl.MAX_BLOCK_DV, False)
    check(1, 40, 40, 1, 256, 256, F32, dropkey_p=0.1, backend="triton")


def test_triton_softmax_lse_is_minus_inf_on_empty_rows_and_log_sum_exp_elsewhere():
    q, k, v, _ = make_qkv(1, 9, 4, 2, 4, 3, F32)
    o, lse = triton_impl.forward(q, k, v, scale=0.5, causal=True, chunk_size=None, block_causal=False,
                                 dropkey_p=0.0, seed=0, attn_fn="softmax")
    s = 0.5 * np.einsum("blhd,bshd->bhls", to_np(q), to_np(k))
    vis = ref.visible_mask(9, 4)
    expected = np.log(np.where(vis, np.exp(s), 0.0).sum(-1))  # -inf where nothing is visible
    assert np.array_equal(np.isneginf(to_np(lse)), np.isneginf(expected))
    fin = np.isfinite(expected)
    assert_close("lse", to_np(lse)[fin], expected[fin], tol("triton", F32, "fwd"))
    _, lse_lap = triton_impl.forward(q, k, v, scale=0.5, causal=True, chunk_size=None, block_causal=False,
                                     dropkey_p=0.0, seed=0, attn_fn="laplace")
    assert lse_lap is None  # laplace is not normalised: nothing to save (as the torch backend)


@pytest.mark.parametrize("opts", [dict(), dict(chunk_size=10, block_causal=True, dropkey_p=0.3),
                                  dict(causal=False, attn_fn="laplace")], ids=["causal", "blockcausal", "laplace"])
def test_triton_knobs_agree(opts):
    q, k, v, do = make_qkv(1, 45, 50, 2, 8, 4, F32)
    results = []
    for cfg in [dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=64),
                dict(BLOCK_M=64, BLOCK_N=64)]:
        with triton_knobs(**cfg):
            results.append(_fwd_bwd(q, k, v, do, "triton", seed=9, **opts))
    o0, g0 = results[0]
    for o, g in results[1:]:
        assert_close("o vs 16x16 tiles", o, to_np(o0), tol("triton", F32, "fwd"))
        for name, a, b in zip(("dq", "dk", "dv"), g, g0):
            assert_close(f"{name} vs 16x16 tiles", a, to_np(b), tol("triton", F32, "bwd"))


def test_triton_no_allocation_of_the_score_matrix(monkeypatch):
    # Record every torch allocation the launchers make (the kernels' tiles are BLOCK_M x BLOCK_N
    # constexpr shapes): none may be as large as the B H L S score matrix; the largest is an
    # input-sized output (o, dq, dk, dv) or the [B, H, L] lse / delta.
    B, L, S, H, dh, dv = 1, 96, 96, 2, 4, 4
    q, k, v, do = make_qkv(B, L, S, H, dh, dv, F32)
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
    with triton_knobs(BLOCK_M=32, BLOCK_N=32):
        o = attention(q, k, v, dropkey_p=0.1, seed=3, backend="triton")
        torch.autograd.grad(o, (q, k, v), do)
    print(f"{len(sizes)} allocations, largest {max(sizes)} entries; score matrix {B * H * L * S}")
    assert sizes and max(sizes) <= max(q.numel(), k.numel(), v.numel(), o.numel(), B * H * L) < B * H * L * S


def test_triton_not_supported_reasons():
    x = torch.randn(1, 4, 1, 8)
    assert triton_impl.not_supported_reasons(x, x, x) == []
    why = triton_impl.not_supported_reasons(x.double(), x.double(), x.double())
    assert any("float64" in w for w in why)
    wide = torch.randn(1, 4, 1, 300)
    assert any("dh = 300" in w for w in triton_impl.not_supported_reasons(wide, wide, x))
    with pytest.raises(Exception, match="dh = 300"):
        attention(wide, wide, x, backend="triton")


def test_triton_aot_variants_cover_every_kernel_dtype_and_flag():
    from megalodon_kernels.bench import triton_variants

    vs = triton_variants.aot_variants("attention")
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
    for (dh, dv), exact in itertools.product(triton_variants.ATTENTION_HEAD_DIMS, (False, True)):
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


def test_triton_fp32_dots_are_fp32_accurate_and_tiled_for_it():
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
    from megalodon_kernels.cuda import device as cuda_device

    with cuda_device.faked("A100"):  # the backend reads the tensors' GPU, of which there is none here
        why = triton_impl.not_supported_reasons(fake(256), fake(256), fake(256))
        assert len(why) == 1 and "dh = 256 > 128" in why[0] and "float32 q" in why[0]
        assert triton_impl.not_supported_reasons(fake(128), fake(128), fake(128)) == []


# ---------------------------------------------------------------------------------------------
# CUDA backend in the emulator: the matmul + dropkey_softmax path, float64, the flash kernels


MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "chunk": dict(causal=True, chunk_size=8),
    "chunk-noncausal": dict(causal=False, chunk_size=8),
    "blockcausal": dict(causal=True, chunk_size=8, block_causal=True),
}


def check_cuda(B, L, S, H, dh, dv, dtype, *, against_torch=True, seed=0, **kw):
    """backend="cuda" vs the reference and vs backend="torch", errors normalised by max(max|ref|, 1)."""
    return check(B, L, S, H, dh, dv, dtype, backend="cuda", against_torch=against_torch, seed=seed, floor=1.0, **kw)


@pytest.fixture
def attention_cuda(use_emulated_cuda):
    """The emulated cuda attention backend, plugged into the dispatcher (conftest.use_emulated_cuda)."""
    return use_emulated_cuda["attention"]


@pytest.fixture
def matmul_path(attention_cuda, monkeypatch):
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "matmul")
    return attention_cuda


@pytest.fixture
def flash_path(attention_cuda, monkeypatch):
    why = attention_cuda.flash_reasons(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    assert not why, f"the emulator extension was built without the flash kernels: {why}"
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "flash")
    return attention_cuda


@pytest.fixture
def calls(monkeypatch):
    """Names of the CUDA attention paths' entry points called, in order (the launch descriptions
    of ops/attention/cuda_impl.py and ops/dropkey_softmax/cuda_impl.py)."""
    from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
    from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda

    seen = []
    for module, attr, name in ((attention_cuda, "flash_fwd", "attention_flash_fwd"),
                               (attention_cuda, "flash_bwd", "attention_flash_bwd"),
                               (attention_cuda, "matmul_fwd", "attention_matmul_fwd"),
                               (attention_cuda, "matmul_bwd", "attention_matmul_bwd"),
                               (dropkey_cuda, "softmax_fwd", "dropkey_softmax_fwd"),
                               (dropkey_cuda, "softmax_bwd", "dropkey_softmax_bwd")):
        fn = getattr(module, attr)
        monkeypatch.setattr(module, attr, lambda *a, _fn=fn, _name=name, **kw: (seen.append(_name), _fn(*a, **kw))[1])
    return seen


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("L,S", [(1, 1), (33, 33), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_cuda_matmul_path_masks(matmul_path, mask, L, S):
    check_cuda(2, L, S, 2, 8, 5, F32, **MASKS[mask])


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_cuda_matmul_path_dropkey(matmul_path, dtype, mask):
    check_cuda(2, 33, 40, 3, 8, 6, dtype, dropkey_p=0.3, seed=1234, **MASKS[mask])


def test_cuda_matmul_path_dropkey_equals_torch_mask(matmul_path):
    # p = 0.9 with one visible key row pattern: a different mask would change o visibly.
    o, _ = check_cuda(1, 20, 20, 2, 4, 4, F32, dropkey_p=0.9, seed=99, causal=False)
    assert (o == 0).all(dim=-1).any()  # some rows lost every key: the drop really happened


@pytest.fixture
def score_blocks(monkeypatch):
    """(q shape, k shape) of every score block the CUDA matmul path forms (its _probs calls)."""
    from megalodon_kernels.ops.attention import cuda_impl

    probs, seen = cuda_impl._probs, []
    monkeypatch.setattr(cuda_impl, "_probs", lambda _l, q, k, *a: (seen.append((q.shape, k.shape)), probs(_l, q, k, *a))[1])
    return seen


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_cuda_matmul_path_chunks_as_batch(matmul_path, score_blocks, dtype):
    # 4 chunks of 8 over L = S = 32 run as 4 batch rows of 8 x 8 scores (not a masked 32 x 32)
    from megalodon_kernels.ops.attention import cuda_impl

    assert cuda_impl.chunks_as_batch(32, 32, 8, False) == 4
    check_cuda(2, 32, 32, 2, 8, 6, dtype, causal=True, chunk_size=8)
    assert score_blocks and all(qs[:2] == ks[:2] == (8, 8) for qs, ks in score_blocks)  # 2 x 4 chunk rows of 8 x 8


@pytest.mark.parametrize("L,S,chunk,block_causal,n", [(33, 33, 8, False, 1), (32, 32, 8, True, 1),
                                                       (32, 40, 8, False, 1), (8, 8, 8, False, 1),
                                                       (32, 32, None, False, 1), (32, 32, 8, False, 4)])
def test_cuda_matmul_path_chunk_rows(L, S, chunk, block_causal, n):
    # L not a multiple of the chunk, block_causal, a KV cache, one chunk, no chunks: the whole matrix
    from megalodon_kernels.ops.attention import cuda_impl

    assert cuda_impl.chunks_as_batch(L, S, chunk, block_causal) == n


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_cuda_matmul_path_chunk_rows_keep_the_dropkey_mask(matmul_path, score_blocks, dtype):
    # chunk rows hash DropKey's (b, h, i, j) of the whole call: each passes its batch and its start
    check_cuda(2, 32, 32, 2, 8, 6, dtype, causal=True, chunk_size=8, dropkey_p=0.3, seed=11)
    assert score_blocks and {qs[1] for qs, _ in score_blocks} == {8}


def test_cuda_matmul_path_slices_batch_rows(matmul_path, score_blocks, monkeypatch):
    # one batch row per slice: DropKey keeps each row's own mask (the slice passes its batch index)
    from megalodon_kernels.ops.attention import cuda_impl

    monkeypatch.setattr(cuda_impl, "SLICE_SCORE_BYTES", 1)
    check_cuda(3, 17, 20, 2, 8, 5, F32, causal=True, dropkey_p=0.3, seed=7)
    assert score_blocks and {qs[0] for qs, _ in score_blocks} == {1}  # every score block is one batch row


def test_cuda_auto_path_rule():
    from megalodon_kernels.ops.attention.cuda_impl import auto_prefers_matmul as prefers

    q7b, q32k, q1m = (1, 4096, 4, 256), (1, 32768, 4, 256), (1, 1 << 20, 4, 256)
    assert prefers("cuda", BF16, q7b, 4096, 2048, 4096, False)  # flash: 16 v tiles of q k^T
    assert prefers("cuda", F16, q7b, 4096, 2048, None, False)  # one chunk or none: 4 x 4096^2 scores
    assert prefers("cuda", BF16, q32k, 32768, 2048, 4096, False)  # 8 chunks as rows of 4 x 4096^2
    assert not prefers("cuda", BF16, q32k, 32768, 2048, 4096, True)  # block_causal: 4 x 32768^2 scores
    assert not prefers("cuda", BF16, q1m, 1 << 20, 2048, None, False)  # no chunks: 4 x 2^40 scores
    assert not prefers("cuda", BF16, q7b, 4096, 128, 4096, False)  # one flash v tile: nothing recomputed
    assert not prefers("cuda", F32, q7b, 4096, 2048, 4096, False)  # fp32: no flash kernel to compare
    assert not prefers("cpu", BF16, q7b, 4096, 2048, 4096, False)  # the emulator keeps its flash path


def test_cuda_auto_follows_the_rule(attention_cuda, calls, monkeypatch):
    from megalodon_kernels.ops.attention import cuda_impl

    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "auto")
    monkeypatch.setattr(cuda_impl, "auto_prefers_matmul", lambda *a: True)
    check_cuda(1, 16, 16, 2, 8, 8, F32, causal=True)
    assert "attention_flash_fwd" not in calls and "attention_matmul_fwd" in calls
    calls.clear()
    monkeypatch.setattr(cuda_impl, "auto_prefers_matmul", lambda *a: False)
    check_cuda(1, 16, 16, 2, 8, 8, F32, causal=True)
    assert "attention_flash_fwd" in calls and "attention_matmul_fwd" not in calls


def test_cuda_matmul_path_rejects_laplace(matmul_path):
    q = torch.randn(1, 4, 1, 8)
    why = matmul_path.not_supported_reasons(q, q, q, attn_fn="laplace")
    assert any("laplace" in r and "backend='torch'" in r for r in why)


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "chunk-noncausal", "full"])
def test_cuda_float64_matmul_path_dropkey(attention_cuda, order, calls, mask):
    # path "auto": float64 has no flash configuration, so the matmul path runs, in fp64 end to end
    # (an fp32 step anywhere would show as ~1e-7 against the 1e-10 / 1e-9 budget).
    check_cuda(2, 33, 40, 2, 8, 6, F64, dropkey_p=0.3, seed=1234, **MASKS[mask])
    assert "attention_flash_fwd" not in calls and "attention_flash_bwd" not in calls
    assert calls[:2] == ["attention_matmul_fwd", "dropkey_softmax_fwd"]
    assert "attention_matmul_bwd" in calls and "dropkey_softmax_bwd" in calls


@pytest.mark.parametrize("L,S", [(1, 1), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_cuda_float64_matmul_path_shapes(matmul_path, L, S):
    # S < L: the leading rows see no key (o = 0); one key: P = 1
    check_cuda(1, L, S, 2, 8, 5, F64, causal=True, dropkey_p=0.2, seed=8)


def test_cuda_float64_op_chunked_dropkey(attention_cuda):
    check_cuda(2, 11, 11, 2, 8, 8, F64, scale=0.4, chunk_size=4, block_causal=True, dropkey_p=0.3, seed=5)


def _lse_reference(q, k, scale):
    _, s, allowed = ref.attention_probs(to_np(q), to_np(k), scale=scale)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def test_cuda_float64_lse_is_float64(attention_cuda):
    from megalodon_kernels.ops.attention.cuda_impl import matmul_fwd

    q, k, v, _ = make_qkv(1, 9, 12, 2, 8, 4, F64)
    o, lse = matmul_fwd(attention_cuda.ext, q.detach(), k.detach(), v.detach(), scale=0.5, causal=True,
                        chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0)
    assert o.dtype == lse.dtype == F64
    close("lse", lse, _lse_reference(q, k, 0.5), tol("cuda", F64, "fwd"), floor=1.0)


def test_cuda_float64_forced_flash_gives_the_reason(attention_cuda, monkeypatch):
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    why = attention_cuda.flash_reasons(q, q)
    assert len(why) == 1 and "float64" in why[0] and "tensor-core" in why[0] and "path='matmul'" in why[0]
    # a direct call with path="flash" refuses with that reason ...
    kw = dict(scale=1.0, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax")
    with pytest.raises(ValueError, match="float64"):
        attention_cuda.forward(q, q, q, path="flash", **kw)
    # ... and a configured path="flash" makes the dispatcher refuse the cuda backend up front
    monkeypatch.setitem(attention_cuda.DEFAULT_CONFIG, "path", "flash")
    reasons = attention_cuda.not_supported_reasons(q, q, q)
    assert any("path='flash'" in r and "float64" in r and "backend='torch'" in r for r in reasons)
    with pytest.raises(ValueError, match="float64"):
        attention(q, q, q, backend="cuda")
    # fp32 under the same configuration is accepted (the reason is about the dtype)
    assert attention_cuda.not_supported_reasons(q.float(), q.float(), q.float()) == []


def test_cuda_float64_laplace_is_refused_with_a_reason(attention_cuda):
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    why = " ".join(attention_cuda.not_supported_reasons(q, q, q, attn_fn="laplace"))
    assert "laplace" in why and "float64" in why and "backend='torch'" in why
    with pytest.raises(ValueError, match="laplace"):
        attention(q, q, q, attn_fn="laplace", backend="cuda")
    # softmax in float64 is accepted, and an unsupported dtype still names q/k/v
    assert attention_cuda.not_supported_reasons(q, q, q) == []
    qi = torch.zeros(1, 4, 1, 8, dtype=torch.complex64)
    assert any("q/k/v" in r and "complex64" in r for r in attention_cuda.not_supported_reasons(qi, qi, qi))


# The flash kernels (CuTe; UniversalFMA atoms in the emulator)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("L,S", [(1, 1), (33, 33), (63, 63), (17, 40), (40, 17)], ids=lambda x: str(x))
def test_cuda_flash_masks(flash_path, mask, L, S):
    check_cuda(2, L, S, 2, 8, 5, F32, **MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
def test_cuda_flash_dropkey_both_orders(flash_path, order, mask):
    check_cuda(1, 70, 70, 2, 16, 12, F32, dropkey_p=0.3, seed=1234, **MASKS[mask])


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "full"])
def test_cuda_flash_laplace(flash_path, order, mask):
    check_cuda(1, 33, 40, 2, 8, 6, F32, attn_fn="laplace", dropkey_p=0.2, seed=5, **MASKS[mask])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_cuda_flash_half_types(flash_path, dtype, mask):
    check_cuda(2, 33, 40, 2, 8, 6, dtype, dropkey_p=0.25, seed=7, **MASKS[mask])


def test_cuda_flash_many_tiles_chunks_skip(flash_path):
    # 3 query and key blocks of 64, chunks of 48 straddling block edges, block_causal, DropKey:
    # exercises the key / query ranges that skip fully masked tiles and the partial tiles.
    check_cuda(1, 150, 150, 1, 8, 4, F32, chunk_size=48, block_causal=True, dropkey_p=0.1, seed=3)


@pytest.mark.parametrize("dh,dv", [(64, 64), (100, 130)], ids=["d64-dv64", "d100pad128-dv130tiled"])
def test_cuda_flash_head_dims_and_dv_tiling(flash_path, dh, dv):
    # dh = 100 is zero-padded to the D = 128 kernel; dv = 130 is padded to 256 = 2 tiles of 128.
    check_cuda(1, 20, 24, 1, dh, dv, F32, dropkey_p=0.2, seed=11, chunk_size=8)


@pytest.mark.parametrize("mask", ["causal", "blockcausal"])
def test_cuda_flash_head_dim_256_bf16(flash_path, mask):
    # The 7B head dim: D = 256 runs the 256-thread backward and dv tiles of 128 (dv = 200 -> 256).
    check_cuda(1, 20, 24, 1, 256, 200, BF16, dropkey_p=0.2, seed=13, **MASKS[mask])


@pytest.mark.parametrize("dtype, dh", [(BF16, 128), (F16, 128), (F16, 256)], ids=["bf16-d128", "fp16-d128", "fp16-d256"])
def test_cuda_flash_half_types_wide_heads(flash_path, dtype, dh):
    # the half-type kernels at D = 128 and 256 (bf16 at 256: test_cuda_flash_head_dim_256_bf16)
    check_cuda(1, 20, 24, 1, dh, dh, dtype, dropkey_p=0.2, seed=17, chunk_size=8, block_causal=True)


def test_cuda_flash_lse_matches_reference(flash_path):
    from megalodon_kernels.ops.attention.cuda_impl import flash_fwd

    q, k, v, _ = make_qkv(1, 33, 40, 2, 8, 4, F32)
    o, lse = flash_fwd(flash_path.ext, q.detach(), k.detach(), v.detach(), scale=0.5, causal=True,
                       chunk_size=None, block_causal=False, dropkey_p=0.0, seed=0, attn_fn="softmax")
    close("lse", lse, _lse_reference(q, k, 0.5), 2e-6, floor=1.0)


def test_cuda_auto_path_picks_flash_and_falls_back(attention_cuda):
    assert attention_cuda.flash_reasons(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 8)) == []
    why = attention_cuda.flash_reasons(torch.zeros(1, 2, 1, 300), torch.zeros(1, 2, 1, 8))
    assert why and "256" in why[0]
    # head dim 300 runs on the matmul path under path="auto"
    check_cuda(1, 5, 5, 1, 300, 3, F32)


@pytest.mark.parametrize("L,S", [(0, 5), (4, 0)], ids=["L0", "S0"])
def test_cuda_flash_empty_lengths(flash_path, L, S):
    # S = 0: every row is empty (o = 0, dq = 0); L = 0: nothing to compute, dk = dv = 0.
    check_cuda(1, L, S, 2, 8, 3, F32, chunk_size=2, block_causal=True, dropkey_p=0.5, seed=1)


def test_cuda_auto_path_runs_the_flash_kernels_and_matmul_fallback_the_softmax_kernel(attention_cuda, calls):
    check_cuda(1, 9, 9, 1, 8, 4, BF16, against_torch=False, dropkey_p=0.2, seed=2)
    assert calls == ["attention_flash_fwd", "attention_flash_bwd"]
    calls.clear()
    check_cuda(1, 9, 9, 1, 300, 4, F32, against_torch=False)  # head dim 300: matmul path
    assert calls == ["attention_matmul_fwd", "dropkey_softmax_fwd", "attention_matmul_bwd", "dropkey_softmax_fwd",
                     "dropkey_softmax_bwd"]
    launched = " ".join(attention_cuda.ext.ext.emulator_launched_kernels())
    assert all(n in launched for n in ("flash_fwd", "flash_bwd_kv", "flash_bwd_q", "dropkey_softmax"))


# flash_path only patches the dispatcher and the backend's config (the same for every example).
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 80), S=st.integers(1, 80), chunk=st.sampled_from([None, 1, 5, 16, 64, 100]),
       causal=st.booleans(), block_causal=st.booleans(), dropkey_p=st.sampled_from([0.0, 0.3, 0.9]),
       seed=st.integers(0, 2**63 - 1), attn_fn=st.sampled_from(["softmax", "laplace"]))
def test_cuda_flash_property(flash_path, L, S, chunk, causal, block_causal, dropkey_p, seed, attn_fn):
    check_cuda(1, L, S, 2, 8, 3, F32, against_torch=False, causal=causal, chunk_size=chunk,
               block_causal=block_causal and chunk is not None, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn)


@pytest.mark.parametrize("mask", ["causal", "blockcausal", "full"])
def test_cuda_flash_tensor_core_layouts_emulated(flash_path, monkeypatch, mask):
    # mk::flash::bf16_sm80emu (emulator only): the kernels with the SM80 TiledMMA (4 warps along M,
    # m16n8k16 bf16 -> fp32) whose atom is an mma.sync stand-in gathering the PTX fragment
    # layout by warp shuffles: checks the tensor-core thread-value layouts end to end.
    from megalodon_kernels.ops.attention import cuda_impl as attention_cuda

    monkeypatch.setitem(attention_cuda.FLASH_ELEMENTS, BF16, attention_cuda.EMULATED_MMA_ELEMENT)
    check_cuda(1, 70, 70, 2, 16, 12, BF16, dropkey_p=0.2, seed=21, **MASKS[mask])
    check_cuda(1, 9, 20, 1, 64, 64, BF16, attn_fn="laplace", **MASKS[mask])


# ---------------------------------------------------------------------------------------------
# The reference on its own: its hand-written backward against central differences of its forward
# (masks depend on indices only, so the forward is smooth in q, k, v), empty rows, the masks


EPS = 1e-6


def _fd_directional(f, xs, dirs):
    """(f(x + eps d) - f(x - eps d)) / (2 eps) for all inputs moved together along ``dirs``."""
    plus = f(*[x + EPS * d for x, d in zip(xs, dirs)])
    minus = f(*[x - EPS * d for x, d in zip(xs, dirs)])
    return (plus - minus) / (2 * EPS)


def _fd_elementwise(f, xs, which):
    """Full numerical gradient of scalar f w.r.t. input ``which``."""
    x = xs[which]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        args = [a.copy() for a in xs]
        args[which][idx] += EPS
        up = f(*args)
        args[which][idx] -= 2 * EPS
        g[idx] = (up - f(*args)) / (2 * EPS)
    return g


MODES = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, chunk_size=2),
    dict(causal=True, chunk_size=3, block_causal=True),
    dict(causal=False, chunk_size=2, block_causal=True),
]


@pytest.mark.parametrize("attn_fn", ["softmax", "laplace"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("L, S", [(5, 5), (3, 6), (6, 3)], ids=["L=S", "S>L", "S<L"])
def test_reference_backward_matches_directional_fd(attn_fn, mode, L, S):
    rng = np.random.default_rng(L * 10 + S)
    B, H, dh, dv = 2, 2, 3, 4
    q, k, v = rng.normal(size=(B, L, H, dh)), rng.normal(size=(B, S, H, dh)), rng.normal(size=(B, S, H, dv))
    keep = rng.random((B, H, L, S)) > 0.25
    do = rng.normal(size=(B, L, H, dv))
    kw = dict(scale=0.8, keep_mask=keep, attn_fn=attn_fn, **mode)

    def loss(q_, k_, v_):
        return float(np.sum(ref.attention(q_, k_, v_, **kw) * do))

    dq, dk, dv_ = ref.attention_bwd(do, q, k, v, **kw)
    for trial in range(3):
        dirs = [rng.normal(size=x.shape) for x in (q, k, v)]
        fd = _fd_directional(loss, (q, k, v), dirs)
        an = sum(float(np.sum(g * d)) for g, d in zip((dq, dk, dv_), dirs))
        print(f"trial {trial}: analytic {an:.10f} fd {fd:.10f}")
        assert abs(an - fd) <= 1e-6 * max(1.0, abs(an))


@pytest.mark.parametrize("attn_fn", ["softmax", "laplace"])
def test_reference_backward_matches_elementwise_fd(attn_fn):
    rng = np.random.default_rng(7)
    B, L, S, H, dh, dv = 1, 3, 4, 2, 2, 2
    q, k, v = rng.normal(size=(B, L, H, dh)), rng.normal(size=(B, S, H, dh)), rng.normal(size=(B, S, H, dv))
    do = rng.normal(size=(B, L, H, dv))
    kw = dict(scale=1.3, causal=True, chunk_size=2, block_causal=True, attn_fn=attn_fn)

    def loss(q_, k_, v_):
        return float(np.sum(ref.attention(q_, k_, v_, **kw) * do))

    grads = ref.attention_bwd(do, q, k, v, **kw)
    for which, name in enumerate(("dq", "dk", "dv")):
        fd = _fd_elementwise(loss, [q, k, v], which)
        err = np.max(np.abs(grads[which] - fd))
        print(f"{name}: max abs err {err:.2e}")
        assert err <= 1e-7


def test_reference_empty_rows_have_zero_output_and_gradient():
    # S < L causal: the first L - S rows see no key; a keep mask of all False drops everything.
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(1, 5, 1, 2)), rng.normal(size=(1, 2, 1, 2)), rng.normal(size=(1, 2, 1, 3))
    do = rng.normal(size=(1, 5, 1, 3))
    o = ref.attention(q, k, v)
    assert np.all(o[:, :3] == 0) and np.all(np.isfinite(o))
    dq, dk, dv = ref.attention_bwd(do, q, k, v)
    assert np.all(dq[:, :3] == 0) and all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    none = np.zeros((1, 1, 5, 2), dtype=bool)
    assert np.all(ref.attention(q, k, v, keep_mask=none) == 0)
    assert all(np.all(g == 0) for g in ref.attention_bwd(do, q, k, v, keep_mask=none))


def test_reference_visible_mask_examples():
    # Bottom-right causal with a KV cache of 2: query 0 sits at position 2.
    assert ref.visible_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    # Chunks of 2, L = S = 5 (ragged last chunk), causal within a chunk.
    m = ref.visible_mask(5, 5, True, 2).astype(int)
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    # Blockwise causal: a chunk also sees the previous one.
    m = ref.visible_mask(4, 4, False, 2, True).astype(int)
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    # S < L with chunks: positions -2, -1 are in chunk -1 (floor), which has no keys.
    m = ref.visible_mask(4, 2, False, 2).astype(int)
    assert m.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


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
