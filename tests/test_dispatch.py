"""Backend selection: explicit > env var > priority list; clear errors; one log line per choice."""
import importlib
import logging

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.ops import _dispatch
from megalodon_kernels.ops._dispatch import ENV_VAR, NoBackendError, OpBackends


def _x():
    return torch.randn(1, 3, 1, 4)


def test_auto_picks_first_usable_backend_in_priority_order():
    table = importlib.import_module("megalodon_kernels.ops.rotary").BACKENDS
    choice = table.select("auto", {"x": _x()}, device=torch.device("cpu"),
                                                          dtype=torch.float32)
    assert choice.name == "torch"


def test_explicit_backend_that_cannot_run_lists_every_reason():
    with pytest.raises(NoBackendError) as err:
        ops.rotary(_x(), torch.arange(3), backend="cuda")
    msg = str(err.value)
    assert "backend 'cuda' (from argument)" in msg
    for name in _dispatch.PRIORITY:
        assert f"  {name}:" in msg


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(NoBackendError, match=f"from {ENV_VAR}"):
        ops.rotary(_x(), torch.arange(3))
    # an explicit argument still wins over the environment
    ops.rotary(_x(), torch.arange(3), backend="torch")
    monkeypatch.setenv(ENV_VAR, "torch")
    ops.rotary(_x(), torch.arange(3))


def test_env_var_with_unknown_value_is_named(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "opencl")
    with pytest.raises(ValueError, match=ENV_VAR):
        ops.rotary(_x(), torch.arange(3))


def test_choice_is_logged_once_per_op_backend_device_dtype(caplog, monkeypatch):
    monkeypatch.setattr(_dispatch, "_logged", set())
    with caplog.at_level(logging.INFO, logger="megalodon_kernels"):
        for _ in range(3):
            ops.rotary(_x(), torch.arange(3))
        ops.rotary(_x().double(), torch.arange(3))
    lines = [r.getMessage() for r in caplog.records if r.name == "megalodon_kernels"]
    assert len(lines) == 2, lines
    assert "rotary: using backend 'torch'" in lines[0]


def test_failed_import_of_optional_backend_becomes_a_reason():
    table = OpBackends("demo", {"torch": "megalodon_kernels.ops.rotary.torch_impl",
                                "triton": "megalodon_kernels.ops.does_not_exist"})
    why = table.reasons("triton", {"x": _x()})
    assert len(why) == 1 and "cannot import megalodon_kernels.ops.does_not_exist" in why[0]
    assert table.select("auto", {"x": _x()}, device=torch.device("cpu"), dtype=torch.float32).name == "torch"


def test_unknown_backend_name_rejected_at_registration():
    with pytest.raises(ValueError, match="unknown backend"):
        OpBackends("demo", {"opencl": "x"})


def test_auto_never_picks_the_triton_interpreter_but_explicit_triton_runs_it():
    assert _dispatch.os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest
    table = importlib.import_module("megalodon_kernels.ops.rotary").BACKENDS
    assert not table.reasons("triton", {"x": _x()})
    assert table.select("auto", {"x": _x()}, device=torch.device("cpu"), dtype=torch.float32).name == "torch"
    assert table.select("triton", {"x": _x()}, device=torch.device("cpu"), dtype=torch.float32).name == "triton"
