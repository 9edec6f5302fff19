"""Ahead-of-time compilation of Triton kernels for sm_80 / sm_90, without a GPU.

The variants (each kernel x each config it can launch with x each input dtype) are declared in
:mod:`megalodon_kernels.bench.triton_variants`. :func:`compile_variant` compiles one with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` and reads its resources:
shared memory from the metadata, registers and local memory (spills) from the bundled
``cuobjdump --dump-resource-usage`` on the cubin. Used by the test suite (every variant must
compile, fit shared memory and not spill), by ``python -m megalodon_kernels.bench.resources``
(which writes the committed report bench/results/aot_sm*.json) and by the autotuner to prune
configs before timing them (:func:`config_problems`).

The signature carries the specialisation hints the JIT adds for aligned production shapes
(pointers and the integer arguments named in ``div16`` divisible by 16): without them the compiled
code and its register count differ from what runs (docs/verification.md).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

#: per-block shared memory limits (bytes) of the target architectures
SMEM_LIMIT = {80: 166912, 90: 232448}
ARCH_NAME = {80: "sm_80 (A100)", 90: "sm_90 (H100)"}
#: the committed resources report of one arch: every variant's registers, shared memory, spills
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPORT_COMMAND = "python -m megalodon_kernels.bench.resources --write"


def _newest_triton() -> tuple[int, int]:
    from .._versions import TRITON_TESTED

    return TRITON_TESTED[1]


def triton_tag(triton: tuple[int, int] | None = None) -> str:
    """The report files' suffix for Triton ``major.minor``: "" for the newest tested release (the
    report the tests' bounded sets and the arch tables read), "_triton3.6" for an older one."""
    if triton is None or tuple(triton[:2]) == _newest_triton():
        return ""
    return f"_triton{triton[0]}.{triton[1]}"


def report_path(cc: int, triton: tuple[int, int] | None = None) -> str:
    """The committed report of sm_<cc> compiled with Triton ``triton`` (major, minor; None: the
    newest tested release)."""
    return os.path.join(RESULTS_DIR, f"aot_sm{cc}{triton_tag(triton)}.json")


def report_tritons() -> list[tuple[int, int]]:
    """The tested Triton releases with a committed report: the oldest and the newest of
    _versions.TRITON_TESTED."""
    from .._versions import TRITON_TESTED

    return sorted(set(TRITON_TESTED))


def _discover_triton_ops() -> tuple[str, ...]:
    """Every op with an ops/<op>/triton_impl.py (each must have its variants declared in triton_variants)."""
    ops_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops")
    return tuple(sorted(d for d in os.listdir(ops_dir) if os.path.isfile(os.path.join(ops_dir, d, "triton_impl.py"))))


#: ops with a Triton backend, found on disk so a new backend cannot be left out of the AOT checks
TRITON_OPS = _discover_triton_ops()


@dataclass(frozen=True)
class Variant:
    op: str
    kernel: str
    fn: object  # the @triton.jit function
    arg_types: tuple  # ((name, "*fp32" | "i32" | "fp32" | ...), ...) for the runtime arguments
    constexprs: tuple  # ((name, value), ...)
    div16: frozenset = frozenset()
    num_warps: int = 4
    num_stages: int = 2
    label: str = ""
    maxnreg: int | None = None  # ptxas register cap per thread (Triton's `maxnreg` option); None: ptxas decides

    @property
    def ident(self) -> tuple[str, str, str]:
        """(op, kernel, label): how the resources report names this variant."""
        return self.op, self.kernel, self.label


@dataclass
class Resources:
    variant: Variant
    cc: int
    regs: int
    shared: int
    local: int  # stack + local memory per thread in bytes: > 0 means spills
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.shared <= SMEM_LIMIT[self.cc]

    @property
    def spills(self) -> bool:
        return self.local > 0


def _source(v: Variant):
    from triton.compiler import ASTSource

    types = dict(v.arg_types)
    consts = dict(v.constexprs)
    signature, attrs = {}, {}
    for i, name in enumerate(v.fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
            if types[name].startswith("*") or name in v.div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise ValueError(f"{v.op}/{v.kernel}: argument {name!r} has neither a type nor a constexpr value")
    return ASTSource(fn=v.fn, signature=signature, constexprs=consts, attrs=attrs)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(v: Variant, cc: int):
    """``triton.compile`` of the variant for sm_<cc> with its launch options (its ``asm`` holds the cubin)."""
    if not hasattr(v.fn, "cache_key"):
        raise RuntimeError(f"{v.op}/{v.kernel} was decorated under TRITON_INTERPRET=1 and cannot be compiled; "
                           "use compile_all(), whose worker processes import the kernels without the interpreter")
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": v.num_warps, "num_stages": v.num_stages}
    if v.maxnreg is not None:
        options["maxnreg"] = v.maxnreg
    return triton.compile(_source(v), target=GPUTarget("cuda", cc, 32), options=options)


def compile_variant(v: Variant, cc: int) -> Resources:
    k = compile_kernel(v, cc)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    try:
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(path)
    usage = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return Resources(v, cc, regs=usage.get("REG", -1), shared=int(k.metadata.shared),
                     local=usage.get("STACK", 0) + usage.get("LOCAL", 0))


def all_variants(ops=TRITON_OPS, config: tuple | None = None) -> list[Variant]:
    """Every variant of ``ops``; with ``config`` (sorted (knob, value) items of one op's backend
    config), only the variants that config launches (``aot_variants(op, space)`` with one value per knob)."""
    from . import triton_variants

    variants = []
    for op in ops:
        space = None if config is None else {k: [v] for k, v in config}
        variants.extend(triton_variants.aot_variants(op, space))
    return variants


def _worker_init():
    # The interpreter replaces @triton.jit functions at decoration time; the workers import the
    # kernel modules fresh (spawn), after this runs, so they get compilable JITFunctions.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _compile_job(args):
    op, index, cc, config = args
    v = all_variants((op,), config)[index]
    try:
        r = compile_variant(v, cc)
    except Exception as exc:  # reported per variant: one bad config must not hide the others
        last = str(exc).strip().splitlines()[-1:] or [""]
        return op, index, cc, None, f"{type(exc).__name__}: {last[0]}"
    return op, index, cc, (r.regs, r.shared, r.local), None


# ------------------------------------------------------------------ the committed resources report

def load_report(cc: int, triton: tuple[int, int] | None = None) -> dict:
    """The committed report of sm_<cc> (with Triton ``triton``, default the newest tested):
    {"rows": [{op, kernel, label, regs, smem, spill}], ...}."""
    with open(report_path(cc, triton)) as f:
        return json.load(f)


def report_rows(ccs=(80, 90)) -> dict:
    """{(op, kernel, label): {cc: row}} over the committed reports of ``ccs``."""
    rows: dict = {}
    for cc in ccs:
        for row in load_report(cc)["rows"]:
            rows.setdefault((row["op"], row["kernel"], row["label"]), {})[cc] = row
    return rows


def heaviest(variants: list[Variant], report: dict) -> list[int]:
    """Indices of a bounded subset: per kernel, the variant with the most registers according to the
    committed ``report`` (:func:`report_rows`; the maximum over its archs), ties broken by shared
    memory, so every kernel compiles once at the variant closest to the register and shared-memory
    limits. A variant missing from the report raises (the report is stale: regenerate it)."""
    best: dict = {}
    for i, v in enumerate(variants):
        if v.ident not in report:
            raise KeyError(f"{v.ident} is not in the resources report; regenerate it: {REPORT_COMMAND}")
        weight = max((r["regs"], r["smem"]) for r in report[v.ident].values())
        key = (v.op, v.kernel)
        if key not in best or weight > best[key][0]:
            best[key] = (weight, i)
    return sorted(i for _, i in best.values())


def compile_all(ops=TRITON_OPS, ccs=(80, 90), workers: int | None = None, bounded: bool = False,
                match: str | None = None) -> list[Resources]:
    """Compile every variant of ``ops`` (with ``bounded``: the :func:`heaviest` per kernel according
    to the committed report; with ``match``: those whose "kernel label" the regular expression
    finds) for every arch, in parallel worker processes."""
    by_op = {op: all_variants((op,)) for op in ops}
    report = report_rows() if bounded else None
    chosen = {op: heaviest(vs, report) if bounded else range(len(vs)) for op, vs in by_op.items()}
    if match is not None:
        chosen = {op: [i for i in idx if re.search(match, f"{by_op[op][i].kernel} {by_op[op][i].label}")]
                  for op, idx in chosen.items()}
    results = _run_jobs([(op, i, cc, None) for op in ops for i in chosen[op] for cc in ccs], workers)
    failed = [f"{by_op[op][i].kernel} [{by_op[op][i].label}] sm_{cc}: {err}" for op, i, cc, _, err in results if err]
    if failed:
        raise RuntimeError("Triton variants failed to compile:\n  " + "\n  ".join(failed))
    return [Resources(by_op[op][i], cc, *usage) for op, i, cc, usage, _ in results]


def _run_jobs(jobs, workers=None):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if not jobs:
        return []
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
        return list(pool.map(_compile_job, jobs))


_PROBLEMS: dict = {}


def config_problems(op: str, config: dict, cc: int, workers: int | None = None) -> list[str]:
    """Why ``op``'s Triton backend must not run with ``config`` on sm_<cc>: every kernel variant
    that config launches (each dtype and tiling) that does not compile, needs more shared memory
    than the arch's per-block limit, or spills registers. Empty when every variant is fine.

    The autotuner's ahead-of-time pruning: Triton raises OutOfResources only when a kernel is
    loaded on a device, so a config is checked offline before it is timed. Conservative across
    dtypes: a config is pruned if any of its variants fails. Cached per process."""
    if cc not in SMEM_LIMIT:
        raise ValueError(f"cc must be one of {sorted(SMEM_LIMIT)} (archs with a known shared memory limit), got {cc}")
    items = tuple(sorted(config.items()))
    key = (op, items, cc)
    if key not in _PROBLEMS:
        variants = all_variants((op,), items)
        problems = []
        for _, i, _, usage, err in _run_jobs([(op, i, cc, items) for i in range(len(variants))], workers):
            v = variants[i]
            if err:
                problems.append(f"{v.kernel} [{v.label}] does not compile for sm_{cc}: {err}")
                continue
            r = Resources(v, cc, *usage)
            if not r.fits:
                problems.append(f"{v.kernel} [{v.label}] needs {r.shared} B shared memory > {SMEM_LIMIT[cc]} B "
                                f"on sm_{cc}")
            if r.spills:
                problems.append(f"{v.kernel} [{v.label}] spills {r.local} B per thread on sm_{cc}")
        _PROBLEMS[key] = problems
    return list(_PROBLEMS[key])


# ------------------------------------------------------------- the other archs' (bounded) report

#: architectures with no full report: each compiled for the bounded subset of :func:`arch_subset`
OTHER_ARCHS = (75, 86, 89, 100, 120)
ARCH_REPORT = os.path.join(RESULTS_DIR, "aot_archs.json")
ARCH_REPORT_COMMAND = "python -m megalodon_kernels.bench.aot --write-archs"


def arch_subset(variants: list[Variant], report: dict) -> list[int]:
    """Per kernel, the variant with the most registers (:func:`heaviest`) and the one with the most
    shared memory, according to the full sm_80/sm_90 reports: the two variants nearest the register
    and the shared-memory limits on another architecture."""
    chosen = set(heaviest(variants, report))
    most: dict = {}
    for i, v in enumerate(variants):
        smem = max(r["smem"] for r in report[v.ident].values())
        if v.kernel not in most or smem >= most[v.kernel][0]:  # ties: the last declared
            most[v.kernel] = (smem, i)
    return sorted(chosen | {i for _, i in most.values()})


def compile_archs(ccs=OTHER_ARCHS, ops=TRITON_OPS, workers: int | None = None) -> list[dict]:
    """Rows {arch, op, kernel, label, regs, smem, spill, error} of :func:`arch_subset` compiled for ``ccs``."""
    report = report_rows()
    by_op = {op: all_variants((op,)) for op in ops}
    jobs = [(op, i, cc, None) for op in ops for i in arch_subset(by_op[op], report) for cc in ccs]
    rows = []
    for op, i, cc, usage, err in _run_jobs(jobs, workers):
        v = by_op[op][i]
        regs, smem, spill = usage if usage else (None, None, None)
        rows.append({"arch": f"sm_{cc}", "op": op, "kernel": v.kernel, "label": v.label, "regs": regs, "smem": smem,
                     "spill": spill, "error": err})
    return rows


def write_arch_report(rows: list[dict], path: str = ARCH_REPORT) -> None:
    """Merge ``rows`` into the committed report (a row replaces the one with its arch and label)."""
    import triton

    old = load_arch_report(path)["rows"] if os.path.exists(path) else []
    key = lambda r: (r["arch"], r["op"], r["kernel"], r["label"])  # noqa: E731
    merged = {key(r): r for r in old}
    merged.update((key(r), r) for r in rows)
    out = {"generated_by": ARCH_REPORT_COMMAND,
           "about": "Per Triton kernel, its variant with the most registers and its variant with the most shared "
                    "memory (per the sm_80/sm_90 reports) compiled ahead of time for further archs: registers per "
                    "thread, shared memory bytes per block, local memory (spill) bytes per thread. The source of "
                    "ops/_triton_common.TRITON_NEEDS. Do not edit: regenerate with the command above.",
           "triton": triton.__version__,
           "smem_optin_bytes": {f"sm_{cc}": _optin(cc) for cc in OTHER_ARCHS},
           "rows": sorted(merged.values(), key=key)}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def load_arch_report(path: str = ARCH_REPORT) -> dict:
    with open(path) as f:
        return json.load(f)


def _optin(cc: int) -> int:
    from ..cuda.device import SMEM_OPTIN_BY_ARCH

    return SMEM_OPTIN_BY_ARCH[cc]


def _main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Compile the Triton kernels ahead of time for further archs "
                                                 "(bounded subset) and write bench/results/aot_archs.json")
    parser.add_argument("--write-archs", action="store_true", help="merge the results into the committed report")
    parser.add_argument("--archs", default=",".join(map(str, OTHER_ARCHS)), help="comma-separated, e.g. 75,120")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--out", default=ARCH_REPORT, help="the report to merge into (default: the committed one)")
    args = parser.parse_args(argv)
    rows = compile_archs(tuple(int(a) for a in args.archs.split(",")), workers=args.workers)
    for r in rows:
        print(f"{r['arch']} {r['op']} {r['kernel']}: regs={r['regs']} smem={r['smem']} spill={r['spill']}"
              + (f" ERROR {r['error']}" if r["error"] else ""))
    if args.write_archs:
        write_arch_report(rows, args.out)


if __name__ == "__main__":
    _main()
