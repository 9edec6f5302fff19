"""The side-by-side with upstream Megalodon's CUDA extension (bench/upstream_build.py, bench/vs_upstream.py,
bench/gpu_upstream_step.py) on the CPU: the build script's copy, edits and per-file log on a fake
checkout; the module loader's refusals; the comparison's dry run (torch backend against float64)."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
import torch

from megalodon_kernels.bench import vs_transformer, vs_upstream

sys.path.insert(0, str(Path(vs_upstream.__file__).parent))
import upstream_build  # noqa: E402


def _fake_checkout(root: Path, call: bool = True) -> Path:
    (root / "megalodon" / "csrc" / "ops").mkdir(parents=True)
    (root / "setup.py").write_text("# upstream setup.py\n")
    for s in upstream_build.SOURCES:
        body = "int f() { return 0; }\n"
        if call and s.endswith(("attention_kernel.cu", "ema_hidden_kernel.cu", "ema_parameters_kernel.cu")):
            body = "void g() {\n  torch::globalContext().alertCuBLASConfigNotDeterministic();\n  gemm();\n}\n"
        (root / s).write_text(body)
    return root


def test_build_copies_edits_and_keeps_unchanged_files(tmp_path):
    src, dst = _fake_checkout(tmp_path / "src"), tmp_path / "build"
    written, notes = upstream_build.prepare_sources(src, dst)
    assert written == 1 + len(upstream_build.SOURCES)
    edited = dst / "megalodon/csrc/ops/attention_kernel.cu"
    assert "alertCuBLAS" not in edited.read_text() and "gemm();" in edited.read_text()
    assert len(notes) == 3 and all("1 replacement" in n for n in notes)
    # a second run writes nothing (edited files included): ninja keeps every object
    stamps = {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    assert upstream_build.prepare_sources(src, dst)[0] == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    # a changed source is rewritten, alone
    (src / "megalodon/csrc/blas.cc").write_text("int f() { return 1; }\n")
    assert upstream_build.prepare_sources(src, dst)[0] == 1


def test_build_refuses_an_edit_whose_target_moved(tmp_path):
    src = _fake_checkout(tmp_path / "src")
    (src / "megalodon/csrc/ops/attention_kernel.cu").write_text("auto c = alertCuBLASConfigNotDeterministic;\n")
    with pytest.raises(RuntimeError, match="source changed"):
        upstream_build.prepare_sources(src, tmp_path / "build")


def test_build_refuses_a_checkout_that_is_not_megalodon(tmp_path, capsys):
    (tmp_path / "setup.py").write_text("")
    assert upstream_build.main(["--src", str(tmp_path), "--build-dir", str(tmp_path / "b")]) == 1
    assert "is not a megalodon checkout" in capsys.readouterr().out


def test_build_logs_one_line_per_file_from_ninja(tmp_path):
    obj = tmp_path / "ema_hidden_kernel.o"
    obj.write_bytes(b"\0" * 2**20)
    line = (f"[7/16] /usr/local/cuda/bin/nvcc -MD -MF {obj}.d -I/x/csrc -c -c /x/csrc/ops/ema_hidden_kernel.cu "
            f"-o {obj} -O3 -gencode=arch=compute_90,code=sm_90")
    out = upstream_build.file_line(line, 12.0)
    assert out.startswith("[ 7/16] compiled ema_hidden_kernel.cu") and "1.00 MiB" in out and "12 s" in out
    assert upstream_build.file_line("running build_ext", 1.0) is None


def test_loader_says_why_it_does_not_load(tmp_path):
    ext, why = vs_upstream.load_upstream(tmp_path / "missing")
    assert ext is None and "does not exist" in why
    ext, why = vs_upstream.load_upstream(tmp_path)
    assert ext is None and "no megalodon_extension" in why
    (tmp_path / "megalodon_extension.cpython-399-x86_64-linux-gnu.so").write_bytes(b"")
    ext, why = vs_upstream.load_upstream(tmp_path)
    assert ext is None and "not built for this Python" in why


def test_dry_comparison_agrees_with_float64_and_skips_upstream_with_the_reason():
    res = vs_upstream.run(["dry"], ["float32"], ["upstream", "torch", "sdpa"], None, torch.device("cpu"), 1,
                          deadline=math.inf, log=lambda s: None, ext_note="no GPU here")
    by_name = {c.name: c for c in vs_upstream.cases("dry")}
    assert {r["case"] for r in res["rows"]} == set(by_name) and not res["not_reached"]
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["providers"]["upstream"] == {"skipped": "no GPU here"}
        assert ("sdpa" in r["providers"]) == (r["case"] == "attention")
        if r["case"] == "attention":  # torch's SDPA on the chunks: the same attention
            assert r["providers"]["sdpa"]["err_fwd"] < 1e-5 and r["providers"]["sdpa"]["err_bwd"] < 1e-5
        t = r["providers"]["torch"]
        assert all(t[m] > 0 for m in vs_upstream.MODES), r
        if by_name[r["case"]].compare:
            # float32 torch backend against itself in float64: float32 rounding, not more
            assert t["err_fwd"] < 1e-5 and t["err_bwd"] < 1e-5, (r["case"], t)
        else:
            assert "err_fwd" not in t
    text = vs_upstream.markdown(res, ["# dry"])
    assert "| dry | fftconv | float32 |" in text and "not run: no GPU here" in text


def test_a_spent_budget_lists_the_cases_not_reached():
    res = vs_upstream.run(["dry"], ["float32"], ["torch"], None, torch.device("cpu"), 1,
                          deadline=time.perf_counter() - 1, log=lambda s: None)
    assert not res["rows"] and len(res["not_reached"]) == len(vs_upstream.cases("dry"))


def test_reference_slice_compares_the_same_rows():
    """fftconv's dry case runs its reference on channels [0, 4) of 8: the outputs compared are that slice."""
    case = next(c for c in vs_upstream.cases("dry") if c.name == "fftconv")
    assert case.ref_rows == 4
    r = vs_upstream.run_case(case, "float32", ["torch"], None, torch.device("cpu"), 1)
    assert r["reference"]["rows"] == 4 and r["providers"]["torch"]["err_fwd"] < 1e-5


def test_paper_step_matches_widths_and_reports_the_paper_ratio():
    m = vs_transformer.build_paper("megalodon", 1, width=64, chunk=32)
    t = vs_transformer.build_paper("transformer", 1, width=64, chunk=32)
    assert abs(vs_transformer.n_params(t) - vs_transformer.n_params(m)) <= 0.01 * vs_transformer.n_params(m)
    rows = [dict(kind="megalodon", tokens=4096, tokens_per_s=140.0, peak_bytes=2),
            dict(kind="transformer", tokens=4096, tokens_per_s=148.0, peak_bytes=4)]
    (q,) = vs_transformer.paper_ratios(rows)
    assert q["throughput"] == pytest.approx(140 / 148) and q["paper"] == pytest.approx(1.40 / 1.48)
    assert q["memory"] == 0.5


#: upstream's ops with a CPU implementation in its extension (ema_parameters, ema_hidden, timestep_norm)
#: and fftconv, whose wrapper takes torch.fft off the GPU (the path it also takes beyond L 16384)
CPU_SERVED = ("cema_kernel", "cema_kernel_hx", "ema_hidden", "fftconv", "timestep_norm")


def test_upstream_wrappers_agree_with_float64_on_its_cpu_paths():
    """Upstream's calling conventions as vs_upstream.py calls them (log q in, q's gradient turned into log
    q's, p as (D, N, 1), timestep_norm's state and dtypes), checked against the float64 reference on the
    CPU implementations upstream's extension has. Needs the module built for this Python and torch
    (bench/upstream_build.py); CI has none and skips."""
    ext, why = vs_upstream.load_upstream(vs_upstream.upstream_location())
    if ext is None:
        pytest.skip(why)
    for case in vs_upstream.cases("dry"):
        if case.name not in CPU_SERVED:
            continue
        r = vs_upstream.run_case(case, "float32", ["upstream"], ext, torch.device("cpu"), 1)
        up = r["providers"]["upstream"]
        assert "skipped" not in up, (case.name, up)
        assert up["err_fwd"] < 1e-5 and up["err_bwd"] < 1e-5, (case.name, up)
