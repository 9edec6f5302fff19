"""NVRTC through CuPy (cuda/nvrtc.py), no GPU and no CUDA toolkit: the kernel instantiations
compile for sm_80 and sm_90 from pip headers only, without spills and within shared memory; the
disk cache (concurrent compiles of one key, corrupt entries, a changed header, prebuilt cubins);
the compile command.

By default (and in CI) one instantiation per kernel template of the launch descriptions is compiled
(the last listed: double, or the widest variant) plus one flash attention kernel, about 45 s from
scratch on two cores; ``--stress`` compiles every instantiation of every kernel, as ``python -m
megalodon_kernels.cuda compile`` does."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megalodon_kernels.cuda import nvrtc

try:
    nvrtc.nvrtc_binding()
except nvrtc.NvrtcUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

PKG_PARENT = Path(__file__).resolve().parents[1].parent
FLASH = ("flash_attention.cuh", "mk::flash::flash_fwd_kernel<mk::flash::FwdCfg<cutlass::bfloat16_t, 128>>")


# Registers per thread each kernel of the launch descriptions may use (as tests/test_cuda_nvcc.py
# does for the compiled launchers' kernels): raising one is a decision to make here.
REGISTER_BUDGET = {
    "rotary_kernel": 40,
    "tsn_dx_kernel": 40, "tsn_moments_kernel": 40, "tsn_normalize_kernel": 40, "tsn_shift_kernel": 40, "tsn_param_partial_kernel": 48,
    "tsn_param_reduce_kernel": 32, "tsn_row_grads_kernel": 40, "tsn_scan_bwd_kernel": 80, "tsn_scan_fwd_kernel": 56,
    "cema_analysis_kernel": 128, "cema_bwd_finish_kernel": 48, "cema_synth_kernel": 80,
    "ema_hidden_coef_kernel": 48, "ema_hidden_finish_kernel": 32,
    "fft4_col_fwd_kernel": 56, "fft4_col_inv_kernel": 48, "fft4_row_conv_kernel": 64, "fft4_row_dk_kernel": 64,
    "fft4_row_spectrum_kernel": 56, "fft4_twiddle_probe_kernel": 24,
    "fftconv_bwd_dk_kernel": 56, "fftconv_bwd_dx_kernel": 64, "fftconv_fwd_kernel": 64, "fftconv_spectrum_kernel": 48,
    "dropkey_softmax_bwd_kernel": 64, "dropkey_softmax_fwd_kernel": 64,
    "flash_fwd_kernel": 208, "flash_bwd_kv_kernel": 255, "flash_bwd_q_kernel": 224,
}


def _dynamic_smem(name: str) -> int:
    from megalodon_kernels.ops.attention import cuda_impl as attention
    from megalodon_kernels.ops.fftconv import cuda_impl as fftconv

    family = _family(name)
    if family == "flash_fwd_kernel":
        return max(attention.fwd_smem_bytes(e, D) for e, D in attention.FLASH)
    if family.startswith("flash_bwd"):
        return max(attention.bwd_smem_bytes(e, D) for e, D in attention.FLASH)
    if family.startswith("fftconv_"):
        return fftconv.one_block_max_smem_bytes()
    if family.startswith(("fft4_col", "fft4_row")):
        return fftconv.multi_pass_max_smem_bytes(rows=family.startswith("fft4_row"))
    return 0


def _family(name: str) -> str:
    return name.split("<")[0].split("::")[-1]


def _bounded(kernels):
    """One instantiation per kernel template: the last listed (double, or bf16 where there is none)."""
    pick = {}
    for k in kernels:
        pick[k.name.split("<")[0]] = k
    return list(pick.values())


def _instantiations(stress: bool):
    from megalodon_kernels.cuda.instances import all_kernels, described_kernels

    if stress:
        return [(k.header, k.name) for k in all_kernels()]
    # the flash kernels take 5-30 s each under NVRTC: one of them here, all under --stress
    return [(k.header, k.name) for k in _bounded(described_kernels()) if k.header != FLASH[0]] + [FLASH]


@pytest.mark.stress
def test_nvrtc_compiles_the_kernels_for_sm80_and_sm90_without_a_cuda_toolkit(stress, tmp_path):
    # a fresh process that cannot see a CUDA toolkit: no nvcc on PATH, no CUDA_HOME, no /usr/local/cuda
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVCC"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (Path(p) / "nvcc").exists() and "cuda" not in p.lower())
    env["MEGALODON_KERNELS_CUDA_CACHE"] = str(tmp_path / "cache")
    env.pop("MEGALODON_KERNELS_CUBIN_DIR", None)
    jobs = _instantiations(stress)
    script = (
        "import json, sys\n"
        "from megalodon_kernels.cuda import nvrtc\n"
        "jobs = json.loads(sys.argv[1])\n"
        "out = {'include_dirs': nvrtc.include_dirs(), 'results': []}\n"
        "for arch in (80, 90):\n"
        "    for header, name in jobs:\n"
        "        c = nvrtc.compile_kernel(header, name, arch)\n"
        "        out['results'].append([arch, name, c.resources.registers, c.resources.spills,\n"
        "                               c.resources.static_smem, len(c.cubin), c.origin])\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], env=env, capture_output=True, text=True,
                          cwd=PKG_PARENT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any("/usr/local/cuda" in d or "toolkit" in d.lower() for d in out["include_dirs"])
    assert len(out["results"]) == 2 * len(jobs)
    from megalodon_kernels.cuda.instances import described_kernels

    assert {_family(k.name) for k in described_kernels()} == set(REGISTER_BUDGET)
    for arch, name, regs, spills, smem, size, origin in out["results"]:
        assert origin == "nvrtc" and size > 1000, name
        assert 0 < regs <= REGISTER_BUDGET.get(_family(name), 255), (arch, name, regs)
        assert spills == 0, f"{name} spills {spills} B on sm_{arch}"
        # plus the worst-case dynamic shared memory the launch descriptions ask for (fftconv's FFTs)
        assert smem + _dynamic_smem(name) <= nvrtc.SMEM_LIMIT[arch], (arch, name, smem)


# --- the disk cache, on a toy kernel (fast) ------------------------------------------------------

TOY = '#include "toy_scale.cuh"\ntemplate <class T> __global__ void toy(T* x, int n) { if (threadIdx.x < n) x[threadIdx.x] *= kScale; }\n'


@pytest.fixture
def toy(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    (root / "toy.cuh").write_text(TOY)
    (root / "toy_scale.cuh").write_text("constexpr float kScale = 2.0f;\n")
    monkeypatch.setenv("MEGALODON_KERNELS_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEGALODON_KERNELS_CUBIN_DIR", raising=False)
    return root


def test_nvrtc_cache_hit_and_a_changed_header_invalidates(toy):
    a = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    assert a.origin == "nvrtc" and a.compile_seconds > 0 and a.resources.registers > 0
    b = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    assert b.origin == "cache" and b.cubin == a.cubin and b.lowered_name == a.lowered_name
    assert nvrtc.compile_kernel("toy.cuh", "toy<float>", 90, root=toy).origin == "nvrtc"  # arch in the key
    (toy / "toy_scale.cuh").write_text("constexpr float kScale = 3.0f;\n")  # an included header changes
    c = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    assert c.origin == "nvrtc" and c.cubin != a.cubin


def test_nvrtc_corrupt_cache_entry_is_recompiled_with_one_warning(toy, monkeypatch):
    monkeypatch.setattr(nvrtc, "_warned_corrupt", False)
    first = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    entry = next(nvrtc.cache_dir().glob("*.cubin"))
    warned = []
    for damage in (lambda b: b[: len(b) // 2], lambda b: b"garbage", lambda b: b[:-1] + bytes([b[-1] ^ 1])):
        entry.write_bytes(damage(entry.read_bytes()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
        assert again.origin == "nvrtc" and again.cubin == first.cubin
        assert nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy).origin == "cache"  # repaired
        warned.append(sum("corrupt NVRTC cache entry" in str(w.message) for w in caught))
    assert warned == [1, 0, 0]  # one warning per process, never an exception


def test_nvrtc_concurrent_compiles_of_one_key_compile_once(toy, tmp_path):
    script = ("import json, sys\nfrom pathlib import Path\nfrom megalodon_kernels.cuda import nvrtc\n"
              "c = nvrtc.compile_kernel('toy.cuh', 'toy<double>', 80, root=Path(sys.argv[1]))\n"
              "print(json.dumps([c.origin, c.cubin.hex()]))\n")
    env = dict(os.environ, MEGALODON_KERNELS_CUDA_CACHE=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(toy)], env=env, cwd=PKG_PARENT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(origin for origin, _ in results) == ["cache", "cache", "nvrtc"]  # the lock serialises them
    assert len({cubin for _, cubin in results}) == 1
    assert len(list((tmp_path / "cache" / "nvrtc").glob("*.cubin"))) == 1
    assert not list((tmp_path / "cache" / "nvrtc").glob("*.tmp"))


def test_nvrtc_prebuilt_folder_is_read_before_compiling(toy, tmp_path, monkeypatch):
    built = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    out = tmp_path / "cubins"
    nvrtc.write_entry(out, nvrtc.cache_key("toy.cuh", "toy<float>", 80, root=toy), built)
    monkeypatch.setenv("MEGALODON_KERNELS_CUBIN_DIR", str(out))
    monkeypatch.setenv("MEGALODON_KERNELS_CUDA_CACHE", str(tmp_path / "empty-cache"))
    got = nvrtc.compile_kernel("toy.cuh", "toy<float>", 80, root=toy)
    assert got.origin == "prebuilt" and got.cubin == built.cubin
    assert not (tmp_path / "empty-cache").exists()


def test_nvrtc_error_names_the_instantiation_and_the_log(toy):
    with pytest.raises(nvrtc.NvrtcError, match=r"toy<not_a_type>(.|\n)*not_a_type"):
        nvrtc.compile_kernel("toy.cuh", "toy<not_a_type>", 80, root=toy)


def test_nvrtc_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function '_Z1kPf' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z1kPf\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 360 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function '_Z1gPf' for 'sm_80'\n"
           "ptxas info    : Used 8 registers, 360 bytes cmem[0]\n")
    r = nvrtc.parse_ptxas_log(log, "_Z1kPf")
    assert (r.registers, r.stack, r.spill_stores, r.spill_loads, r.static_smem, r.spills) == (40, 16, 8, 4, 2048, 12)
    assert nvrtc.parse_ptxas_log(log, "_Z1gPf").registers == 8
    with pytest.raises(nvrtc.NvrtcError, match="no resources"):
        nvrtc.parse_ptxas_log(log, "_Z1hPf")


def test_nvrtc_compile_command_reports_and_fails_on_spills(monkeypatch, capsys):
    from megalodon_kernels.cuda import __main__ as cli

    def fake(header, name, arch):
        spills = 8 if name.endswith("<double>") else 0
        return nvrtc.Compiled(header, name, arch, "x", b"", "", nvrtc.Resources(32, 0, spills, 0, 0), 0.5, "nvrtc")

    monkeypatch.setattr(nvrtc, "compile_kernel", fake)
    assert cli.main(["compile", "--arch", "80", "--only", "rotary"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and all(line.startswith("sm_80") for line in lines[:6])
    assert cli.main(["compile", "--arch", "80", "90", "--only", "tsn_dx"]) == 1
    out = capsys.readouterr().out
    assert out.count("SPILLS") == 2 and "6 compiles (2 archs)" in out
