"""The fp32 comparisons can see a 1e-5 relative gain error in each op's forward.

A kernel whose output is off by a factor 1 + 1e-5 (a wrong normalisation constant, a dropped
term of a series) is broken, and the tolerances must be tight enough to say so. Each test here
multiplies the torch backend's forward output by 1 + 1e-5 (the ``gain_error`` fixture patches
``ops/<op>/torch_impl.py``'s forward; the gradients are left alone) and runs the op's own check
(the same ``support.tol`` budgets and ``assert_close``, from tests/test_<op>.py) on one
representative float32 case: it must fail on the forward output. The same perturbation must fail
the self-check's comparison (selfcheck.tolerance) for every op.
"""
import contextlib
import importlib

import pytest
import torch

import support
import test_attention
import test_cema
import test_cema_kernel
import test_dropkey_softmax
import test_ema_hidden
import test_fftconv
import test_rotary
import test_timestep_norm
from megalodon_kernels import selfcheck

F32 = torch.float32
GAIN = 1 + 1e-5

#: op -> (forward function of its torch backend, positions of the op's outputs in what it returns:
#: None for a function returning the output itself)
FORWARD = {
    "cema_kernel": ("forward", (0, 1)),          # (k, b, ...)
    "ema_hidden": ("forward", (0,)),              # (h, V, W)
    "fftconv": ("forward", None),
    "cema": ("forward", (0, 1)),                        # (y, h, saved)
    "timestep_norm": ("forward", (0,)),        # (y, count, mean, var, saved)
    "attention": ("forward", (0,)),                      # (o, lse)
    "dropkey_softmax": ("forward", None),
    "rotary": ("forward", None),
}


@contextlib.contextmanager
def gain_error(monkeypatch, op):
    """The torch backend of ``op`` with its forward outputs multiplied by ``GAIN``."""
    module = importlib.import_module(f"megalodon_kernels.ops.{op}.torch_impl")
    name, outputs = FORWARD[op]
    real = getattr(module, name)

    def scaled(t):
        return None if t is None else t * GAIN

    def perturbed(*args, **kwargs):
        out = real(*args, **kwargs)
        if outputs is None:
            return scaled(out)
        return type(out)(scaled(o) if i in outputs else o for i, o in enumerate(out))

    with monkeypatch.context() as m:
        m.setattr(module, name, perturbed)
        yield


def _timestep_norm_case():
    c = next(p.values[0] for p in test_timestep_norm.CASES if p.id == "L45-D8-G2-mixed")
    return lambda: test_timestep_norm.test_matches_reference(c, "torch", F32)


def _rotary_case():
    return lambda: test_rotary.check(2, 33, 2, 16, F32, 512.0, False, 7, False, True, backend="torch")


#: op -> its test file's check, on one representative float32 case with the torch backend
CHECKS = {
    "cema_kernel": lambda: test_cema_kernel.check_cema_kernel("torch", 3, 4, 2, 65, F32),
    "ema_hidden": lambda: test_ema_hidden.check_ema_hidden("torch", 2, 3, 4, 65, F32, F32),
    "fftconv": lambda: test_fftconv.check_fftconv("torch", 2, 3, 63, F32, F32),
    "cema": lambda: test_cema.check_cema("torch", 2, 3, 4, 65, F32, F32),
    "timestep_norm": lambda: _timestep_norm_case()(),
    "attention": lambda: test_attention.check(1, 33, 33, 2, 16, 16, F32, backend="torch"),
    "dropkey_softmax": lambda: test_dropkey_softmax.check((2, 3, 17, 20), F32, backend="torch"),
    "rotary": lambda: _rotary_case()(),
}

#: the name each check gives its first forward comparison
FIRST_OUTPUT = {"cema_kernel": "k", "ema_hidden": "h", "fftconv": "y", "cema": "y", "timestep_norm": "y",
                "attention": "o", "dropkey_softmax": "y", "rotary": "y"}


@pytest.mark.parametrize("op", list(CHECKS))
def test_op_check_passes_unperturbed(op):
    """The representative case passes as it is: the failure below is the perturbation's."""
    CHECKS[op]()


@pytest.mark.parametrize("op", list(CHECKS))
def test_op_check_catches_a_1e5_gain_error(op, monkeypatch):
    with gain_error(monkeypatch, op), pytest.raises(AssertionError, match="relative error") as info:
        CHECKS[op]()
    assert str(info.value).startswith(f"{FIRST_OUTPUT[op]}: relative error"), str(info.value)


@pytest.mark.parametrize("op", list(selfcheck.CASES))
def test_selfcheck_catches_a_1e5_gain_error(op, monkeypatch):
    _, case = selfcheck.CASES[op]
    cpu = torch.device("cpu")
    honest = case("torch", F32, cpu)
    with gain_error(monkeypatch, op):
        perturbed = case("torch", F32, cpu)
    where = (op, "torch", "cpu", "float32")
    reached = 0
    for (check, actual, expected, kind), (_, real, _, _) in zip(perturbed, honest):
        if kind != "fwd":
            continue
        tolerance = selfcheck.tolerance(op, "torch", F32, kind)
        assert selfcheck._compare(where, check, real, expected, tolerance).passed, (op, check)
        if torch.equal(actual.detach(), real.detach()):  # an output the gain does not touch (count, mean)
            continue
        reached += 1
        row = selfcheck._compare(where, check, actual, expected, tolerance)
        assert not row.passed, f"{op} {check}: a 1e-5 gain error passes the self-check ({row.rel:.1e} <= {row.tol:.1e})"
    assert reached, op


def test_budgets_are_3x_to_4x_the_measured_errors():
    """Every fp32/fp64 budget of the tests (support.MEASURED) and of the self-check
    (selfcheck.MEASURED) is between 3x and 4x the error measured for it: tight enough to catch a
    kernel that gets 4x worse, loose enough for rounding noise."""
    pairs = [(m, support.TOLERANCES[key][kind]) for key, ms in support.MEASURED.items()
             for kind, m in zip(("fwd", "bwd"), ms) if m > 0]
    pairs += [(m, selfcheck.tolerance(op, "torch", dtype, kind)) for op, per_dtype in selfcheck.MEASURED.items()
              for dtype, ms in per_dtype.items() for kind, m in zip(("fwd", "bwd"), ms)]
    assert pairs
    for measured, allowed in pairs:
        assert 3 * measured <= allowed * (1 + 1e-9) and allowed <= 4 * measured, (measured, allowed)
