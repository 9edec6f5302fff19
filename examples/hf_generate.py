"""Megalodon through Hugging Face transformers: Trainer, save/load, Auto classes, generate, streamer.

Without arguments: builds a tiny byte-level Megalodon, trains it for a few Trainer steps on a
repeated sentence, saves it with save_pretrained, reloads it with AutoModelForCausalLM, then
generates a left-padded batch of prompts of different lengths (each row exactly as if alone) and
streams one continuation with a TextStreamer. Everything is built in process: no download.
With ``--upstream DIR``: converts that upstream checkpoint (config.json + consolidated.pth) into
``--out``, reloads it and generates greedily from token ids (bring your own tokenizer).

    python examples/hf_generate.py
    python examples/hf_generate.py --steps 60 --new-tokens 40
    python examples/hf_generate.py --upstream path/to/upstream --out /tmp/megalodon-hf
"""
import argparse
import tempfile
import time

import torch

# transformers loads in the functions below, after the arguments are parsed: --help answers at once

TEXT = "the quick brown fox jumps over the lazy dog. "


def byte_tokenizer():
    """256 byte ids plus <pad> (id 256), built with tokenizers' ByteLevel: no vocabulary to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")
    out.add_special_tokens({"pad_token": "<pad>"})
    return out


def train_tiny(out_dir: str, steps: int, tok) -> None:
    from transformers import Trainer, TrainingArguments

    from megalodon_kernels.model import get_config
    from megalodon_kernels.model.hf import MegalodonForCausalLM, MegalodonHFConfig

    torch.manual_seed(0)
    cfg = get_config("tiny", vocab_size=len(tok))
    model = MegalodonForCausalLM(MegalodonHFConfig.from_model_config(cfg, pad_token_id=tok.pad_token_id))
    ids = tok(TEXT * 40)["input_ids"]
    data = [{"input_ids": torch.tensor(ids[i:i + 48]), "labels": torch.tensor(ids[i:i + 48])}
            for i in range(0, len(ids) - 48, 12)]
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
                             logging_steps=max(1, steps // 5), report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [round(h["loss"], 3) for h in trainer.state.log_history if "loss" in h]
    print(f"Trainer: {steps} steps, logged losses {losses}")
    model.save_pretrained(out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--upstream", help="an upstream checkpoint directory to convert instead of training a tiny model")
    ap.add_argument("--out", help="where to write the transformers directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=40, help="Trainer steps for the tiny model")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, TextStreamer

    import megalodon_kernels.model.hf  # noqa: F401  (registers model_type "megalodon")
    from megalodon_kernels.model.hf_convert import upstream_to_hf

    out = args.out or tempfile.mkdtemp(prefix="megalodon-hf-")
    if args.upstream:
        upstream_to_hf(args.upstream, out)
        model = AutoModelForCausalLM.from_pretrained(out)
        print(f"converted {args.upstream} -> {out}: {type(model).__name__}, {model.dtype}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        ids = torch.tensor([[1]])
        print("greedy ids:", model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0].tolist())
        return

    tok = byte_tokenizer()
    train_tiny(out, args.steps, tok)
    model = AutoModelForCausalLM.from_pretrained(out)  # the Auto class finds MegalodonForCausalLM
    print(f"reloaded from {out}: {type(model).__name__}")

    prompts = ["the quick", "over the lazy", "fox"]
    batch = tok(prompts, return_tensors="pt", padding=True)  # left padding: each row runs as if alone
    t0 = time.perf_counter()
    outs = model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, tok.batch_decode(outs, skip_special_tokens=True)):
        print(f"  {p!r:16} -> {o!r}")
    print(f"{len(prompts)} rows x {args.new_tokens} tokens in {dt:.2f} s")

    print("streamed: ", end="")
    model.generate(**tok(["the lazy"], return_tensors="pt"), max_new_tokens=args.new_tokens, do_sample=False,
                   streamer=TextStreamer(tok))


if __name__ == "__main__":
    main()
