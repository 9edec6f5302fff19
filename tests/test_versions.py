"""The tested version range (_versions.py) and how ``python -m megalodon_kernels`` reports a version
outside it (issue 28 item 4). Versions are faked: CI has only the pairs it installs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy
import pytest
import torch

from megalodon_kernels import __main__ as cli
from megalodon_kernels import _versions as v

ROOT = Path(__file__).resolve().parents[1]


def test_parse():
    assert v.parse("2.11.0+cu130") == (2, 11, 0)
    assert v.parse("3.10.0.dev20260101") == (3, 10, 0)
    assert v.parse("2.13") == (2, 13, 0)
    assert v.parse("nightly") is None


@pytest.mark.parametrize("torch_v,triton_v", [("2.11.0+cu130", "3.6.0"), ("2.12.1", "3.7.1"),
                                              ("2.13.0+cpu", "3.9.0"), ("2.13.0", None)])
def test_tested_range_has_no_problem(torch_v, triton_v):
    assert v.problems(torch_v, triton_v, "2.3.5", interpret=True) == []


@pytest.mark.parametrize("torch_v,triton_v,expect", [
    ("2.10.0", "3.6.0", ["torch 2.10.0 is older than the tested range (2.11-2.13)", "torch>=2.11"]),
    ("2.14.0", "3.9.0", ["torch 2.14.0 is newer than the tested range (2.11-2.13)", "torch>=2.11,<2.14"]),
    ("2.13.0", "3.5.1", ["triton 3.5.1 is older than the tested range (3.6-3.9)", "triton>=3.6"]),
    ("2.13.0", "3.10.0", ["triton 3.10.0 is newer than the tested range (3.6-3.9)", "triton>=3.6,<3.10"]),
    ("unknown", "3.9.0", ["torch 'unknown': cannot read its version"]),
])
def test_outside_the_range_says_what_why_and_the_fix(torch_v, triton_v, expect):
    found = v.problems(torch_v, triton_v, "2.3.5", interpret=False)
    assert len(found) == 1, found
    assert all(e in found[0] for e in expect), found[0]
    assert "cannot read" in found[0] or "because" in found[0]


def test_interpreter_numpy_rule():
    """Triton 3.6's interpreter with NumPy >= 2.4 is reported only when the interpreter is on."""
    assert v.problems("2.11.0", "3.6.0", "2.4.0", interpret=False) == []
    assert v.problems("2.11.0", "3.6.0", "2.3.5", interpret=True) == []
    assert v.problems("2.11.0", "3.7.0", "2.4.0", interpret=True) == []
    [p] = v.problems("2.11.0", "3.6.0", "2.4.6", interpret=True)
    assert "numpy<2.4" in p and "TRITON_INTERPRET=1" in p


def test_triton_backends_refuse_cpu_tensors_where_the_interpreter_is_broken(monkeypatch):
    """With a Triton whose interpreter fails on the installed NumPy, a Triton backend asked for CPU
    tensors refuses with the rule's sentence instead of failing inside a kernel."""
    pytest.importorskip("triton")
    from megalodon_kernels.ops import _triton_common
    from megalodon_kernels.ops.fftconv import fftconv

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, k = torch.randn(1, 5, 13), torch.randn(5, 13)  # a shape no other test dispatches (choices are cached)
    sentence = v.interpreter_problem("3.6.0", "2.4.6")
    monkeypatch.setattr(_triton_common, "INTERPRETER_PROBLEM", sentence)
    with pytest.raises(ValueError, match="numpy<2.4"):
        fftconv(x, k, backend="triton")
    monkeypatch.setattr(_triton_common, "INTERPRETER_PROBLEM", None)
    assert torch.allclose(fftconv(x, k, backend="triton"), fftconv(x, k, backend="torch"), atol=1e-5)


_RUNTIME_LOOP = textwrap.dedent("""
    import torch, triton, triton.language as tl

    @triton.jit
    def count(out, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(n):  # a loop over a runtime bound, as the library's kernels have
            acc += 1.0
        tl.store(out + tl.arange(0, BLOCK), acc)

    out = torch.zeros(16)
    count[(1,)](out, 3, BLOCK=16)
    assert out.eq(3).all(), out
""")


def test_interpreter_numpy_rule_matches_the_installed_triton():
    """The rule above says whether this Triton's interpreter runs a runtime-bound loop with this
    NumPy: run one (TRITON_INTERPRET=1, a fresh process) and compare."""
    pytest.importorskip("triton")
    from importlib import metadata

    found = v.problems(torch.__version__, metadata.version("triton"), numpy.__version__, interpret=True)
    reported = any("TRITON_INTERPRET=1" in p for p in found)
    run = subprocess.run([sys.executable, "-c", _RUNTIME_LOOP], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=120)
    failed = run.returncode != 0
    assert failed == reported, run.stderr[-2000:]
    if failed:
        assert "only 0-dimensional arrays" in run.stderr


def test_pyproject_lower_bounds_are_the_oldest_tested_pair():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = lambda r: ".".join(map(str, r[0]))  # noqa: E731
    assert f"torch>={oldest(v.TORCH_TESTED)}" in meta["dependencies"]
    for extra in ("triton", "test"):
        assert f"triton>={oldest(v.TRITON_TESTED)}" in meta["optional-dependencies"][extra]


def test_the_running_versions_are_reported(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    found = cli.version_problems()
    assert any(p.startswith("torch 2.9.1+cu128 is older") for p in found), found


def _fake_checks(monkeypatch, run_checks):
    from megalodon_kernels import selfcheck

    monkeypatch.setattr(selfcheck, "run_checks", run_checks)


def _crash():
    raise RuntimeError("deep in a kernel")


def test_main_reports_an_unsupported_torch_and_a_crash_of_the_self_check(monkeypatch, capsys):
    """An old torch whose self-check crashes: the reason is printed before, the crash after, exit 1."""
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _fake_checks(monkeypatch, _crash)
    assert cli.main() == 1
    out = capsys.readouterr().out
    assert "unsupported (tested: torch 2.11-2.13, triton 3.6-3.9)" in out
    assert "torch 2.9.1 is older than the tested range" in out
    assert out.index("torch 2.9.1 is older") < out.index("the self-check could not run: RuntimeError: deep in a kernel")
    assert "1 unsupported version(s): see above" in out


def test_main_on_a_supported_version_does_not_hide_a_crash(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _fake_checks(monkeypatch, _crash)
    with pytest.raises(RuntimeError, match="deep in a kernel"):
        cli.main()


@pytest.mark.parametrize("torch_v,code", [("2.13.0", 0), ("2.14.0", 1)])
def test_main_exit_code(monkeypatch, capsys, torch_v, code):
    """All checks pass (none, faked): exit 0 on a tested torch, 1 on an untested one."""
    monkeypatch.setattr(torch, "__version__", torch_v)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _fake_checks(monkeypatch, lambda: ([], {}))
    assert cli.main() == code
    out = capsys.readouterr().out
    assert "0 passed, 0 failed" in out
    assert ("unsupported" in out) == bool(code)
