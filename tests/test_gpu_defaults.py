"""``auto`` on a GPU with no autotune table: the backend order the GPU runs measured
(autotune/gpu_defaults.py over the committed autotune/gpu_defaults.json).

* The committed file is what autotune/derive_defaults.py derives from the committed results (so
  neither can drift from the other), and at every measured point it ranks first the backend
  measured fastest there among those timed (never one measured slower than another able one).
* The ranking: the nearest point where a pair was timed decides the pair; dtype counts; a pair
  never timed together keeps the fixed priority; no points, no ranking.
* The dispatcher takes the ranking on a CUDA device, a table entry before it, and never on CPU.
"""
import json
import sys
import types

import pytest
import torch

from megalodon_kernels.autotune import derive_defaults, gpu_defaults
from megalodon_kernels.cuda import device as cuda_device
from megalodon_kernels.ops._dispatch import ENV_VAR, PRIORITY, OpBackends


class Shaped:
    """A dispatch input with only a shape (what gpu_defaults.features reads)."""

    def __init__(self, *shape):
        self.shape = shape


def _inputs(op, rows, L):
    """Dispatch inputs of ``op`` whose features are (rows, L) (rows = B * D, B = 1)."""
    if op == "cema_kernel":
        return {"p": Shaped(rows, 16), "length": L, "hx": None}
    if op == "timestep_norm":
        return {"x": Shaped(1, L, rows)}
    if op in ("attention", "rotary"):
        return {"q" if op == "attention" else "x": Shaped(1, L, rows, 64)}
    if op == "dropkey_softmax":
        return {"scores": Shaped(rows, 1, L, L)}
    return {"x": Shaped(1, rows, L)}


def test_committed_file_is_derived_from_the_committed_results():
    derived = derive_defaults.derive(derive_defaults.sources_under(derive_defaults.RESULTS))
    assert json.loads(gpu_defaults.PATH.read_text()) == json.loads(json.dumps(derived))
    assert derived["classes"]["sm_90"]["cema"], "the H100/H200 runs timed cema"


def test_at_every_measured_point_the_fastest_there_comes_first():
    data = gpu_defaults.table()
    checked = 0
    for device_class, ops in data["classes"].items():
        for op, points in ops.items():
            for p in points:
                able = [b for b in PRIORITY if b in p["ms"]]
                ranked = gpu_defaults.rank(op, device_class, p["dtype"], _inputs(op, p["rows"], p["L"]), able)
                if len(able) < 2:
                    continue
                fastest = min(able, key=lambda b: p["ms"][b])
                assert ranked[0] == fastest, (device_class, op, p)
                checked += 1
    assert checked >= 15


def test_the_measured_facts_behind_the_defaults():
    # the H200 run (7B shapes, bf16): torch's cuFFT fftconv beat the CUDA one; the H100 probe (B2
    # D256 L4096 fp32): the CUDA one beat torch; cema at the probe shape goes to the composed CUDA
    # cema (its stages measured faster than torch's cema at the nearest shape both were timed)
    rank = lambda op, dt, rows, L, able: gpu_defaults.rank(op, "sm_90", dt, _inputs(op, rows, L), able)  # noqa: E731
    assert rank("fftconv", "bfloat16", 4 * 4096, 4096, ["cuda", "triton", "torch"])[0] == "torch"
    assert rank("fftconv", "float32", 2 * 256, 4096, ["cuda", "triton", "torch"])[0] == "cuda"
    assert rank("cema", "float32", 2 * 256, 4096, ["cuda", "torch"])[0] == "cuda"
    assert rank("cema", "float32", 2 * 256, 4096, ["cuda", "triton", "torch"])[0] == "cuda"
    assert rank("cema", "bfloat16", 4096, 32768, ["cuda", "torch"])[0] == "torch"


DATA = {"classes": {"sm_90": {"fftconv": [
    {"dtype": "float32", "rows": 16, "L": 1024, "ms": {"cuda": 1.0, "torch": 2.0}},
    {"dtype": "float32", "rows": 4096, "L": 1024, "ms": {"cuda": 3.0, "torch": 2.0}},
    {"dtype": "bfloat16", "rows": 16, "L": 1024, "ms": {"cuda": 3.0, "torch": 2.0}},
    {"dtype": "float32", "rows": 16, "L": 1024, "ms": {"triton": 5.0, "torch": 6.0}},
]}}}


def _rank(dtype, rows, L, able=("cuda", "triton", "torch"), device_class="sm_90", op="fftconv"):
    return gpu_defaults.rank(op, device_class, dtype, _inputs(op, rows, L), list(able), DATA)


def test_the_nearest_point_where_a_pair_was_timed_decides_it():
    assert _rank("float32", 16, 1024, ("cuda", "torch")) == ["cuda", "torch"]
    assert _rank("float32", 4096, 1024, ("cuda", "torch")) == ["torch", "cuda"]
    assert _rank("float32", 32, 2048, ("cuda", "torch")) == ["cuda", "torch"]       # nearer the first
    assert _rank("float32", 2048, 1024, ("cuda", "torch")) == ["torch", "cuda"]     # nearer the second
    # a dtype mismatch counts: bf16 at 16 rows takes the bf16 point (same rows), not the float32 one
    assert _rank("bfloat16", 16, 1024, ("cuda", "torch")) == ["torch", "cuda"]
    assert _rank("float32", 16, 1024, ("cuda", "torch")) == ["cuda", "torch"]


def test_pairs_never_timed_together_keep_the_priority_order():
    # cuda beats torch, triton beats torch, cuda and triton never met: cuda (priority) first
    assert _rank("float32", 16, 1024) == ["cuda", "triton", "torch"]
    # without cuda able: triton, then torch
    assert _rank("float32", 16, 1024, ("triton", "torch")) == ["triton", "torch"]


def test_no_points_no_ranking():
    assert _rank("float32", 16, 1024, device_class="sm_80") is None        # a class never measured
    assert _rank("float32", 16, 1024, op="cema") is None                   # an op never measured there
    assert _rank("float32", 16, 1024, ("cuda",)) is None                   # one backend: nothing to order
    assert gpu_defaults.rank("fftconv", "sm_90", "float32", {"y": 1}, ["cuda", "torch"], DATA) is None


class FakeBackend(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.DEFAULT_CONFIG = {}

    def not_supported_reasons(self, x, **_):
        return []


DEMO = "fftconv_defaults_demo"


@pytest.fixture
def fake_op(monkeypatch):
    """An op (named as fftconv for the features) over fake cuda / torch backends that take anything,
    the defaults of DATA, and an H100 profile for the CUDA device."""
    mods = {b: FakeBackend(f"mk_defaults_{b}") for b in ("cuda", "torch")}
    for mod in mods.values():
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delenv(ENV_VAR, raising=False)
    demo = {"classes": {"sm_90": {DEMO: DATA["classes"]["sm_90"]["fftconv"]}}}
    monkeypatch.setattr(gpu_defaults, "table", lambda: demo)
    with cuda_device.faked("H100"):
        yield OpBackends(DEMO, {b: m.__name__ for b, m in mods.items()})


def _features_as_fftconv(monkeypatch):
    real = gpu_defaults.features
    monkeypatch.setattr(gpu_defaults, "features",
                        lambda op, inputs: real("fftconv" if op == DEMO else op, inputs))


def test_dispatch_takes_the_measured_order_on_a_cuda_device(fake_op, monkeypatch):
    _features_as_fftconv(monkeypatch)
    x_small, x_wide = torch.zeros(1, 16, 1024), torch.zeros(1, 4096, 1024)
    cuda = torch.device("cuda")
    assert fake_op.select("auto", {"x": x_small}, device=cuda, dtype=torch.float32).name == "cuda"
    assert fake_op.select("auto", {"x": x_wide}, device=cuda, dtype=torch.float32).name == "torch"
    # on CPU tensors the measured GPU order is not used: the fixed priority (cuda first) applies
    assert fake_op.select("auto", {"x": x_wide}, device=torch.device("cpu"), dtype=torch.float32).name == "cuda"
    # a named backend is never overridden
    assert fake_op.select("cuda", {"x": x_wide}, device=cuda, dtype=torch.float32).name == "cuda"


def test_a_pair_timed_at_the_call_outweighs_pairs_timed_far_away():
    # cuda beats triton and triton beats torch at L 1024 only, torch beats cuda at the call's own
    # point: unweighted votes tie all three (a cycle) and the fixed priority would put cuda first
    data = {"classes": {"sm_90": {"fftconv": [
        {"dtype": "bfloat16", "rows": 16384, "L": 4096, "ms": {"cuda": 8.3, "torch": 6.6}},
        {"dtype": "bfloat16", "rows": 8192, "L": 1024, "ms": {"cuda": 1.29, "triton": 1.34, "torch": 1.37}},
    ]}}}
    order = gpu_defaults.rank("fftconv", "sm_90", "bfloat16", _inputs("fftconv", 16384, 4096),
                              ["cuda", "triton", "torch"], data)
    assert order[0] == "torch"
