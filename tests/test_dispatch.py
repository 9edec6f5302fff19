"""Backend selection: explicit > env var > priority list; clear errors; one log line per choice;
the resolved choice cached per call signature, and dropped when what decided it changes."""
import importlib
import json
import logging
import sys
import types

import pytest
import torch

from megalodon_kernels import ops
from megalodon_kernels.autotune import cache as autotune_cache
from megalodon_kernels.autotune import registry
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
    autotune_cache.refresh()  # choices cached by earlier tests are resolved (and so logged) again
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


# --- the cache of resolved choices ------------------------------------------------------------------

OP = "demo_cached"


class FakeBackend(types.ModuleType):
    """A backend module that counts its not_supported_reasons calls; ``max_len`` refuses longer x,
    ``contiguous`` refuses strided x."""

    def __init__(self, name, max_len=None, contiguous=False):
        super().__init__(name)
        self.DEFAULT_CONFIG = {}
        self.calls = 0
        self.max_len, self.contiguous = max_len, contiguous

    def not_supported_reasons(self, x, **_):
        self.calls += 1
        why = []
        if self.max_len is not None and x.shape[1] > self.max_len:
            why.append(f"L = {x.shape[1]} > {self.max_len}")
        if self.contiguous and not x.is_contiguous():
            why.append("x must be contiguous")
        return why


@pytest.fixture
def fakes(monkeypatch):
    """An OpBackends over a picky cuda (L <= 16, contiguous x) and a torch that takes anything."""
    cuda, torch_ = FakeBackend("mk_demo_cuda", max_len=16, contiguous=True), FakeBackend("mk_demo_torch")
    for mod in (cuda, torch_):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return OpBackends(OP, {"cuda": cuda.__name__, "torch": torch_.__name__}), cuda, torch_


def _select(backends, x, backend="auto"):
    return backends.select(backend, {"x": x}, device=x.device, dtype=x.dtype)


def _calls(*mods):
    return sum(m.calls for m in mods)


def test_repeated_call_reuses_the_choice(fakes):
    backends, cuda, torch_ = fakes
    x = torch.zeros(2, 8, 4)
    first = _select(backends, x)
    assert first.name == "cuda" and _calls(cuda, torch_) == 1
    for _ in range(5):
        assert _select(backends, x) is first  # no backend was asked again
    assert _select(backends, torch.ones(2, 8, 4)) is first  # values are not part of the signature
    assert _calls(cuda, torch_) == 1
    assert _select(backends, x, "torch").name == "torch"  # another backend argument: resolved once
    assert _select(backends, x, "torch").name == "torch"
    assert _calls(cuda, torch_) == 2


def test_a_shape_or_layout_the_cached_backend_cannot_run_is_resolved_again(fakes):
    backends, cuda, torch_ = fakes
    assert _select(backends, torch.zeros(1, 16, 4)).name == "cuda"
    assert _select(backends, torch.zeros(1, 17, 4)).name == "torch"  # L > 16: cuda refuses
    assert _select(backends, torch.zeros(8, 4, 16).transpose(1, 2)).name == "torch"  # same shape, strided
    assert _select(backends, torch.zeros(1, 16, 4, dtype=torch.float64)).name == "cuda"
    with pytest.raises(NoBackendError, match="L = 17 > 16"):
        _select(backends, torch.zeros(1, 17, 4), "cuda")
    assert _select(backends, torch.zeros(1, 16, 4)).name == "cuda"  # cached
    # four signatures under auto, one under "cuda" and its error, which lists every backend's reasons
    assert _calls(cuda) == 4 + 1 + 1


def test_scalar_inputs_are_part_of_the_signature():
    a, b = _dispatch.signature({"x": torch.zeros(2, 3), "n": 1}), _dispatch.signature({"x": torch.zeros(2, 3), "n": True})
    assert a != b and a == _dispatch.signature({"x": torch.ones(2, 3), "n": 1})
    assert _dispatch.signature({"x": torch.zeros(2, 3)}) != _dispatch.signature({"x": torch.zeros(3, 2).t()})


def test_unhashable_inputs_are_resolved_every_time(fakes):
    backends, cuda, _ = fakes
    inputs = {"x": torch.zeros(1, 8, 4), "extra": [1, 2]}
    for _ in range(2):
        assert backends.select("auto", inputs, device=torch.device("cpu"), dtype=torch.float32).name == "cuda"
    assert cuda.calls == 2


def test_env_var_change_is_seen(fakes, monkeypatch):
    backends, cuda, torch_ = fakes
    x = torch.zeros(1, 8, 4)
    assert _select(backends, x).name == "cuda"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert _select(backends, x).name == "torch"
    assert _select(backends, x, "cuda").name == "cuda"  # an explicit argument still wins
    monkeypatch.setenv(ENV_VAR, "auto")
    assert _select(backends, x).name == "cuda"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """The demo op registered with a key and a space, an empty user cache dir and shipped dir."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(autotune_cache.ENV_CACHE, str(user))
    monkeypatch.setattr(autotune_cache, "SHIPPED_DIR", shipped)
    registry.register(OP, key=lambda x: {"D": x.shape[2], "L": registry.pow2_bucket(x.shape[1])},
                      space={"cuda": {}, "torch": {"block": [16, 32]}}, replace=True)
    autotune_cache.refresh()
    yield user, shipped
    registry.unregister(OP)
    autotune_cache.refresh()


def _table_entry(x, backend, config):
    key = registry.get(OP).key({"x": x})
    cand = {"backend": backend, "config": config, "status": "ok", "note": "", "error": 0.0, "tolerance": 1e-6,
            "median_s": 1e-3, "p20_s": 1e-3, "p80_s": 1e-3, "reps": 5}
    return {autotune_cache.entry_id(OP, x.dtype, key): {
        "op": OP, "dtype": "float32", "key": key, "shape": {"B": 1}, "check_shape": {"B": 1}, "seed": 0,
        "date": "2025-01-01T00:00:00Z", "winner": {"backend": backend, "config": config}, "default": None,
        "candidates": [cand],
        # measured over the demo op's registered candidates (an entry without this record is stale)
        "candidate_set": autotune_cache.candidate_set(registry.get(OP).space, x.device.type)}}


def test_env_reader_sees_every_change_without_raising(monkeypatch):
    # select's key reads the environment on every call, without os.environ.get's KeyError when unset
    name = "MEGALODON_KERNELS_TEST_ENV_READER"
    read = _dispatch.env_reader(name)
    monkeypatch.delenv(name, raising=False)
    assert read() == ""
    monkeypatch.setenv(name, "cuda é")
    assert read() == "cuda é"
    monkeypatch.delenv(name)
    assert read() == ""
    monkeypatch.setattr(_dispatch.os, "environ", {name: "replaced"})  # a test that swaps os.environ itself
    assert read() == "replaced"


def test_table_write_and_clear_drop_the_cached_choices(fakes, tables):
    backends, cuda, torch_ = fakes
    user, shipped = tables
    x = torch.zeros(1, 8, 4)
    assert _select(backends, x).name == "cuda"  # no table: the priority list
    ident = autotune_cache.identity(x.device)
    autotune_cache.write_entries(user / autotune_cache.table_name(ident), ident,
                                 _table_entry(x, "torch", {"block": 32}), {"megalodon_kernels": "test"})
    choice = _select(backends, x)
    assert (choice.name, choice.config) == ("torch", {"block": 32})  # the new winner, not the cached cuda
    assert autotune_cache.clear() and _select(backends, x).name == "cuda"


def test_a_new_user_cache_dir_is_read(fakes, tables, monkeypatch):
    backends, _, _ = fakes
    user, _ = tables
    x = torch.zeros(1, 8, 4)
    ident = autotune_cache.identity(x.device)
    other = user.parent / "other"
    other.mkdir()
    (other / autotune_cache.table_name(ident)).write_text(json.dumps({
        "schema": autotune_cache.SCHEMA_VERSION, "device": ident, "versions": {}, "date": "2025-01-01T00:00:00Z",
        "entries": _table_entry(x, "torch", {"block": 16})}))
    assert _select(backends, x).name == "cuda"
    monkeypatch.setenv(autotune_cache.ENV_CACHE, str(other))  # no refresh: the setting alone
    assert (_select(backends, x).name, _select(backends, x).config) == ("torch", {"block": 16})


def test_registration_change_drops_the_cached_choices(fakes, tables):
    backends, cuda, _ = fakes
    x = torch.zeros(1, 8, 4)
    _select(backends, x)
    calls = cuda.calls
    registry.register(OP, key=lambda x: {"D": x.shape[2]}, space={"cuda": {}, "torch": {"block": [16, 32]}},
                      replace=True)
    assert _select(backends, x).name == "cuda" and cuda.calls == calls + 1


def test_forced_tuner_candidate_bypasses_the_cache(fakes, tables):
    backends, cuda, torch_ = fakes
    x = torch.zeros(1, 8, 4)
    cached = _select(backends, x)
    assert cached.name == "cuda"
    with registry.force(OP, "torch", {"block": 32}):
        forced = _select(backends, x)
        assert (forced.name, forced.config) == ("torch", {"block": 32})
        assert _select(backends, x, "cuda").name == "torch"  # whatever the argument says
    assert _select(backends, x) is cached  # the forced candidate was not stored
    with registry.force(OP, "cuda", {}):
        with pytest.raises(NoBackendError, match="forced by the tuner"):
            _select(backends, torch.zeros(1, 17, 4))


def test_knobs_patched_in_place_are_used(fakes):
    backends, cuda, _ = fakes
    x = torch.zeros(1, 8, 4)
    assert _select(backends, x).config == {}
    cuda.DEFAULT_CONFIG["warps"] = 8  # how tests run a backend with other knob values
    assert _select(backends, x).config == {"warps": 8}
    del cuda.DEFAULT_CONFIG["warps"]
    assert _select(backends, x).config == {}


def test_replacing_a_backend_module_drops_the_cached_choices(fakes, monkeypatch):
    backends, cuda, torch_ = fakes
    x = torch.zeros(1, 8, 4)
    assert _select(backends, x).module is cuda
    other = FakeBackend("mk_demo_cuda_emulated")
    with monkeypatch.context() as patch:
        patch.setitem(backends._loaded, "cuda", other)  # as tests plug in the emulated CUDA backend
        assert _select(backends, x).module is other
    assert _select(backends, x).module is cuda


def test_the_cache_is_bounded(fakes, monkeypatch):
    backends, _, _ = fakes
    monkeypatch.setattr(_dispatch, "MAX_CHOICES", 3)
    for L in range(1, 10):
        _select(backends, torch.zeros(1, L, 4))
    assert len(backends._choices) == 3
    assert _select(backends, torch.zeros(1, 9, 4)) is _select(backends, torch.zeros(1, 9, 4))


def test_use_swaps_a_backend_module_in_and_back_out(fakes):
    backends, cuda, torch_ = fakes
    x = torch.zeros(2, 8, 4)
    other = FakeBackend("mk_demo_swapped")
    assert _select(backends, x, "cuda").module is cuda
    with backends.use("cuda", other, "(swapped in) demo"):
        assert _select(backends, x, "cuda").module is other
        assert backends._modules["cuda"] == "(swapped in) demo"
    assert _select(backends, x, "cuda").module is cuda and backends._modules["cuda"] == cuda.__name__
    with backends.use("triton", other):   # a backend the op did not have is removed again afterwards
        assert _select(backends, x, "triton").module is other
    assert "triton" not in backends._modules and "triton" not in backends._loaded
