"""Megalodon against a matched Llama-style Transformer: training-step time and peak memory.

    python bench/vs_transformer.py [--tokens 4096 16384 65536] [--B 1] [--steps 2] [--threads 1]
                                   [--device cpu|cuda] [--max-step-s 900] [--out bench/results/vs_transformer.md]

Megalodon is the bench model of bench/cpu_step.py (vocab 1000, model_dim 256, 2 layers, chunk 256,
fp32). The Transformer (:class:`Llama`) has the same vocabulary, width 256, depth 2 and, within 0.1 %,
the same parameter count: pre-norm blocks of RMSNorm, causal self-attention with rotary position
embeddings (4 heads of 64, ``F.scaled_dot_product_attention(is_causal=True)``: torch picks its flash
kernel where it has one, on the CPU too) and a SwiGLU FFN whose hidden width is what matches the
parameter count; untied embedding and output head like the Megalodon model. Both models take the same
tokens and the same fused output projection + cross-entropy (model/loss.py), so the step differs only
in the blocks.

One step = zero_grad, forward + loss over ``B`` sequences of ``tokens / B`` tokens, backward (no
optimizer). On the CPU, each (model, length) point first runs in a process of its own: a 256-token step
(one-time costs), then the first full step, which gives the peak memory; then both models run in one
process, one warm-up step each and ``--steps`` timed steps alternating between them, so that the load
of a shared machine falls on both alike (median and minimum; a length above ``--max-timed-tokens``
reports its single first step). On CUDA all of it runs in this process, model after model.
Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the step (parameters included); on the
CPU the growth of the process's peak resident set (``ru_maxrss``) over the first
step, above what the built model and its inputs already hold. A point whose warm-up step alone
exceeds ``--max-step-s`` is reported as not measured instead of timed again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalodon_kernels.model import Megalodon
from megalodon_kernels.model.loss import linear_cross_entropy

sys.path.insert(0, str(Path(__file__).parent))
from cpu_step import VOCAB, bench_config, machine_load  # noqa: E402

HEAD_DIM = 64
ROPE_THETA = 10000.0


def rope_tables(L: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    ang = torch.arange(L, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, d): rotate the pairs (x[i], x[i + d/2]) by the position's angle (Llama's half split)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """``cache``: this layer's [keys, values] (B, H, positions, d), appended to; a call with a
        non-empty cache must be one token (decoding), which attends to every cached position."""
        B, L, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:
            if cache[0] is not None:
                if L != 1:
                    raise ValueError(f"with a filled cache, decode one token at a time (got {L})")
                k, v, causal = torch.cat((cache[0], k), 2), torch.cat((cache[1], v), 2), False
            cache[0], cache[1] = k, v
        a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def matched_ffn(dim: int, layers: int, vocab: int, target_params: int) -> int:
    """The SwiGLU hidden width that brings the Transformer's parameter count closest to ``target_params``."""
    fixed = 2 * vocab * dim + dim + layers * (4 * dim * dim + 2 * dim)
    return max(1, round((target_params - fixed) / (layers * 3 * dim)))


class Llama(nn.Module):
    """The matched Transformer; ``model(tokens, labels=labels)`` returns the fused loss as Megalodon's does."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=dim ** -0.5)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, cache: list | None = None) -> torch.Tensor:
        """``cache``: from :meth:`init_cache`, filled by a prompt and extended by one token per call."""
        x = self.embed(tokens)
        d = x.shape[-1] // self.layers[0].heads
        start = 0 if cache is None or cache[0][0] is None else cache[0][0].shape[2]
        cos, sin = rope_tables(start + tokens.shape[1], d, tokens.device)
        cos, sin = cos[start:], sin[start:]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache[i])
        x = self.norm(x)
        if labels is None:
            return self.head(x)
        return linear_cross_entropy(x, self.head.weight, labels)


    def init_cache(self) -> list:
        return [[None, None] for _ in self.layers]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


KINDS = ("megalodon", "transformer")


def build(kind: str, device="cpu") -> nn.Module:
    """``megalodon`` (the bench model) or ``transformer`` (matched to it), seeded, in train mode."""
    torch.manual_seed(0)
    cfg = bench_config()
    if kind == "megalodon":
        return Megalodon(cfg).to(device).train()
    if kind != "transformer":
        raise ValueError(f"kind must be 'megalodon' or 'transformer', got {kind!r}")
    target = n_params(Megalodon(cfg))
    ffn = matched_ffn(cfg.model_dim, cfg.num_layers, cfg.vocab_size, target)
    torch.manual_seed(0)
    return Llama(cfg.vocab_size, cfg.model_dim, cfg.num_layers, cfg.model_dim // HEAD_DIM, ffn).to(device).train()


def step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach()


# ------------------------------------------------------------------------------------ the paper's setting
#: Megalodon / Llama2 training throughput per device in the paper (section 4.1, Fig. 4: Llama2 32K 1.00,
#: Megalodon 32K 1.32, Megalodon 4K 1.40, Llama2 4K 1.48 relative to Llama2-7B at 32K)
PAPER_THROUGHPUT_RATIO = {4096: 1.40 / 1.48, 32768: 1.32 / 1.00}
PAPER_VOCAB = 32000
PAPER_HEAD_DIM = 128  # Llama2-7B: 32 heads of 128


def build_paper(kind: str, layers: int, device="cpu", width: int = 4096, chunk: int = 4096) -> nn.Module:
    """The 7B layer width with ``layers`` layers: Megalodon as upstream's ``mega7.1B`` (D 4096, 4 heads, z 1024,
    v 8192, FFN 11264, G 64) at chunk ``chunk``; the Transformer as a Llama2-7B layer (32 heads of 128) with
    the SwiGLU width that matches Megalodon's parameter count at that depth (11972 at 2 layers: Llama2-7B's
    own 11008 gives 202.4M parameters a layer against Megalodon's 214.2M, on the meta device).
    ``width`` < 4096 scales every width down by the same factor (the dry run's tiny models). Seeded,
    train mode, float32 parameters."""
    from megalodon_kernels.model.config import get_config

    f = width / 4096
    cfg = get_config("mega7.1B", vocab_size=PAPER_VOCAB if width == 4096 else 256, num_layers=layers, model_dim=width,
                     z_dim=max(8, int(1024 * f)), value_dim=max(8, int(8192 * f)),
                     ffn_hidden_dim=max(8, int(11264 * f)),
                     norm_num_groups=max(1, int(64 * f)) if width >= 64 else 2, chunk_size=chunk,
                     num_heads=4 if width >= 256 else 1)
    torch.manual_seed(0)
    if kind == "megalodon":
        return Megalodon(cfg).to(device).train()
    if kind != "transformer":
        raise ValueError(f"kind must be 'megalodon' or 'transformer', got {kind!r}")
    with torch.device("meta"):
        target = n_params(Megalodon(cfg))
    ffn = matched_ffn(width, layers, cfg.vocab_size, target)
    torch.manual_seed(0)
    heads = max(1, width // PAPER_HEAD_DIM)
    return Llama(cfg.vocab_size, width, layers, heads, ffn).to(device).train()


def measure_paper(kinds, tokens, layers: int, steps: int, device="cpu", max_step_s: float = float("inf"),
                  width: int = 4096, chunk: int = 4096, deadline: float = float("inf")) -> list[dict]:
    """Training steps as the paper trains: bf16 autocast over float32 parameters, forward + fused loss,
    backward, AdamW (fused on CUDA), batch 1. Every model of ``kinds`` is built once on the device, then
    each length of ``tokens`` runs on all of them in turn (so that a ``deadline`` (perf_counter) that
    cuts the run leaves whole pairs). Per (length, kind): {kind, tokens, layers, params, warmup_s,
    step_s (median of ``steps``), steps_s, tokens_per_s, peak_bytes, peak_kind, loss}."""
    device = torch.device(device)
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    models, opts = {}, {}
    for kind in kinds:
        with torch.device(device):
            models[kind] = build_paper(kind, layers, device, width, chunk)
        opts[kind] = torch.optim.AdamW(models[kind].parameters(), lr=1e-5, fused=device.type == "cuda")
    rows = []
    for n in ([tokens] if isinstance(tokens, int) else tokens):
        for kind in kinds:
            if time.perf_counter() > deadline:
                return rows
            model, opt = models[kind], opts[kind]
            vocab = model.embed.weight.shape[0]
            tok = torch.randint(0, vocab, (1, n + 1), generator=torch.Generator().manual_seed(1)).to(device)

            def one():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(tok[:, :-1], labels=tok[:, 1:])
                loss.backward()
                opt.step()
                return loss.detach()

            row = dict(kind=kind, tokens=n, layers=layers, width=width, chunk=chunk, params=n_params(model),
                       device=str(device), precision="bf16 autocast, float32 parameters, AdamW")
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                row["peak_kind"] = ("torch.cuda.max_memory_allocated over the first step at this length (both "
                                    "models' parameters and AdamW state included)")
            else:
                row["peak_kind"] = "not measured on the CPU"
            try:
                t0 = time.perf_counter()
                loss = one()  # the first length's also allocates AdamW's state
                _sync(device)
                row["warmup_s"] = time.perf_counter() - t0
                row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                row["loss"] = float(loss)
                times = []
                if row["warmup_s"] <= max_step_s:
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        one()
                        _sync(device)
                        times.append(time.perf_counter() - t0)
            except Exception as exc:  # out of memory at one length: the point, not the others
                row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}", peak_bytes=0, steps_s=[], step_s=None,
                           tokens_per_s=None)
                opt.zero_grad(set_to_none=True)
                rows.append(row)
                continue
            row["steps_s"] = times
            row["step_s"] = statistics.median(times) if times else None
            row["tokens_per_s"] = n / row["step_s"] if row["step_s"] else None
            rows.append(row)
    return rows


def paper_ratios(rows: list[dict]) -> list[dict]:
    """Per length: Megalodon tokens/s / Transformer tokens/s beside the paper's ratio, and the memory ratio."""
    by = {(r["kind"], r["tokens"]): r for r in rows}
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        m, t = by.get(("megalodon", tokens)), by.get(("transformer", tokens))
        if m and t and m.get("tokens_per_s") and t.get("tokens_per_s"):
            out.append(dict(tokens=tokens, throughput=m["tokens_per_s"] / t["tokens_per_s"],
                            paper=PAPER_THROUGHPUT_RATIO.get(tokens),
                            memory=(m["peak_bytes"] / t["peak_bytes"]) if t["peak_bytes"] else None))
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(kind: str, B: int, L: int, steps: int, device="cpu", max_step_s: float = float("inf")) -> dict:
    """One point in this process: {kind, B, L, tokens, params, warmup_s, step_s (median) or None,
    steps_s, peak_bytes, peak_kind, loss}."""
    device = torch.device(device)
    model = build(kind, device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, L + 1), generator=gen).to(device)
    row = dict(kind=kind, B=B, L=L, tokens=B * L, params=n_params(model), device=str(device))
    # a short step first: one-time costs (lazy imports, library pools) stay out of the peak and the warm-up
    step(model, tokens[:, :min(L, 256) + 1])
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = 0
        row["peak_kind"] = "torch.cuda.max_memory_allocated over the first step (parameters included)"
    else:
        before = _rss_bytes()
        row["peak_kind"] = "growth of the process's peak resident set over the first step"
    t0 = time.perf_counter()
    loss = step(model, tokens)
    _sync(device)
    row["warmup_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        row["peak_bytes"] = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    row["loss"] = float(loss)
    times = []
    if row["warmup_s"] <= max_step_s:
        for _ in range(steps):
            t0 = time.perf_counter()
            step(model, tokens)
            _sync(device)
            times.append(time.perf_counter() - t0)
    row["steps_s"] = times
    row["step_s"] = statistics.median(times) if times else None
    return row


@torch.no_grad()
def decode_rate(kind: str, context: int, new: int, device="cpu", piece: int = 4096) -> dict:
    """Greedy decoding of ``new`` tokens after a ``context``-token prompt, batch 1, eval mode:
    {kind, context, new, prefill_s, tokens_per_s (of the new tokens)}. Megalodon streams with its
    constant-size cache (prompt in pieces of ``piece``); the Transformer keeps every key and value
    (prompt in one causal call, then each token attends to all of them)."""
    device = torch.device(device)
    model = build(kind, device).eval()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (1, context), generator=gen).to(device)
    cache = model.init_cache(1) if kind == "megalodon" else model.init_cache()
    t0 = time.perf_counter()
    for a in range(0, context, piece if kind == "megalodon" else context):
        logits = model(prompt[:, a:a + piece] if kind == "megalodon" else prompt, cache=cache)
    _sync(device)
    prefill = time.perf_counter() - t0
    tok = logits[:, -1:].argmax(-1)
    model(tok, cache=cache)  # the first decoding call (one-time costs) stays out of the rate
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new):
        tok = model(tok, cache=cache)[:, -1:].argmax(-1)
    _sync(device)
    dt = time.perf_counter() - t0
    return dict(kind=kind, context=context, new=new, prefill_s=prefill, tokens_per_s=new / dt)


def measure_in_child(kind: str, B: int, L: int, steps: int, threads: int, max_step_s: float) -> dict:
    """:func:`measure` in a fresh process (its own peak resident set), on the CPU."""
    r = _child(f"measure({kind!r}, {B}, {L}, {steps}, 'cpu', {max_step_s!r})", threads)
    return r if "error" not in r else dict(kind=kind, B=B, L=L, tokens=B * L, **r)


def time_pair(B: int, L: int, steps: int, device="cpu") -> dict:
    """Both models in this process, their steps alternating (megalodon, transformer, megalodon, ...) after
    one warm-up step each, so that a shared machine's load falls on both alike: {kind: [seconds per step]}."""
    device = torch.device(device)
    models = {kind: build(kind, device) for kind in KINDS}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, L + 1), generator=gen).to(device)
    for model in models.values():
        step(model, tokens)
    _sync(device)
    times = {kind: [] for kind in models}
    for _ in range(steps):
        for kind, model in models.items():
            t0 = time.perf_counter()
            step(model, tokens)
            _sync(device)
            times[kind].append(time.perf_counter() - t0)
    return times


def _child(call: str, threads: int):
    code = (f"import json, sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"torch.set_num_threads({threads}); import vs_transformer as v; print('ROW' + json.dumps(v.{call}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("ROW"):
            return json.loads(line[3:])
    return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def ratios(rows: list[dict]) -> list[dict]:
    """Per length: Megalodon / Transformer step time and peak memory (< 1: Megalodon faster / smaller)."""
    by = {(r["kind"], r["tokens"]): r for r in rows}
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        m, t = by.get(("megalodon", tokens)), by.get(("transformer", tokens))
        if not m or not t:
            continue
        ok = lambda k: m.get(k) and t.get(k)  # noqa: E731
        out.append(dict(tokens=tokens, time=(m["step_s"] / t["step_s"]) if ok("step_s") else None,
                        time_min=(min(m["steps_s"]) / min(t["steps_s"])) if ok("steps_s") else None,
                        memory=(m["peak_bytes"] / t["peak_bytes"]) if ok("peak_bytes") else None))
    return out


def _fmt_s(x) -> str:
    return "-" if x is None else (f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s")


def markdown(rows: list[dict], cmd: str, header: list[str]) -> str:
    lines = ["# Megalodon vs a matched Llama-style Transformer: training step", "", f"`{cmd}`", ""] + header + [""]
    lines += ["| model | params | B x L | first step | step (median) | min | steps | peak memory | loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | - | {r['B']} x {r['L']} | failed: {r['error']} | | | | |")
            continue
        steps = ", ".join(_fmt_s(s) for s in r["steps_s"]) or "not timed: warm-up over the step limit"
        if r.get("first_step_only"):
            steps = "first step only (longer than --max-timed-tokens)"
        if r.get("timing_error"):
            steps = f"timing failed: {r['timing_error']}"
        low = min(r["steps_s"]) if r["steps_s"] else None
        lines.append(f"| {r['kind']} | {r['params']:,} | {r['B']} x {r['L']} | {_fmt_s(r['warmup_s'])} | "
                     f"{_fmt_s(r['step_s'])} | {_fmt_s(low)} | {steps} | {r['peak_bytes'] / 2**20:.0f} MiB | "
                     f"{r['loss']:.4f} |")
    lines += ["", "Megalodon / Transformer (< 1: Megalodon faster or smaller; from this one run):", "",
              "| tokens | step time (medians) | step time (minima) | peak memory |", "|---|---|---|---|"]
    for q in ratios(rows):
        f = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(f"| {q['tokens']} | {f(q['time'])} | {f(q.get('time_min'))} | {f(q['memory'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-step-s", type=float, default=900.0)
    ap.add_argument("--max-timed-tokens", type=int, default=16384,
                    help="CPU: longer points report their single first step instead of alternating timed steps")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if any(t % a.B for t in a.tokens):
        ap.error("every --tokens value must be a multiple of --B")
    cmd = "python bench/vs_transformer.py " + " ".join(
        [f"--tokens {' '.join(map(str, a.tokens))}", f"--B {a.B}", f"--steps {a.steps}", f"--threads {a.threads}",
         f"--device {a.device}", f"--max-step-s {a.max_step_s:g}", f"--max-timed-tokens {a.max_timed_tokens}"] + ([f"--out {a.out}"] if a.out else []))
    load_before = machine_load()
    rows = []
    for tokens in a.tokens:
        L = tokens // a.B
        if a.device != "cpu":
            for kind in KINDS:
                rows.append(measure(kind, a.B, L, a.steps, a.device, a.max_step_s))
                print(json.dumps(rows[-1]), flush=True)
            continue
        # the CPU: peak memory and the first step of each model in a process of its own, then the timed
        # steps of both models alternating in one process (up to --max-timed-tokens)
        pair = {}
        here = [measure_in_child(kind, a.B, L, 0, a.threads, a.max_step_s) for kind in KINDS]
        if tokens <= a.max_timed_tokens and a.steps > 0:
            pair = _child(f"time_pair({a.B}, {L}, {a.steps})", a.threads)
        for r in here:
            if "error" in pair:
                r["timing_error"] = pair["error"]
            if pair.get(r["kind"]):
                r["steps_s"] = pair[r["kind"]]
                r["step_s"] = statistics.median(r["steps_s"])
            elif "error" not in r:
                r["steps_s"], r["step_s"] = [r["warmup_s"]], r["warmup_s"]
                r["first_step_only"] = True
            rows.append(r)
            print(json.dumps(r), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    from megalodon_kernels.autotune.device import cpu_model

    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.machine()} {cpu_model()}"
    header = [f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, torch "
              f"{torch.__version__}, {dev}, {a.threads} thread(s). The machine is shared with other jobs: "
              "compare the ratios (both models measured back to back in this run), not the absolute times "
              "across runs.", "", f"- `uptime` before: `{load_before}`", f"- `uptime` after: `{machine_load()}`",
              "- peak memory: " + (rows[0].get("peak_kind", "?") if rows else "?")]
    text = markdown(rows, cmd, header)
    print(text)
    if a.out:
        a.out.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(dict(command=cmd, rows=rows, ratios=ratios(rows)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
