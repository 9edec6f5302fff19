"""Every Triton kernel x every config it can launch with compiles for sm_80 and sm_90 ahead of
time, fits the per-block shared memory and does not spill (no GPU needed).

Compiling every variant takes tens of minutes on 2 cores (the FFT tiles alone take ~30 s each),
so the default run (and CI) compiles, per kernel, the heaviest variant according to the committed
resources report bench/results/aot_sm*.json (most registers, ties by shared memory; see
``bench.aot.heaviest``); ``--stress`` compiles all of them, as does
``python -m megalodon_kernels.bench.resources --write``, which regenerates the report. The report
cannot go stale silently: its variant list must equal the declared variants (checked without
compiling).

Each tested Triton release has its own report (bench/results/aot_sm80.json, aot_sm90.json for the
newest; aot_sm80_triton3.6.json etc. for the oldest). The rule, checked against them: nothing a
backend may launch spills or overflows shared memory on a tested release; what does on an older
release is pruned for it in ops/_triton_common.RELEASE_PRUNES (a config value out of the candidate
space, or a launch refused with a reason), and the table prunes nothing else.

Further archs (sm_75, 86, 89, 100, 120: bench/results/aot_archs.json, a bounded subset per kernel) are
the data behind ops/_triton_common.TRITON_NEEDS, which every Triton backend's not_supported_reasons
reads for the tensors' device: the table must equal the compiled figures, and each GPU profile of
cuda/device.py must run or refuse (with a reason naming its arch) what the table implies."""
import re

import pytest

from megalodon_kernels._versions import TRITON_TESTED, parse
from megalodon_kernels.bench.aot import (REPORT_COMMAND, SMEM_LIMIT, TRITON_OPS, all_variants, compile_all, heaviest,
                                         load_report, report_path, report_rows, report_tritons)


@pytest.fixture(scope="module")
def compiled(request):
    return compile_all(TRITON_OPS, (80, 90), bounded=not request.config.getoption("--stress"))


def _release_id(release):
    return "triton%d.%d" % release


@pytest.mark.parametrize("release", report_tritons(), ids=_release_id)
@pytest.mark.parametrize("cc", sorted(SMEM_LIMIT))
def test_report_lists_exactly_the_declared_variants(cc, release):
    """One report per arch and tested Triton release (report_path), each complete for what it
    says it compiled: every variant for the newest release; an older release's report may be a
    selection it records (its ops and a regular expression over "kernel label"; its markdown
    says so), and then lists exactly the declared variants of that selection."""
    report = load_report(cc, release)
    newest = release == TRITON_TESTED[1]
    ops = TRITON_OPS if newest else tuple(report["ops"])
    match = None if newest else report.get("match")
    assert ops and set(ops) <= set(TRITON_OPS), ops
    declared = [v.ident for v in all_variants(ops) if match is None or re.search(match, f"{v.kernel} {v.label}")]
    assert len(set(declared)) == len(declared), "two declared variants share (op, kernel, label)"
    assert report["arch"] == f"sm_{cc}" and report["generated_by"] == REPORT_COMMAND
    assert parse(report["triton"])[:2] == release, (report_path(cc, release), report["triton"])
    listed = [(r["op"], r["kernel"], r["label"]) for r in report["rows"]]
    missing, extra = set(declared) - set(listed), set(listed) - set(declared)
    assert not missing and not extra, (f"bench/results/aot_sm{cc}.json is stale (regenerate: {REPORT_COMMAND}); "
                                       f"declared but not reported: {sorted(missing)[:3]}; "
                                       f"reported but not declared: {sorted(extra)[:3]}")
    assert len(listed) == len(declared)
    assert report["variants"] == len(listed)
    assert report["spilling"] == sum(r["spill"] > 0 for r in report["rows"])
    assert report["over_smem_limit"] == sum(r["smem"] > SMEM_LIMIT[cc] for r in report["rows"])


def test_bounded_set_is_the_heaviest_variant_of_every_kernel():
    report = report_rows()
    for op in TRITON_OPS:
        variants = all_variants((op,))
        chosen = heaviest(variants, report)
        assert sorted({(variants[i].op, variants[i].kernel) for i in chosen}) == \
            sorted({(v.op, v.kernel) for v in variants}) and len(chosen) == len({v.kernel for v in variants})
        for i in chosen:
            weight = max((r["regs"], r["smem"]) for r in report[variants[i].ident].values())
            rivals = [max((r["regs"], r["smem"]) for r in report[v.ident].values())
                      for v in variants if v.kernel == variants[i].kernel]
            assert weight == max(rivals), variants[i].ident


def _over_limits(release) -> set:
    """(op, kernel, label) of every variant that spills or overflows shared memory on sm_80 or
    sm_90 according to ``release``'s committed report."""
    return {(r["op"], r["kernel"], r["label"]) for cc in sorted(SMEM_LIMIT) for r in load_report(cc, release)["rows"]
            if r["spill"] > 0 or r["smem"] > SMEM_LIMIT[cc]}


@pytest.mark.parametrize("release", report_tritons(), ids=_release_id)
def test_what_spills_on_a_release_is_exactly_what_is_pruned_there(release):
    """The rule: on every tested Triton release no variant the backends may launch spills or
    overflows shared memory; a launch that does on an older release is pruned for it
    (_triton_common.RELEASE_PRUNES), and the table prunes nothing that does not."""
    from megalodon_kernels.ops._triton_common import RELEASE_PRUNES

    pruned = {(p.op, kernel, label) for p in RELEASE_PRUNES if release < p.below for kernel, label in p.variants}
    bad = _over_limits(release)
    assert bad == pruned, (f"Triton {release}: over the limits but not pruned: {sorted(bad - pruned)[:4]}; "
                           f"pruned but fine: {sorted(pruned - bad)[:4]}")


def test_release_prunes_are_lifted_by_a_tested_release_and_reach_the_user():
    """Each prune ends at a tested release (the newest compiles everything clean), names what
    spills, and is visible: a config value leaves the op's candidate space, a launch gets a
    not_supported_reasons sentence naming the fixed release, on a CUDA device only."""
    from megalodon_kernels.ops import _triton_common as tc

    oldest, newest = TRITON_TESTED
    assert not _over_limits(newest), "the newest tested Triton must compile every variant clean"
    for p in tc.RELEASE_PRUNES:
        assert oldest < p.below <= newest and p.why and p.variants, p
        assert (p.config is None) != (p.launch is None), p
        if p.config:
            module = importlib.import_module(f"megalodon_kernels.ops.{p.op}.triton_impl")
            space = getattr(module, "CONFIG_SPACE_ALL_RELEASES", module.CONFIG_SPACE)
            full = tc.release_config_space(p.op, space, newest)
            old = tc.release_config_space(p.op, space, oldest)
            for knob, value in p.config.items():
                assert value in full[knob] and value not in old[knob] and old[knob], (p, old)
            assert any(p.why in line for line in tc.release_pruned_configs(p.op, oldest))
            assert not tc.release_pruned_configs(p.op, newest)
        else:
            gpu = torch.device("cuda", 0)
            assert p.families and set(p.families) <= set(tc.TRITON_FAMILY.values()), p
            for profile, caps in cuda_device.PROFILES.items():
                with cuda_device.faked(profile):
                    why = tc.release_reasons(p.op, gpu, oldest, **p.launch)
                    if tc.TRITON_FAMILY.get(caps.arch) not in p.families:
                        assert not why, (profile, why)  # only where the report shows the spill
                        continue
                    assert why and p.why in why[0] and f"triton>={p.below[0]}.{p.below[1]}" in why[0], why
                    assert not tc.release_reasons(p.op, gpu, newest, **p.launch)
                    other = {k: ("other" if not isinstance(v, bool) else not v) for k, v in p.launch.items()}
                    assert not tc.release_reasons(p.op, gpu, oldest, **other)
            assert any(tc.TRITON_FAMILY.get(c.arch) in p.families for c in cuda_device.PROFILES.values()), p
            assert not tc.release_reasons(p.op, torch.device("cpu"), oldest, **p.launch)  # the interpreter


@pytest.mark.stress
def test_every_chosen_variant_compiled_for_both_archs(compiled, stress):
    every = all_variants()
    report = report_rows()
    expect = len(every) if stress else sum(len(heaviest(all_variants((op,)), report)) for op in TRITON_OPS)
    assert len(compiled) == 2 * expect > 0


@pytest.mark.stress
@pytest.mark.parametrize("op", TRITON_OPS)
def test_variants_fit_shared_memory_and_do_not_spill(compiled, op):
    """On the running Triton: every compiled variant fits and does not spill, except the ones
    RELEASE_PRUNES prunes for this release (never launched on it; the committed reports check
    that the table prunes exactly what spills)."""
    from megalodon_kernels.ops._triton_common import RELEASE_PRUNES, triton_release

    release = triton_release()
    pruned = {(p.op, k, lab) for p in RELEASE_PRUNES if release < p.below for k, lab in p.variants}
    rows = [r for r in compiled if r.variant.op == op]
    assert rows, f"no AOT variants declared for {op}"
    spills = []
    for r in rows:
        if r.variant.ident in pruned:
            continue
        print(f"{op} {r.variant.label} sm_{r.cc}: regs={r.regs} smem={r.shared} local={r.local}")
        assert r.regs > 0, "cuobjdump reported no register count"
        assert r.shared <= SMEM_LIMIT[r.cc], f"{r.variant.label}: {r.shared} B smem > {SMEM_LIMIT[r.cc]} on sm_{r.cc}"
        if r.spills:
            spills.append(f"{r.variant.label}: {r.local} B of local memory (spills) on sm_{r.cc}")
    assert not spills, spills


# ------------------------------------------- further archs: what each GPU runs (ops/_triton_common)

import importlib  # noqa: E402

import torch  # noqa: E402

from megalodon_kernels.bench.aot import OTHER_ARCHS, arch_subset, load_arch_report  # noqa: E402
from megalodon_kernels.cuda import device as cuda_device  # noqa: E402
from megalodon_kernels.ops import _triton_common  # noqa: E402


def _rows_by(arch: str, op: str):
    return [r for r in load_arch_report()["rows"] if r["arch"] == arch and r["op"] == op]


def test_arch_report_covers_the_bounded_subset_of_every_arch():
    """aot_archs.json holds, for every further arch, exactly the declared variants of arch_subset,
    each compiled without error (it cannot go stale silently)."""
    report = report_rows()
    listed = {(r["arch"], r["op"], r["kernel"], r["label"]) for r in load_arch_report()["rows"]}
    expected = set()
    for op in TRITON_OPS:
        variants = all_variants((op,))
        expected |= {(f"sm_{cc}", *variants[i].ident) for i in arch_subset(variants, report) for cc in OTHER_ARCHS}
    assert listed == expected, (f"bench/results/aot_archs.json is stale (regenerate: python -m "
                                f"megalodon_kernels.bench.aot --write-archs); missing {sorted(expected - listed)[:3]}, "
                                f"extra {sorted(listed - expected)[:3]}")
    errors = [r for r in load_arch_report()["rows"] if r["error"]]
    assert not errors, errors[:3]


@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_needs_table_is_the_compiled_data(op):
    """TRITON_NEEDS[op]: per family the most shared memory of the op's compiled variants (sm_80 and
    sm_90: every variant; the others: the bounded subset), and the TF32 rule as the sm_75 data shows it."""
    tf32, smem = _triton_common.TRITON_NEEDS[op]
    full = {cc: max(r["smem"] for r in load_report(cc)["rows"] if r["op"] == op) for cc in (80, 90)}
    assert smem[80] == full[80] and smem[90] == full[90]
    for arch, family in _triton_common.TRITON_FAMILY.items():
        rows = _rows_by(f"sm_{arch}", op)
        if not rows:
            continue
        if arch in (75, 100):
            if not (arch == 75 and tf32):
                assert smem[family] == max(r["smem"] for r in rows), f"sm_{arch}"
        else:  # sm_86/89/120 are sm_80's family: no variant needs more than sm_80's figure
            assert max(r["smem"] for r in rows) <= smem[family], f"sm_{arch}"
    t4 = _rows_by("sm_75", op)
    bad_on_t4 = [r for r in t4 if r["spill"] > 0 or r["smem"] > cuda_device.SMEM_OPTIN_BY_ARCH[75]]
    # TF32 ops: the FMA lowering spills or overflows on sm_75; the others compile cleanly there
    assert bool(bad_on_t4) == tf32, bad_on_t4[:2]
    assert (75 in smem) == (not tf32)


class _OnCuda:
    """A CPU tensor that reports a CUDA device: what a backend's not_supported_reasons reads."""

    device = torch.device("cuda", 0)
    is_cuda = True

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


def _inputs(op, dtype):
    """Representative inputs of ``op``'s Triton not_supported_reasons, on a (faked) CUDA device."""
    c = lambda *s, dt=dtype: _OnCuda(torch.zeros(*s, dtype=dt))  # noqa: E731
    p, lq = c(8, 16, dt=torch.float32), c(8, 16, dt=torch.complex64)
    return {
        "attention": lambda: dict(q=c(2, 1024, 8, 128), k=c(2, 1024, 8, 128), v=c(2, 1024, 8, 128)),
        "cema": lambda: dict(x=c(2, 8, 4096), p=p, log_q=lq, gamma=lq, omega=c(8), hx=None),
        "cema_kernel": lambda: dict(p=p, log_q=lq, gamma=lq, length=4096, hx=None),
        "dropkey_softmax": lambda: dict(scores=c(2, 8, 256, 256)),
        "ema_hidden": lambda: dict(x=c(2, 8, 4096), p=p, log_q=lq, hx=None),
        "fftconv": lambda: dict(x=c(2, 8, 4096), k=c(8, 4096, dt=torch.float32)),
        "rotary": lambda: dict(x=c(2, 1024, 8, 128)),
        "timestep_norm": lambda: dict(x=c(2, 1024, 256), num_groups=8),
    }[op]()


#: what the Triton backends run (True) or refuse per GPU: TF32 dots need sm_80+, every kernel's
#: shared memory fits every other profile (docs/gpus.md, "Triton")
RUNS = {name: {op: caps.arch >= 80 or not _triton_common.TRITON_NEEDS[op][0] for op in TRITON_OPS}
        for name, caps in cuda_device.PROFILES.items()}


def _release_pruned_here(op: str, caps) -> bool:
    """Whether the installed Triton refuses ``op`` on ``caps`` for _inputs' shapes (fftconv and
    cema at L = 4096: the slice path) by _triton_common.RELEASE_PRUNES, once the op's
    not_supported_reasons asks release_reasons (its module then has CONFIG_SPACE_ALL_RELEASES)."""
    conv = importlib.import_module("megalodon_kernels.ops.fftconv.triton_impl")
    release = _triton_common.triton_release()
    if op not in ("fftconv", "cema") or not hasattr(conv, "CONFIG_SPACE_ALL_RELEASES") or release is None:
        return False
    launch = conv.launch_path(4096)
    return any(p.op == "fftconv" and p.launch and all(launch.get(k) == v for k, v in p.launch.items())
               and release < p.below
               and _triton_common.TRITON_FAMILY.get(caps.arch) in p.families for p in _triton_common.RELEASE_PRUNES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("profile", list(cuda_device.PROFILES))
def test_each_gpu_profile_runs_or_refuses_with_a_reason(profile, dtype):
    ran = {}
    with cuda_device.faked(profile):
        for op in TRITON_OPS:
            module = importlib.import_module(f"megalodon_kernels.ops.{op}.triton_impl")
            why = [w for w in module.not_supported_reasons(**_inputs(op, dtype))
                   if "dtype" not in w]  # dtypes a backend never takes are not this test's subject
            ran[op] = not why
            if why:
                assert any(cuda_device.PROFILES[profile].sm in w and "backend=" in w for w in why), why
    caps = cuda_device.PROFILES[profile]
    assert ran == {op: runs and not _release_pruned_here(op, caps) for op, runs in RUNS[profile].items()}
    assert not all(RUNS["T4"].values()) and all(RUNS["A10"].values())  # the table itself is not vacuous


def test_a_device_with_less_shared_memory_refuses_with_both_figures():
    """The shared-memory check reads the device (here an A100 cut to 64 KB per block)."""
    small = cuda_device.with_smem(cuda_device.PROFILES["A100"], 65536)
    with cuda_device.faked(small):
        why = _triton_common.arch_reasons("attention", torch.device("cuda", 0))
        assert why and "65536 B" in why[0] and "82944 B" in why[0]
        assert _triton_common.arch_reasons("rotary", torch.device("cuda", 0)) == []
    # per device: cuda:0 with 80 B per block, cuda:1 a plain A100
    with cuda_device.faked("A100", index=1), \
            cuda_device.faked(cuda_device.with_smem(cuda_device.PROFILES["A100"], 80), index=0):
        assert _triton_common.arch_reasons("dropkey_softmax", torch.device("cuda", 0))  # 128 B > 80 B
        assert not _triton_common.arch_reasons("dropkey_softmax", torch.device("cuda", 1))


# ------------------------------------- the launch prunes reach each backend's not_supported_reasons

def _fake_cuda(*shape, dtype):
    """A tensor on a CUDA device that this CPU-only machine does not have (metadata only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype)


BF16, F16, F32, C64 = torch.bfloat16, torch.float16, torch.float32, torch.complex64
_CEMA = dict(p=(2, 4, F32), log_q=(2, 4, C64), gamma=(2, 4, C64), omega=(2, F32))
#: N = 17: more state lanes than cema's chunked kernels take, so its FFT form runs (and is pruned)
_CEMA_FFT = dict(p=(2, 17, F32), log_q=(2, 17, C64), gamma=(2, 17, C64), omega=(2, F32))
#: (op, backend inputs, the GPU families where a RELEASE_PRUNES launch prune of Triton 3.6 refuses
#: them): each pruned launch and its neighbours (another tile, dtype, length or unpacked)
LAUNCH_CASES = [
    ("fftconv", dict(x=(1, 2, 2049, F32), k=(2, 2049, F32)), ()),  # the slice path's first length: no prune
    ("fftconv", dict(x=(1, 2, 2048, BF16), k=(2, 2048, F32)), ()),  # the 4096-point tile: clean on 3.6
    ("fftconv", dict(x=(1, 2, 1024, BF16), k=(2, 1024, F32)), (80,)),  # the 2048-point tile, bf16: 512 < L <= 1024
    ("fftconv", dict(x=(1, 2, 513, BF16), k=(2, 513, F32)), (80,)),
    ("fftconv", dict(x=(1, 2, 1024, F32), k=(2, 1024, F32)), ()),  # the same tile in fp32: clean
    ("fftconv", dict(x=(1, 2, 512, BF16), k=(2, 512, F32)), ()),
    ("cema", dict(x=(1, 2, 2048, BF16), **_CEMA_FFT), ()),
    ("cema", dict(x=(1, 2, 1024, BF16), **_CEMA_FFT), (80,)),  # through fftconv's 2048-point bf16 tile prune
    ("cema", dict(x=(1, 2, 512, BF16), **_CEMA_FFT), ()),
    # the chunked form (N <= 16) launches none of the FFT form's pruned kernels: it runs everywhere
    ("cema", dict(x=(1, 2, 2048, BF16), **_CEMA), ()),
    ("cema", dict(x=(1, 2, 4096, F32), **_CEMA), ()),
    ("timestep_norm", dict(x=(1, 40, 256, BF16), num_groups=1, packed=True), (90,)),
    ("timestep_norm", dict(x=(1, 40, 256, BF16), num_groups=1, packed=False), ()),
    ("timestep_norm", dict(x=(1, 40, 256, F16), num_groups=1, packed=True), ()),
    ("timestep_norm", dict(x=(1, 40, 256, BF16), num_groups=4, packed=True), ()),  # D/G = 64: another tile
    ("timestep_norm", dict(x=(1, 40, 1024, F32), num_groups=1, packed=True), (90,)),
    ("timestep_norm", dict(x=(1, 40, 1024, F32), num_groups=4, packed=True), ()),  # D/G = 256
]


@pytest.mark.parametrize("op,inputs,families", LAUNCH_CASES,
                         ids=[f"{c[0]}-{i}-{'refused' if c[2] else 'runs'}" for i, c in enumerate(LAUNCH_CASES)])
def test_a_launch_prune_refuses_exactly_its_launches_in_the_backend(monkeypatch, op, inputs, families):
    """Through the op's Triton backend (what dispatch asks): on the oldest tested release, a launch
    RELEASE_PRUNES prunes is refused on the GPU families that spill it, with the fix in the reason;
    its neighbours, the other families and the newest release run."""
    from megalodon_kernels.ops._triton_common import TRITON_FAMILY

    oldest, newest = TRITON_TESTED
    module = importlib.import_module(f"megalodon_kernels.ops.{op}.triton_impl")
    args = {name: _fake_cuda(*v[:-1], dtype=v[-1]) if isinstance(v, tuple) else v for name, v in inputs.items()}
    for release in (oldest, newest):
        monkeypatch.setattr(_triton_common, "triton_release", lambda release=release: release)
        for profile in ("H100", "A100", "L4"):
            with cuda_device.faked(profile):
                why = module.not_supported_reasons(**args)
            if release == oldest and TRITON_FAMILY[cuda_device.PROFILES[profile].arch] in families:
                assert why and all("triton>=3.7" in w and "spills registers" in w for w in why), why
            else:
                assert why == [], (release, profile, why)


def test_timestep_norm_dispatch_says_whether_a_call_is_packed(monkeypatch):
    """The packed launch prunes need to know a packed call from an unpacked one: timestep_norm
    hands ``packed`` to every backend's not_supported_reasons."""
    from megalodon_kernels.ops.timestep_norm import timestep_norm, torch_impl

    seen = []
    real = torch_impl.not_supported_reasons
    monkeypatch.setattr(torch_impl, "not_supported_reasons", lambda **kw: seen.append(kw["packed"]) or real(**kw))
    x, scale, bias = torch.randn(1, 13, 6), torch.ones(6), torch.zeros(6)  # a shape no other test dispatches
    timestep_norm(x, scale, bias, 3, backend="torch")
    timestep_norm(x, scale, bias, 3, backend="torch", cu_seqlens=torch.tensor([0, 5, 13]))
    assert seen == [False, True]
