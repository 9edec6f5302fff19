"""transformers integration (model/hf.py, model/hf_convert.py) with the real transformers package.

Offline: HF_HUB_OFFLINE is set before transformers is imported, the tokenizer is built in process.
Tiny configs; the whole file runs in seconds after the imports.
"""
import dataclasses
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub at import: nothing here may reach the network

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from megalodon_kernels.model import CheckpointMismatchError, Megalodon, MegalodonConfig, get_config  # noqa: E402
from megalodon_kernels.model.hf import CACHE_ARG, MegalodonForCausalLM, MegalodonHFCache, MegalodonHFConfig  # noqa: E402
from megalodon_kernels.model.hf_convert import hf_to_upstream, main as convert_main, upstream_to_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _cache(out):
    """The cache an output carries (its field is "cache" since transformers 5.24, "past_key_values" before)."""
    return getattr(out, CACHE_ARG)


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return MegalodonForCausalLM(MegalodonHFConfig.from_model_config(get_config("tiny", **overrides))).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompt():
    # 20 tokens: the prefill crosses the tiny config's 16-token chunk, decoding crosses the next one.
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def greedy(model, prompt):
    """Our own greedy generate: 12 new tokens."""
    return model.megalodon.generate(prompt, 12, greedy=True)


# ---- config -----------------------------------------------------------------------------------

def test_config_mirrors_the_dataclass():
    hf = MegalodonHFConfig()
    for f in dataclasses.fields(MegalodonConfig):
        assert getattr(hf, f.name) == f.default, f.name
    ours = get_config("tiny", swiglu=True, rope_base=5e5, backend={"cema": "torch"})
    back = MegalodonHFConfig.from_model_config(ours, eos_token_id=7)
    assert back.to_model_config() == ours and back.eos_token_id == 7
    assert back.hidden_size == ours.model_dim and back.num_hidden_layers == ours.num_layers
    assert MegalodonHFConfig.from_model_config(get_config("tiny", share_emb=True)).tie_word_embeddings is True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        MegalodonHFConfig(share_emb=False, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="num_heads"):
        MegalodonHFConfig(z_dim=32, num_heads=3)


def test_auto_classes_know_megalodon():
    cfg = AutoConfig.for_model("megalodon", **get_config("tiny").to_dict())
    assert isinstance(cfg, MegalodonHFConfig)
    assert type(AutoModelForCausalLM.from_config(cfg)) is MegalodonForCausalLM


# ---- forward ----------------------------------------------------------------------------------

def test_parameter_names_and_logits_are_megalodons(model, prompt):
    ref = Megalodon(model.config.to_model_config()).eval()
    assert list(model.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(model.state_dict(), strict=True)
    out = model(prompt, use_cache=False)
    assert _cache(out) is None and out.loss is None
    assert torch.equal(out.logits, ref(prompt))
    # the cache path gives the same logits and a cache that has consumed the prompt
    out = model(prompt)
    assert isinstance(_cache(out), MegalodonHFCache) and _cache(out).get_seq_length() == prompt.shape[1]
    torch.testing.assert_close(out.logits, ref(prompt), rtol=0, atol=1e-5)


def test_logits_to_keep(model, prompt):
    full = model(prompt, use_cache=False).logits
    last3 = model(prompt, use_cache=False, logits_to_keep=3).logits
    assert last3.shape == (2, 3, 256)
    torch.testing.assert_close(last3, full[:, -3:], rtol=0, atol=1e-5)
    picked = model(prompt, use_cache=False, logits_to_keep=torch.tensor([0, 7])).logits
    torch.testing.assert_close(picked, full[:, [0, 7]], rtol=0, atol=1e-5)


def test_labels_give_the_shifted_fused_loss(prompt):
    m = _model().train()
    labels = prompt.clone()
    labels[0, 5:9] = -100
    out = m(prompt, labels=labels)
    assert out.logits is None  # the fused loss never forms them
    out.loss.backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    logits = m(prompt, use_cache=False).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    want.backward()
    print(f"loss {out.loss.item():.6f} vs {want.item():.6f}")
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)
    # Trainer's num_items_in_batch: the sum over this batch's targets divided by it
    n = int((labels[:, 1:] != -100).sum())
    scaled = m(prompt, labels=labels, num_items_in_batch=torch.tensor(3 * n)).loss
    torch.testing.assert_close(scaled, out.loss.detach() / 3, rtol=1e-6, atol=0)


def _left_padded(lengths=(20, 13, 5), seed=2):
    """Left-padded ids (pad 0) and their mask for prompts of these lengths, and the prompts."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = p
        mask[b, L - len(p):] = 1
    return ids, mask, prompts


def test_attention_mask_forward(model, prompt):
    ones = torch.ones_like(prompt)
    assert torch.equal(model(prompt, attention_mask=ones, use_cache=False).logits,
                       model(prompt, use_cache=False).logits)
    # right padding without a cache: the tokens' logits are exact (the model is causal)
    mask = ones.clone()
    mask[1, 13:] = 0
    padded = prompt.clone()
    padded[1, 13:] = 0
    got = model(padded, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[1, :13], model(prompt[1:, :13], use_cache=False).logits[0], rtol=0, atol=1e-5)
    # left padding, with or without a cache: each row as if alone, zeros under the padding
    ids, mask, prompts = _left_padded()
    for use_cache in (False, True):
        out = model(ids, attention_mask=mask, use_cache=use_cache)
        for b, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits[0]
            torch.testing.assert_close(out.logits[b, ids.shape[1] - len(p):], alone, rtol=0, atol=1e-5)
            assert (out.logits[b, :ids.shape[1] - len(p)] == 0).all()
    assert _cache(out).state.lengths.tolist() == [20, 13, 5]
    last = model(ids, attention_mask=mask, logits_to_keep=1).logits
    torch.testing.assert_close(last, out.logits[:, -1:], rtol=0, atol=1e-5)


def test_attention_mask_refusals(model, prompt):
    ids, mask, _ = _left_padded()
    holes = mask.clone()
    holes[0, 3] = 0
    with pytest.raises(ValueError, match="attention_mask row 0"):
        model(ids, attention_mask=holes, use_cache=False)
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        model(ids.flip(1), attention_mask=right)  # with a cache
    used = _cache(model(ids[:, :4], use_cache=True))
    with pytest.raises(ValueError, match="fresh cache"):
        model(ids, attention_mask=mask, cache=used)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="only 0"):
        model(ids, attention_mask=mask * 2)


def test_labels_with_left_padding(model):
    ids, mask, prompts = _left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    got = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    logits = torch.cat([model(p[None], use_cache=False).logits[0, :-1] for p in prompts])
    want = F.cross_entropy(logits, torch.cat([p[1:] for p in prompts]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_inputs(model, prompt):
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(prompt, inputs_embeds=torch.zeros(2, 20, 64))
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        model(inputs_embeds=torch.zeros(1, 3, 63))
    with pytest.raises(ValueError, match="output_attentions"):
        model(prompt, output_attentions=True)
    with pytest.raises(TypeError, match="input_ids"):
        model(prompt.float())
    with pytest.raises(TypeError, match="cache"):
        model(prompt, cache=model.megalodon.init_cache(2))
    with pytest.raises(ValueError, match="labels"):
        model(prompt, labels=prompt[:, :-1])
    cache = _cache(model(prompt))
    with pytest.raises(NotImplementedError, match="cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([0, 2]))


# ---- generation -------------------------------------------------------------------------------

def test_greedy_generate_equals_ours(model, prompt, greedy):
    ref = greedy
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), ref)
    assert torch.equal(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                      do_sample=False), ref)
    # without a cache transformers re-runs the whole sequence every step: same tokens
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=False), ref[:, :24])


def test_left_padded_generate_equals_ours(model):
    ids, mask, prompts = _left_padded()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, model.megalodon.generate(ids, 8, attention_mask=mask, greedy=True))
    for b, p in enumerate(prompts):  # and each row as if alone
        assert torch.equal(got[b, ids.shape[1]:], model.megalodon.generate(p[None], 8, greedy=True)[0, len(p):])
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                              use_cache=False)
    assert torch.equal(no_cache, got[:, :ids.shape[1] + 3])
    torch.manual_seed(3)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=30, top_p=1.0,
                         temperature=0.9, pad_token_id=0)
    torch.manual_seed(3)
    assert torch.equal(got, model.megalodon.generate(ids, 8, attention_mask=mask, top_k=30, temperature=0.9))


def test_sampling_equals_ours(model, prompt):
    torch.manual_seed(5)
    ref = model.megalodon.generate(prompt, 12, temperature=0.8, top_k=20)
    torch.manual_seed(5)
    got = model.generate(prompt, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=1.0)
    assert torch.equal(got, ref)


def test_eos_and_streamer(model, prompt, greedy):
    ref = greedy
    eos = int(ref[0, 20 + 3])  # row 0 ends after its 4th new token
    rows_end = [(ref[r, 20:] == eos).nonzero() for r in range(2)]

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    streamer = Collect()
    got = model.generate(prompt[:1], max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         streamer=streamer)
    assert torch.equal(got, ref[:1, :24])
    assert streamer.ended and torch.equal(torch.cat([c.reshape(1, -1) for c in streamer.chunks], 1), got)
    both = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    for r in range(2):
        stop = 20 + (int(rows_end[r][0]) + 1 if len(rows_end[r]) else 12)
        assert torch.equal(both[r, :stop], ref[r, :stop])
        assert (both[r, stop:] == 0).all()


def test_continue_from_returned_cache(model, prompt, greedy):
    ref = greedy
    first = model.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    # The last generated token has not been fed yet: since transformers 5.24 (a cache of recurrent
    # layers) it is the next call's whole input; before, generate takes the whole sequence and
    # cuts off the get_seq_length() tokens the cache has seen.
    ids = first.sequences[:, -1:] if CACHE_ARG == "cache" else first.sequences
    more = model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_ARG: _cache(first)})
    assert torch.equal(torch.cat([first.sequences, more[:, ids.shape[1]:]], 1), ref)


def test_beam_search_reorders_the_state(model, prompt):
    # Beam search reorders cache rows every step; each returned score must equal the sequence's
    # log-probability recomputed from scratch, which fails if a row carried another beam's state.
    out = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, length_penalty=0.0,
                         return_dict_in_generate=True, output_scores=True)
    logp = torch.log_softmax(model(out.sequences, use_cache=False).logits.double(), -1)
    want = logp[:, 19:-1].gather(-1, out.sequences[:, 20:, None]).squeeze(-1).sum(-1)
    print("beam scores", out.sequences_scores.tolist(), want.tolist())
    torch.testing.assert_close(out.sequences_scores.double(), want, rtol=0, atol=1e-4)


# ---- save / load / convert --------------------------------------------------------------------

@pytest.mark.parametrize("share_emb", [False, True], ids=["untied", "tied"])
def test_save_pretrained_round_trip(tmp_path, share_emb):
    m = _model(share_emb=share_emb)
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is MegalodonForCausalLM and not back.training and not back.megalodon.training
    a, b = m.state_dict(), back.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (back.output.output.weight is back.embed.weight) == share_emb


def test_from_pretrained_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    m = _model()
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["layers.1.nffn.fc2.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.nffn.fc2.weight"):
        MegalodonForCausalLM.from_pretrained(tmp_path)


def _upstream_dir(path, cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    sd = Megalodon(cfg).to(dtype).state_dict()
    path.mkdir()
    # upstream's config.json is the training config, with the ModelConf under "model"
    (path / "config.json").write_text(json.dumps({"model": cfg.to_upstream_dict(), "lr": 3e-4, "seed": 1}))
    torch.save(sd, path / "consolidated.pth")
    return sd


@pytest.mark.parametrize("dtype,share_emb", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16_tied"])
def test_convert_upstream_and_back(tmp_path, dtype, share_emb):
    cfg = get_config("tiny", share_emb=share_emb, swiglu=share_emb)
    sd = _upstream_dir(tmp_path / "up", cfg, dtype)
    assert convert_main(["to-hf", str(tmp_path / "up"), str(tmp_path / "hf"), "--eos-token-id", "3"]) == 0
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert m.dtype == dtype and m.config.eos_token_id == 3 and m.config.to_model_config() == cfg
    ref = Megalodon.from_upstream(tmp_path / "up").eval()
    x = torch.randint(0, 256, (1, 9))
    if dtype == torch.float32:
        assert torch.equal(m(x, use_cache=False).logits, ref(x))
    assert convert_main(["to-upstream", str(tmp_path / "hf"), str(tmp_path / "up2")]) == 0
    back = torch.load(tmp_path / "up2" / "consolidated.pth", weights_only=True)
    assert list(back) == list(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    assert json.loads((tmp_path / "up2" / "config.json").read_text())["model"] == cfg.to_upstream_dict()


def test_convert_refuses_a_mismatched_checkpoint(tmp_path, capsys):
    cfg = get_config("tiny")
    _upstream_dir(tmp_path / "up", cfg)
    (tmp_path / "up" / "config.json").write_text(json.dumps({"model": cfg.replace(swiglu=True).to_upstream_dict()}))
    with pytest.raises(CheckpointMismatchError, match="fc3"):
        upstream_to_hf(tmp_path / "up", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert convert_main(["to-hf", str(tmp_path / "up"), str(tmp_path / "hf")]) == 1  # the command: a message
    assert "fc3" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    m = _model(attn_fn="laplace")
    m.save_pretrained(tmp_path / "laplace")
    with pytest.raises(ValueError, match="attn_fn"):
        hf_to_upstream(tmp_path / "laplace", tmp_path / "up3")


# ---- Trainer, pipeline, checkpointing ---------------------------------------------------------

def _byte_tokenizer():
    """A byte-level tokenizer built in process (256 ids, one per byte), no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_trainer_loss_falls(tmp_path):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    from transformers import Trainer, TrainingArguments

    m = _model(num_layers=1).train()
    text = list(("the quick brown fox jumps over the lazy dog. " * 20).encode())
    data = [{"input_ids": torch.tensor(text[i:i + 32]), "labels": torch.tensor(text[i:i + 32])}
            for i in range(0, 512, 16)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=m, args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evaluated = trainer.evaluate()["eval_loss"]  # the labels path in eval mode (no logits, no cache)
    print("Trainer losses", losses, "eval", evaluated)
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0] and evaluated < 0.5 * losses[0]


def test_pipeline_text_generation(model):
    from transformers import pipeline

    tok = _byte_tokenizer()
    ids = tok("héllo")["input_ids"]
    assert len(ids) == len("héllo".encode()) and tok.decode(ids) == "héllo"
    gen = pipeline("text-generation", model=model, tokenizer=tok)
    text = gen("hello", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    want = model.megalodon.generate(torch.tensor([ids[:0] + tok("hello")["input_ids"]]), 6, greedy=True)
    assert text == tok.decode(want[0].tolist())


def test_gradient_checkpointing(prompt):
    m = _model().train()
    loss = m(prompt, labels=prompt).loss
    loss.backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    # activation_* in recent transformers 5.x (gradient_* its deprecated alias), gradient_* only in older ones
    enable, disable, enabled = (("activation_checkpointing_enable", "activation_checkpointing_disable",
                                 "is_activation_checkpointing") if hasattr(m, "activation_checkpointing_enable") else
                                ("gradient_checkpointing_enable", "gradient_checkpointing_disable",
                                 "is_gradient_checkpointing"))
    getattr(m, enable)()
    # transformers' mechanism: every block carries the flag; the core's own loop never checkpoints
    assert m.config.layerwise_ckpt and getattr(m, enabled) and not m.megalodon.config.layerwise_ckpt
    assert all(block.gradient_checkpointing for block in m.layers)
    m(prompt, labels=prompt).loss.backward()
    for g, p in zip(want, m.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    getattr(m, disable)()
    assert not m.config.layerwise_ckpt and not getattr(m, enabled)


def test_example_runs(tmp_path, capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_generate.py")
    spec = importlib.util.spec_from_file_location("hf_generate_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "2", "--new-tokens", "3", "--out", str(tmp_path / "tiny")])
    _upstream_dir(tmp_path / "up", get_config("tiny"))
    example.main(["--upstream", str(tmp_path / "up"), "--out", str(tmp_path / "hf"), "--new-tokens", "3"])
    printed = capsys.readouterr().out
    assert "reloaded from" in printed and "3 rows x 3 tokens" in printed and "greedy ids: [1, " in printed
