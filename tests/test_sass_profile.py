"""bench/sass_profile.py: the SASS listing's loops and instruction classes, and the issue bound.

The parser is checked on a hand-written listing in nvdisasm's format (exact counts), then on a
real kernel compiled for sm_90: the chunked CEMA forward, whose one runtime loop (over blocks of
chunks) holds its tensor-core dots."""
import inspect

import pytest

from megalodon_kernels.cuda import build

from megalodon_kernels.bench import sass_profile as sp

LISTING = """
        .global         k
k:
	//## File "/x/kern.py", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, RZ ;
.L_x_0:
	//## File "/x/kern.py", line 12
        /*0020*/                   HMMA.1688.F32.TF32 R4, R8, R12, R4 ;
        /*0030*/                   SHFL.BFLY PT, R2, R3, 0x1, 0x1f ;
.L_x_1:
	//## File "/x/kern.py", line 13
        /*0040*/                   FADD R1, R1, R2 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
	//## File "/x/kern.py", line 12
        /*0060*/                   LDG.E R5, desc[UR4][R6.64] ;
        /*0070*/              @!P1 BRA `(.L_x_0) ;
	//## File "/x/kern.py", line 15
        /*0080*/                   STG.E desc[UR4][R6.64], R1 ;
        /*0090*/                   EXIT ;
.L_x_2:
        /*00a0*/                   BRA `(.L_x_2);
"""


def test_parse_finds_nested_loops_and_classes():
    instrs, labels = sp.parse(LISTING)
    assert [i.base for i in instrs] == ["S2R", "MOV", "HMMA", "SHFL", "FADD", "BRA", "LDG", "BRA", "STG", "EXIT", "BRA"]
    assert instrs[2].line == "kern.py:12" and instrs[2].cls == "tensor"
    assert instrs[7].text.startswith("@!P1") and instrs[7].opcode == "BRA"
    rs = sp.regions(instrs, labels)
    assert [(r.name, r.start, r.end, r.depth, r.count) for r in rs] == [
        ("kernel", 0, 10, 0, 11), ("loop0", 2, 7, 1, 6), ("loop1", 4, 5, 2, 2)]
    outer = rs[1]
    assert outer.by_class() == {"branch": 2, "tensor": 1, "shuffle": 1, "fp32": 1, "global": 1}
    assert dict(outer.by_line()) == {"kern.py:12": 4, "kern.py:13": 2}


def test_launch_count_and_issue_bound():
    instrs, labels = sp.parse(LISTING)
    kernel, outer = sp.regions(instrs, labels)[:2]
    # 5 instructions outside the loop once, 6 in it 10 times, 4 warps, 100 programs
    n = sp.launch_warp_instructions(kernel, outer, warps=4, programs=100, iterations=10)
    assert n == 100 * 4 * (5 + 60)
    # 132 SMs x 4 schedulers x 1.98e9 per second on sm_90
    assert sp.issue_bound_ms(132 * 4 * 1.98e9, 90) == pytest.approx(1e3)


def test_compiled_cema_forward_loop_holds_its_dots():
    from megalodon_kernels.ops.cema import triton_chunked

    (variant, sass), = sp.variant_sass("cema", r"^_fwd_kernel .*x=fp32 hx=False", 90)
    instrs, labels = sp.parse(sass)
    rs = sp.regions(instrs, labels)
    loops = [r for r in rs if r.depth == 1]
    assert len(loops) == 1, [(r.name, r.count) for r in loops]
    loop = loops[0]
    # the loop over blocks of chunks: its body has the five tf32x3 dots' HMMAs, none outside it
    assert loop.by_class().get("tensor", 0) == rs[0].by_class()["tensor"] > 0
    src, first = inspect.getsourcelines(triton_chunked._fwd_kernel.fn)
    dot_line = first + next(i for i, s in enumerate(src) if "Y = tl.dot(X, T" in s)
    assert f"triton_chunked.py:{dot_line}" in {i.line for i in loop.instrs}
    text = sp.describe(f"{variant.kernel} [{variant.label}]", variant.num_warps, sass, 90, programs=16384, iterations=8)
    assert "issue bound" in text and "loop0" in text


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not found (CUDA toolkit)")
def test_cuda_fftconv_forward_has_its_stage_loops():
    (name, sass), = sp.cuda_sass("fftconv", r"^mk::fftconv_fwd_kernel<float>$", 90)
    assert name.startswith("void mk::fftconv_fwd_kernel<float>")
    instrs, labels = sp.parse(sass)
    loops = [r for r in sp.regions(instrs, labels) if r.depth >= 1]
    # the warp-shuffle stages (span 1..16) and the shared-memory stages each run in a loop
    assert any("shuffle" in r.by_class() for r in loops)
    assert any("shared" in r.by_class() and "sync" not in r.by_class() and r.count < 64 for r in loops)
    # line info: most instructions come from the header's own lines (the rest: CUDA's intrinsics headers)
    assert sum(1 for i in instrs if (i.line or "").startswith("fftconv.cuh:")) > len(instrs) / 2
