"""Test-wide setup: interpreter mode, seeds, NaN-poisoned allocations, hypothesis profiles.

NaN poisoning (FLA's trick): every ``torch.empty*`` allocation made while a test runs is filled
with NaN (floating and complex dtypes), so a kernel or launcher that forgets to write part of
its output fails loudly instead of passing on zero-initialised memory.
"""
import os
import random
import shutil

# Must precede any triton import: Triton kernels run on CPU tensors in the interpreter, and
# fp fusion is pinned so numerics do not change with Triton's default (docs/verification.md).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# tl.dot in the interpreter rounds like the GPU's tensor cores (tests/device_model.py); on for every test
pytest_plugins = ["device_model"]

settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", max_examples=25, deadline=None, print_blob=True)
settings.register_profile("stress", max_examples=300, deadline=None, print_blob=True)
# fresh random examples, nothing replayed from an example database: .ci/random_properties.sh runs
# every property test (marker "property") under this profile with a few printed seeds
settings.register_profile("random", max_examples=3, deadline=None, print_blob=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", default=False,
                     help="run the stress tests at full size and hypothesis with 300 examples per property "
                          "(default: the bounded form CI runs)")


def pytest_configure(config):
    if config.getoption("--stress"):
        settings.load_profile("stress")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small-tensor tests: with a second (busy) core, intra-op
    threading only adds waits. Used with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def stress(request) -> bool:
    """True under ``--stress``: tests marked ``stress`` then run their full-size cases; by default
    (and in CI) they run a bounded form of the same check."""
    return request.config.getoption("--stress")

_POISON = {
    "empty": torch.empty,
    "empty_like": torch.empty_like,
    "empty_strided": torch.empty_strided,
}


def _poisoned(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point() or t.is_complex():
            t.detach().fill_(float("nan"))  # detach: torch 2.11's checkpoint allocates a leaf that requires grad
        return t

    return make


@pytest.fixture(autouse=True)
def _seed_and_poison(monkeypatch):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    for name, factory in _POISON.items():
        monkeypatch.setattr(torch, name, _poisoned(factory))
    orig_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(orig_new_empty))
    yield


#: tests that check something over the whole session and so must run last
RUN_LAST = ("test_every_kernel_ran_in_the_emulator",)


def pytest_collection_modifyitems(session, config, items):
    for item in items:   # every hypothesis test is a property test: -m property selects them all
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
    items.sort(key=lambda item: item.originalname in RUN_LAST)  # stable: everything else keeps its order


# --- the CPU SIMT emulator of the CUDA kernels ----------------------------------------------------

#: why a test of the CUDA kernels cannot run here (None: it can)
NO_EMULATOR = (None if shutil.which(os.environ.get("CXX", "g++")) else
               "the CUDA emulator extension needs a C++ compiler (g++ or $CXX)")


@pytest.fixture(scope="module")
def ext():
    """The emulator extension (built from cuda/*.cu on first use, cached); fiber order reset after."""
    from megalodon_kernels.cuda import build

    if NO_EMULATOR:
        pytest.skip(NO_EMULATOR)
    mod = build.load_emulator()
    yield mod
    mod.emulator_set_reverse(-1)


@pytest.fixture(params=[0, 1], ids=["natural", "reversed"])
def order(request, ext):
    """Run a test in both fiber orders: a missing barrier shows in one of them (docs/verification.md)."""
    ext.emulator_set_reverse(request.param)
    yield request.param
    ext.emulator_set_reverse(-1)


@pytest.fixture(scope="module")
def emulated():
    """Every op's CUDA backend (the classes of ops/<op>/cuda_impl.py) over the emulator extension,
    by op name; a test module may override it with the few it needs."""
    from megalodon_kernels.cuda import build
    from megalodon_kernels.cuda.launch import EmulatorLauncher
    from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
    from megalodon_kernels.ops.cema import cuda_impl as cema_layer_cuda
    from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda
    from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda
    from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda
    from megalodon_kernels.ops.fftconv import cuda_impl as fftconv_cuda
    from megalodon_kernels.ops.rotary import cuda_impl as rotary_cuda
    from megalodon_kernels.ops.timestep_norm import cuda_impl as timestep_norm_cuda

    if NO_EMULATOR:
        pytest.skip(NO_EMULATOR)
    launcher = EmulatorLauncher(build.load_emulator())
    by_name = lambda: launcher  # noqa: E731  (each op's launch description runs in the emulator)
    return {
        "attention": attention_cuda.AttentionBackend(by_name, "cpu"),
        "cema": cema_layer_cuda.CemaBackend(by_name, "cpu"),
        "cema_kernel": cema_cuda.CemaKernelBackend(by_name, "cpu"),
        "dropkey_softmax": dropkey_cuda.DropKeySoftmaxBackend(by_name, "cpu"),
        "ema_hidden": hidden_cuda.EmaHiddenBackend(by_name, "cpu"),
        "fftconv": fftconv_cuda.FftconvBackend(by_name, "cpu"),
        "rotary": rotary_cuda.RotaryBackend(by_name, "cpu"),
        "timestep_norm": timestep_norm_cuda.TimestepNormBackend(by_name, "cpu"),
    }


@pytest.fixture(autouse=True)
def _cuda_backend_runs_in_the_emulator(request):
    """A test parametrised with ``backend="cuda"`` runs the CUDA backend in the emulator
    (:func:`use_emulated_cuda`); skipped only where the emulator cannot be built."""
    callspec = getattr(request.node, "callspec", None)
    if request.node.get_closest_marker("gpu") is not None:
        return  # tests/test_gpu.py: "cuda" is the real backend on a real device, never the emulator
    if callspec is not None and callspec.params.get("backend") == "cuda":
        if NO_EMULATOR:
            pytest.skip(NO_EMULATOR)
        request.getfixturevalue("use_emulated_cuda")


@pytest.fixture
def use_emulated_cuda(emulated, monkeypatch):
    """Plug the test module's ``emulated`` backends ({op: its cuda_impl.py class over the emulator})
    into each op's dispatcher as backend "cuda", for the test's duration; returns them."""
    import importlib

    for op, impl in emulated.items():
        backends = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
        monkeypatch.setitem(backends._modules, "cuda", f"(emulated) megalodon_kernels.ops.{op}.cuda_impl")
        monkeypatch.setitem(backends._loaded, "cuda", impl)
    return emulated


@pytest.fixture(scope="session", autouse=True)
def _record_emulator_launches():
    """Every emulator extension the session loads records what its launchers launched (read by
    tests/test_cuda_kernels.py::test_every_kernel_ran_in_the_emulator)."""
    from megalodon_kernels.cuda import build

    load = build.load_emulator

    def load_recording(*args, **kwargs):
        mod = load(*args, **kwargs)
        if not hasattr(mod, "launch_log"):
            _record_launches(mod)
        return mod

    build.load_emulator = load_recording
    yield
    build.load_emulator = load


def _record_launches(mod):
    """Wrap the extension's functions so every call appends (function, args, kwargs, kernels) to
    ``mod.launch_log``; ``kernels`` are the MK_LAUNCH names of the launches it made, in order,
    read from the emulator's per-launch profile line (MK_EMU_PROFILE=1) on stderr. Together with
    the call's dtype codes they name the template instantiation that ran."""
    import tempfile

    mod.launch_log = []
    sink = tempfile.TemporaryFile()

    def recording(name, fn):
        def call(*args, **kwargs):
            fd = sink.fileno()
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            saved_env = os.environ.get("MK_EMU_PROFILE")
            saved_fd = os.dup(2)
            os.environ["MK_EMU_PROFILE"] = "1"
            os.dup2(fd, 2)
            try:
                return fn(*args, **kwargs)
            finally:
                os.dup2(saved_fd, 2)
                os.close(saved_fd)
                if saved_env is None:
                    del os.environ["MK_EMU_PROFILE"]
                else:
                    os.environ["MK_EMU_PROFILE"] = saved_env
                os.lseek(fd, 0, os.SEEK_SET)
                lines = sink.read().decode(errors="replace").splitlines()
                launched = [line.split()[1] for line in lines if line.startswith("[mk-emu] ")]
                other = [line for line in lines if not line.startswith("[mk-emu] ")]
                if other:  # anything else the extension printed still reaches stderr
                    os.write(2, ("\n".join(other) + "\n").encode())
                mod.launch_log.append((name, args, kwargs, launched))
        return call

    for name in dir(mod):
        fn = getattr(mod, name)
        if callable(fn) and not name.startswith(("_", "emulator_")):
            setattr(mod, name, recording(name, fn))


@pytest.fixture
def autotune_dirs(tmp_path, monkeypatch):
    """An empty autotune user cache dir and an empty shipped-tables dir, both under tmp_path, for
    the tests of the tables (the real ones are neither read nor written)."""
    from megalodon_kernels.autotune import cache

    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(cache.ENV_CACHE, str(user))
    monkeypatch.setattr(cache, "SHIPPED_DIR", shipped)
    cache.refresh()
    yield user, shipped
    cache.refresh()
