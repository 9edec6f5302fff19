"""The fp32 comparisons can see a 1e-5 relative gain error in each op's forward.

A kernel whose output is off by a factor 1 + 1e-5 (a wrong normalisation constant, a dropped
term of a series) is broken, and the tolerances must be tight enough to say so. Each test here
multiplies the torch backend's forward output by 1 + 1e-5 (the ``gain_error`` fixture patches
``ops/<op>/torch_impl.py``'s forward; the gradients are left alone) and runs the op's own check
(the same ``support.tol`` budgets and ``assert_close``, from tests/test_<op>.py) on one
representative float32 case: it must fail on the forward output. The same perturbation must fail
the self-check's comparison (selfcheck.tolerance) for every op.

The bounds are scaled by the magnitude of the terms (tests/support.py), which a cancelling output
cannot hide behind, but which could hide an error smaller than the terms themselves. Two more
mutations, each held to the loosest budget any backend of the op has (so every backend's bound
fails it):

- **one wrong sign**: one term of a reduction whose terms cancel (domega of a single channel,
  dk[0], dbias) enters with the wrong sign;
- **a one-ulp drift per step** of a long recurrence: |q| one unit in the last place too large
  (cema_kernel over 2048 steps, ema_hidden and cema over 4096), or each step of TimestepNorm's
  input one more unit too large (2048 steps).
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
from megalodon_kernels.ops.cema import cema
from megalodon_kernels.ops.ema_hidden import ema_hidden

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
    pairs += [(m, support.TERMS_TOLERANCES[(op, b, str(d).replace("torch.", ""), kind)])
              for (op, b, d), ms in support.MEASURED_TERMS.items() for kind, m in zip(("fwd", "bwd"), ms)]
    pairs += [(m, selfcheck.tolerance(op, "torch", dtype, kind)) for op, per_dtype in selfcheck.MEASURED.items()
              for dtype, ms in per_dtype.items() for kind, m in zip(("fwd", "bwd"), ms)]
    assert pairs
    for measured, allowed in pairs:
        assert 3 * measured <= allowed * (1 + 1e-9) and allowed <= 4 * measured, (measured, allowed)


# --- mutations a bound on the magnitude of the terms could hide ----------------------------------

ULP = 2.0 ** -24   # one unit in the last place of float32 at 1, relative


def loosest_tol(op):
    """``tol`` with the largest budget any backend of ``op`` has for that dtype and direction."""
    def tol(backend, dtype, kind, op_=None):
        budgets = [v[kind] for (o, _, d), v in support.TOLERANCES.items() if o == op and d == dtype]
        return support.Tol(max(budgets), (op, "loosest", str(dtype).replace("torch.", ""), kind))
    return tol


def _fails_only_when_mutated(monkeypatch, op, check, function, mutation, outputs):
    """``check`` passes the loosest budget of ``op`` as it is, and fails on one of ``outputs`` once
    the torch backend's ``function`` ("forward" or "backward") is replaced by ``mutation`` of it."""
    monkeypatch.setattr(importlib.import_module(f"test_{op}"), "tol", loosest_tol(op))
    check()
    module = support.backend_module(op, "torch")
    monkeypatch.setattr(module, function, mutation(getattr(module, function)))
    with pytest.raises(AssertionError, match="relative error") as info:
        check()
    assert str(info.value).split(":")[0] in outputs, str(info.value)


def _wrong_sign_cema(real):
    def backward(dy, dh, x, *rest, **kw):
        grads = list(real(dy, dh, x, *rest, **kw))
        t = x.shape[-1] // 2
        grads[4] = grads[4].clone()
        grads[4][0] -= 2 * (dy[0, 0, t].double() * x[0, 0, t].double()).to(grads[4].dtype)   # domega[0]
        return tuple(grads)
    return backward


def _wrong_sign_fftconv(real):
    def backward(dy, x, k, *rest, **kw):
        dx, dk = real(dy, x, k, *rest, **kw)
        t = x.shape[-1] // 2
        dk = dk.clone()
        dk[0, 0] -= 2 * (dy[0, 0, t].double() * x[0, 0, t].double()).to(dk.dtype)
        return dx, dk
    return backward


def _wrong_sign_timestep_norm(real):
    def backward(dy, *rest, **kw):
        dx, dscale, dbias, *state = real(dy, *rest, **kw)
        dbias = dbias.clone()
        dbias[0] -= 2 * dy[0, dy.shape[1] // 2, 0].to(dbias.dtype)   # an unpadded step of row 0
        return (dx, dscale, dbias, *state)
    return backward


def _timestep_norm_row(L, center, seed=3):
    p, gen = test_timestep_norm.problem(1, L, 4, 1, seed, pad="none", prior=True, center=center)
    return lambda: test_timestep_norm.run(p, F32, gen=gen)


#: op -> (its module's check on a case whose reduction cancels, the torch backward's mutation,
#: the gradient it reaches)
WRONG_SIGN = {
    # one channel: domega = sum over (b, t) of dy x cancels (the case a fresh random run failed on)
    "cema": (lambda: test_cema.check_cema("torch", 2, 1, 3, 124, F32, F32), _wrong_sign_cema, "domega"),
    "fftconv": (lambda: test_fftconv.check_fftconv("torch", 2, 1, 63, F32, F32), _wrong_sign_fftconv, "dk"),
    "timestep_norm": (_timestep_norm_row(45, 1.0), _wrong_sign_timestep_norm, "dbias"),
}


@pytest.mark.parametrize("op", list(WRONG_SIGN))
def test_wrong_sign_of_one_term_of_a_cancelling_reduction(op, monkeypatch):
    check, mutation, output = WRONG_SIGN[op]
    _fails_only_when_mutated(monkeypatch, op, check, "backward", mutation, (output,))


def _drifting_log_q(real, position):
    """The forward with |q| one ulp too large: every step of the recurrence one ulp more."""
    def forward(*args, **kw):
        args = list(args)
        args[position] = args[position] + ULP
        return real(*args, **kw)
    return forward


def _drifting_steps(real):
    """TimestepNorm's forward with step t of x scaled by 1 + (t + 1) ulp."""
    def forward(x, *args, **kw):
        drift = 1 + ULP * torch.arange(1, x.shape[1] + 1, dtype=torch.float64)
        return real((x.double() * drift[None, :, None]).to(x.dtype), *args, **kw)
    return forward


def _long_memory_forward(op):
    """The forward outputs of ``op`` (torch backend) on a signal of one sign over 4096 steps with
    long-memory coefficients (1 - |q| in [1e-4, 1e-3]) that do not rotate (q real), against the
    reference and its terms. A signal of mixed signs, or a rotating q, would average a drift out
    along with the rounding, against terms that do not cancel."""
    def check():
        gen = torch.Generator().manual_seed(17)
        c = support.cema_coefficients(gen, 2, 4, 1, F32, min_gap=1e-4, max_gap=1e-3)
        c = c._replace(log_q=torch.complex(c.log_q.real, torch.zeros_like(c.log_q.real)))
        x = torch.randn(1, 2, 4096, generator=gen, dtype=torch.float64).abs().float()
        n = {k: support.to_np(v) for k, v in (("x", x), *c._asdict().items())}
        if op == "ema_hidden":
            h = ema_hidden(x, c.p, c.log_q, c.hx, backend="torch")
            args = (n["x"], n["p"], n["log_q"], n["hx"])
            support.assert_close("h", h, test_ema_hidden.ref.ema_hidden(*args), test_ema_hidden.tol("torch", F32, "fwd"),
                                 test_ema_hidden.ref.ema_hidden_terms(*args))
        else:
            omega = torch.full((2,), 0.5)
            y, h = cema(x, c.p, c.log_q, c.gamma, omega, c.hx, return_state=True, backend="torch")
            args = (n["x"], n["p"], n["log_q"], n["gamma"], support.to_np(omega), n["hx"])
            (y_ref, h_ref), (y_m, h_m) = (test_cema.ref.cema(*args, return_state=True),
                                          test_cema.ref.cema_terms(*args, return_state=True))
            support.assert_close("y", y, y_ref, test_cema.tol("torch", F32, "fwd"), y_m)
            support.assert_close("h", h, h_ref, test_cema.tol("torch", F32, "fwd"), h_m)
    return check


#: op -> (a check on a long recurrence, the torch forward's mutation, the forward outputs it compares)
DRIFT = {
    "cema_kernel": (lambda: test_cema_kernel.check_cema_kernel("torch", 2, 4, 1, 2048, F32),
                    lambda real: _drifting_log_q(real, 1), ("k", "b")),
    "ema_hidden": (_long_memory_forward("ema_hidden"), lambda real: _drifting_log_q(real, 2), ("h",)),
    "cema": (_long_memory_forward("cema"), lambda real: _drifting_log_q(real, 2), ("y", "h")),
    "timestep_norm": (_timestep_norm_row(2048, 50.0), _drifting_steps, ("y", "mean", "var")),
}


@pytest.mark.parametrize("op", list(DRIFT))
def test_one_ulp_drift_per_step_of_a_long_recurrence(op, monkeypatch):
    check, mutation, outputs = DRIFT[op]
    _fails_only_when_mutated(monkeypatch, op, check, "forward", mutation, outputs)
