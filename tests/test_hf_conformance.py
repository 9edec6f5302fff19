"""Regression tests of our own for issue 43 (transformers conformance of model/hf.py): the five
defects (shift_labels ignored, a continuation re-absorbed by the cache, _is_stateful unset,
init_weights doing nothing, checkpointing options dropped) and the features the generic suite
expects (output_hidden_states, inputs_embeds, sampling like the native generate, a pad id inside
a prompt). transformers' own suite runs in tests/test_hf_transformers_suite.py.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megalodon_kernels.model.hf import CACHE_ARG, MegalodonForCausalLM, MegalodonHFConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny config (its snippets use it): chunk 4, so 7- and 10-token inputs cross chunks.
CFG = dict(num_layers=2, model_dim=32, z_dim=16, value_dim=32, num_heads=2, ffn_hidden_dim=64, cema_ndim=4,
           chunk_size=4, norm_num_groups=4, vocab_size=99, eos_token_id=98, pad_token_id=98)


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return MegalodonForCausalLM(MegalodonHFConfig(**{**CFG, **overrides})).eval()


#: the eos (and pad) id of CFG: the native generate is given it too, so both stop alike
EOS = 98


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 98, (2, 7), generator=torch.Generator().manual_seed(1))


# ---- 1. shift_labels --------------------------------------------------------------------------

def test_shift_labels_replace_labels(ids):
    m = _model().train()
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 98, ids.shape, generator=g)
    shift = torch.randint(0, 98, ids.shape, generator=g)
    shift[0, 2] = -100
    got = m(ids, labels=labels, shift_labels=shift).loss
    # the pre-shifted targets are the targets: position i against shift[:, i], every position
    logits = m(ids, use_cache=False).logits
    want = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, m(ids, labels=labels).loss)
    # labels do not matter once shift_labels are given; shift_labels alone suffice
    torch.testing.assert_close(m(ids, labels=shift, shift_labels=shift).loss, got, rtol=0, atol=0)
    torch.testing.assert_close(m(ids, shift_labels=shift).loss, got, rtol=0, atol=0)
    # Trainer's num_items_in_batch with them: the sum over the valid targets divided by it
    n = int((shift != -100).sum())
    scaled = m(ids, shift_labels=shift, num_items_in_batch=2 * n).loss
    torch.testing.assert_close(scaled, got.detach() / 2, rtol=1e-6, atol=0)


def test_shift_labels_with_left_padding(model):
    ids = torch.tensor([[98, 98, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    shift = torch.tensor([[-100, -100, 9, 10, 11], [12, 13, 14, 15, 16]])
    got = model(ids, attention_mask=mask, shift_labels=shift, use_cache=False).loss
    rows = [model(ids[0:1, 2:], use_cache=False).logits[0], model(ids[1:], use_cache=False).logits[0]]
    want = F.cross_entropy(torch.cat(rows), torch.cat([shift[0, 2:], shift[1]]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- 2. continuing a cache --------------------------------------------------------------------

def test_continue_with_the_whole_sequence(model, ids):
    """The issue's snippet: the whole sequence plus the cache feeds the cache only the new token."""
    o3 = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = getattr(o3, CACHE_ARG)
    assert cache.state.lengths.tolist() == [9, 9]  # the last new token is not fed yet
    more = model.generate(o3.sequences, attention_mask=torch.ones_like(o3.sequences), max_new_tokens=2,
                          do_sample=False, **{CACHE_ARG: cache})
    assert cache.state.lengths.tolist() == [11, 11]
    assert torch.equal(more, model.megalodon.generate(ids, 5, greedy=True, eos_token_id=EOS))
    # and without a mask (generate makes one as wide as the input): the same
    o3 = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    more = model.generate(o3.sequences, max_new_tokens=2, do_sample=False, **{CACHE_ARG: getattr(o3, CACHE_ARG)})
    assert torch.equal(more, model.megalodon.generate(ids, 5, greedy=True, eos_token_id=EOS))


def test_continue_left_padded_with_the_whole_sequence(model):
    ids = torch.tensor([[98, 98, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    first = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    cache = getattr(first, CACHE_ARG)
    assert cache.state.lengths.tolist() == [4, 6]
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
    more = model.generate(first.sequences, attention_mask=full_mask, max_new_tokens=2, do_sample=False,
                          **{CACHE_ARG: cache})
    want = model.megalodon.generate(ids, 4, attention_mask=mask, greedy=True, eos_token_id=EOS)
    assert torch.equal(more, want)


@pytest.mark.skipif(CACHE_ARG != "cache", reason="before transformers 5.24 generate itself cuts the cache's "
                                                   "length off the input, so it takes the whole sequence only")
def test_continue_with_only_the_new_tokens(model, ids):
    first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    more = model.generate(first.sequences[:, -1:], max_new_tokens=2, do_sample=False,
                          **{CACHE_ARG: getattr(first, CACHE_ARG)})
    assert torch.equal(more[:, 1:], model.megalodon.generate(ids, 5, greedy=True, eos_token_id=EOS)[:, -2:])


def test_a_mask_that_disagrees_with_the_cache_is_refused(model, ids):
    cache = getattr(model(ids), CACHE_ARG)  # 7 tokens per row
    nxt = torch.tensor([[3], [4]])
    ok = model(nxt, attention_mask=torch.ones(2, 8, dtype=torch.long), **{CACHE_ARG: cache.clone()}).logits
    alone = model(torch.cat([ids, nxt], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(ok, alone, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cache has consumed"):
        model(nxt, attention_mask=torch.ones(2, 9, dtype=torch.long), **{CACHE_ARG: cache.clone()})
    with pytest.raises(ValueError, match="no cache was given"):
        model(nxt, attention_mask=torch.ones(2, 8, dtype=torch.long), use_cache=False)
    # a "whole sequence" that cannot be one (its mask's tokens before the new ones are not the cache's)
    first = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    seq = first.sequences
    holes = torch.ones_like(seq)
    holes[:, -1] = 0
    # (before transformers 5.24 generate cuts the input itself: then the mask's gap is what is refused)
    with pytest.raises(ValueError, match="generate continues a cache|not one run of tokens"):
        model.generate(seq, attention_mask=holes, max_new_tokens=1, **{CACHE_ARG: getattr(first, CACHE_ARG)})


# ---- 3. a stateful model ----------------------------------------------------------------------

def test_assisted_and_prompt_lookup_decoding_refused(model, ids):
    assert MegalodonForCausalLM._is_stateful
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, max_new_tokens=4, assistant_model=_model(seed=1))


# ---- 4. init_weights --------------------------------------------------------------------------

def _meta_built(seed, **overrides):
    with torch.device("meta"):
        m = MegalodonForCausalLM(MegalodonHFConfig(**{**CFG, **overrides}))
    m.to_empty(device="cpu")  # NaN-poisoned memory under tests/conftest.py
    torch.manual_seed(seed)
    m.init_weights()
    return m


@pytest.mark.parametrize("overrides", [{}, {"init_mode": "bert", "rescale_nffn": True, "norm_prior_count": 2,
                                            "swiglu": True, "share_emb": True}],
                         ids=["default", "bert_rescale_prior_swiglu_tied"])
def test_init_weights_on_a_meta_built_model(overrides):
    built = _model(**overrides).state_dict()
    meta = _meta_built(0, **overrides)
    again = _meta_built(0, **overrides).state_dict()
    for k, v in meta.state_dict().items():
        ref = built[k]
        assert torch.isfinite(v.double()).all(), k
        assert torch.equal(v, again[k]), k  # deterministic under the seed
        if ref.numel() == 1 or bool((ref == ref.flatten()[0]).all()):
            assert torch.equal(v, ref), k  # constants: buffers, zero-initialised weights, alpha
        else:  # random: the constructor's distribution
            print(f"{k}: std {v.double().std():.4f} vs {ref.double().std():.4f}")
            assert 0.6 < float(v.double().std() / ref.double().std()) < 1.6, k
    ids = torch.randint(0, 98, (1, 6))
    assert torch.isfinite(meta.eval()(ids, use_cache=False).logits).all()
    if overrides.get("share_emb"):
        assert meta.output.output.weight is meta.embed.weight


def test_missing_weights_are_initialised_and_loaded_ones_kept(tmp_path):
    from safetensors.torch import load_file, save_file

    m = _model()
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for k in ("layers.0.mega.cema.alpha", "layers.1.nffn.fc1.weight", "rope.freqs"):
        del sd[k]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="strict=False"):
        MegalodonForCausalLM.from_pretrained(tmp_path)
    back, info = MegalodonForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["layers.0.mega.cema.alpha", "layers.1.nffn.fc1.weight", "rope.freqs"]
    loaded = back.state_dict()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k  # a loaded weight is never re-initialised
    assert torch.equal(loaded["rope.freqs"], m.state_dict()["rope.freqs"])
    for k in ("layers.0.mega.cema.alpha", "layers.1.nffn.fc1.weight"):
        assert torch.isfinite(loaded[k]).all() and loaded[k].std() > 0, k
    assert MegalodonForCausalLM.from_pretrained(tmp_path, strict=False).training is False


# ---- 5. gradient checkpointing ----------------------------------------------------------------

def _ffn_runs(m, ids):
    """How often each block's FFN runs in one training forward and backward: 2 where the block is
    checkpointed (the backward replays it), 1 where it is not."""
    runs = [0] * len(m.layers)
    # a pre-hook: non-reentrant checkpointing stops its replay once the tensors it needs are back
    handles = [b.nffn.register_forward_pre_hook(lambda mod, a, i=i: runs.__setitem__(i, runs[i] + 1))
               for i, b in enumerate(m.layers)]
    try:
        m(ids, labels=ids).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return runs


def _checkpointing(m, kwargs=None, **more):
    """transformers' enable call: activation_checkpointing_enable, gradient_checkpointing_enable before 5.2x."""
    if hasattr(m, "activation_checkpointing_enable"):
        return m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **more)
    return m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **more)


def test_checkpointing_options_are_honoured(ids):
    from transformers.modeling_layers import GradientCheckpointingLayer

    m = _model().train()
    assert all(isinstance(b, GradientCheckpointingLayer) for b in m.layers)
    assert _ffn_runs(m, ids) == [1, 1]
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    _checkpointing(m, {"use_reentrant": True})
    assert all(b._gradient_checkpointing_func.keywords == {"use_reentrant": True} for b in m.layers)
    assert _ffn_runs(m, ids) == [2, 2]
    for g, p in zip(want, m.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    m.zero_grad()
    _checkpointing(m, every_n_layers=2)  # non-reentrant (transformers' default), block 0 only
    assert [b.gradient_checkpointing for b in m.layers] == [True, False]
    assert m.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    assert _ffn_runs(m, ids) == [2, 1]
    (m.activation_checkpointing_disable if hasattr(m, "activation_checkpointing_disable")
     else m.gradient_checkpointing_disable)()
    assert not any(b.gradient_checkpointing for b in m.layers) and not m.config.layerwise_ckpt
    # upstream's layerwise_ckpt in the config turns it on (non-reentrant), as it always did
    on = _model(layerwise_ckpt=True).train()
    assert all(b.gradient_checkpointing for b in on.layers) and _ffn_runs(on, ids) == [2, 2]
    # a block that updates a streaming state is never checkpointed (its replay would absorb the tokens twice)
    cache = on.new_cache(2)
    on(ids, **{CACHE_ARG: cache}, use_cache=True).logits.sum().backward()
    assert cache.state.lengths.tolist() == [7, 7]
    whole = on(torch.cat([ids, ids], 1), use_cache=False).logits
    torch.testing.assert_close(on(ids, **{CACHE_ARG: cache}).logits, whole[:, 7:], rtol=0, atol=1e-5)


# ---- output_hidden_states, inputs_embeds --------------------------------------------------------

def test_output_hidden_states(model, ids):
    out = model(ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    assert len(hs) == 3 and all(h.shape == (2, 7, 32) for h in hs)
    torch.testing.assert_close(hs[0], model.embed(ids), rtol=0, atol=0)  # no scale_emb in this config
    torch.testing.assert_close(model.output.final_norm(model.layers[1](hs[1]))[0], hs[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(model.output.output(hs[2]).float(), out.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.layers[0](hs[0]), hs[1], rtol=0, atol=1e-6)
    # streaming: the prompt's and then one step's hidden states are those of the whole sequence's
    cache = model.new_cache(2)
    a = model(ids[:, :6], output_hidden_states=True, **{CACHE_ARG: cache}).hidden_states
    b = model(ids[:, 6:], output_hidden_states=True, **{CACHE_ARG: cache}).hidden_states  # the one-token step
    for whole, first, step in zip(hs, a, b):
        torch.testing.assert_close(torch.cat([first, step], 1), whole, rtol=0, atol=1e-5)
    # left padding: zeros under the padding, each row as alone; and the config's flag
    pad = torch.tensor([[98, 98, 5, 6, 7]])
    both = torch.cat([pad, ids[:1, :5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    m2 = copy.deepcopy(model)
    m2.config.output_hidden_states = True
    hp = m2(both, attention_mask=mask, use_cache=False).hidden_states
    alone = model(pad[:, 2:], output_hidden_states=True, use_cache=False).hidden_states
    for h, a in zip(hp, alone):
        assert (h[0, :2] == 0).all()
        torch.testing.assert_close(h[0, 2:], a[0], rtol=0, atol=1e-5)


def test_inputs_embeds(model, ids):
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds, use_cache=False).logits,
                               model(ids, use_cache=False).logits, rtol=0, atol=0)
    scaled = _model(scale_emb=True)  # the model scales inputs_embeds as it scales its embeddings
    torch.testing.assert_close(scaled(inputs_embeds=scaled.embed(ids), use_cache=False).logits,
                               scaled(ids, use_cache=False).logits, rtol=0, atol=0)
    got = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
    # transformers returns only the new tokens when the prompt came as embeddings
    assert torch.equal(got, model.megalodon.generate(ids, 4, greedy=True, eos_token_id=EOS)[:, 7:])


# ---- sampling defaults, pad id in a prompt ------------------------------------------------------

def test_sampling_settings_that_match_the_native_generate(model, ids):
    # the native generate's defaults (temperature 1, no top-k) are top_k=0 in transformers ...
    torch.manual_seed(4)
    want = model.megalodon.generate(ids, 6, eos_token_id=EOS)
    torch.manual_seed(4)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0), want)
    # ... and transformers' own default (top_k=50) is the native generate's top_k=50
    torch.manual_seed(4)
    want = model.megalodon.generate(ids, 6, top_k=50, eos_token_id=EOS)
    torch.manual_seed(4)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=True), want)


def test_pad_id_inside_a_prompt_without_a_mask(ids):
    m = _model(pad_token_id=0)  # a pad id that is not the eos: transformers then infers the mask
    inside = ids.clone()
    inside[:, 3] = 0
    with pytest.raises(ValueError, match="attention_mask: torch.ones_like"):
        m.generate(inside, max_new_tokens=2, do_sample=False)
    got = m.generate(inside, attention_mask=torch.ones_like(inside), max_new_tokens=2, do_sample=False)
    assert torch.equal(got, m.megalodon.generate(inside, 2, greedy=True, eos_token_id=EOS))
    # pad ids only in front: left padding, each row as alone
    lead = ids.clone()
    lead[0, :2] = 0
    got = m.generate(lead, max_new_tokens=2, do_sample=False)
    assert torch.equal(got[0, 2:], m.megalodon.generate(lead[:1, 2:], 2, greedy=True, eos_token_id=EOS)[0])
