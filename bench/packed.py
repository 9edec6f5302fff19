"""Packed rows vs padding vs one unpacked row: time and tokens/s of the stateful ops and the model.

    python bench/packed.py [--set cpu|full] [--repeats 7] [--ops fftconv cema timestep_norm attention model]
                           [--out bench/results/packed.md]
    TRITON_INTERPRET=1 python bench/packed.py --bytes     # Triton kernel bytes of packed calls vs the ideal

The documents: ``--docs`` lengths drawn log-uniformly in [min, max] (seeded), the issue's set being
64 documents of 16..4096 tokens (``--set full``); ``--set cpu`` scales it to 16..1024 for a small
shared CPU. The same documents run three ways:

* packed: one row (1, T), T = the sum of the lengths, with ``cu_seqlens`` (every op restarts at
  each document start);
* padded: a batch of n rows, each document padded to the longest (what one does without
  packing; TimestepNorm gets the padding mask, everything else is causal so the padding is inert);
* unpacked: one row of the same T tokens without ``cu_seqlens`` (the cost floor of a row of T:
  what packing would cost if the document boundaries were free).

Widths are the bench ``cpu`` shape set's (D, N, G, H, dz, dv, chunk), float32, backend ``torch``
(``--backend`` to change it), one torch thread unless ``--threads`` says otherwise. Each op is timed forward (under no_grad) and forward+backward
(gradients of every floating input); the model (a small config, ``model_config``) forward gives
the logits and forward+backward adds a cross-entropy loss and its backward (padding targets
ignored). Reported: the median of ``--repeats`` timed runs after ``--warmup`` runs, and the useful
tokens per second (T / time, for all three layouts). The three layouts of one op are timed
round-robin (packed, padded, unpacked, packed, ...), so the ratios hold up on a shared machine.

The packed op calls reuse one ``cu_seqlens`` tensor, so its plan (one host read of cu_seqlens)
is cached after the warm-up, as it is for every layer after the first in a model step; the model
runs get a fresh ``cu_seqlens`` every call, so they pay the planning once per call like a training
step; the plan's own cost is printed too.

``--bytes`` counts the bytes the Triton kernels of a packed forward and backward load and store
(the interpreter counter of bench/triton_bytes.py; small shapes, since the interpreter is slow)
and compares them with the ideal of the op on the packed row (bench/roofline.py's formulas with
B = 1, L = T), next to the same ratio of the unpacked row. The gathers into document rows and the
scatters back are torch indexing outside the Triton kernels: they are not in the count, and the
report gives the row padding factor (sum of row lengths / T) that they and the kernels pay.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalodon_kernels import ops
from megalodon_kernels.bench.shapes import BENCH_SETS
from megalodon_kernels.ops._packing import plan

OPS = ("fftconv", "cema", "timestep_norm", "attention", "model")
LAYOUTS = ("packed", "padded", "unpacked")


@dataclass(frozen=True)
class DocSet:
    n: int
    min_len: int
    max_len: int


DOC_SETS = {"cpu": DocSet(64, 16, 1024), "full": DocSet(64, 16, 4096)}


def document_lengths(docs: DocSet, seed: int) -> list[int]:
    """n lengths log-uniform in [min_len, max_len] (rounded), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(docs.n, generator=g, dtype=torch.float64)
    lo, hi = math.log(docs.min_len), math.log(docs.max_len)
    return [int(v) for v in torch.exp(lo + u * (hi - lo)).round().clamp(docs.min_len, docs.max_len)]


def cu_of(lengths, device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def pad_documents(packed: torch.Tensor, dim: int, lengths) -> torch.Tensor:
    """The documents of a packed tensor (batch 1, time at ``dim``) as a zero-padded batch
    (n, ..., max length, ...)."""
    longest = max(lengths)
    shape = list(packed.shape)
    shape[0], shape[dim] = len(lengths), longest
    out = packed.new_zeros(shape)
    start = 0
    for d, n in enumerate(lengths):
        out[d].narrow(dim - 1, 0, n).copy_(packed[0].narrow(dim - 1, start, n))
        start += n
    return out


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def op_cases(op: str, lengths, s, backend: str, device, dtype=torch.float32, seed: int = 0):
    """{layout: (forward callable -> output tensors, the floating leaves needing gradients)}."""
    g = torch.Generator().manual_seed(seed)
    T, D = sum(lengths), s.D
    cu = cu_of(lengths, device)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device)

    if op in ("fftconv", "cema"):
        x = r(1, D, T)
        xp = pad_documents(x, 2, lengths)
        Lp = xp.shape[-1]
        if op == "fftconv":
            k = r(D, T) / math.sqrt(T)
            cases = {"packed": (x, k, cu), "padded": (xp, k[:, :Lp], None), "unpacked": (x, k, None)}
            out = {}
            for name, (xx, kk, c) in cases.items():
                xx, kk = _leaves(xx, kk)
                out[name] = (lambda xx=xx, kk=kk, c=c: ops.fftconv(xx, kk, backend=backend, cu_seqlens=c), [xx, kk])
            return out
        N = s.N
        gf = torch.Generator().manual_seed(seed + 1)
        p = torch.rand(D, N, generator=gf).to(device)
        log_q = torch.complex(-torch.rand(D, N, generator=gf) * 0.1, torch.rand(D, N, generator=gf) * 3).to(device)
        gamma = torch.complex(torch.randn(D, N, generator=gf), torch.randn(D, N, generator=gf)).to(device)
        omega = torch.randn(D, generator=gf).to(device)
        out = {}
        for name, (xx, c) in {"packed": (x, cu), "padded": (xp, None), "unpacked": (x, None)}.items():
            leaves = _leaves(xx, p, log_q, gamma, omega)
            out[name] = (lambda v=leaves, c=c: ops.cema(*v, backend=backend, cu_seqlens=c)[0], leaves)
        return out
    if op == "timestep_norm":
        x = r(1, T, D) + 3
        xp = pad_documents(x, 1, lengths)
        mask = torch.arange(xp.shape[1], device=device)[None] >= torch.tensor(lengths, device=device)[:, None]
        scale, bias = r(D), r(D)
        out = {}
        for name, (xx, m, c) in {"packed": (x, None, cu), "padded": (xp, mask, None), "unpacked": (x, None, None)}.items():
            leaves = _leaves(xx, scale, bias)
            out[name] = (lambda v=leaves, m=m, c=c: ops.timestep_norm(*v, s.G, padding_mask=m, backend=backend,
                                                                      cu_seqlens=c)[0], leaves)
        return out
    if op == "attention":
        H, dz, dv = s.H, s.dz, s.dv
        q, k, v = r(1, T, H, dz) / math.sqrt(dz), r(1, T, H, dz), r(1, T, H, dv)
        padded = tuple(pad_documents(t, 1, lengths) for t in (q, k, v))
        out = {}
        for name, (qkv, c) in {"packed": ((q, k, v), cu), "padded": (padded, None), "unpacked": ((q, k, v), None)}.items():
            leaves = _leaves(*qkv)
            out[name] = (lambda v=leaves, c=c: ops.attention(*v, chunk_size=s.chunk, backend=backend, cu_seqlens=c),
                         leaves)
        return out
    raise KeyError(op)


def model_config(s, backend: str):
    """The benchmarked model: 2 layers at the shape set's widths, byte vocabulary."""
    from megalodon_kernels.model import get_config

    return get_config("tiny", vocab_size=256, num_layers=2, model_dim=s.D, z_dim=s.H * s.dz, value_dim=s.H * s.dv,
                      num_heads=s.H, ffn_hidden_dim=2 * s.D, cema_ndim=s.N, chunk_size=s.chunk,
                      norm_num_groups=s.G, backend=backend)


def model_cases(lengths, s, backend: str, device, seed: int = 0):
    """{layout: (forward callable -> logits, loss callable(logits))}."""
    from megalodon_kernels.model import Megalodon, pack

    torch.manual_seed(seed)
    model = Megalodon(model_config(s, backend)).to(device)
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g).to(device) for n in lengths]
    tokens, cu = pack(docs)
    targets = torch.roll(tokens, -1, 1)
    padded = pad_documents(tokens, 1, lengths)
    padded_targets = pad_documents(targets, 1, lengths)
    padded_targets[torch.arange(padded.shape[1], device=device)[None] >= torch.tensor(lengths, device=device)[:, None]] = -100

    def loss_of(tg):
        return lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tg.reshape(-1), ignore_index=-100)

    return model, {
        # a fresh cu_seqlens each call: the plan is made once per call, as in a training step
        "packed": (lambda: model(tokens, cu_seqlens=cu.clone()), loss_of(targets)),
        "padded": (lambda: model(padded), loss_of(padded_targets)),
        "unpacked": (lambda: model(tokens), loss_of(targets)),
    }


def median_time(fn, repeats: int, warmup: int) -> float:
    return median_times({"": fn}, repeats, warmup)[""]


def median_times(fns: dict, repeats: int, warmup: int) -> dict:
    """{name: median seconds} of ``fns`` timed round-robin (one run of each per repeat), so a change
    in the machine's load during the measurement falls on every layout alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _as_list(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def _runners(op, lengths, s, backend, device):
    """{layout: (forward-only callable, forward+backward callable)}."""
    runners = {}
    if op == "model":
        model, cases = model_cases(lengths, s, backend, device)
        for layout, (fwd, loss_of) in cases.items():
            def run_fwd(fwd=fwd):
                with torch.no_grad():
                    fwd()

            def run_both(fwd=fwd, loss_of=loss_of):
                model.zero_grad(set_to_none=True)
                loss_of(fwd()).backward()

            runners[layout] = (run_fwd, run_both)
        return runners
    for layout, (fwd, leaves) in op_cases(op, lengths, s, backend, device).items():
        def run_fwd(fwd=fwd):
            with torch.no_grad():
                fwd()

        def run_both(fwd=fwd, leaves=leaves):
            for t in leaves:
                t.grad = None
            outs = _as_list(fwd())
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        runners[layout] = (run_fwd, run_both)
    return runners


def time_op(op, lengths, s, backend, device, repeats, warmup):
    """{layout: (fwd seconds, fwd+bwd seconds)}, the layouts timed round-robin."""
    runners = _runners(op, lengths, s, backend, device)
    fwd = median_times({layout: r[0] for layout, r in runners.items()}, repeats, warmup)
    both = median_times({layout: r[1] for layout, r in runners.items()}, repeats, warmup)
    return {layout: (fwd[layout], both[layout]) for layout in runners}


def plan_seconds(lengths, device, repeats: int) -> float:
    """Median time to plan a fresh cu_seqlens (the host read and the bucket index tensors)."""
    cu = cu_of(lengths, device)
    T = sum(lengths)
    return median_time(lambda: plan(cu.clone(), T), repeats, 1)


def row_padding_factor(lengths, T: int) -> float:
    """Sum of the document rows' lengths over T: the extra work document rows do over the packed row."""
    buckets = plan(cu_of(lengths, "cpu"), T).buckets
    return sum(b.size * b.docs.numel() for b in buckets) / T


# ------------------------------------------------------------------------------------- bytes
def bytes_rows(seed: int = 0, ops=("fftconv", "cema", "timestep_norm", "attention"), D: int = 16, G: int = 2):
    """[(op, direction, packed (total, unique) kernel bytes / ideal, unpacked (total, unique) /
    ideal)] at a small shape in the Triton interpreter (TRITON_INTERPRET=1): "total" counts every
    access, "unique" distinct addresses (bench/triton_bytes.py). D, G: the feature width and
    TimestepNorm's groups (at D = 16 its saved per-step statistics, 3 G / (2 D) of x, are a large
    part of its traffic; the ideal leaves them out)."""
    from megalodon_kernels.bench.roofline import ideal
    from megalodon_kernels.bench.triton_bytes import count_bytes
    import dataclasses

    s = dataclasses.replace(BENCH_SETS["cpu"], D=D, N=4, G=G, H=1, dz=16, dv=16, chunk=32)
    lengths = document_lengths(DocSet(16, 4, 256), seed)
    T = sum(lengths)
    shape = {"B": 1, "L": T, "D": s.D, "N": s.N, "G": s.G, "H": s.H, "dh": s.dz, "dv": s.dv, "chunk": s.chunk}
    rows = []
    for op in ops:
        cases = op_cases(op, lengths, s, "triton", torch.device("cpu"), seed=seed)
        ratios = {}
        for layout in ("packed", "unpacked"):
            fwd, leaves = cases[layout]
            with count_bytes() as c_fwd:
                outs = _as_list(fwd())
            with count_bytes() as c_bwd:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            want = ideal(op, shape)
            ratios[layout] = [(c.total / want[d][0], (c.loaded_unique + c.stored_unique) / want[d][0])
                              for c, d in ((c_fwd, "fwd"), (c_bwd, "bwd"))]
        for i, direction in enumerate(("fwd", "bwd")):
            rows.append((op, direction, ratios["packed"][i], ratios["unpacked"][i]))
    return lengths, s, rows


# ------------------------------------------------------------------------------------ report
def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(DOC_SETS), default="cpu", help="document set (full: 16..4096)")
    ap.add_argument("--docs", type=int, default=None, help="number of documents (default: the set's 64)")
    ap.add_argument("--ops", nargs="*", choices=OPS, default=list(OPS))
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default); 1 by default, since on a shared CPU more threads "
                         "than free cores make every call several times slower and the ratios meaningless")
    ap.add_argument("--bytes", action="store_true", help="Triton kernel bytes / ideal of packed calls instead of times")
    ap.add_argument("--bytes-width", nargs=2, type=int, default=(16, 2), metavar=("D", "G"),
                    help="--bytes: feature width and TimestepNorm groups (default 16 2)")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    lines = []

    def emit(text=""):
        print(text, flush=True)
        lines.append(text)

    if a.bytes:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--bytes needs TRITON_INTERPRET=1 set in the environment")
        lengths, s, rows = bytes_rows(a.seed, [op for op in a.ops if op != "model"], *a.bytes_width)
        T = sum(lengths)
        emit(f"Triton kernel bytes / ideal, interpreter counter: {len(lengths)} documents of {min(lengths)}..{max(lengths)} "
             f"tokens, T = {T}, D={s.D} N={s.N} G={s.G} H={s.H} dz={s.dz} dv={s.dv} chunk={s.chunk}, float32; "
             f"row padding factor {row_padding_factor(lengths, T):.3f}")
        emit()
        emit("| op | pass | packed total / ideal | unpacked total / ideal | packed unique / ideal "
             "| unpacked unique / ideal | packed / unpacked (total) |")
        emit("|---|---|---|---|---|---|---|")
        for op, direction, packed, unpacked in rows:
            emit(f"| {op} | {direction} | {packed[0]:.3f} | {unpacked[0]:.3f} | {packed[1]:.3f} | {unpacked[1]:.3f} "
                 f"| {packed[0] / unpacked[0]:.3f} |")
    else:
        docs = DOC_SETS[a.set]
        if a.docs:
            docs = DocSet(a.docs, docs.min_len, docs.max_len)
        lengths = document_lengths(docs, a.seed)
        s = BENCH_SETS["cpu"]
        device = torch.device(a.device)
        T, longest = sum(lengths), max(lengths)
        load0 = os.getloadavg()
        emit(f"{machine_line()}; backend {a.backend}, float32, median of {a.repeats} round-robin runs after {a.warmup} warm-up runs")
        emit(f"documents: {len(lengths)} of {min(lengths)}..{longest} tokens (log-uniform {docs.min_len}..{docs.max_len}, "
             f"seed {a.seed}), T = {T}; padded: {len(lengths)} x {longest} = {len(lengths) * longest} positions "
             f"({len(lengths) * longest / T:.2f}x T); document rows: {row_padding_factor(lengths, T):.2f}x T")
        emit(f"widths: D={s.D} N={s.N} G={s.G} H={s.H} dz={s.dz} dv={s.dv} chunk={s.chunk}; model: "
             f"{model_config(s, a.backend).num_layers} layers of these widths, vocabulary 256")
        emit(f"planning a fresh cu_seqlens: {plan_seconds(lengths, device, a.repeats) * 1e3:.2f} ms")
        emit(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
        emit()
        emit("| op | pass | packed ms | padded ms | unpacked ms | packed tok/s | padded tok/s | unpacked tok/s "
             "| packed / padded | packed / unpacked |")
        emit("|---|---|---|---|---|---|---|---|---|---|")
        for op in a.ops:
            t = time_op(op, lengths, s, a.backend, device, a.repeats, a.warmup)
            for i, direction in enumerate(("fwd", "fwd+bwd")):
                p, d, u = (t[layout][i] for layout in LAYOUTS)
                emit(f"| {op} | {direction} | {p * 1e3:.1f} | {d * 1e3:.1f} | {u * 1e3:.1f} | {T / p:,.0f} | "
                     f"{T / d:,.0f} | {T / u:,.0f} | {p / d:.2f} | {p / u:.2f} |")
        load1 = os.getloadavg()
        emit()
        emit(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
