"""Every Triton kernel x every config it can launch with compiles for sm_80 and sm_90 ahead of
time, fits the per-block shared memory and does not spill (no GPU needed).

Compiling every variant takes tens of minutes on 2 cores (the FFT tiles alone take ~30 s each),
so the default run (and CI) compiles, per kernel, the heaviest variant according to the committed
resources report bench/results/aot_sm*.json (most registers, ties by shared memory; see
``bench.aot.heaviest``); ``--stress`` compiles all of them, as does
``python -m megalodon_kernels.bench.resources --write``, which regenerates the report. The report
cannot go stale silently: its variant list must equal the declared variants (checked without
compiling)."""
import pytest

from megalodon_kernels.bench.aot import (REPORT_COMMAND, SMEM_LIMIT, TRITON_OPS, all_variants, compile_all, heaviest,
                                         load_report, report_rows)


@pytest.fixture(scope="module")
def compiled(request):
    return compile_all(TRITON_OPS, (80, 90), bounded=not request.config.getoption("--stress"))


@pytest.mark.parametrize("cc", sorted(SMEM_LIMIT))
def test_report_lists_exactly_the_declared_variants(cc):
    declared = [v.ident for v in all_variants()]
    assert len(set(declared)) == len(declared), "two declared variants share (op, kernel, label)"
    report = load_report(cc)
    assert report["arch"] == f"sm_{cc}" and report["generated_by"] == REPORT_COMMAND
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


@pytest.mark.stress
def test_every_chosen_variant_compiled_for_both_archs(compiled, stress):
    every = all_variants()
    report = report_rows()
    expect = len(every) if stress else sum(len(heaviest(all_variants((op,)), report)) for op in TRITON_OPS)
    assert len(compiled) == 2 * expect > 0


@pytest.mark.stress
@pytest.mark.parametrize("op", TRITON_OPS)
def test_variants_fit_shared_memory_and_do_not_spill(compiled, op):
    rows = [r for r in compiled if r.variant.op == op]
    assert rows, f"no AOT variants declared for {op}"
    spills = []
    for r in rows:
        print(f"{op} {r.variant.label} sm_{r.cc}: regs={r.regs} smem={r.shared} local={r.local}")
        assert r.regs > 0, "cuobjdump reported no register count"
        assert r.shared <= SMEM_LIMIT[r.cc], f"{r.variant.label}: {r.shared} B smem > {SMEM_LIMIT[r.cc]} on sm_{r.cc}"
        if r.spills:
            spills.append(f"{r.variant.label}: {r.local} B of local memory (spills) on sm_{r.cc}")
    assert not spills, spills
