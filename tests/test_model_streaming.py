"""Streaming inference: any split of a sequence through the cache gives the logits of one full
forward (fp32 tolerance), across several chunk boundaries; the cache never grows; generation.
"""
import pytest
import torch

from megalodon_kernels.model import Megalodon, MegalodonConfig
from support import perturb_


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread

C = 8


def make_model(dtype=torch.float32, seed=0, **kw):
    cfg = dict(num_layers=2, model_dim=24, z_dim=16, value_dim=20, num_heads=2, ffn_hidden_dim=40, cema_ndim=4,
               chunk_size=C, norm_num_groups=4, vocab_size=41, backend="torch")
    cfg.update(kw)
    torch.manual_seed(seed)
    return perturb_(Megalodon(MegalodonConfig(**cfg)).to(dtype).eval(), seed + 100, 0.2)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


# L = 45 = 5 full chunks of 8 + 5: every split below crosses >= 3 chunk boundaries.
SPLITS = {
    "one-call": [45],
    "token-by-token": [1] * 45,
    "uneven": [5, 3, 8, 1, 20, 8],
    "sevens": [7] * 6 + [3],
    "chunk-aligned": [8] * 5 + [5],
    "multi-chunk-prefill-mid-chunk": [2, 17, 26],
    "prefill-then-decode": [19] + [1] * 26,
}


@pytest.fixture(scope="module")
def fp32_model_and_logits():
    model = make_model()
    tokens = torch.randint(0, 41, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    return model, tokens, full


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
@torch.no_grad()
def test_streaming_equals_full_forward(fp32_model_and_logits, split):
    model, tokens, full = fp32_model_and_logits
    sizes = SPLITS[split]
    cache = model.init_cache(2)
    pieces = [model(piece, cache=cache) for piece in tokens.split(sizes, dim=1)]
    streamed = torch.cat(pieces, dim=1)
    err = rel_err(streamed, full)
    print(f"{split}: relative max error {err:.2e}")
    assert err < 2e-5
    assert cache.num_tokens == 45 and cache.chunk_offset == 45 % C
    # fixed-size chunk buffers; the live slots are the first 45 % C
    assert all(s.k.shape[1] == C and s.chunk_offset == 45 % C for s in cache.layers)


@torch.no_grad()
def test_streaming_equals_full_forward_fp64_tight():
    model = make_model(torch.float64, seed=3, swiglu=True, scale_emb=True, share_emb=True, rescale_nffn=True)
    tokens = torch.randint(0, 41, (1, 37), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    cache = model.init_cache(1)
    streamed = torch.cat([model(p, cache=cache) for p in tokens.split([3, 9, 1, 1, 15, 8], dim=1)], dim=1)
    err = rel_err(streamed, full)
    print(f"fp64 relative max error {err:.2e}")
    assert err < 1e-10


@torch.no_grad()
def test_cache_clone_branches_independently(fp32_model_and_logits):
    model, tokens, full = fp32_model_and_logits
    cache = model.init_cache(2)
    model(tokens[:, :13], cache=cache)
    branch = cache.clone()
    a = model(tokens[:, 13:20], cache=cache)
    b = model(tokens[:, 13:20], cache=branch)
    assert torch.equal(a, b)
    assert rel_err(a, full[:, 13:20]) < 2e-5


@torch.no_grad()
def test_decode_memory_does_not_grow():
    """Cache bytes stay at the bound set by chunk_size (never by the token count), constant per
    step; a many-chunk prefill leaves no large buffer behind."""
    model = make_model(seed=4)
    cfg = model.config
    B, H = 1, cfg.num_heads
    cache = model.init_cache(B)
    # one chunk of key/value slots per layer, plus norm stats, lengths and the CEMA state
    kv = cfg.num_layers * C * B * H * (cfg.z_head_dim + cfg.v_head_dim) * 4
    stats = (cfg.num_layers + 1) * B * (8 + 8 + 2 * cfg.norm_num_groups * 4)
    hx = cfg.num_layers * B * cfg.model_dim * cfg.cema_ndim * 8
    bound = kv + stats + hx
    tok = torch.zeros(B, 1, dtype=torch.long)
    sizes = []
    for _ in range(6 * C):
        logits = model(tok, cache=cache)
        tok = logits[:, -1:].argmax(-1)
        sizes.append(cache.nbytes())
    print(f"cache bytes: min {min(sizes)}, max {max(sizes)}, bound {bound}")
    assert max(sizes) <= bound
    assert min(sizes) == max(sizes)  # fixed shapes: nothing accumulates
    # long prefill: 5 chunks + 3 in one call -> only 3 keys per layer are kept
    cache = model.init_cache(B)
    model(torch.randint(0, 41, (B, 5 * C + 3)), cache=cache)
    assert cache.chunk_offset == 3
    assert cache.nbytes() <= bound


@torch.no_grad()
def test_generate_greedy_matches_full_forward_argmax():
    model = make_model(seed=5)
    prompt = torch.randint(0, 41, (2, 11), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, 14, greedy=True)
    assert out.shape == (2, 25) and torch.equal(out[:, :11], prompt)
    # every generated token is the argmax of a full forward over its prefix
    logits = model(out)
    assert torch.equal(logits[:, 10:-1].argmax(-1), out[:, 11:])
    # temperature 0 and top_k=1 are greedy too; prefilling in pieces changes nothing
    assert torch.equal(model.generate(prompt, 14, temperature=0.0), out)
    assert torch.equal(model.generate(prompt, 14, top_k=1, generator=torch.Generator().manual_seed(0)), out)
    assert torch.equal(model.generate(prompt, 14, greedy=True, prefill_size=4), out)


@torch.no_grad()
def test_generate_sampling_top_k_and_temperature():
    model = make_model(seed=6)
    model.train()  # generate runs in eval mode and restores the mode
    prompt = torch.randint(0, 41, (2, 5), generator=torch.Generator().manual_seed(4))
    s1 = model.generate(prompt, 12, temperature=0.8, top_k=3, generator=torch.Generator().manual_seed(9))
    s2 = model.generate(prompt, 12, temperature=0.8, top_k=3, generator=torch.Generator().manual_seed(9))
    assert model.training
    assert torch.equal(s1, s2)  # reproducible with the same generator
    model.eval()
    logits = model(s1)
    top3 = logits[:, 4:-1].topk(3, dim=-1).indices
    assert (top3 == s1[:, 5:, None]).any(-1).all()  # every sampled token is in its step's top 3
    s3 = model.generate(prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(10))
    assert s3.shape == (2, 17)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)


@torch.no_grad()
def test_generate_stops_at_eos():
    model = make_model(seed=7)
    prompt = torch.randint(0, 41, (1, 4), generator=torch.Generator().manual_seed(5))
    greedy = model.generate(prompt, 10, greedy=True)
    eos = int(greedy[0, 6])
    out = model.generate(prompt, 10, greedy=True, eos_token_id=eos)
    first = int((greedy[0, 4:] == eos).nonzero()[0]) + 4
    assert out.shape[1] == first + 1 and int(out[0, -1]) == eos
