"""The launch descriptions (ops/<op>/cuda_impl.py) drive the GPU runtime and the emulator alike.

Each op call runs through a tee: the GPU runtime's code (cuda/runtime.py GpuLauncher: kernel
lookup, smem opt-in, argument packing, driver launch) over a fake driver that records what
cuLaunchKernel would receive, and the emulator (which executes the launch by name and reports the
C++ parameter types it unpacked). The two records must be equal, launch for launch: the GPU path
launches exactly what the emulator executed and checked against the references."""
import ctypes

import pytest
import torch

from megalodon_kernels.cuda import nvrtc
from megalodon_kernels.cuda.launch import EmulatorLauncher
from megalodon_kernels.cuda.runtime import GpuLauncher
from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda
from megalodon_kernels.ops.dropkey_rule import seed_key, threshold
from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda
from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda
from megalodon_kernels.ops.fftconv import cuda_impl as fftconv_cuda
from megalodon_kernels.ops.rotary import cuda_impl as rotary_cuda, rotation_tables
from megalodon_kernels.ops.timestep_norm import cuda_impl as tsn_cuda

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


class FakeDriver:
    """Records the driver calls the GPU runtime makes (no GPU)."""

    def __init__(self):
        self.launches, self.loaded, self.smem_optins = [], [], []

    def load(self, cubin):
        self.loaded.append(cubin)
        return ("module", len(self.loaded))

    def function(self, module, lowered_name):
        return lowered_name

    def set_max_dynamic_smem(self, function, nbytes):
        self.smem_optins.append((function, nbytes))

    def launch(self, function, grid, block, smem, stream, values):
        self.launches.append((function, tuple(grid), tuple(block), smem, stream, [bytes(v) for v in values]))


def fake_compile(header, name, arch):
    return nvrtc.Compiled(header, name, arch, f"lowered {name}", f"cubin of {name}".encode(), "",
                          nvrtc.Resources(0, 0, 0, 0, 0), 0.0, "fake")


class Tee:
    def __init__(self, gpu, emulator):
        self.gpu, self.emulator, self.gpu_tags = gpu, emulator, []

    def __call__(self, launch):
        self.gpu_tags.append(tuple(tag for tag, _ in launch.args))
        self.gpu(launch)
        self.emulator(launch)


@pytest.fixture
def tee(ext):
    driver = FakeDriver()
    gpu = GpuLauncher(driver=driver, compile_kernel=fake_compile, arch_of=lambda device: 80,
                      stream_of=lambda device: 0, device_type="cpu")
    t = Tee(gpu, EmulatorLauncher(ext, records=[]))
    t.driver = driver
    return t


def assert_same_launches(tee):
    gpu = [(fn.removeprefix("lowered "), grid, block, smem, tuple(zip(tags, data)))
           for (fn, grid, block, smem, _stream, data), tags in zip(tee.driver.launches, tee.gpu_tags)]
    emu = tee.emulator.records
    assert gpu and len(gpu) == len(emu)
    assert gpu == emu  # name, grid, block, smem, and per argument (type tag, bytes)
    # each instantiation was compiled and loaded once, whatever the number of launches
    loaded = tee.driver.loaded
    assert len(loaded) == len(set(loaded)) and {f"cubin of {name}".encode() for name, *_ in gpu} <= set(loaded)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("path", ["fwd", "bwd"])
def test_rotary_gpu_launches_equal_the_emulator_launches(tee, dtype, path):
    B, L, H, d = 2, 5, 3, 8
    x = torch.randn(B, L, H, d).to(dtype)
    cos, sin = rotation_tables(torch.arange(L), d, 10000.0, None, False, F64 if dtype == F64 else F32)
    backend = rotary_cuda.RotaryBackend(lambda: tee, "cpu")
    y = getattr(backend, {"fwd": "forward", "bwd": "backward"}[path])(x, cos, sin)
    assert torch.isfinite(y.float()).all()
    assert_same_launches(tee)
    conj = "true" if path == "bwd" else "false"
    assert tee.emulator.records[0][0] == f"mk::rotary_kernel<{rotary_cuda.cuda_launch.CPP_TYPES[dtype]}, {conj}>"


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("path", ["fwd", "bwd"])
def test_timestep_norm_gpu_launches_equal_the_emulator_launches(tee, dtype, path):
    B, L, D, G = 2, 40, 8, 2
    acc = F64 if dtype == F64 else F32
    x = torch.randn(B, L, D).to(dtype)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :7] = True
    args = (x, torch.rand(D, dtype=acc) + 0.5, torch.randn(D, dtype=acc), torch.tensor([0, 3]),
            torch.zeros(B, G, dtype=acc), torch.ones(B, G, dtype=acc), mask, G, 1e-5)
    backend = tsn_cuda.TimestepNormBackend(lambda: tee, "cpu")
    y, count, mean, var, saved = backend.forward(*args)
    if path == "bwd":
        _reset(tee)
        dx, *_ = backend.backward(torch.randn(B, L, D).to(dtype), torch.randn(B, G, dtype=acc),
                                           torch.randn(B, G, dtype=acc), saved, G)
        assert torch.isfinite(dx.float()).all()
    else:
        assert torch.isfinite(y.float()).all()
    assert_same_launches(tee)
    # the scan's eps argument travels in the accumulation type (float32 or float64)
    if path == "fwd":
        scan = next(r for r in tee.emulator.records if "tsn_scan_fwd" in r[0])
        assert scan[4][-1][0] == ("f64" if dtype == F64 else "f32")


def _reset(tee):
    for log in (tee.driver.launches, tee.gpu_tags, tee.emulator.records):
        log.clear()


def _coefficients(real, D=3, N=20, B=2):
    g = torch.Generator().manual_seed(1)
    cdt = torch.complex64 if real == F32 else torch.complex128
    p = torch.rand(D, N, generator=g, dtype=real)
    log_q = torch.complex(-torch.rand(D, N, generator=g, dtype=real) * 0.1,
                          torch.rand(D, N, generator=g, dtype=real) * 3).to(cdt)
    gamma = torch.randn(D, N, generator=g, dtype=cdt)
    hx = torch.randn(B, D, N, generator=g, dtype=cdt)
    return p, log_q, gamma, hx


@pytest.mark.parametrize("real", [F32, F64], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_cema_kernel_gpu_launches_equal_the_emulator_launches(tee, real, weighted):
    p, log_q, gamma, hx = _coefficients(real)
    backend = cema_cuda.CemaKernelBackend(lambda: tee, "cpu")
    k, b = backend.forward(p, log_q, gamma, 70, hx)
    assert torch.isfinite(k).all() and torch.isfinite(b).all()
    assert_same_launches(tee)
    _reset(tee)
    grads = backend.backward(torch.randn_like(k), torch.randn_like(b), p, log_q, gamma, 70, hx,
                                    (True, weighted, True, True))
    assert all(torch.isfinite(torch.view_as_real(g) if g.is_complex() else g).all() for g in grads)
    assert_same_launches(tee)
    assert [r[0].split("<")[0] for r in tee.emulator.records] == ["mk::cema::cema_analysis_kernel",
                                                                  "mk::cema::cema_bwd_finish_kernel"]


@pytest.mark.parametrize("dtype,real", [(F32, F32), (BF16, F32), (F64, F64), (BF16, F64)], ids=str)
def test_ema_hidden_gpu_launches_equal_the_emulator_launches(tee, dtype, real):
    p, log_q, _, hx = _coefficients(real)
    x = torch.randn(2, 3, 50).to(dtype)
    backend = hidden_cuda.EmaHiddenBackend(lambda: tee, "cpu")
    h, V, W = backend.forward(x, p, log_q, hx, True)
    assert torch.isfinite(torch.view_as_real(h)).all()
    assert_same_launches(tee)
    _reset(tee)
    dx, dp, dlq, dhx = backend.backward(torch.randn_like(h), p, log_q, hx, V, W, 50)
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()
    assert_same_launches(tee)


@pytest.mark.parametrize("dtype,L", [(F32, 100), (BF16, 100), (F64, 100), (F32, 16385), (F64, 8193)],
                         ids=["f32-one_block", "bf16-one_block", "f64-one_block", "f32-multi_pass", "f64-multi_pass"])
def test_fftconv_gpu_launches_equal_the_emulator_launches(tee, dtype, L):
    # B = 2 with a product-spectrum slice of one batch element: the dk sum accumulates, then finalizes
    x, k = torch.randn(2, 1, L).to(dtype), torch.randn(1, L).to(F64 if dtype == F64 else F32)
    backend = fftconv_cuda.FftconvBackend(lambda: tee, "cpu")
    y = backend.forward(x, k)
    assert torch.isfinite(y.float()).all()
    assert_same_launches(tee)
    _reset(tee)
    row_bytes = (fftconv_cuda.fft_size(L) + 1) * (16 if dtype == F64 else 8)
    dx, dk = backend.backward(torch.randn_like(y), x, k, True, True, max_workspace_bytes=row_bytes)
    assert torch.isfinite(dx.float()).all() and torch.isfinite(dk).all()
    assert_same_launches(tee)
    if L > 10000:  # the multi-pass plan travels by value as a 16-byte struct
        assert any(arg[0] == "struct16" for r in tee.emulator.records for arg in r[4])
    # the one-block kernels end with the twiddle table: a pointer for float arithmetic, null for double
    table = fftconv_cuda.twiddles(fftconv_cuda.real_of(dtype), x.device)
    one_block = [r for r in tee.emulator.records if r[0].startswith("mk::fftconv_")]
    assert one_block or L > 8192
    for name, _grid, _block, _smem, args in one_block:
        assert args[-1][0] == "ptr", name
        assert (args[-1][1] == bytes(8)) == (dtype == F64), name
        if table is not None:
            assert int.from_bytes(args[-1][1], "little") == table.data_ptr(), name


def test_fftconv_twiddle_table_is_every_span_rounded_once():
    # tw[m - 32 + r] = e^{-i pi r / m} for m = 32 .. 2^14, each the complex64 rounding of the exact value
    import numpy as np

    table = fftconv_cuda._twiddle_values(14).numpy()
    assert table.shape == ((1 << 15) - 32,) and table.dtype == np.complex64
    for s in (5, 9, 14):
        m = 1 << s
        exact = np.exp(-1j * np.pi * np.arange(m, dtype=np.float64) / m).astype(np.complex64)
        np.testing.assert_array_equal(table[m - 32:2 * m - 32], exact)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("batch_index", [False, True], ids=["own_batch", "batch_index"])
def test_dropkey_softmax_gpu_launches_equal_the_emulator_launches(tee, dtype, batch_index):
    # S = 300: several scores per thread (64 threads); batch_index: packed attention's per-row document
    scores = torch.randn(3, 2, 5, 300).to(dtype)
    bidx = torch.tensor([4, 0, 4]) if batch_index else None
    backend = dropkey_cuda.DropKeySoftmaxBackend(lambda: tee, "cpu")
    y = dropkey_cuda.softmax_fwd(tee, scores, causal=True, dropkey_p=0.3, seed=2**40 + 7, batch_index=bidx)
    assert torch.isfinite(y.float()).all()
    assert_same_launches(tee)
    (name, grid, block, smem, args), = tee.emulator.records
    assert name == f"mk::dropkey_softmax_fwd_kernel<{dropkey_cuda.cuda_launch.CPP_TYPES[dtype]}, 8>"
    assert block == (64, 1, 1) and smem == 0
    assert [a[0] for a in args] == ["ptr", "ptr", "i64", "i32", "i32", "i32", "bool", "u32", "u32", "ptr", "ptr"]
    assert args[7][1] == seed_key(2**40 + 7).to_bytes(4, "little") and args[8][1] == threshold(0.3).to_bytes(4, "little")
    assert (args[9][1] == bytes(8)) != batch_index  # a null pointer exactly when no batch index is given
    assert args[10][1] == bytes(8)  # no index offset: null (only chunk rows of the attention pass one)
    _reset(tee)
    dx = backend.backward(torch.randn_like(y), y, causal=True)
    assert torch.isfinite(dx.float()).all()
    assert_same_launches(tee)
    assert tee.emulator.records[0][0].startswith("mk::dropkey_softmax_bwd_kernel<")


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16, F64], ids=str)
@pytest.mark.parametrize("batch_index", [False, True], ids=["own_batch", "batch_index"])
def test_attention_matmul_path_gpu_launches_equal_the_emulator_launches(tee, dtype, batch_index):
    # the matmul path: torch matmuls around the dropkey_softmax kernels (fwd; bwd recomputes P)
    B, L, S, H = 2, 7, 9, 2
    q, k, v = torch.randn(B, L, H, 8).to(dtype), torch.randn(B, S, H, 8).to(dtype), torch.randn(B, S, H, 5).to(dtype)
    kw = dict(scale=0.5, causal=True, chunk_size=4, block_causal=True, dropkey_p=0.3, seed=11,
              batch_index=torch.tensor([3, 3]) if batch_index else None)
    o, lse = attention_cuda.matmul_fwd(tee, q, k, v, **kw)
    assert torch.isfinite(o.float()).all() and o.dtype == dtype
    assert_same_launches(tee)
    acc = "double" if dtype == F64 else "float"  # the scores are in the accumulation type
    assert [r[0] for r in tee.emulator.records] == [f"mk::dropkey_softmax_fwd_kernel<{acc}, 8>"]
    _reset(tee)
    grads = attention_cuda.matmul_bwd(tee, torch.randn_like(o), q, k, v, **kw)
    assert all(torch.isfinite(g.float()).all() for g in grads)
    assert_same_launches(tee)
    assert [r[0] for r in tee.emulator.records] == [f"mk::dropkey_softmax_fwd_kernel<{acc}, 8>",
                                                    f"mk::dropkey_softmax_bwd_kernel<{acc}, 8>"]


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("dh,dv", [(16, 12), (100, 130), (256, 200)], ids=["D64", "D128", "D256"])
@pytest.mark.parametrize("mode", ["softmax", "laplace", "batch_index"])
def test_attention_flash_gpu_launches_equal_the_emulator_launches(tee, dtype, dh, dv, mode):
    # the kernels a GPU has (bf16 / fp16 tensor-core tiles) at every padded head dim; v padded to the dv tile
    B, L, S, H = 2, 70, 67, 1
    q, k = torch.randn(B, L, H, dh).to(dtype), torch.randn(B, S, H, dh).to(dtype)
    v = torch.randn(B, S, H, dv).to(dtype)
    kw = dict(scale=0.3, causal=True, chunk_size=32, block_causal=True, dropkey_p=0.2, seed=5,
              attn_fn="laplace" if mode == "laplace" else "softmax",
              batch_index=torch.tensor([1, 0]) if mode == "batch_index" else None)
    backend = attention_cuda.AttentionBackend(lambda: tee, "cpu")
    assert backend.flash_reasons(q, v) == []
    o, lse = backend.forward(q, k, v, path="flash", **kw)
    assert torch.isfinite(o.float()).all()
    assert_same_launches(tee)
    D = attention_cuda.flash_head_dim(dh)
    element = attention_cuda.FLASH_ELEMENTS[dtype]
    (name, grid, block, smem, args), = tee.emulator.records
    assert name == f"mk::flash::flash_fwd_kernel<mk::flash::FwdCfg<{element}, {D}>>"
    ldv = -(-dv // attention_cuda.fwd_dv_tile(D)) * attention_cuda.fwd_dv_tile(D)
    assert grid == (2, B * H, ldv // attention_cuda.fwd_dv_tile(D)) and block == (128, 1, 1)
    assert smem == attention_cuda.fwd_smem_bytes(element, D) and [a[0] for a in args] == ["struct128"]
    _reset(tee)
    grads = backend.backward(torch.randn_like(o), q, k, v, o, lse, path="flash", **kw)
    assert all(torch.isfinite(g.float()).all() for g in grads)
    assert_same_launches(tee)
    assert [r[0].split("<")[0] for r in tee.emulator.records] == [
        "mk::flash::flash_bwd_kv_kernel", "mk::flash::flash_bwd_kv_kernel", "mk::flash::flash_bwd_q_kernel"]
    assert [r[0].rsplit(", ", 1)[-1] for r in tee.emulator.records[:2]] == ["mk::flash::Grad::kDV>",
                                                                           "mk::flash::Grad::kDK>"]


def test_flash_params_mirror_the_kernels_struct():
    # mk::flash::Params: 8 pointers, 6 ints, a float, 4 ints, 2 uint32, (4 bytes padding) and a pointer
    assert ctypes.sizeof(attention_cuda.FlashParams) == 128
    assert attention_cuda.FlashParams.batch_index.offset == 120 and attention_cuda.FlashParams.thr.offset == 112


def test_emulator_refuses_arguments_that_do_not_match_the_signature(ext):
    from megalodon_kernels.cuda.launch import Kernel, Launch

    k = rotary_cuda.KERNELS[0]
    good = [("ptr", 0)] * 4 + [("i64", 0)] * 4 + [("bool", False)]
    bad_size = good[:-1] + [("i32", 0)]  # a 4-byte value for the 1-byte bool parameter
    with pytest.raises(ValueError, match="argument 8 has 4 bytes"):
        EmulatorLauncher(ext)(Launch(k, (1, 1, 1), (32, 1, 1), 0, tuple(bad_size), torch.device("cpu")))
    with pytest.raises(ValueError, match="8 arguments for 9 parameters"):
        EmulatorLauncher(ext)(Launch(k, (1, 1, 1), (32, 1, 1), 0, tuple(good[:-1]), torch.device("cpu")))
    with pytest.raises(ValueError, match="no kernel mk::nope"):
        EmulatorLauncher(ext)(Launch(Kernel("rotary.cuh", "mk::nope<float>"), (1, 1, 1), (32, 1, 1), 0, (),
                                     torch.device("cpu")))


def test_gpu_launcher_opts_in_to_large_dynamic_smem_once(tee):
    from megalodon_kernels.cuda.launch import Launch

    k = rotary_cuda.KERNELS[0]
    args = tuple([("ptr", 0)] * 4 + [("i64", 0)] * 4 + [("bool", False)])
    for smem in (1024, 64 * 1024, 64 * 1024, 100 * 1024):
        tee.gpu(Launch(k, (1, 1, 1), (32, 1, 1), smem, args, torch.device("cpu")))
    assert tee.driver.smem_optins == [(f"lowered {k.name}", 64 * 1024), (f"lowered {k.name}", 100 * 1024)]
    assert len(tee.driver.launches) == 4 and len(tee.driver.loaded) == 1


def test_gpu_launcher_checks_a_repeated_launch_again_under_another_device_profile(tee):
    """A launch that fit is not checked again (GpuLauncher remembers it), but under a faked
    profile it is: 100 KB of shared memory fits an A100 block, not a T4's 64 KB."""
    from megalodon_kernels.cuda import device
    from megalodon_kernels.cuda.launch import Launch, LaunchDoesNotFit

    k = rotary_cuda.KERNELS[0]
    launch_ = Launch(k, (1, 1, 1), (32, 1, 1), 100 * 1024, tuple([("ptr", 0)] * 4 + [("i64", 0)] * 4 + [("bool", False)]),
                     torch.device("cpu"))
    tee.gpu(launch_)
    tee.gpu(launch_)
    assert len(tee.driver.launches) == 2
    with device.faked(device.with_smem(device.PROFILES["A100"], 64 * 1024)):
        with pytest.raises(LaunchDoesNotFit, match="shared memory"):
            tee.gpu(launch_)
    assert len(tee.driver.launches) == 2


# --- availability: why the GPU runtime cannot run, reported and never raised at import -------------

@pytest.fixture
def fresh_runtime(monkeypatch):
    from megalodon_kernels.cuda import runtime

    monkeypatch.setattr(runtime, "_reason", runtime._UNSET)
    monkeypatch.setattr(runtime, "_launcher", None)
    return runtime


def test_availability_without_cupy_names_the_extra(fresh_runtime, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)  # an import that fails
    with monkeypatch.context() as gpu:  # a GPU is visible: then the missing extra is the reason
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        reason = fresh_runtime.unavailable_reason()
    assert "NVRTC through CuPy is not available" in reason and "pip install -e '.[cuda]'" in reason
    why = rotary_cuda.not_supported_reasons(x=torch.zeros(1, 2, 1, 4))
    assert any("CUDA backend is unavailable" in r and "pip install" in r for r in why)
    from megalodon_kernels import ops

    y = ops.rotary(torch.randn(1, 2, 1, 4), torch.arange(2))  # auto falls back
    assert torch.isfinite(y).all()


def test_availability_without_a_gpu_gives_no_install_advice(fresh_runtime, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)  # no CuPy either
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = fresh_runtime.unavailable_reason()
    assert reason.startswith("no CUDA device is visible to torch") and "pip install" not in reason


class _FakeVersionDriver:
    def __init__(self, version):
        self.version = version

    def driver_version(self):
        return self.version


@pytest.mark.parametrize("driver,want", [
    (12080, "the NVIDIA driver supports CUDA 12.8 but NVRTC is 13"),  # driver older than NVRTC's major
    (13000, None),
])
def test_availability_old_driver_and_unsupported_arch(fresh_runtime, monkeypatch, driver, want):
    from types import SimpleNamespace

    from megalodon_kernels.cuda import device

    runtime = fresh_runtime
    monkeypatch.setattr(runtime.nvrtc, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(runtime.nvrtc, "supported_archs", lambda: [75, 80, 86, 87, 89, 90, 100, 120])
    monkeypatch.setattr(runtime.nvrtc, "include_dirs", lambda: ())
    monkeypatch.setattr(runtime.nvrtc, "nvrtc_binding", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(runtime, "CupyDriver", lambda: _FakeVersionDriver(driver))
    reason = runtime.unavailable_reason()
    if want is not None:
        assert want in reason
        with pytest.raises(RuntimeError, match="CUDA backend is unavailable"):
            runtime.gpu_launcher()
        return
    assert reason is None
    # a mixed machine: an sm_61 GPU NVRTC 13 cannot target next to an H100; calls on the old one are
    # refused with the reason, the H100 keeps the CUDA backend
    old = device.DeviceCaps("Tesla P100", 61, 49152, 56)
    on = lambda i: SimpleNamespace(device=torch.device("cuda", i))  # noqa: E731  (no CUDA tensor without a GPU)
    with device.faked("H100"), device.faked(old, index=1):
        assert runtime.arch_reason(torch.device("cuda", 0)) is None
        assert "cannot compile for cuda:1 (sm_61" in runtime.arch_reason(torch.device("cuda", 1))
        backend = rotary_cuda.RotaryBackend(runtime.gpu_launcher)
        assert backend._arch_reasons([on(0)]) == []
        why = backend._arch_reasons([on(1)])
        assert len(why) == 1 and "sm_61" in why[0] and "backend='triton' or 'torch'" in why[0]
        assert backend._arch_reasons([torch.zeros(1)]) == []  # CPU tensors: the emulator, no NVRTC arch
