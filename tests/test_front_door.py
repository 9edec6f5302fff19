"""What a newcomer meets first (issue 44): every command's --help answers without running anything,
the version is pyproject's, the project files exist, the README links every document, and the
output has no stray lines."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: every command the README and docs/guide.md name that takes arguments, and every example
HELP = [
    ["-m", "megalodon_kernels"],
    ["-m", "megalodon_kernels.bench"],
    ["-m", "megalodon_kernels.bench", "gpu"],
    ["-m", "megalodon_kernels.bench", "report"],
    ["-m", "megalodon_kernels.autotune"],
    ["-m", "megalodon_kernels.cuda"],
    ["-m", "megalodon_kernels.model.hf_convert"],
    ["-m", "megalodon_kernels.autotune", "regenerate"],
    ["-m", "megalodon_kernels.bench.resources"],
    ["-m", "megalodon_kernels.bench.cuda_resources"],
    ["-m", "megalodon_kernels.bench.triton_bytes"],
    *[[f"bench/{name}.py"] for name in ("op_times", "packed", "accuracy_cema", "accuracy_timestep_norm", "accuracy_fp32",
                                         "cema_forms", "cpu_step", "decode", "compile_step", "vs_transformer", "host_cost")],
    *[[str(p.relative_to(ROOT))] for p in sorted((ROOT / "examples").glob("*.py"))],
]


#: runs each command's --help in one interpreter (torch imported once), as ``python ...`` would
_RUN_HELPS = r"""
import contextlib, io, json, runpy, sys, time
results = []
for argv in json.loads(sys.argv[1]):
    out, started = io.StringIO(), time.perf_counter()
    sys.argv = [argv[-1] if argv[0] != "-m" else argv[1], *argv[2:], "--help"]
    code = None
    with contextlib.redirect_stdout(out):
        try:
            if argv[0] == "-m":
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    results.append(dict(argv=argv, code=code, out=out.getvalue(), s=time.perf_counter() - started))
print(json.dumps(results))
"""


def test_every_help_answers_without_running_anything():
    """Each ``--help`` prints its usage and exits 0 before doing anything. One interpreter runs them
    all (each alone takes about an ``import torch``: 1.6-1.9 s on an idle core here)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _RUN_HELPS, json.dumps(HELP)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for res in json.loads(r.stdout.splitlines()[-1]):
        argv, out = res["argv"], res["out"]
        print(f"{' '.join(argv)} --help: exit {res['code']}, {res['s']:.2f} s (the first pays torch's import)")
        assert res["code"] in (0, None) and out.lstrip().startswith("usage:"), (argv, res["code"], out[:500])
        assert "self-check\n" not in out and " passed" not in out, argv  # nothing ran
        if argv[0].startswith("examples/"):  # the docstring's first paragraph, not its first line cut mid-sentence
            description = out.split("\n\n")[1]
            assert description.rstrip().endswith("."), (argv, description)


def test_version_is_pyprojects():
    import megalodon_kernels

    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert megalodon_kernels.__version__ == version
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()
    assert f"version: {version}" in (ROOT / "CITATION.cff").read_text()


def test_project_files():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()
    citation = (ROOT / "CITATION.cff").read_text()
    for paper in ("Megalodon", "Mega: Moving Average Equipped Gated Attention", "A Length-Extrapolatable Transformer"):
        assert paper in citation, paper


def test_readme_and_docs_index_link_every_page():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name == "README.md":
            continue
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
        assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):  # relative links resolve
        assert (ROOT / target).exists(), target


def test_profiler_markers_do_not_reach_the_output(capfd):
    """bench gpu's model step profiles a training step; torch's profiler library prints USDT / STAGE
    lines from C++ at every start and stop, which the step drops (other stderr lines stay)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT / "bench"))
    from megalodon_kernels.bench.gpu_steps import _without_kineto_markers

    with _without_kineto_markers(), profile(activities=[ProfilerActivity.CPU]):
        torch.ones(4) @ torch.ones(4)
        os.write(2, b"a real message\n")
    err = capfd.readouterr().err
    assert "a real message" in err and "USDT" not in err and "STAGE:" not in err


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
def test_cuda_extra_advice_only_with_a_gpu(gpu, monkeypatch):
    import torch

    from megalodon_kernels.cuda import runtime

    monkeypatch.setattr(runtime, "_reason", runtime._UNSET)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)  # no CuPy
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    reason = runtime.unavailable_reason()
    assert ("pip install -e '.[cuda]'" in reason) == gpu, reason
