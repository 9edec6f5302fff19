"""Autotune tables that outlive the code (docs/design.md, "Autotune", stale entries).

An entry records the candidate set it was measured over. Once an op's registration offers other
candidates (a new backend, knob or value, another default; on CUDA another Triton release), the
entry is stale: lookups pass over it, so ``auto`` falls back to its default order (which puts the
compiled ``cpu`` backend before ``torch``) and says so once in the log; ``show`` and ``verify``
flag it; an entry without the record (tables written before entries carried one) is stale too.
The scenario of issue 28: a table tuned when an op had only ``torch`` pinned ``torch`` after the
op gained a ``cpu`` backend. A cheap fake op, no real kernels.
"""
import json
import logging
import sys
import types

import pytest
import torch

from megalodon_kernels.autotune import cache, registry
from megalodon_kernels.autotune.__main__ import main as cli
from megalodon_kernels.autotune.tuning import tuner

OP = "fake_stale"
OLD_SPACE = {"torch": {"block": [16, 32]}}                 # what the table was tuned over
NEW_SPACE = {"cpu": {}, "torch": {"block": [16, 32]}}      # the release that added a compiled cpu backend
KEY = {"D": 8, "L": 512}
VERSIONS = {"megalodon_kernels": "0.1.0", "torch": "2.13.0", "triton": None, "python": "3.11"}


def key_fn(x):
    return {"D": x.shape[2], "L": registry.pow2_bucket(x.shape[1])}


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return registry.Case(inputs={"x": torch.randn(shape["B"], shape["L"], shape["D"], generator=gen).to(dtype)})


def run(case, backend, config):
    registry.forced(OP, case.inputs)  # what a dispatcher does: consume the forced candidate
    return {"y": 2.0 * case.inputs["x"]}


HARNESS = registry.Harness(make_case=make_case, run=run,
                           reference=lambda c: {"y": 2.0 * c.inputs["x"].double().numpy()}, tolerance={"float32": 1e-6})


def register(space):
    return registry.register(OP, key=key_fn, space=space, harness=HARNESS, replace=True)


@pytest.fixture
def fake_op():
    yield register(OLD_SPACE)
    registry.unregister(OP)


def entry(key, block, *, measured_over=OLD_SPACE, device_type="cpu"):
    """An entry whose winner is torch {"block": block}, measured over ``measured_over`` (None: an
    entry written before entries recorded their candidate set)."""
    ok = {"backend": "torch", "config": {"block": block}, "status": "ok", "note": "", "error": 1e-8,
          "tolerance": 1e-6, "median_s": 1e-3, "p20_s": 9e-4, "p80_s": 1.1e-3, "reps": 5}
    e = {"op": OP, "dtype": "float32", "key": key, "shape": {"B": 2, "L": key["L"], "D": key["D"]},
         "check_shape": {"B": 1, "L": key["L"], "D": key["D"]}, "seed": 0, "date": "2026-01-01T00:00:00Z",
         "winner": {"backend": "torch", "config": {"block": block}}, "default": None, "candidates": [ok]}
    if measured_over is not None:
        e["candidate_set"] = cache.candidate_set(measured_over, device_type)
    return cache.entry_id(OP, "float32", key), e


def write(path, ident, *entries):
    path.write_text(json.dumps({"schema": cache.SCHEMA_VERSION, "device": ident, "versions": VERSIONS,
                                "date": "2026-01-01T00:00:00Z", "entries": dict(entries)}))
    cache.refresh()


def stale_lines(caplog):
    return [r for r in caplog.records
            if r.name == "megalodon_kernels" and "not measured over today's" in r.getMessage()]


def test_entry_measured_over_todays_candidates_is_used(fake_op, autotune_dirs, caplog):
    user, _ = autotune_dirs
    ident = cache.identity("cpu")
    write(user / "t.json", ident, entry(KEY, 32))
    with caplog.at_level(logging.INFO, logger="megalodon_kernels"):
        assert cache.lookup(OP, ident, torch.float32, KEY) == ("torch", {"block": 32})
    assert cache.staleness(dict([entry(KEY, 32)])[cache.entry_id(OP, "float32", KEY)], "cpu") is None
    assert not stale_lines(caplog)


def _fake_backends(monkeypatch):
    from megalodon_kernels.ops._dispatch import OpBackends

    for backend in ("torch", "cpu"):
        mod = types.ModuleType(f"mk_stale_{backend}")
        mod.DEFAULT_CONFIG = {"block": 16} if backend == "torch" else {}
        mod.not_supported_reasons = lambda x: []
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return OpBackends(OP, {"torch": "mk_stale_torch", "cpu": "mk_stale_cpu"})


def test_a_new_candidate_makes_the_old_entry_untrusted(fake_op, autotune_dirs, monkeypatch, caplog):
    user, _ = autotune_dirs
    backends = _fake_backends(monkeypatch)
    write(user / "t.json", cache.identity("cpu"), entry(KEY, 32))
    x = torch.zeros(1, 300, 8)
    choice = backends.select("auto", {"x": x}, device=x.device, dtype=x.dtype)
    assert (choice.name, choice.config) == ("torch", {"block": 32})  # the table's winner over the old set

    register(NEW_SPACE)  # the upgrade: the op now has a cpu backend the table never measured
    with caplog.at_level(logging.INFO, logger="megalodon_kernels"):
        for length in (300, 400, 512):  # same key, the dispatcher's cached choice dropped by the registration
            choice = backends.select("auto", {"x": torch.zeros(1, length, 8)}, device=x.device, dtype=x.dtype)
            assert (choice.name, choice.config) == ("cpu", {})  # default order, not the stale torch pin
            assert cache.lookup(OP, x.device, x.dtype, KEY) is None
            assert cache.lookup(OP, x.device, x.dtype, KEY, backend="torch") is None  # its config is stale too
    lines = stale_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]  # once per (table, op)
    text = lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING  # the user's own table: they can re-tune it
    assert OP in text and "backend cpu added" in text and "t.json" in text
    assert f"regenerate --shapes cpu --ops {OP}" in text

    register(OLD_SPACE)  # back to the set it was measured over: trusted again
    assert cache.lookup(OP, x.device, x.dtype, KEY) == ("torch", {"block": 32})


def test_a_stale_user_entry_falls_through_to_a_fresh_shipped_one(fake_op, autotune_dirs, caplog):
    user, shipped = autotune_dirs
    ident = cache.identity("cpu")
    register(NEW_SPACE)
    write(user / "t.json", ident, entry(KEY, 32, measured_over=OLD_SPACE))
    write(shipped / "t.json", ident, entry(KEY, 16, measured_over=NEW_SPACE),
          entry({"D": 8, "L": 64}, 32, measured_over=OLD_SPACE))
    with caplog.at_level(logging.INFO, logger="megalodon_kernels"):
        assert cache.lookup(OP, ident, torch.float32, KEY) == ("torch", {"block": 16})
        assert cache.lookup(OP, ident, torch.float32, {"D": 8, "L": 64}) is None
    levels = sorted((r.levelno, str(shipped / "t.json") in r.getMessage()) for r in stale_lines(caplog))
    assert levels == [(logging.INFO, True), (logging.WARNING, False)]  # a shipped table: info, not a warning


@pytest.mark.parametrize("new_space, change", [
    ({"torch": {"block": [16, 32, 64]}}, "torch block values [64] added"),
    ({"torch": {"block": [16]}}, "torch block values [32] removed"),
    ({"torch": {"block": [32, 16]}}, "torch block default 16 -> 32"),  # the baseline the tuner compared with
    ({"torch": {"block": [16, 32], "unroll": [1, 2]}}, "torch knob unroll added"),
    ({"torch": {"block": [16, 32]}, "gpu_only": {}}, "backend gpu_only added"),
])
def test_what_counts_as_another_candidate_set(fake_op, new_space, change):
    _, e = entry(KEY, 32)
    assert cache.staleness(e, "cpu") is None
    why = cache.staleness(e, "cpu", registry.Tunable(OP, key_fn, new_space))
    assert why is not None and change in why


def test_backends_that_never_run_on_the_device_type_do_not_count(fake_op):
    # Triton is never timed on CPU and cuda needs CUDA tensors: a CPU table stays valid when they change;
    # on CUDA they count, and the compiled cpu backend does not.
    _, e = entry(KEY, 32)
    grown = registry.Tunable(OP, key_fn, {**OLD_SPACE, "triton": {"warps": [4, 8]}, "cuda": {}})
    assert cache.staleness(e, "cpu", grown) is None
    _, on_gpu = entry(KEY, 32, measured_over=OLD_SPACE, device_type="cuda")
    with_cuda = registry.Tunable(OP, key_fn, {**OLD_SPACE, "cuda": {}})
    assert "backend cuda added" in cache.staleness(on_gpu, "cuda", with_cuda)
    assert cache.staleness(on_gpu, "cuda", registry.Tunable(OP, key_fn, NEW_SPACE)) is None


def test_reordering_values_other_than_the_default_is_the_same_set():
    a = cache.candidate_set({"torch": {"block": [16, 32, 64]}, "cpu": {}}, "cpu")
    b = cache.candidate_set({"cpu": {}, "torch": {"block": [16, 64, 32]}}, "cpu")
    assert a == b
    assert cache.candidate_set({"torch": {"block": [16, 32]}}, "cpu") != cache.candidate_set(
        {"torch": {"block": [16, 32.0]}}, "cpu")  # 32.0 is not the int 32 (a table must match the space exactly)


def test_triton_release_matters_on_cuda_only(fake_op, monkeypatch):
    space = {"torch": {"block": [16, 32]}, "triton": {"warps": [4, 8]}}
    monkeypatch.setattr(cache, "_triton_release", lambda: "3.6")
    _, old = entry(KEY, 32, measured_over=space, device_type="cuda")
    _, old_cpu = entry(KEY, 32, measured_over=space, device_type="cpu")
    assert old["candidate_set"]["versions"] == {"triton": "3.6"} and old_cpu["candidate_set"]["versions"] == {}
    tunable = registry.Tunable(OP, key_fn, space)
    assert cache.staleness(old, "cuda", tunable) is None
    monkeypatch.setattr(cache, "_triton_release", lambda: "3.9")
    cache._today_memo.clear()  # the installed Triton is fixed for a process; this test changes it
    try:
        assert "triton 3.6 -> 3.9" in cache.staleness(old, "cuda", tunable)
        assert cache.staleness(old_cpu, "cpu", tunable) is None  # on CPU Triton is never timed
    finally:
        cache._today_memo.clear()


def test_an_entry_without_a_recorded_candidate_set_is_stale(fake_op, autotune_dirs, capsys):
    user, _ = autotune_dirs
    ident = cache.identity("cpu")
    path = user / cache.table_name(ident)
    write(path, ident, entry(KEY, 32, measured_over=None), entry({"D": 8, "L": 64}, 16))
    assert cache.lookup(OP, ident, torch.float32, KEY) is None
    assert cache.lookup(OP, ident, torch.float32, {"D": 8, "L": 64}) == ("torch", {"block": 16})

    assert cli(["show", "--table", str(path)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "STALE, not used: no candidate set recorded" in out
    assert out.count("STALE, not used") == 1  # the fresh entry is not flagged
    assert "1 of 2 entries are STALE" in out and f"regenerate --shapes cpu --ops {OP}" in out

    assert cli(["verify"]) == 1  # a stale entry is a problem: `auto` does not use what the table says
    out = capsys.readouterr().out
    print(out)
    assert f"STALE {cache.entry_id(OP, 'float32', KEY)}" in out
    assert f"ok   {cache.entry_id(OP, 'float32', {'D': 8, 'L': 64})}" in out  # the fresh one is still checked
    assert "2 entries, 1 problem(s) (1 stale)" in out


def test_show_and_verify_flag_an_entry_after_a_candidate_is_added(fake_op, autotune_dirs, capsys):
    user, _ = autotune_dirs
    ident = cache.identity("cpu")
    write(user / cache.table_name(ident), ident, entry(KEY, 32))
    assert cli(["verify"]) == 0 and "0 problem(s)" in capsys.readouterr().out
    register(NEW_SPACE)
    assert cli(["show"]) == 0
    out = capsys.readouterr().out
    assert "STALE, not used: measured over another candidate set than today's: backend cpu added" in out
    assert cli(["verify"]) == 1 and "(1 stale)" in capsys.readouterr().out


def test_the_tuner_records_todays_candidate_set_and_the_writer_keeps_it(fake_op, tmp_path):
    register(NEW_SPACE)
    _, e = tuner.tune_shape(registry.get(OP), {"B": 1, "L": 40, "D": 8}, torch.float32, "cpu", budget_s=0.001)
    assert e["candidate_set"] == cache.candidate_set(NEW_SPACE, "cpu")
    path = tmp_path / "t.json"
    cache.write_entries(path, cache.identity("cpu"), {cache.entry_id(OP, "float32", e["key"]): e}, VERSIONS)
    (stored,) = cache.read_table(path)["entries"].values()
    assert stored["candidate_set"] == e["candidate_set"] and cache.staleness(stored, "cpu") is None


#: Shipped entries allowed to be stale, entry id -> why (a table of another machine that cannot be
#: re-measured where the space changed).
_H200_TRITON36 = ("measured on an H200 under the GPU image's Triton 3.6 (bench/results/gpu/h200_run2): fresh "
                  "there (checked with the old pair's Triton 3.6), stale under Triton 3.9, whose fftconv "
                  "candidate space adds direct_max_len 64, so auto ignores them there until a 3.9 GPU run")
KNOWN_STALE: dict = {
    "fftconv/bfloat16/D=4096,L=4096,k=float32": _H200_TRITON36,
    "fftconv/bfloat16/D=4096,L=32768,k=float32": _H200_TRITON36,
}


def test_shipped_tables_are_measured_over_todays_candidates():
    # Whoever changes an op's candidates (on the device types a shipped table covers) is told here that
    # those entries will be ignored, and how to re-tune them, instead of nobody noticing.
    from megalodon_kernels.autotune.__main__ import _load_ops

    _load_ops()
    paths = sorted(cache.SHIPPED_DIR.glob("*.json"))
    assert paths, "no shipped tables found"
    for path in paths:
        table = cache.read_table(path)
        device_type = table["device"]["type"]
        stale = {eid: cache.staleness(e, device_type) for eid, e in table["entries"].items()}
        stale = {eid: why for eid, why in stale.items() if why is not None and eid not in KNOWN_STALE}
        assert not stale, (
            f"{path.name}: entries not measured over today's candidates (`auto` ignores them): {stale}. "
            f"On that machine ({table['device']['name']}): python -m megalodon_kernels.autotune regenerate --shapes "
            f"{'cpu' if device_type == 'cpu' else 'h100'} --ops <ops> --out {path}; or list them in KNOWN_STALE")
