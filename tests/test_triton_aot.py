"""Every Triton kernel x every config it can launch with compiles for sm_80 and sm_90 ahead of
time, fits the per-block shared memory and does not spill (no GPU needed).

Compiling every variant takes tens of minutes on 2 cores (the FFT tiles alone take ~30 s each),
so the default run (and CI) compiles the bounded set ``_triton_aot.representative`` (the last,
largest variant of every kernel); ``--stress`` compiles all of them, as does
``python -m megalodon_kernels.bench.resources``."""
import pytest

from megalodon_kernels.ops._triton_aot import SMEM_LIMIT, TRITON_OPS, all_variants, compile_all, representative

@pytest.fixture(scope="module")
def compiled(request):
    return compile_all(TRITON_OPS, (80, 90), bounded=not request.config.getoption("--stress"))


@pytest.mark.stress
def test_every_chosen_variant_compiled_for_both_archs(compiled, stress):
    every = all_variants()
    expect = len(every) if stress else sum(len(representative(all_variants((op,)))) for op in TRITON_OPS)
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
