"""Autotune infrastructure, exercised with a small fake op (the real ops register themselves).

Covers the autotune contract (docs/design.md, "Autotune"): foreign-device tables ignored; corrupt, truncated, ill-typed and
schema-invalid tables skipped with one warning; concurrent writers all land; out-of-space configs
rejected; batch size and lengths within a bucket share a key (no re-tuning); lookup (and `auto`)
return the table's winner; the tuner checks before it times and a wrong candidate never wins;
the runtime half of the package loads no op and no tuning tool.
"""
import json
import multiprocessing
import subprocess
import sys
import time
import types
import warnings

import numpy as np
import pytest
import torch

from megalodon_kernels.autotune import cache, registry
from megalodon_kernels.autotune.__main__ import main as cli
from megalodon_kernels.autotune.tuning import tuner
from megalodon_kernels.ops._dispatch import NoBackendError

OP = "fake_scale"
IDENT = {"type": "cpu", "name": "Test CPU 9000", "cores": 2}
OTHER = {"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}
VERSIONS = {"megalodon_kernels": "0.1.0", "torch": "2.13.0", "triton": None, "python": "3.11"}
SPACE = {"torch": {"block": [16, 32, 64]}, "cuda": {"warps": [4, 8]}}


def fake_key(x):
    return {"D": x.shape[2], "L": registry.pow2_bucket(x.shape[1])}  # never B, never the raw L


# --- the fake op: y = 2 x; block=32 is fast, block=16 slow, block=64 fast but wrong; cuda broken ------

RUNS = []  # (B, L, backend, config) of every run, to see what the tuner executed


def make_case(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["B"], shape["L"], shape["D"], generator=gen, dtype=torch.float64).to(dtype)
    return registry.Case(inputs={"x": x})


def run(case, backend, config):
    x = case.inputs["x"]
    # What a real op's dispatcher does first: take the candidate the tuner forces, reporting its inputs.
    backend, config = registry.forced(OP, {"x": x})
    RUNS.append((x.shape[0], x.shape[1], backend, dict(config)))
    if backend == "cuda" and config["warps"] == 4:
        raise RuntimeError("kernel launch failed")
    if backend == "cuda":
        raise NoBackendError("fake_scale: cuda cannot run these inputs")
    if config["block"] == 16:
        time.sleep(0.01)
    return {"y": x * (2.5 if config["block"] == 64 else 2.0)}


def reference(case):
    return {"y": 2.0 * case.inputs["x"].double().numpy()}


HARNESS = registry.Harness(make_case=make_case, run=run, reference=reference,
                           tolerance={"float32": 1e-6, "float64": 1e-12},
                           check_shape=lambda s: {**s, "B": 1})


@pytest.fixture
def fake_op():
    RUNS.clear()
    yield registry.register(OP, key=fake_key, space=SPACE, harness=HARNESS, replace=True)
    registry.unregister(OP)


def candidate(backend, config, status="ok", median=1e-3):
    ok = status == "ok"
    return {"backend": backend, "config": config, "status": status, "note": "", "error": 1e-8 if ok else None,
            "tolerance": 1e-6, "median_s": median if ok else None, "p20_s": median * 0.9 if ok else None,
            "p80_s": median * 1.1 if ok else None, "reps": 5 if ok else 0}


def entry(key, winner_config, *, backend="torch", dtype="float32", op=OP, extra=()):
    cands = [candidate(backend, winner_config, median=1e-3), *extra]
    return cache.entry_id(op, dtype, key), {
        "op": op, "dtype": dtype, "key": key, "shape": {"B": 4, **key}, "check_shape": {"B": 1, **key},
        "seed": 0, "date": "2025-01-01T00:00:00Z", "winner": {"backend": backend, "config": winner_config},
        "default": None, "candidates": cands,
        "candidate_set": cache.candidate_set(SPACE, "cpu"),  # measured over today's fake_scale space
    }


def table(ident, *entries):
    return {"schema": cache.SCHEMA_VERSION, "device": ident, "versions": VERSIONS, "date": "2025-01-01T00:00:00Z",
            "entries": dict(entries)}


def dump(path, obj):
    path.write_text(json.dumps(obj))
    cache.refresh()


KEY = {"D": 8, "L": 512}


def test_lookup_returns_the_winner(fake_op, autotune_dirs):
    user, _ = autotune_dirs
    dump(user / "t.json", table(IDENT, entry(KEY, {"block": 32}, extra=[candidate("cuda", {"warps": 8}, median=2e-3)])))
    assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 32})
    assert cache.lookup(OP, IDENT, "float32", KEY) == ("torch", {"block": 32})
    # A forced backend gets the winner's config when the winner is that backend, else its defaults.
    assert cache.lookup(OP, IDENT, torch.float32, KEY, backend="torch") == ("torch", {"block": 32})
    assert cache.lookup(OP, IDENT, torch.float32, KEY, backend="cuda") is None
    # Misses: other dtype, other key, other op.
    assert cache.lookup(OP, IDENT, torch.float64, KEY) is None
    assert cache.lookup(OP, IDENT, torch.float32, {"D": 8, "L": 1024}) is None
    assert cache.lookup("not_registered", IDENT, torch.float32, KEY) is None


def test_user_dir_overrides_shipped(fake_op, autotune_dirs):
    user, shipped = autotune_dirs
    dump(shipped / "t.json", table(IDENT, entry(KEY, {"block": 16}), entry({"D": 8, "L": 64}, {"block": 64})))
    dump(user / "t.json", table(IDENT, entry(KEY, {"block": 32})))
    assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 32})
    assert cache.lookup(OP, IDENT, torch.float32, {"D": 8, "L": 64}) == ("torch", {"block": 64})


def test_foreign_device_table_ignored(fake_op, autotune_dirs):
    user, shipped = autotune_dirs
    dump(user / "gpu.json", table(OTHER, entry(KEY, {"block": 64})))
    dump(user / "other-cpu.json", table({**IDENT, "cores": 64}, entry(KEY, {"block": 64})))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ignored silently: a foreign table is not an error
        assert cache.lookup(OP, IDENT, torch.float32, KEY) is None
    dump(shipped / "mine.json", table(IDENT, entry(KEY, {"block": 16})))
    assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 16})
    states = {p.name: s for p, s, _ in cache.tables_for(IDENT)}
    assert states["gpu.json"].startswith("other device") and states["mine.json"] == "used"


def _good_text():
    return json.dumps(table(IDENT, entry(KEY, {"block": 32})), indent=1)


def _mutated(fn):
    t = json.loads(_good_text())  # a deep copy: the mutation must not reach KEY
    fn(t)
    return json.dumps(t)


def _set(path, value):
    def fn(t):
        obj = t
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = value
    return fn


EID = cache.entry_id(OP, "float32", KEY)
BAD_TABLES = {
    "empty": "",
    "not-json": "{this is not json",
    "truncated": _good_text()[: len(_good_text()) // 2],
    "binary": "\x00\x01\x02",
    "a-list": "[1, 2, 3]",
    "schema-too-new": _mutated(_set(["schema"], 2)),
    "schema-as-string": _mutated(_set(["schema"], "1")),
    "median-as-string": _mutated(_set(["entries", EID, "candidates", 0, "median_s"], "0.001")),
    "reps-as-bool": _mutated(_set(["entries", EID, "candidates", 0, "reps"], True)),
    "negative-time": _mutated(_set(["entries", EID, "candidates", 0, "p20_s"], -1.0)),
    "entries-a-list": _mutated(_set(["entries"], [])),
    "unknown-status": _mutated(_set(["entries", EID, "candidates", 0, "status"], "great")),
    "missing-device": _mutated(lambda t: t.pop("device")),
    "extra-field": _mutated(_set(["pickle"], "gASVAAAAAAAAAAB9lC4=")),
    "winner-not-a-candidate": _mutated(_set(["entries", EID, "winner", "config"], {"block": 16})),
    "id-mismatch": _mutated(lambda t: t["entries"].update({"x/float32/D=8": t["entries"].pop(EID)})),
    "key-with-float": _mutated(_set(["entries", EID, "key", "L"], 512.0)),
    "candidate-set-a-list": _mutated(_set(["entries", EID, "candidate_set"], [])),
    "candidate-values-not-a-list": _mutated(_set(["entries", EID, "candidate_set", "space", "torch", "block"], 16)),
    # a space edited by hand whose fingerprint still claims to be another set's
    "candidate-set-fingerprint-forged": _mutated(_set(["entries", EID, "candidate_set", "space", "torch", "block"],
                                                      [16, 32])),
    "nan-time": _good_text().replace('"median_s": 0.001', '"median_s": NaN'),
    "duplicate-names": _good_text().replace('"op": "fake_scale"', '"op": "fake_scale", "op": "fake_scale"'),
}


@pytest.mark.parametrize("name", list(BAD_TABLES))
def test_bad_table_skipped_with_one_warning(fake_op, autotune_dirs, name):
    user, shipped = autotune_dirs
    (user / "bad.json").write_text(BAD_TABLES[name])
    dump(shipped / "good.json", table(IDENT, entry(KEY, {"block": 16})))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            # The bad file never wins over the shipped table it would override, and never raises.
            assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 16})
            cache.refresh()
    ours = [w for w in seen if issubclass(w.category, cache.AutotuneWarning)]
    print([str(w.message) for w in ours])
    assert len(ours) == 1 and "bad.json" in str(ours[0].message)


def test_valid_table_passes_validation():
    cache.validate(json.loads(_good_text()))


@pytest.mark.parametrize("config", [
    {"block": 48},                 # not an allowed value
    {"block": 32.0},               # a float where the space says int
    {"block": True},               # a bool is not the int 1
    {"block": 32, "unroll": 2},    # a knob the space does not declare
    {},                            # a knob missing
], ids=["value", "float-for-int", "bool", "extra-knob", "missing-knob"])
def test_out_of_space_config_rejected(fake_op, autotune_dirs, config):
    user, shipped = autotune_dirs
    dump(user / "t.json", table(IDENT, entry(KEY, config)))
    dump(shipped / "t.json", table(IDENT, entry(KEY, {"block": 16})))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # The user entry is rejected; the shipped entry for the same key is used instead.
        assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 16})
        assert cache.lookup(OP, IDENT, torch.float32, KEY) == ("torch", {"block": 16})
    assert len([w for w in seen if "rejecting entry" in str(w.message)]) == 1


def test_unknown_backend_in_table_rejected(fake_op, autotune_dirs):
    user, _ = autotune_dirs
    dump(user / "t.json", table(IDENT, entry(KEY, {"block": 32}, backend="triton")))
    with pytest.warns(cache.AutotuneWarning, match="not declared"):
        assert cache.lookup(OP, IDENT, torch.float32, KEY) is None


def _writer(path, worker, count):
    # Runs in a child process: no torch work, only the cache's read-merge-write under the lock.
    for i in range(count):
        eid, e = entry({"D": worker, "L": 1 << i}, {"block": 32})
        cache.write_entries(path, IDENT, {eid: e}, VERSIONS)


def test_concurrent_writers_all_land(tmp_path):
    path = tmp_path / "shared" / "table.json"
    workers, count = 4, 8
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w + 1, count)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    final = cache.read_table(path)  # valid JSON, valid schema
    assert len(final["entries"]) == workers * count
    assert sorted(p.name for p in path.parent.iterdir()) == [cache.LOCK_NAME, "table.json"]  # no temp files left


def test_write_refuses_other_device_and_drops_stale_versions(tmp_path):
    path = tmp_path / "t.json"
    cache.write_entries(path, IDENT, dict([entry(KEY, {"block": 32})]), VERSIONS)
    with pytest.raises(cache.TableError, match="holds measurements of"):
        cache.write_entries(path, OTHER, dict([entry(KEY, {"block": 32})]), VERSIONS)
    other_key = {"D": 8, "L": 64}
    cache.write_entries(path, IDENT, dict([entry(other_key, {"block": 16})]), {**VERSIONS, "torch": "9.9"})
    assert list(cache.read_table(path)["entries"]) == [cache.entry_id(OP, "float32", other_key)]


# --- keys ----------------------------------------------------------------------------------------------

def test_pow2_bucket():
    assert [registry.pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 2048, 2049, 4096)] == [0, 1, 2, 4, 4, 8, 2048, 4096,
                                                                                        4096]
    with pytest.raises(ValueError):
        registry.pow2_bucket(-1)


def test_register_validates():
    with pytest.raises(TypeError):
        registry.register("bad op", key=lambda x: {}, space={"torch": {}})
    with pytest.raises(TypeError):
        registry.register("x1", key=lambda x: {}, space={"torch": {"block": []}})
    with pytest.raises(ValueError):
        registry.register("x2", key=lambda x: {}, space={"torch": {"block": [1, 1]}})
    assert registry.get("x1") is None and registry.get("x2") is None


def test_candidates_and_defaults(fake_op):
    assert fake_op.candidates() == [("torch", {"block": 16}), ("torch", {"block": 32}), ("torch", {"block": 64}),
                                    ("cuda", {"warps": 4}), ("cuda", {"warps": 8})]
    assert fake_op.default_config("torch") == {"block": 16}


# --- the tuner -----------------------------------------------------------------------------------------

SHAPES = [{"B": 2, "L": 300, "D": 8}, {"B": 7, "L": 500, "D": 8}, {"B": 1, "L": 600, "D": 8}]


def test_tuner_checks_before_timing_and_wrong_never_wins(fake_op):
    lines = []
    eid, e = tuner.tune_shape(fake_op, SHAPES[0], torch.float32, "cpu", budget_s=0.02,
                              priority=("cuda", "triton", "torch"), progress=lines.append)
    print("\n".join(lines))
    cache.validate(table(IDENT, (eid, e)))
    status = {(c["backend"], tuple(c["config"].values())): c for c in e["candidates"]}
    assert status[("torch", (64,))]["status"] == "wrong" and status[("torch", (64,))]["median_s"] is None
    assert status[("torch", (64,))]["error"] == pytest.approx(0.25)
    assert status[("cuda", (4,))]["status"] == "failed" and "launch failed" in status[("cuda", (4,))]["note"]
    assert status[("cuda", (8,))]["status"] == "unsupported"
    assert status[("torch", (16,))]["status"] == status[("torch", (32,))]["status"] == "ok"
    assert e["winner"] == {"backend": "torch", "config": {"block": 32}}
    assert e["default"] == {"backend": "cuda", "config": {"warps": 4}}  # first supported in priority order
    # The check ran on the check shape (B=1), timing on the full shape (B=2); wrong ones were never timed.
    assert all(b == 1 for b, _, backend, cfg in RUNS if cfg == {"block": 64})
    assert any(b == 2 for b, _, _, cfg in RUNS if cfg == {"block": 32})


def test_same_bucket_is_not_tuned_again(fake_op, autotune_dirs):
    user, _ = autotune_dirs
    entries = tuner.tune_op(OP, SHAPES, [torch.float32], "cpu", budget_s=0.01)
    # L=300 and L=500 share the bucket 512 (and B differs): one entry; L=600 is the bucket 1024.
    assert set(entries) == {cache.entry_id(OP, "float32", {"D": 8, "L": 512}),
                            cache.entry_id(OP, "float32", {"D": 8, "L": 1024})}
    assert not any(b == 7 for b, *_ in RUNS), "the second shape of the bucket was tuned again"
    ident = cache.identity("cpu")
    cache.write_entries(user / cache.table_name(ident), ident, entries, VERSIONS)
    # Any batch size and any L in the bucket finds the same winner.
    for B, L in [(1, 257), (3, 300), (64, 512)]:
        case = fake_op.harness.make_case({"B": B, "L": L, "D": 8}, torch.float32, "cpu", 0)
        assert cache.lookup(OP, "cpu", torch.float32, fake_op.key(case.inputs)) == ("torch", {"block": 32})
    # Already-tuned keys can be skipped entirely.
    RUNS.clear()
    assert tuner.tune_op(OP, SHAPES, [torch.float32], "cpu", budget_s=0.01, skip=set(entries)) == {}
    assert RUNS == []


@pytest.mark.parametrize("other, winner", [
    ([4e-3, 6e-3, 7e-3, 8e-3, 10e-3], 32),  # lower p20 than the default, but overlapping: noise
    ([1e-3, 1e-3, 2e-3, 2e-3, 3e-3], 64),   # every run faster than every default run: a real win
])
def test_default_kept_unless_significantly_beaten(monkeypatch, other, winner):
    space = {"torch": {"block": [32, 64]}}

    def same(case, backend, config):
        registry.forced(OP, case.inputs)
        return {"y": 2.0 * case.inputs["x"]}

    def fake_timer(fns, device, **_):
        samples = {0: [5e-3, 6e-3, 7e-3, 8e-3, 9e-3], 1: other}  # candidate 0 is the default (block 32)
        return {i: tuner.Timing.of(samples[i]) for i in fns}, {}

    monkeypatch.setattr(tuner, "time_interleaved", fake_timer)
    harness = registry.Harness(make_case, same, reference, HARNESS.tolerance)
    tunable = registry.register(OP, key=fake_key, space=space, harness=harness, replace=True)
    try:
        _, e = tuner.tune_shape(tunable, SHAPES[0], torch.float32, "cpu")
    finally:
        registry.unregister(OP)
    assert e["default"] == {"backend": "torch", "config": {"block": 32}}
    assert e["winner"] == {"backend": "torch", "config": {"block": winner}}


def test_significance_test():
    assert tuner.significantly_faster([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # complete separation, 5 + 5
    assert not tuner.significantly_faster([1, 2, 3, 4, 6], [5, 7, 8, 9, 10])  # one overlap is not enough
    assert not tuner.significantly_faster([6, 7, 8, 9, 10], [1, 2, 3, 4, 5])
    rng = np.random.default_rng(0)
    same = [tuner.significantly_faster(rng.normal(size=20), rng.normal(size=20)) for _ in range(300)]
    assert sum(same) <= 9  # about 1% false positives expected
    assert tuner.significantly_faster(rng.normal(size=40), rng.normal(size=40) + 1.0)


def test_triton_is_never_timed_on_cpu():
    # The Triton interpreter is a test vehicle on CPU: the tuner prunes it, like the dispatcher skips it.
    space = {"triton": {"block": [16]}, "torch": {"block": [16, 32]}}
    tunable = registry.register(OP, key=fake_key, space=space, harness=HARNESS, replace=True)
    try:
        _, e = tuner.tune_shape(tunable, SHAPES[0], torch.float32, "cpu", budget_s=0.01,
                                priority=("cuda", "triton", "torch"))
    finally:
        registry.unregister(OP)
    assert [c["status"] for c in e["candidates"]] == ["pruned", "ok", "ok"]
    assert e["default"] == {"backend": "torch", "config": {"block": 16}}


def test_verify_entry(fake_op):
    eid, e = tuner.tune_shape(fake_op, SHAPES[0], torch.float32, "cpu", budget_s=0.01)
    assert tuner.verify_entry(e, "cpu")[0]
    bad = {**e, "winner": {"backend": "torch", "config": {"block": 64}}}
    ok, message = tuner.verify_entry(bad, "cpu")
    assert not ok and "tolerance" in message


def test_rel_error_nan_is_inf():
    assert tuner.rel_error({"y": torch.tensor([1.0, float("nan")])}, {"y": np.array([1.0, 2.0])}) == float("inf")
    assert tuner.rel_error({"y": torch.tensor([1.0, 2.5])}, {"y": np.array([1.0, 2.0])}) == pytest.approx(0.25)


def test_force_must_be_consumed(fake_op):
    with pytest.raises(RuntimeError, match="never consulted"):
        with registry.force(OP, "torch", {"block": 32}):
            pass
    with registry.force(OP, "torch", {"block": 32}) as seen:
        assert registry.forced("other_op") is None
        assert registry.forced(OP, {"x": torch.zeros(3, 300, 8)}) == ("torch", {"block": 32})
    assert seen.keys == [{"D": 8, "L": 512}]
    assert registry.forced(OP) is None


def test_harness_whose_inputs_drift_from_the_dispatch_is_refused(fake_op):
    def run_other_length(case, backend, config):
        registry.forced(OP, {"x": case.inputs["x"][:, :100]})  # the op would dispatch on another L
        return {"y": 2 * case.inputs["x"]}

    drifting = registry.Harness(make_case, run_other_length, reference, HARNESS.tolerance)
    tunable = registry.register(OP, key=fake_key, space=SPACE, harness=drifting, replace=True)
    with pytest.raises(tuner.HarnessError, match="dispatched on"):
        tuner.tune_shape(tunable, SHAPES[0], torch.float32, "cpu", budget_s=0.01)


# --- the dispatcher and the CLI ---------------------------------------------------------------------------

def test_auto_picks_the_table_winner(fake_op, autotune_dirs, monkeypatch):
    from megalodon_kernels.ops._dispatch import OpBackends

    for backend in ("torch", "cuda"):
        mod = types.ModuleType(f"mk_fake_{backend}")
        mod.DEFAULT_CONFIG = dict(registry.get(OP).default_config(backend))
        mod.not_supported_reasons = lambda x: []
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    backends = OpBackends(OP, {"torch": "mk_fake_torch", "cuda": "mk_fake_cuda"})
    user, _ = autotune_dirs
    ident = cache.identity("cpu")
    dump(user / "t.json", table(ident, entry(KEY, {"block": 32})))
    x = torch.zeros(1, 512, 8)
    inputs = {"x": x}
    choice = backends.select("auto", inputs, device=x.device, dtype=x.dtype)
    assert (choice.name, choice.config) == ("torch", {"block": 32})  # priority alone would pick cuda
    choice = backends.select("auto", {"x": torch.zeros(1, 512, 16)}, device=x.device, dtype=x.dtype)
    assert (choice.name, choice.config) == ("cuda", {"warps": 4})  # no entry: priority list, defaults
    with registry.force(OP, "torch", {"block": 64}):
        choice = backends.select("auto", inputs, device=x.device, dtype=x.dtype)
    assert (choice.name, choice.config) == ("torch", {"block": 64})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("shape_set", ["a100", "h100"])
def test_gpu_set_refused_without_gpu(shape_set, autotune_dirs, capsys):
    assert cli(["regenerate", "--shapes", shape_set]) == 2
    out = capsys.readouterr().out
    assert "refusing" in out and "CUDA GPU" in out
    assert not any(autotune_dirs[0].iterdir())


def test_shape_sets():
    from megalodon_kernels.autotune.shapes import SHAPE_SETS

    a100 = SHAPE_SETS["a100"]
    assert a100.shapes("attention")[1] == {"B": 1, "L": 32768, "H": 4, "dh": 256, "dv": 2048, "chunk": 4096}
    assert a100.shapes("dropkey_softmax")[1] == {"B": 8, "H": 4, "L": 4096, "S": 4096}
    assert [s["B"] for s in a100.shapes("fftconv")] == [4, 1]  # 16K tokens per GPU, at least one sequence
    assert SHAPE_SETS["cpu"].device_type == "cpu" and SHAPE_SETS["h100"].device_type == "cuda"


def test_rel_error_of_a_part():
    out = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    part = registry.Part((slice(None), np.array([0, 2])), np.array([[1.0, 3.0], [4.0, 6.6]]))
    assert tuner.rel_error({"y": out}, {"y": part}) == pytest.approx(0.6 / 6.6)


def test_interleaved_timing_cuts_hopeless_candidates_and_records_failures():
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(0.005)

    def broken():
        raise RuntimeError("out of shared memory")

    timings, failures = tuner.time_interleaved({"fast": fast, "slow": slow, "broken": broken}, "cpu", budget_s=0.01)
    assert set(timings) == {"fast", "slow"} and isinstance(failures["broken"], RuntimeError)
    assert timings["slow"].reps == 2 and timings["slow"].median_s >= 0.005  # cut after two rounds
    assert timings["fast"].reps >= 5 and timings["fast"].p20_s <= timings["fast"].median_s <= timings["fast"].p80_s


# --- end to end with the real rotary op ------------------------------------------------------------

def test_rotary_regenerate_show_verify_clear(autotune_dirs, capsys, monkeypatch):
    from megalodon_kernels.autotune import shapes
    from megalodon_kernels.ops import rotary  # noqa: F401  (registers the op)

    rotary_registered = registry.get("rotary")
    assert rotary_registered is not None and rotary_registered.harness is None  # the tuner finds its module
    user, _ = autotune_dirs
    small = shapes.ShapeSet("cpu", "cpu", D=8, N=2, G=2, H=2, dz=8, dv=8, chunk=16, lengths=(24, 31), tokens=48,
                            dtypes=("float32",))
    monkeypatch.setitem(shapes.SHAPE_SETS, "cpu", small)
    assert cli(["regenerate", "--shapes", "cpu", "--ops", "rotary", "--budget", "0.01"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "key rotary/float32/H=2,L=32,d=8" in out and "already tuned, skipped" in out  # L=24 and 31: one bucket
    path = user / cache.table_name(cache.identity("cpu"))
    tab = cache.read_table(path)
    assert list(tab["entries"]) == ["rotary/float32/H=2,L=32,d=8"]
    x = torch.randn(5, 17, 2, 8)  # another batch and length, same bucket
    assert cache.lookup("rotary", x.device, x.dtype, rotary_registered.key({"x": x})) == ("torch", {})
    assert cli(["show"]) == 0 and "W" in capsys.readouterr().out
    assert cli(["verify"]) == 0 and "0 problem(s)" in capsys.readouterr().out
    assert cli(["clear"]) == 0 and not path.exists()


# --- layering ------------------------------------------------------------------------------------------

def test_runtime_modules_load_no_op_no_tuning_tool_no_reference():
    # A fresh interpreter: what the runtime modules pull in, not what this test session already holds.
    code = ("import sys\n"
            "from megalodon_kernels.autotune import cache, device, registry\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('megalodon_kernels'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    print(loaded)
    assert "megalodon_kernels.autotune.cache" in loaded  # the probe imported what it meant to
    forbidden = ("megalodon_kernels.ops", "megalodon_kernels.autotune.tuning", "megalodon_kernels.reference",
                 "megalodon_kernels.bench", "megalodon_kernels.model")
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"the autotune runtime imported {bad}"


def test_the_tuner_finds_a_real_ops_harness_by_name_and_explains_a_missing_one():
    from megalodon_kernels.autotune.tuning.harness import rotary as rotary_harness
    from megalodon_kernels.ops import rotary  # noqa: F401  (registers the op)

    assert tuner.harness_for(registry.get("rotary")) is rotary_harness.HARNESS
    orphan = registry.register("orphan_op", key=fake_key, space={"torch": {}})
    try:
        with pytest.raises(LookupError, match="orphan_op has no tuning harness"):
            tuner.harness_for(orphan)
    finally:
        registry.unregister("orphan_op")


def test_register_takes_a_harness_object_not_a_module_path():
    with pytest.raises(TypeError, match="must be a Harness"):
        registry.register("by_path", key=fake_key, space={"torch": {}},
                          harness="megalodon_kernels.autotune.tuning.harness.rotary")
    assert registry.get("by_path") is None


def test_registration_changes_the_cache_version():
    before = cache.version()
    registry.register("versioned_op", key=fake_key, space={"torch": {}})
    registered = cache.version()
    registry.unregister("versioned_op")
    assert len({before, registered, cache.version()}) == 3
    cache.refresh()
    assert cache.version() != registered
