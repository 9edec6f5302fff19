"""``python -m megalodon_kernels``: what it checks, how its report reads, and that a disagreement
with a reference makes it exit 1."""
import re

import pytest
import torch

from megalodon_kernels import __main__ as main_mod
from megalodon_kernels import selfcheck
from megalodon_kernels.ops._dispatch import PRIORITY
from megalodon_kernels.reference import fftconv as fftconv_reference


_RUNS: dict = {}


@pytest.fixture
def checked():
    """One full self-check on the CPU (the Triton backend runs in the interpreter under the tests),
    run once inside the first test that asks for it, so under conftest's NaN-poisoned allocations."""
    if "cpu" not in _RUNS:
        _RUNS["cpu"] = selfcheck.run_checks([torch.device("cpu")])
    return _RUNS["cpu"]


def _claimed():
    return {op: [selfcheck.dtype_name(d) for d in dtypes] for op, (dtypes, _) in selfcheck.CASES.items()}


def test_selfcheck_passes_and_covers_every_op_and_dtype(checked):
    rows, availability = checked
    assert set(availability) == {"cpu"}
    assert set(availability["cpu"]) == set(selfcheck.CASES)
    for op, (dtypes, _) in selfcheck.CASES.items():
        names = {selfcheck.dtype_name(d) for d in dtypes}
        # float64 for every op; float16 for every op whose inputs may be half precision
        assert "float64" in names, op
        assert op == "cema_kernel" or {"float16", "bfloat16", "float32"} <= names, op
        for backend in PRIORITY:
            seen = availability["cpu"][op][backend]
            # every claimed dtype is accounted for: ran, or refused with at least one reason
            assert set(seen.ran) | set(seen.refused) == names, (op, backend)
            assert all(seen.refused.values()), (op, backend)
            ran_rows = {r.dtype for r in rows if r.op == op and r.backend == backend}
            assert ran_rows == set(seen.ran), (op, backend)
        assert availability["cpu"][op]["torch"].ran == [selfcheck.dtype_name(d) for d in dtypes]
        for dtype in names:  # forward and backward against the reference, in every dtype
            kinds = {r.check for r in rows if r.op == op and r.backend == "torch" and r.dtype == dtype}
            assert len(kinds) >= 2, (op, dtype, kinds)
    failed = [r for r in rows if not r.passed]
    assert not failed, failed


def test_report_lists_every_op_once_and_each_distinct_reason_once(checked):
    rows, availability = checked
    text = "\n".join(main_mod.availability_lines(availability, _claimed()))
    print(text)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["op"])
    assert lines[header].split() == ["op", *PRIORITY]
    table = lines[header + 1:header + 1 + len(selfcheck.CASES)]
    assert [line.split()[0] for line in table] == list(selfcheck.CASES)
    # every cell: yes, no (n, ...) or "<dtypes> only (n, ...)"
    cell = r"(yes|no \([\d, ]+\)|(?:fp\d\d |bf16 )+only \([\d, ]+\))"
    for line in table:
        assert re.fullmatch(r"\s+\S+" + r"\s+".join([""] + [cell] * len(PRIORITY)) + r"\s*", line), line
    # the numbered reasons: 1..n, each text once, each number cited by some cell
    numbered = re.findall(r"^  \((\d+)\) ", text, flags=re.M)
    assert numbered == [str(i) for i in range(1, len(numbered) + 1)]
    reasons = re.split(r"\n  \(\d+\) ", "\n" + text.split("\n\n", 1)[1].rstrip())[1:]
    flat = [" ".join(r.split()) for r in reasons]
    assert len(flat) == len(set(flat))
    cited = {int(n) for line in table for group in re.findall(r"\(([\d, ]+)\)", line) for n in group.split(", ")}
    assert cited == set(range(1, len(numbered) + 1))
    # every reason a cell points to is printed exactly once (the CUDA build hint is shared by
    # seven ops' cells and still appears once)
    shown = {" ".join(r.split()) for per_op in availability["cpu"].values() for seen in per_op.values()
             for r in main_mod.cell_reasons(seen)}
    assert shown == set(flat)
    normalised = " ".join(text.split())
    for reason in shown:
        assert normalised.count(reason) == 1, reason


@pytest.fixture
def only_fftconv(monkeypatch):
    monkeypatch.setattr(selfcheck, "CASES", {"fftconv": selfcheck.CASES["fftconv"]})
    monkeypatch.setattr(selfcheck, "local_devices", lambda: [torch.device("cpu")])


def test_selfcheck_exits_0_when_everything_agrees(only_fftconv, capsys):
    assert main_mod.main() == 0
    out = capsys.readouterr().out
    assert " NO " not in out and ", 0 failed" in out


def test_a_wrong_op_fails_the_selfcheck_with_exit_code_1(only_fftconv, monkeypatch, capsys):
    real = selfcheck.ops.fftconv
    monkeypatch.setattr(selfcheck.ops, "fftconv", lambda x, k, backend: real(x, k, backend=backend) * 1.001)
    assert main_mod.main() == 1
    out = capsys.readouterr().out
    assert "fftconv" in out and " NO " in out


def test_a_wrong_reference_fails_the_selfcheck_with_exit_code_1(only_fftconv, monkeypatch, capsys):
    real = fftconv_reference.fftconv
    monkeypatch.setattr(fftconv_reference, "fftconv", lambda x, k: real(x, k) * 1.001)
    assert main_mod.main() == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if " NO " in line]
    assert failed and all(line.split()[0] == "fftconv" and line.split()[5] == "y" for line in failed), failed
