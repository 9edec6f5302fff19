"""Each real op's autotune registration agrees with its backends, its harness and the shape sets.

Every op package registers itself (a lost registration fails here). Checked: every backend in the declared space has a
module ``ops/<op>/<backend>_impl.py`` whose DEFAULT_CONFIG has exactly the declared knobs, with the
FIRST declared value of each (what the tuner records as the default); the tuner finds the op's
harness (``autotune/tuning/harness/<op>.py``); the cpu shape set covers the op and its cases map to
a key the registration accepts.
"""
import importlib
import inspect
import pkgutil

import pytest
import torch

import megalodon_kernels.ops as ops_pkg
from megalodon_kernels.autotune import registry
from megalodon_kernels.autotune.shapes import SHAPE_SETS
from megalodon_kernels.autotune.tuning import tuner

OPS = sorted(info.name for info in pkgutil.iter_modules(ops_pkg.__path__) if info.ispkg)


def _registered(op):
    importlib.import_module(f"megalodon_kernels.ops.{op}")
    tunable = registry.get(op)
    assert tunable is not None, f"ops/{op}/__init__.py does not register {op} for autotuning"
    return tunable


@pytest.mark.parametrize("op", OPS)
def test_space_matches_default_config(op):
    tunable = _registered(op)
    for backend in tunable.space:
        try:
            impl = importlib.import_module(f"megalodon_kernels.ops.{op}.{backend}_impl")
        except ImportError as exc:  # an optional dependency of that backend is absent here
            print(f"{op}/{backend}: not importable here ({exc})")
            continue
        assert impl.DEFAULT_CONFIG == tunable.default_config(backend), (
            f"{op}/{backend}: DEFAULT_CONFIG {impl.DEFAULT_CONFIG} must equal the first value of every declared "
            f"knob {tunable.default_config(backend)}")


@pytest.mark.parametrize("op", OPS)
def test_harness_and_cpu_shapes(op):
    tunable = _registered(op)
    harness = tuner.harness_for(tunable)
    shapes = SHAPE_SETS["cpu"].shapes(op)
    assert shapes, f"the cpu shape set has no shapes for {op}"
    for shape in shapes:
        small = harness.check_shape(shape) if harness.check_shape else shape
        case = harness.make_case(small, torch.float32, torch.device("cpu"), 0)
        assert tunable.key(case.inputs) == tunable.key(harness.make_case(shape, torch.float32, "cpu", 0).inputs)


#: the ops whose backends follow the one backend-module shape (ops/_dispatch.py's docstring)
UNIFORM_OPS = ["cema", "cema_kernel", "ema_hidden", "fftconv", "timestep_norm"]


def _required(fn) -> list[str]:
    """The parameters a caller must pass (positional, no default): the op's inputs."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty]


@pytest.mark.parametrize("op", UNIFORM_OPS)
def test_every_backend_module_has_the_same_shape(op):
    backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
    shapes = {}
    for name, path in backends.config_spaces().items():
        module = importlib.import_module(f"megalodon_kernels.ops.{op}.{name}_impl")
        for attr in ("not_supported_reasons", "forward", "backward", "CONFIG_SPACE", "DEFAULT_CONFIG"):
            assert hasattr(module, attr), f"ops/{op}/{name}_impl.py has no {attr}"
        assert inspect.isfunction(module.forward) and inspect.isfunction(module.backward), (
            f"ops/{op}/{name}_impl.py: forward/backward must be module-level functions")
        assert module.DEFAULT_CONFIG == {k: v[0] for k, v in module.CONFIG_SPACE.items()}
        shapes[name] = (_required(module.forward), _required(module.backward))
    first = next(iter(shapes.values()))
    assert all(s == first for s in shapes.values()), f"{op}: forward/backward inputs differ between backends: {shapes}"
