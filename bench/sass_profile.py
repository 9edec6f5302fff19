"""Instruction mix of a compiled Triton kernel, per loop, from its SASS: a GPU-free look at where
the issue slots go.

A kernel compiled ahead of time (:mod:`megalodon_kernels.bench.aot`, sm_80 / sm_90) is
disassembled with the ``nvdisasm`` Triton bundles (``-c -g``: code only, with source lines). Each
backward branch closes a loop; for the whole kernel and for each loop the static instructions are
counted per class (tensor-core, fp32, integer, shuffle, shared, global, ...) and per source line.

Static counts are what one warp issues per pass over the code (per loop iteration for a loop body).
With the number of programs, warps and iterations of a launch, they give the warp-instructions the
launch issues, and from the SM count and clock a lower bound on its time when nothing else limits
it (:func:`issue_bound_ms`): one instruction per scheduler per cycle, four schedulers per SM.
Tensor-core instructions take several cycles of their pipe each, so a kernel rich in them can
be slower than that bound; one rich in shuffles and dependent arithmetic is latency-bound well
above it. The bound says which side of the roofline's bytes and FLOPs a kernel sits on before a
GPU measures it.

    python -m megalodon_kernels.bench.sass_profile --op cema --match "_fwd_kernel .*fp32 hx=False" \\
        --arch 90 --programs 16384 --iterations 8
    python -m megalodon_kernels.bench.sass_profile --op fftconv --cuda --match "fftconv_fwd_kernel<float>"

The CUDA kernels (``--cuda``) are compiled by nvcc from the ops' instantiations (cuda/build.py).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

#: opcode (before the first dot) -> class; anything else counts as "other"
CLASSES = {
    "tensor": ("HMMA", "HGMMA", "IMMA", "BMMA", "DMMA", "WGMMA"),
    "fp32": ("FADD", "FMUL", "FFMA", "FSEL", "FSETP", "FMNMX", "FSET", "FCHK", "FSWZADD"),
    "int": ("IADD3", "IMAD", "LOP3", "SHF", "ISETP", "LEA", "SEL", "IABS", "IMNMX", "VIADD", "UIADD3",
            "UIMAD", "ULOP3", "USHF", "ULEA", "UISETP", "USEL", "SGXT", "PRMT", "IADD", "IMUL", "POPC", "FLO",
            "BREV", "BMSK", "IDP", "VIMNMX", "LOP", "ISCADD", "USGXT", "UPRMT", "UFLO", "UPOPC", "UBMSK"),
    "move": ("MOV", "UMOV", "CS2R", "S2R", "S2UR", "R2UR", "P2R", "R2P", "PLOP3", "UPLOP3", "LDC", "ULDC",
             "SHFL_NONE", "MOVM", "VOTE", "VOTEU", "UP2UR"),
    "shuffle": ("SHFL",),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS", "LDGDEPBAR"),
    "global": ("LDG", "STG", "LDGSTS", "RED", "ATOM", "ATOMG", "LD", "ST", "UBLKCP", "UTMALDG", "UTMASTG"),
    "local": ("LDL", "STL"),
    "convert": ("F2F", "F2I", "I2F", "I2FP", "F2FP", "FRND", "I2I"),
    "special": ("MUFU",),
    "sync": ("BAR", "DEPBAR", "WARPSYNC", "BSSY", "BSYNC", "MEMBAR", "ERRBAR", "CCTL", "SYNCS", "ARRIVES",
             "WARPGROUP"),
    "branch": ("BRA", "EXIT", "RET", "CALL", "JMP", "BRX", "YIELD", "NOP"),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}

#: an H200 / H100 SXM: 132 SMs at ~1.98 GHz boost, four schedulers per SM issuing one warp-instruction
#: per cycle each (an A100: 108 SMs at 1.41 GHz)
SMS = {80: 108, 90: 132}
CLOCK_GHZ = {80: 1.41, 90: 1.98}
SCHEDULERS_PER_SM = 4


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str      # with its modifiers, e.g. "HMMA.1688.F32.TF32"
    text: str        # the whole instruction, predicate included
    line: str | None  # "file.py:line", the source line nvdisasm attributes it to

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def cls(self) -> str:
        return _CLASS_OF.get(self.base, "other")


@dataclass
class Region:
    """The whole kernel, or one loop: [start, end] are instruction indices (end: the backward branch)."""
    name: str
    start: int
    end: int
    depth: int = 0
    instrs: list = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.instrs)

    def by_class(self) -> dict:
        return dict(collections.Counter(i.cls for i in self.instrs).most_common())

    def by_opcode(self, top: int = 12) -> list:
        return collections.Counter(i.base for i in self.instrs).most_common(top)

    def by_line(self, top: int = 12) -> list:
        return collections.Counter(i.line for i in self.instrs).most_common(top)


_LINE = re.compile(r'\s*//## File "(?P<file>[^"]*)", line (?P<line>\d+)')
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_INSTR = re.compile(r"\s*/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<text>[^;]*);")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"`\(?(?P<label>\.L_x_\d+)\)?")


def parse(sass: str) -> tuple[list[Instr], dict]:
    """The instructions of one kernel's ``nvdisasm -c -g`` listing, and {label: index of the next instruction}."""
    instrs, labels, line = [], {}, None
    for raw in sass.splitlines():
        m = _LINE.match(raw)
        if m:
            line = f'{os.path.basename(m.group("file"))}:{m.group("line")}'
            continue
        m = _LABEL.match(raw)
        if m:
            labels[m.group("label")] = len(instrs)
            continue
        m = _INSTR.match(raw)
        if m:
            text = m.group("text").strip()
            opcode = _PRED.sub("", text).split()[0]
            instrs.append(Instr(int(m.group("addr"), 16), opcode, text, line))
    return instrs, labels


def regions(instrs: list[Instr], labels: dict) -> list[Region]:
    """The kernel (depth 0) and every loop closed by a backward branch, outermost first. A self-branch
    (Triton's trap after EXIT) is not a loop."""
    out = [Region("kernel", 0, len(instrs) - 1, 0, list(instrs))]
    spans = []
    for i, ins in enumerate(instrs):
        if ins.base != "BRA":
            continue
        m = _TARGET.search(ins.text)
        if m and m.group("label") in labels and labels[m.group("label")] < i:
            spans.append((labels[m.group("label")], i))
    spans.sort(key=lambda s: (s[0], -s[1]))
    for n, (s, e) in enumerate(spans):
        depth = 1 + sum(1 for (s2, e2) in spans if (s2, e2) != (s, e) and s2 <= s and e <= e2)
        out.append(Region(f"loop{n}", s, e, depth, instrs[s:e + 1]))
    return out


def issue_bound_ms(warp_instructions: float, cc: int = 90) -> float:
    """The time to issue ``warp_instructions`` on all schedulers of a full sm_<cc> part, in ms."""
    return warp_instructions / (SMS[cc] * SCHEDULERS_PER_SM * CLOCK_GHZ[cc] * 1e9) * 1e3


def launch_warp_instructions(kernel: Region, loop: Region | None, warps: int, programs: int,
                             iterations: float) -> float:
    """Warp-instructions of a launch of ``programs`` programs of ``warps`` warps whose ``loop`` runs
    ``iterations`` times per program (the code outside it once)."""
    body = loop.count if loop is not None else 0
    return programs * warps * ((kernel.count - body) + iterations * body)


def disassemble(cubin: bytes) -> str:
    from .aot import _cuobjdump

    nvdisasm = os.path.join(os.path.dirname(_cuobjdump()), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([nvdisasm, "-c", "-g", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def _sass_job(args):
    op, index, cc = args
    from .aot import all_variants, compile_kernel

    return disassemble(compile_kernel(all_variants((op,))[index], cc).asm["cubin"])


def variant_sass(op: str, match: str, cc: int = 90) -> list[tuple[object, str]]:
    """[(variant, SASS)] of ``op``'s variants whose "kernel label" the regular expression ``match``
    finds, compiled for sm_<cc> in spawned workers (the kernels must be imported without the
    interpreter)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from .aot import _worker_init, all_variants

    variants = all_variants((op,))
    chosen = [i for i, v in enumerate(variants) if re.search(match, f"{v.kernel} {v.label}")]
    if not chosen:
        raise ValueError(f"match={match!r} selects no {op} variant")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(len(chosen), os.cpu_count() or 1), mp_context=ctx,
                             initializer=_worker_init) as pool:
        sass = list(pool.map(_sass_job, [(op, i, cc) for i in chosen]))
    return [(variants[i], s) for i, s in zip(chosen, sass)]


def split_functions(sass: str) -> dict:
    """{mangled kernel name: its listing} of a multi-kernel ``nvdisasm`` listing."""
    out, name, buf = {}, None, []
    for raw in sass.splitlines():
        m = re.match(r"\s*//-+ \.text\.(\S+)\s+-+", raw)
        if m:
            if name is not None:
                out[name] = "\n".join(buf)
            name, buf = m.group(1), []
        elif name is not None:
            buf.append(raw)
    if name is not None:
        out[name] = "\n".join(buf)
    return out


def cuda_sass(op: str, match: str, cc: int = 90) -> list[tuple[str, str]]:
    """[(kernel, SASS)] of the CUDA kernels of ``op`` (ops/<op>/cuda_impl.py KERNELS) whose name
    expression ``match`` finds, compiled by nvcc for sm_<cc> with line info (no GPU needed)."""
    import importlib

    from ..cuda import build

    nvcc = build.nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or put the CUDA toolkit's bin on PATH)")
    kernels = [k for k in importlib.import_module(f"megalodon_kernels.ops.{op}.cuda_impl").KERNELS
               if re.search(match, k.name)]
    if not kernels:
        raise ValueError(f"match={match!r} selects no CUDA kernel of {op}")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in build.nvcc_sources(kernels):
            cubin = os.path.join(tmp, "k.cubin")
            build.run_tool([nvcc, *build.NVCC_FLAGS, f"-arch=sm_{cc}", f"-I{build.CUDA_DIR}", str(src),
                            "-o", cubin], f"nvcc {src.name} sm_{cc}")
            with open(cubin, "rb") as f:
                listing = disassemble(f.read())
            for mangled, text in split_functions(listing).items():
                out.append((build._demangle([mangled])[0], text))
    return out


def describe(title: str, warps: int, sass: str, cc: int, programs: int | None = None,
             iterations: float | None = None) -> str:
    """The regions' counts of one kernel; with ``programs``: the launch's warp-instructions and issue
    bound, its largest outer loop run ``iterations`` times per program (block)."""
    instrs, labels = parse(sass)
    rs = regions(instrs, labels)
    lines = [f"{title} sm_{cc}, {warps} warps"]
    for r in rs:
        lines.append(f"  {r.name:7s} depth {r.depth}: {r.count:5d} instructions  {r.by_class()}")
        lines.append(f"           opcodes {r.by_opcode()}")
        lines.append(f"           source lines {r.by_line()}")
    loops = [r for r in rs if r.depth == 1]
    if programs is not None:
        loop = max(loops, key=lambda r: r.count) if loops else None
        n = launch_warp_instructions(rs[0], loop, warps, programs, iterations or 0)
        lines.append(f"  launch: {programs} programs x {warps} warps, "
                     f"{iterations or 0:g} iterations of {loop.name if loop else 'no loop'}: {n:.3g} warp-instructions, "
                     f"issue bound {issue_bound_ms(n, cc):.3f} ms on {SMS[cc]} SMs at {CLOCK_GHZ[cc]} GHz")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", required=True)
    ap.add_argument("--match", required=True, help="regular expression on 'kernel label' (Triton) or on the "
                                                     "kernel's name expression (--cuda)")
    ap.add_argument("--cuda", action="store_true", help="the op's CUDA kernels (nvcc) instead of its Triton variants")
    ap.add_argument("--warps", type=int, default=None, help="--cuda: warps per block of the launch")
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SMS))
    ap.add_argument("--programs", type=int, default=None, help="programs (blocks) in the launch, for the issue bound")
    ap.add_argument("--iterations", type=float, default=None, help="iterations of the largest outer loop per program")
    ap.add_argument("--dump", default=None, help="directory to write each kernel's SASS into")
    args = ap.parse_args(argv)
    if args.cuda:
        found = [(name, args.warps or 1, sass) for name, sass in cuda_sass(args.op, args.match, args.arch)]
    else:
        found = [(f"{v.kernel} [{v.label}]", v.num_warps, sass)
                 for v, sass in variant_sass(args.op, args.match, args.arch)]
    for title, warps, sass in found:
        print(describe(title, warps, sass, args.arch, args.programs, args.iterations))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{title}_sm{args.arch}")[:150] + ".sass"
            with open(os.path.join(args.dump, name), "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
