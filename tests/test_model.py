"""Model layer (model/): every module's forward against a float64 composition of the NumPy
references in megalodon_kernels.reference (plus plain NumPy for linear layers and the
per-position norms, which have no op), gradients reaching every parameter, configs and presets.

The reference composition below is written from the model math (docs/math.md, model) directly, independently of the
model code: coefficients, +1 reparameterisations, RoPE positions relative to each chunk,
block-diagonal causal attention, the two-hop residual.
"""
import math

import numpy as np
import pytest
import torch

from megalodon_kernels.model import (ComplexEMA, Megalodon, MegalodonAttention, MegalodonBlock,
                                     MegalodonConfig, PRESETS, TimestepNorm, get_config)
from megalodon_kernels.reference import attention as R_attn
from megalodon_kernels.reference import cema as R_cema
from megalodon_kernels.reference import rotary as R_rot
from megalodon_kernels.reference import timestep_norm as R_tsn
from support import tol

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

# the model's budgets (tests/support.py, op "model": 3x-4x the worst error its tests measure; here
# fp32 4.5e-7 (lm logits), fp64 1.6e-15 (cema h) at most, docs/verification.md)
TOL = {dtype: tol("torch", dtype, "fwd") for dtype in (torch.float64, torch.float32)}

# `with torch.device("meta")` recognises factory functions through a lazily built, cached set;
# build it now, before conftest's NaN-poisoning fixture swaps torch.empty for a wrapper (the
# wrapper would be cached instead and meta construction would allocate for real).
try:
    import torch.utils._device as _torch_device

    _torch_device._device_constructors()
except (ImportError, AttributeError):  # private API moved: the meta test then skips itself
    pass


def n(t):
    """Tensor -> float64 / complex128 NumPy."""
    t = t.detach().cpu()
    return t.to(torch.complex128).numpy() if t.is_complex() else t.to(torch.float64).numpy()


def check(name, actual, expected, tol):
    a, e = n(actual) if isinstance(actual, torch.Tensor) else actual, np.asarray(expected)
    assert a.shape == e.shape, f"{name}: shape {a.shape} vs {e.shape}"
    err = float(np.max(np.abs(a - e)))
    rel = err / max(float(np.max(np.abs(e))), 1e-30)
    print(f"{name}: max abs err {err:.3e}, relative {rel:.3e} (tol {tol:.0e})")
    assert rel <= tol, f"{name}: relative error {rel:.3e} > {tol:.0e}"


def small_cfg(**kw):
    base = dict(num_layers=2, model_dim=24, z_dim=16, value_dim=20, num_heads=2, ffn_hidden_dim=40, cema_ndim=4,
                chunk_size=8, norm_num_groups=4, vocab_size=37, backend="torch")
    base.update(kw)
    return MegalodonConfig(**base)


@torch.no_grad()
def randomize(module, scale=0.3):
    """Perturb every parameter (zero-initialised norm weights, gamma/beta, imaginary CEMA gamma)
    so each +1 and offset is actually exercised."""
    g = torch.Generator().manual_seed(1234)
    for p in module.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


# ---------------------------------------------------------------------------------------------
# Reference composition (float64 NumPy)

def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sig(x)


def rms(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * (w + 1.0)


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y if w is None else y * (w + 1.0) + b


def lin(x, layer):
    y = x @ n(layer.weight).T
    return y if layer.bias is None else y + n(layer.bias)


def ref_coeffs(cema):
    alpha, delta, theta, gamma = n(cema.alpha)[..., 0], n(cema.delta)[..., 0], n(cema.theta)[:, 0, 0], n(cema.gamma)
    N = alpha.shape[1]
    a, d = sig(alpha), sig(delta)
    phase = np.arange(1, N + 1)[None, :] * sig(theta)[:, None] * 2 * math.pi / N
    log_q = np.log(1.0 - a * d) + 1j * phase
    return a, log_q, (gamma[..., 0] + 1j * gamma[..., 1]) * math.sqrt(1.0 / N)


def ref_tsn(mod, x, prev=(None, None, None)):
    pc, pm, pv = prev
    B = x.shape[0]
    if pc is None:
        pc = np.full(B, int(mod.prior_count))
        pm = np.broadcast_to(n(mod.prior_mean), (B, mod.num_groups))
        pv = np.broadcast_to(np.exp(n(mod.prior_logv)), (B, mod.num_groups))
    return R_tsn.timestep_norm(x, n(mod.weight) + 1.0, n(mod.bias), mod.num_groups, pc, pm, pv, None, mod.eps)


def ref_mega(mod, x, st=None):
    """Spec 7.1 / 7.2. st: dict with prev stats, hx, k, v (or None); returns (out, new st)."""
    B, L, D = x.shape
    H, dz, dv, C, eps = mod.num_heads, mod.z_head_dim, mod.v_head_dim, mod.chunk_size, mod.timenorm.eps
    st = st or {"prev": (None, None, None), "hx": None, "k": np.zeros((B, 0, H, dz)), "v": np.zeros((B, 0, H, dv))}
    tsn, cnt, mean, var = ref_tsn(mod.timenorm, x, st["prev"])
    p, log_q, gamma = ref_coeffs(mod.cema)
    y, h = R_cema.cema(tsn.transpose(0, 2, 1), p, log_q, gamma, n(mod.cema.omega)[:, 0], st["hx"], True)
    mx = rms(y.transpose(0, 2, 1), None if mod.rmsnorm.weight is None else n(mod.rmsnorm.weight), eps)
    z = rms(lin(mx, mod.wz).reshape(B, L, H, dz), None, eps).reshape(B, L, H * dz)
    G, Bt = n(mod.gamma), n(mod.beta)
    q = z * (G[0] + 1.0) / math.sqrt(dz) + Bt[0]
    k = z * (G[1] + 1.0) / math.sqrt(dz) + Bt[1]
    v = silu(lin(tsn, mod.wv)).reshape(B, L, H, dv)
    r = silu(lin(mx, mod.wr))
    off = st["k"].shape[1]
    pos = (off + np.arange(L)) % C  # RoPE position inside the chunk
    q = R_rot.rotary(q.reshape(B, L, H, dz), pos, mod.rope_base)
    k = R_rot.rotary(k.reshape(B, L, H, dz), pos, mod.rope_base)
    k_all, v_all = np.concatenate([st["k"], k], 1), np.concatenate([st["v"], v], 1)
    attn = R_attn.attention(q, k_all, v_all, scale=1.0, causal=True, chunk_size=C).reshape(B, L, H * dv)
    out = lin(mx, mod.wh1) + lin(attn * r, mod.wh2) + x
    S = k_all.shape[1]
    keep = S % C
    new = {"prev": (cnt, mean, var), "hx": h, "k": k_all[:, S - keep:], "v": v_all[:, S - keep:]}
    return out, new


def ref_nffn(mod, y, residual):
    eps = mod.norm.eps
    u = layer_norm(y, None if mod.norm.weight is None else n(mod.norm.weight),
                   None if mod.norm.bias is None else n(mod.norm.bias), eps)
    hidden = silu(lin(u, mod.fc1))
    if mod.fc3 is not None:
        hidden = hidden * lin(u, mod.fc3)
    out = lin(hidden, mod.fc2)
    if mod.alpha is not None:
        out = out * n(mod.alpha)
    return out + residual


def ref_lm(model, tokens):
    cfg = model.config
    x = n(model.embed.weight)[tokens.numpy()]
    if cfg.scale_emb:
        x = x * math.sqrt(cfg.model_dim)
    for blk in model.layers:
        y, _ = ref_mega(blk.mega, x)
        x = ref_nffn(blk.nffn, y, x)
    x, _, _, _ = ref_tsn(model.output.final_norm, x)
    return x @ n(model.output.output.weight).T


# ---------------------------------------------------------------------------------------------
# Module forwards == reference composition

DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_complex_ema_matches_reference(dtype):
    torch.manual_seed(0)
    mod = ComplexEMA(12, 5, backend="torch").to(dtype)
    randomize(mod)
    B, L = 2, 19
    x = torch.randn(B, 12, L, dtype=dtype)
    hx = torch.randn(B, 12, 5, dtype=torch.complex128).to(torch.complex128 if dtype == torch.float64
                                                          else torch.complex64)
    p, log_q, gamma = ref_coeffs(mod)
    for h0 in (None, hx):
        y, h = mod(x, h0, return_state=True)
        y_ref, h_ref = R_cema.cema(n(x), p, log_q, gamma, n(mod.omega)[:, 0], None if h0 is None else n(h0), True)
        check("cema y", y, y_ref, TOL[dtype])
        check("cema h", h, h_ref, TOL[dtype])
    cp, clq, cg = mod.coefficients()
    assert cp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check("p", cp, p, TOL[dtype])
    check("log_q", clq, log_q, TOL[dtype])
    check("gamma_c", cg, gamma, TOL[dtype])


def test_complex_ema_coefficients_fp32_from_bf16_params_and_slow_decay():
    """Coefficients are fp32 whatever the parameter dtype; log|q| near |q| = 1 keeps its digits."""
    mod = ComplexEMA(4, 3, backend="torch")
    with torch.no_grad():
        mod.alpha.fill_(9.0)
        mod.delta.fill_(11.0)  # 1 - a d ~ 1.4e-4: fp32 1 - a*d loses ~3 digits
    exact = math.log(sig(-9.0) + sig(9.0) * sig(-11.0))  # 1 - a d without cancellation
    _, log_q, _ = mod.coefficients()
    rel = abs(float(log_q.real[0, 0].detach()) - exact) / abs(exact)
    print(f"log|q| rel err {rel:.2e}")
    assert rel < 1e-6
    # saturated sigmoids (a d rounds to 1 in fp32): the gradient stays finite
    with torch.no_grad():
        mod.alpha.fill_(20.0)
        mod.delta.fill_(20.0)
    y, _ = mod(torch.randn(1, 4, 9))
    y.sum().backward()
    assert torch.isfinite(mod.alpha.grad).all() and torch.isfinite(mod.delta.grad).all()
    mod_bf = mod.to(torch.bfloat16)
    p, log_q, gamma = mod_bf.coefficients()
    assert p.dtype == torch.float32 and log_q.dtype == torch.complex64 and gamma.dtype == torch.complex64


def test_complex_ema_no_stale_coefficients_in_eval():
    """Upstream caches coefficients in eval mode (an upstream behaviour we keep); a parameter change must show."""
    mod = ComplexEMA(6, 4, backend="torch").eval()
    x = torch.randn(1, 6, 9)
    y0, _ = mod(x)
    with torch.no_grad():
        mod.alpha.add_(1.0)
    y1, _ = mod(x)
    assert not torch.allclose(y0, y1)


@pytest.mark.parametrize("prior_count", [0, 3])
def test_timestep_norm_module_matches_reference(prior_count):
    mod = TimestepNorm(12, 3, prior_count=prior_count, backend="torch").double()
    randomize(mod)
    if prior_count:
        assert isinstance(mod.prior_mean, torch.nn.Parameter)
    else:
        with torch.no_grad():  # buffers: give them values anyway (a loaded checkpoint may)
            mod.prior_mean.add_(0.1)
            mod.prior_logv.add_(-0.2)
    x = torch.randn(2, 11, 12, dtype=torch.float64) * 3 + 1
    y, cnt, mean, var = mod(x)
    y_ref, cnt_ref, mean_ref, var_ref = ref_tsn(mod, n(x))
    check("tsn y", y, y_ref, TOL[torch.float64])
    check("tsn mean", mean, mean_ref, TOL[torch.float64])
    check("tsn var", var, var_ref, TOL[torch.float64])
    assert cnt.tolist() == list(cnt_ref)
    # continuing from a carried state
    y2, _, _, _ = mod(x, cnt, mean, var)
    y2_ref = R_tsn.timestep_norm(n(x), n(mod.weight) + 1, n(mod.bias), 3, cnt_ref, mean_ref, var_ref, None, mod.eps)[0]
    check("tsn y (carried)", y2, y2_ref, TOL[torch.float64])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_affine", [True, False], ids=["affine", "no-affine"])
def test_mega_attention_matches_reference(dtype, norm_affine):
    """L = 29 with C = 8: three full chunks and a partial one, in one call and then continued."""
    torch.manual_seed(1)
    cfg = small_cfg(norm_affine=norm_affine)
    mod = MegalodonAttention(cfg).to(dtype).eval()
    randomize(mod)
    x = torch.randn(2, 29, cfg.model_dim, dtype=dtype)
    out_ref, _ = ref_mega(mod, n(x))
    check("mega", mod(x), out_ref, TOL[dtype])
    # streaming through a LayerState: 11 tokens then 18 (starting mid-chunk)
    from megalodon_kernels.model import LayerState
    st = LayerState.empty(2, cfg.chunk_size, 2, 8, 10, dtype=dtype)
    a = mod(x[:, :11], st)
    assert st.chunk_offset == 3
    b = mod(x[:, 11:], st)
    check("mega streamed", torch.cat([a, b], 1), out_ref, TOL[dtype])
    # and the reference itself, continued from its own state, agrees
    r1, s1 = ref_mega(mod, n(x[:, :11]))
    r2, _ = ref_mega(mod, n(x[:, 11:]), s1)
    check("reference streamed vs whole", np.concatenate([r1, r2], 1), out_ref, TOL[torch.float64])


@pytest.mark.parametrize("swiglu,rescale", [(False, False), (True, True)], ids=["silu", "swiglu-rescale"])
def test_nffn_and_block_match_reference(swiglu, rescale):
    cfg = small_cfg(swiglu=swiglu, rescale_nffn=rescale)
    blk = MegalodonBlock(cfg, layer_id=1).double().eval()
    if rescale:
        assert torch.allclose(blk.nffn.alpha, torch.full((cfg.model_dim,), 0.05, dtype=torch.float64))
    randomize(blk)
    assert (blk.nffn.fc3 is not None) == swiglu and (blk.nffn.alpha is not None) == rescale
    y, x = torch.randn(2, 2, 13, cfg.model_dim, dtype=torch.float64).unbind(0)
    check("nffn", blk.nffn(y, x), ref_nffn(blk.nffn, n(y), n(x)), TOL[torch.float64])
    mega_ref, _ = ref_mega(blk.mega, n(x))
    check("block (two-hop residual)", blk(x), ref_nffn(blk.nffn, mega_ref, n(x)), TOL[torch.float64])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "pg19"])
def test_lm_matches_reference(dtype, variant):
    extra = dict(swiglu=True, scale_emb=True, share_emb=True) if variant == "pg19" else dict(output_size=29)
    torch.manual_seed(2)
    model = Megalodon(small_cfg(**extra)).to(dtype).eval()
    randomize(model, 0.2)
    tokens = torch.randint(0, 37, (2, 21))
    logits = model(tokens)
    assert logits.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert logits.shape == (2, 21, model.config.out_size)
    if variant == "pg19":
        assert model.output.output.weight is model.embed.weight
    check("lm logits", logits, ref_lm(model, tokens), TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Gradients

@pytest.mark.parametrize("extra", [dict(), dict(swiglu=True, rescale_nffn=True, share_emb=True, scale_emb=True,
                                                norm_prior_count=2)],
                         ids=["plain", "all-options"])
def test_gradients_reach_every_parameter(extra):
    torch.manual_seed(3)
    model = Megalodon(small_cfg(**extra))
    tokens = torch.randint(0, 37, (2, 20))  # 2 full chunks + a partial one
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    names = [name for name, _ in model.named_parameters()]
    if extra:
        assert any(k.endswith("prior_mean") for k in names) and any(k.endswith("nffn.alpha") for k in names)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient reached {name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"
        assert p.grad.abs().max() > 0, f"zero gradient in {name}"


def test_gradient_matches_finite_difference():
    """Directional derivative of a float64 model's loss along a random parameter direction."""
    torch.manual_seed(4)
    model = Megalodon(small_cfg(swiglu=True, rescale_nffn=True)).double()
    randomize(model, 0.1)
    tokens = torch.randint(0, 37, (1, 19))
    w = torch.randn(1, 19, 37, dtype=torch.float64)
    params = list(model.parameters())

    def loss():
        return (model(tokens).double() * w).sum()

    loss().backward()
    dirs = [torch.randn_like(p) for p in params]
    analytic = sum(float((p.grad * d).sum()) for p, d in zip(params, dirs))
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, dirs):
            p.add_(eps * d)
        up = float(loss())
        for p, d in zip(params, dirs):
            p.sub_(2 * eps * d)
        down = float(loss())
    numeric = (up - down) / (2 * eps)
    print(f"analytic {analytic:.8e} numeric {numeric:.8e}")
    assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric))


def test_training_mode_dropkey_is_reproducible():
    torch.manual_seed(5)
    model = Megalodon(small_cfg(attention_dropout=0.3, dropout=0.1, hidden_dropout=0.1))
    tokens = torch.randint(0, 37, (2, 17))
    torch.manual_seed(7)
    a = model(tokens)
    torch.manual_seed(7)
    b = model(tokens)
    assert torch.equal(a, b)
    model.eval()
    c, d = model(tokens), model(tokens)
    assert torch.equal(c, d) and not torch.allclose(a, c)


def test_layerwise_checkpointing_same_gradients():
    torch.manual_seed(6)
    cfg = small_cfg()
    m1, m2 = Megalodon(cfg), Megalodon(cfg.replace(layerwise_ckpt=True))
    m2.load_state_dict(m1.state_dict())
    tokens = torch.randint(0, 37, (1, 12))
    m1(tokens).sum().backward()
    m2(tokens).sum().backward()
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), name


@torch.no_grad()
def test_bf16_forward_runs_with_fp32_coefficients():
    torch.manual_seed(8)
    model = Megalodon(small_cfg()).eval()
    tokens = torch.randint(0, 37, (1, 20))
    ref = model(tokens)
    out = model.to(torch.bfloat16)(tokens)
    assert torch.isfinite(out).all()
    rel = float((out - ref).abs().max() / ref.abs().max())
    print(f"bf16 vs fp32 logits: rel {rel:.3e}")
    assert rel < 0.1


# ---------------------------------------------------------------------------------------------
# Config, presets, construction

def test_presets_match_upstream_table_and_build_without_cuda():
    table = {  # upstream presets: layers, D, H, z, v, F, G, swiglu, scale_emb, share_emb
        "mega200M": (12, 1024, 1, 256, 2048, 2560, 32, False, False, False),
        "mega1.3B": (24, 2048, 2, 512, 4096, 4864, 64, False, False, False),
        "mega1.3B_pg19": (24, 2048, 2, 512, 4096, 3584, 64, True, True, True),
        "mega7.1B": (32, 4096, 4, 1024, 8192, 11264, 64, False, False, False),
        "mega7.3B": (32, 4096, 4, 1024, 8192, 8192, 64, True, False, False),
    }
    for name, row in table.items():
        c = PRESETS[name]
        assert (c.num_layers, c.model_dim, c.num_heads, c.z_dim, c.value_dim, c.ffn_hidden_dim, c.norm_num_groups,
                c.swiglu, c.scale_emb, c.share_emb) == row, name
        assert c.chunk_size == 2048 and c.cema_ndim == 16 and c.norm_eps == 1e-5
    # Full-size construction on the meta device: no memory, no CUDA, no torch.distributed.
    with torch.device("meta"):
        m = Megalodon(get_config("mega7.1B", vocab_size=32000))
    sd = m.state_dict()
    assert sd["rope.freqs"].shape == (128,) and sd["layers.31.mega.wv.weight"].shape == (8192, 4096)
    n_params = sum(p.numel() for p in m.parameters())
    print(f"mega7.1B parameters: {n_params / 1e9:.2f}B")
    assert 6.5e9 < n_params < 7.5e9
    tiny = Megalodon(get_config("tiny"))
    assert sum(p.numel() for p in tiny.parameters()) < 200_000


def test_config_from_upstream_json(tmp_path):
    import json
    upstream = {"model": {**PRESETS["mega200M"].to_upstream_dict(), "vocab_size": 32000, "custom_bwd": False},
                "tokenizer": {"path": "x"}, "optim": {"lr": 1e-3}}
    (tmp_path / "config.json").write_text(json.dumps(upstream))
    c = MegalodonConfig.from_upstream(tmp_path)
    assert c.model_dim == 1024 and c.vocab_size == 32000 and c.backend == "auto"
    assert MegalodonConfig.from_upstream(upstream["model"]).to_upstream_dict() == c.to_upstream_dict()
    with pytest.raises(ValueError, match="unknown MegalodonConfig fields: \\['bogus'\\]"):
        MegalodonConfig.from_upstream({"bogus": 1})
    with pytest.raises(ValueError, match="z_dim"):
        MegalodonConfig(z_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        Megalodon(get_config("mega200M"))


def test_bad_inputs_are_refused():
    model = Megalodon(small_cfg())
    with pytest.raises(TypeError, match="tokens"):
        model(torch.randn(1, 5))
    with pytest.raises(ValueError, match="batch"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=model.init_cache(1))
