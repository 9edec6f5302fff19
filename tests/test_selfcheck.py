"""``python -m megalodon_kernels`` reports failures and exits 1 when an op disagrees with its reference."""
from megalodon_kernels import __main__ as main_mod
from megalodon_kernels import selfcheck


def test_selfcheck_passes_and_covers_every_op_and_dtype():
    rows, availability = selfcheck.run_checks()
    assert set(availability) == set(selfcheck.CASES)
    for op, (dtypes, _) in selfcheck.CASES.items():
        assert availability[op]["torch"] == "usable"
        checked = {r.dtype for r in rows if r.op == op and r.backend == "torch"}
        assert checked == {str(d).replace("torch.", "") for d in dtypes}, op
    failed = [r for r in rows if not r.passed]
    assert not failed, failed


def test_a_wrong_op_fails_the_selfcheck_with_exit_code_1(monkeypatch, capsys):
    real = selfcheck.ops.fftconv
    monkeypatch.setattr(selfcheck.ops, "fftconv", lambda x, k, backend: real(x, k, backend=backend) * 1.001)
    assert main_mod.main() == 1
    out = capsys.readouterr().out
    assert "fftconv" in out and " NO " in out

