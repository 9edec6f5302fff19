"""Every Triton kernel x every config it can launch with compiles for sm_80 and sm_90 ahead of
time, fits the per-block shared memory and does not spill (no GPU needed)."""
import pytest

from megalodon_kernels.ops._triton_aot import SMEM_LIMIT, TRITON_OPS, all_variants, compile_all


@pytest.fixture(scope="module")
def compiled():
    return compile_all(TRITON_OPS, (80, 90))


def test_every_variant_compiled_for_both_archs(compiled):
    assert len(compiled) == 2 * len(all_variants()) > 0


@pytest.mark.parametrize("op", TRITON_OPS)
def test_variants_fit_shared_memory_and_do_not_spill(compiled, op):
    rows = [r for r in compiled if r.variant.op == op]
    assert rows, f"no AOT variants declared for {op}"
    for r in rows:
        print(f"{op} {r.variant.label} sm_{r.cc}: regs={r.regs} smem={r.shared} local={r.local}")
        assert r.regs > 0, "cuobjdump reported no register count"
        assert r.shared <= SMEM_LIMIT[r.cc], f"{r.variant.label}: {r.shared} B smem > {SMEM_LIMIT[r.cc]} on sm_{r.cc}"
        assert not r.spills, f"{r.variant.label}: {r.local} B of local memory (spills) on sm_{r.cc}"
