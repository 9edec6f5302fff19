"""The flash attention and dropkey_softmax kernels also compile with nvcc for sm_80 and sm_90,
without spills, within shared memory: a cross-check of the NVRTC build (tests/test_cuda_nvrtc.py)
with the toolkit's compiler where one is installed.

cuda/build.py generates one source per kernel template that instantiates the same name
expressions as the ops' launch descriptions (their KERNELS lists), and compiles it with ``nvcc
-std=c++20 -cubin -arch=sm_XX -Xptxas -v`` (no GPU needed), which reports per kernel the
registers, spill stores/loads and STATIC shared memory; the dynamic shared memory comes from the
launch descriptions' own sizing (flash attention's tiles) and the sum is checked against the
per-block opt-in limit (166912 B on A100, 232448 B on H100). Results are cached by source hash.

nvcc takes ~15 s per flash instantiation on 2 cores, so the default run (and CI) compiles two of
the six flash configurations (each element type once: bf16 at the largest head dim, fp16 at the
smallest) and every dropkey_softmax kernel; ``--stress`` compiles all of them. The NVRTC build
compiles every flash configuration under --stress too, and the emulator executes them.
"""
import pytest

from megalodon_kernels.cuda import build
from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda

pytestmark = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not found (CUDA toolkit)")

ARCHS = (80, 90)
BOUNDED_FLASH = (("cutlass::bfloat16_t", max(attention_cuda.FLASH_HEAD_DIMS)),
                 ("cutlass::half_t", min(attention_cuda.FLASH_HEAD_DIMS)))


@pytest.fixture(scope="module")
def kernels(request):
    flash = attention_cuda.FLASH if request.config.getoption("--stress") else {
        key: attention_cuda.FLASH[key] for key in BOUNDED_FLASH}
    return [k for ks in flash.values() for k in ks.values()] + dropkey_cuda.KERNELS


@pytest.fixture(scope="module")
def resources(kernels):
    return build.nvcc_resources_all(build.nvcc_sources(kernels), ARCHS)  # parallel, cached


@pytest.fixture(scope="module")
def dynamic_smem():
    """Worst-case dynamic shared memory per flash kernel family, as the launch description asks."""
    fwd = max(attention_cuda.fwd_smem_bytes(e, D) for e, D in attention_cuda.FLASH)
    bwd = max(attention_cuda.bwd_smem_bytes(e, D) for e, D in attention_cuda.FLASH)
    return {"flash_fwd_kernel": fwd, "flash_bwd_kv_kernel": bwd, "flash_bwd_q_kernel": bwd}


def _family(kernel: str) -> str:
    """'void mk::fftconv_fwd_kernel<float>(...)' -> 'fftconv_fwd_kernel'."""
    name = kernel.split("(")[0].split("<")[0]
    return name.split("::")[-1].split()[-1]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_compiles_every_instantiation(resources, kernels, arch):
    rows = [r for r in resources if r.arch == arch]  # compiled in parallel
    assert len(rows) == len(kernels), f"ptxas reported {len(rows)} kernels for {len(kernels)} instantiations"


def test_no_spills(resources):
    bad = [r for r in resources if r.spill_stores or r.spill_loads]
    for r in resources:
        print(f"{r.source:<20} sm_{r.arch}  {r.registers:>3} regs  {r.spill_stores:>3} B spill st  "
              f"{r.spill_loads:>3} B spill ld  {r.stack:>3} B stack  {r.static_smem:>6} B smem  {r.kernel}")
    assert not bad, "spills: " + "; ".join(f"{r.kernel} sm_{r.arch}: {r.spill_stores}/{r.spill_loads} B" for r in bad)


def test_shared_memory_within_per_block_limits(resources, dynamic_smem):
    over = []
    for r in resources:
        total = r.static_smem + dynamic_smem.get(_family(r.kernel), 0)
        if total > build.SMEM_LIMIT[r.arch]:
            over.append(f"{r.kernel} sm_{r.arch}: {total} B > {build.SMEM_LIMIT[r.arch]} B")
    assert not over, "; ".join(over)


def test_dynamic_smem_names_real_kernels(resources, dynamic_smem):
    families = {_family(r.kernel) for r in resources}
    unknown = sorted(set(dynamic_smem) - families)
    assert not unknown, f"dynamic shared memory named for kernels nvcc did not compile: {unknown}"


# Registers per thread of every kernel family, worst case over its instantiations and sm_80/sm_90,
# rounded up to the allocation unit (8 per thread: 256 per warp). More registers cost occupancy:
# raising a budget is a decision to make here, not a side effect of an edit.
REGISTER_BUDGET = {
    "dropkey_softmax_bwd_kernel": 64, "dropkey_softmax_fwd_kernel": 64,
    "flash_bwd_kv_kernel": 255, "flash_bwd_q_kernel": 224, "flash_fwd_kernel": 208,
}
# (the NVRTC build checks every kernel's budget, tests/test_cuda_nvrtc.py; nvcc these two headers)


def test_registers_within_each_kernels_budget(resources):
    families = {_family(r.kernel) for r in resources}
    assert families == set(REGISTER_BUDGET), (
        f"kernels without a register budget: {sorted(families - set(REGISTER_BUDGET))}; "
        f"budgets of kernels nvcc did not compile: {sorted(set(REGISTER_BUDGET) - families)}")
    over = [f"{r.kernel[:120]} sm_{r.arch}: {r.registers} > {REGISTER_BUDGET[_family(r.kernel)]}"
            for r in resources if r.registers > REGISTER_BUDGET[_family(r.kernel)]]
    assert not over, "registers above the budget: " + "; ".join(over)
