"""The CUDA backends on every GPU a user may have: the configuration each picks, or its reason.

The device boundary (cuda/device.py) is faked with the PROFILES of real GPUs (T4 sm_75, A10 sm_86,
L4 sm_89, A100 sm_80, H100 sm_90, B200 sm_100, RTX 5090 sm_120: compute capability, opt-in shared
memory per block, grid limits). For each op x dtype x representative shape the backend's choice is
read without a GPU and without running a kernel: the launch descriptions run on meta tensors (no
memory; pointers are offsets from 0) through a launcher that only records the launches, and every
recorded launch is checked against the profile (cuda/launch.py fit_reason: the kernel's oldest
arch, shared memory, block size, grid). The expected choices are written out here from the
kernels' sizes, independently of the code that makes them:

* fftconv: one block per row holds N = nextpow2(L) complex values (8 B fp32, 16 B fp64) in shared
  memory: up to L 16384 (fp64 8192) with 163 KiB or more (sm_80/90/100), 8192 (4096) with
  64-99 KiB (sm_75/86/89/120); the multi-pass FFT beyond, to 2^27 (2^25) or 2^25 (2^23).
* attention: the flash kernels need sm_80 (SM80 MMA atoms, cp.async) and 112384 B at head dim 256
  (bf16/fp16); elsewhere softmax attention takes the matmul path (cuBLAS + dropkey_softmax, any
  arch) and attn_fn="laplace" (flash only) is refused, so ``auto`` falls back.
* every other kernel (rotary, timestep_norm, cema, ema_hidden, dropkey_softmax) has no dynamic
  shared memory and compiles for every arch: the same launches everywhere.

Then: the chosen kernels compile through NVRTC for each profile's arch within its shared memory and
without spills (a bounded set by default, every chosen kernel under ``--stress``); grids stay within
65535 in y and z at extreme shapes (B * H = 200k); the launchers refuse a launch that does not fit
before compiling it; the emulator runs the new plans (fftconv's smaller one-block limit and split
multi-pass plans) to the reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megalodon_kernels.cuda import device, launch as L
from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda
from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda
from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda
from megalodon_kernels.ops.fftconv import cuda_impl as fftconv_cuda
from megalodon_kernels.ops.rotary import cuda_impl as rotary_cuda
from megalodon_kernels.ops.timestep_norm import cuda_impl as tsn_cuda

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
PROFILES = list(device.PROFILES)
#: the profiles with less than 128 KiB of shared memory per block (64 KiB on the T4, 99 KiB else)
SMALL_SMEM = {"T4", "A10", "L4", "RTX 5090"}


class Recorder:
    """A launcher that records the launches (on meta tensors nothing could run)."""

    EMULATOR = False
    device_type = "meta"

    def __init__(self):
        self.records: list[L.Launch] = []

    def __call__(self, launch: L.Launch) -> None:
        self.records.append(launch)


def meta(*shape, dtype=F32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def assert_fit(records, caps):
    assert records
    for r in records:
        assert L.fit_reason(caps, r.kernel, r.grid, r.block, r.smem) is None, (caps.name, r.kernel.name, r.grid, r.smem)


def families(records) -> set[str]:
    return {r.kernel.name.split("<")[0].split("::")[-1] for r in records}


# --- the fake reaches every reader of the boundary ---------------------------------------------------

def test_profiles_are_what_the_backends_see():
    assert device.emulated_caps() == device.EMULATED == device.PROFILES["A100"]  # the emulator's default GPU
    for name, caps in device.PROFILES.items():
        with device.faked(name):
            assert device.caps("cuda:0") == device.caps(torch.device("cuda", 3)) == caps
            assert device.launch_caps("cpu") == device.launch_caps("meta") == caps  # the emulator's launches
            assert rotary_cuda.RotaryBackend(Recorder, "meta").caps(meta(1)) == caps
            with device.faked("T4", index=1):  # one device of a mixed machine
                assert device.caps("cuda:1").arch == 75 and device.caps("cuda:0") == caps
    assert device.emulated_caps() == device.EMULATED
    assert {c.arch for c in device.PROFILES.values()} == {75, 80, 86, 89, 90, 100, 120}


# --- fftconv: one block per row up to what fits, multi-pass beyond ---------------------------------

#: profile class -> (one-block max L, max L) for float32/bfloat16 x and for float64 x
FFTCONV_LIMITS = {"small": {F32: (8192, 2**25), F64: (4096, 2**23)},
                  "large": {F32: (16384, 2**27), F64: (8192, 2**25)}}
FFTCONV_LENGTHS = (1, 100, 4096, 4097, 8192, 8193, 16384, 16385, 2**20 + 3, 2**23, 2**23 + 1, 2**25, 2**25 + 1,
                   2**27, 2**27 + 1)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("profile", PROFILES)
def test_fftconv_configuration_per_device(profile, dtype):
    caps = device.PROFILES[profile]
    one_block, longest = FFTCONV_LIMITS["small" if profile in SMALL_SMEM else "large"][F64 if dtype == F64 else F32]
    backend = fftconv_cuda.FftconvBackend(Recorder, "meta")
    with device.faked(profile):
        for n in FFTCONV_LENGTHS:
            x, k = meta(1, 1, n, dtype=dtype), meta(1, n, dtype=F64 if dtype == F64 else F32)
            why = backend.not_supported_reasons(x, k)
            if n > longest:
                assert len(why) == 1 and f"L <= {longest} =" in why[0] and caps.name in why[0], why
                assert "backend='torch'" in why[0]
                continue
            assert why == []
            cfg = fftconv_cuda.config(caps, n, dtype)
            rec = Recorder()
            fftconv_cuda.launch_fwd(rec, x, k)
            fftconv_cuda.launch_bwd(rec, x, x, k)
            assert_fit(rec.records, caps)
            assert max(r.smem for r in rec.records) == cfg.smem <= caps.smem_per_block_optin
            if n <= one_block:
                assert cfg.path == "one_block" and families(rec.records) == {
                    "fftconv_spectrum_kernel", "fftconv_fwd_kernel", "fftconv_bwd_dx_kernel", "fftconv_bwd_dk_kernel"}
            else:
                assert cfg.path == "multi_pass" and all(f.startswith("fft4_") for f in families(rec.records))
                p = cfg.plan
                assert p.log2n1 + p.log2n2 == cfg.log2n and min(p.log2n1, p.log2n2) >= fftconv_cuda.MIN_LOG2


def test_fftconv_plans_at_the_edges():
    # (profile, dtype, L) -> (path, log2 N, (log2 N1, log2 N2, log2 C), dynamic smem): the row pass
    # holds 2 N2 complex values and the column pass N1 C, each within the device's shared memory
    want = {
        ("A10", F32, 8192): ("one_block", 13, (), 65536),
        ("A10", F32, 8193): ("multi_pass", 14, (7, 7, 4), 16384),
        ("A10", F32, 2**25): ("multi_pass", 25, (13, 12, 0), 65536),       # N2 = 2^12: 2 N2 fp32 = 64 KiB
        ("A100", F32, 16384): ("one_block", 14, (), 131072),
        ("A100", F32, 2**27): ("multi_pass", 27, (14, 13, 0), 131072),
        ("T4", F64, 4096): ("one_block", 12, (), 65536),
        ("T4", F64, 4097): ("multi_pass", 13, (6, 7, 4), 16384),
        ("L4", F64, 2**23): ("multi_pass", 23, (12, 11, 0), 65536),
        ("H100", F64, 8192): ("one_block", 13, (), 131072),
    }
    got = {key: fftconv_cuda.config(device.PROFILES[key[0]], key[2], key[1]).summary() for key in want}
    assert got == want


# --- attention: flash where the device runs it, else the matmul path (softmax) or a refusal -----------

def _attention_expectation(profile, dtype, dh):
    caps = device.PROFILES[profile]
    if dtype in (F32, F64):
        return "matmul", None  # no GPU flash configuration for fp32/fp64
    if caps.arch < 80:
        return "matmul", "sm_80 or newer"
    if dh > 128 and caps.smem_per_block_optin < 112384:
        return "matmul", "112384 B of shared memory"
    return "flash", None


@pytest.mark.parametrize("dtype", [BF16, F16, F32, F64], ids=str)
@pytest.mark.parametrize("profile", PROFILES)
def test_attention_path_per_device(profile, dtype):
    caps = device.PROFILES[profile]
    backend = attention_cuda.AttentionBackend(Recorder, "meta")
    kw = dict(scale=0.125, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.1, seed=3)
    with device.faked(profile):
        for dh in (64, 100, 256):
            path, why = _attention_expectation(profile, dtype, dh)
            q, v = meta(2, 70, 3, dh, dtype=dtype), meta(2, 70, 3, 48, dtype=dtype)
            assert backend.not_supported_reasons(q, q, v) == []  # softmax: one of the two paths always runs
            rec = Recorder()
            backend._get_ext = lambda: rec
            o, lse = backend.forward(q, q, v, attn_fn="softmax", **kw)
            backend.backward(meta(*o.shape, dtype=dtype), q, q, v, o, lse, attn_fn="softmax", **kw)
            assert_fit(rec.records, caps)
            kernels = families(rec.records)
            if path == "flash":
                assert kernels == {"flash_fwd_kernel", "flash_bwd_kv_kernel", "flash_bwd_q_kernel"}
                assert backend.flash_reasons(q, v) == []
                assert backend.not_supported_reasons(q, q, v, attn_fn="laplace") == []
            else:
                assert kernels == {"dropkey_softmax_fwd_kernel", "dropkey_softmax_bwd_kernel"}
                laplace = " ".join(backend.not_supported_reasons(q, q, v, attn_fn="laplace"))
                assert "needs the flash kernel" in laplace and "backend='torch'" in laplace
                if why is not None:  # the device is the reason, and the reason says so
                    assert why in laplace and caps.sm in laplace
                    with pytest.raises(ValueError, match=caps.sm):
                        backend.forward(q, q, v, attn_fn="softmax", path="flash", **kw)


# --- the other ops: no dynamic shared memory, every arch, the same launches everywhere ---------------

def _coefficients(real, D, N, B):
    cdt = torch.complex64 if real == F32 else torch.complex128
    return meta(D, N, dtype=real), meta(D, N, dtype=cdt), meta(D, N, dtype=cdt), meta(B, D, N, dtype=cdt)


def _other_op_launches(dtype, B=2, L_=300, H=3, D=16, N=16):
    """Forward and backward launches of rotary, dropkey_softmax, timestep_norm, cema_kernel and
    ema_hidden for x of ``dtype`` at these sizes (recorded on meta tensors)."""
    rec = Recorder()
    real = F64 if dtype == F64 else F32
    x = meta(B, L_, H, 2 * D, dtype=dtype)
    cos = meta(1, L_, 1, D, dtype=real)
    rotary = rotary_cuda.RotaryBackend(lambda: rec, "meta")
    rotary.forward(x, cos, cos)
    rotary.backward(x, cos, cos)
    scores = meta(B, H, L_, L_, dtype=dtype)
    dks = dropkey_cuda.DropKeySoftmaxBackend(lambda: rec, "meta")
    y = dks.forward(scores, causal=True, dropkey_p=0.1, seed=1)
    dks.backward(y, y, causal=True)
    xt, G = meta(B, L_, D, dtype=dtype), 4
    tsn = tsn_cuda.TimestepNormBackend(lambda: rec, "meta")
    out = tsn.forward(xt, meta(D, dtype=real), meta(D, dtype=real), meta(B, dtype=torch.int64),
                                meta(B, G, dtype=real), meta(B, G, dtype=real), meta(B, L_, dtype=torch.bool), G, 1e-5)
    tsn.backward(xt, meta(B, G, dtype=real), meta(B, G, dtype=real), out[-1], G)
    p, log_q, gamma, hx = _coefficients(real, D, N, B)
    cema = cema_cuda.CemaKernelBackend(lambda: rec, "meta")
    k, b = cema.forward(p, log_q, gamma, L_, hx)
    cema.backward(k, b, p, log_q, gamma, L_, hx)
    hidden = hidden_cuda.EmaHiddenBackend(lambda: rec, "meta")
    h, V, W = hidden.forward(meta(B, D, L_, dtype=dtype), p, log_q, hx, True)
    hidden.backward(h, p, log_q, hx, V, W, L_)
    return rec.records


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
def test_other_ops_launch_the_same_everywhere(dtype):
    launches = {}
    for profile in PROFILES:
        with device.faked(profile):
            records = _other_op_launches(dtype)
        assert_fit(records, device.PROFILES[profile])
        assert all(r.smem == 0 and r.kernel.min_arch == L.MIN_ARCH for r in records)
        launches[profile] = [(r.kernel, r.grid, r.block) for r in records]
    assert all(v == launches["A100"] for v in launches.values())
    assert {"rotary_kernel", "dropkey_softmax_fwd_kernel", "tsn_scan_fwd_kernel", "cema_synth_kernel",
            "cema_analysis_kernel"} <= families(r for r in records)


# --- grid limits at extreme shapes -------------------------------------------------------------------

def test_grids_stay_within_limits_at_extreme_shapes():
    caps = device.PROFILES["H100"]
    B, H = 50_000, 4  # B * H = 200k (and 100k documents of a packed row are batch rows here)
    with device.faked("H100"):
        backend = attention_cuda.AttentionBackend(Recorder, "meta")
        q = meta(B, 64, H, 64, dtype=BF16)
        assert backend.flash_reasons(q, q) == []
        rec = Recorder()
        backend._get_ext = lambda: rec
        kw = dict(scale=0.125, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.1, seed=3,
                  attn_fn="softmax")
        o, lse = backend.forward(q, q, q, path="flash", **kw)
        fwd = list(rec.records)
        backend.backward(o, q, q, q, o, lse, path="flash", **kw)
        assert_fit(rec.records, caps)
        per = 65535 // H
        assert [r.grid[1] for r in fwd] == [per * H] * (B // per) + [(B % per) * H]
        params = [r.args[0][1] for r in fwd]
        assert sum(p.B for p in params) == B
        # each slice starts where the previous one ended (meta pointers are byte offsets from 0, so
        # the first slice's read as null), its DropKey batch index too (arange(B) from row b0 on)
        row = 64 * H * 64 * 2
        assert [p.q for p in params] == [i * per * row or None for i in range(len(params))]
        assert [p.batch_index for p in params] == [8 * i * per or None for i in range(len(params))]
        for records in (_other_op_launches(BF16, B=B, L_=8, H=H, D=4, N=4),):
            assert_fit(records, caps)
        rec = Recorder()
        attention_cuda.matmul_fwd(rec, q, q, q, **{k: v for k, v in kw.items() if k != "attn_fn"})
        fftconv_cuda.launch_fwd(rec, meta(B, H, 100), meta(H, 100))
        fftconv_cuda.launch_fwd(rec, meta(B, H, 20000), meta(H, 20000))
        assert_fit(rec.records, caps)


def test_flash_batch_slices_equal_one_launch(ext, monkeypatch):
    # the emulator's fp32 flash tiles: slices of one batch row give the same output, lse and
    # gradients, bit for bit, DropKey included (the batch index keeps each row's mask)
    emu = L.EmulatorLauncher(ext)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 16, 1, 16, generator=g) for _ in range(3))
    kw = dict(scale=0.3, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.3, seed=5, attn_fn="softmax")
    whole = attention_cuda.flash_fwd(emu, q, k, v, **kw)
    do = torch.randn(whole[0].shape, generator=g)
    grads = attention_cuda.flash_bwd(emu, do, q, k, v, *whole, **kw)
    monkeypatch.setattr(attention_cuda, "MAX_GRID_Y", 1)
    records = []
    sliced = attention_cuda.flash_fwd(L.EmulatorLauncher(ext, records), q, k, v, **kw)
    assert len(records) == 3 and all(r[1][1] == 1 for r in records)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
    assert all(torch.equal(a, b) for a, b in zip(grads, attention_cuda.flash_bwd(emu, do, q, k, v, *sliced, **kw)))


# --- the launchers refuse what the device cannot take --------------------------------------------------

class _Driver:
    def __init__(self):
        self.launches = []

    def load(self, cubin):
        return "module"

    def function(self, module, name):
        return name

    def set_max_dynamic_smem(self, function, nbytes):
        pass

    def launch(self, *args):
        self.launches.append(args)


def test_launchers_refuse_a_launch_the_device_cannot_take():
    from megalodon_kernels.cuda import nvrtc
    from megalodon_kernels.cuda.runtime import GpuLauncher

    compiled, static = [], {"smem": 0}

    def compile_kernel(header, name, arch):
        compiled.append((name, arch))
        return nvrtc.Compiled(header, name, arch, name, b"cubin", "", nvrtc.Resources(32, 0, 0, 0, static["smem"]),
                              0.0, "fake")

    driver = _Driver()
    gpu = GpuLauncher(driver=driver, compile_kernel=compile_kernel, stream_of=lambda d: 0, device_type="cpu")
    flash = attention_cuda.FLASH[("cutlass::bfloat16_t", 64)]["fwd"]
    one_block = fftconv_cuda._k("fftconv.cuh", "fftconv_fwd_kernel<float>")
    cpu = torch.device("cpu")
    launch = lambda k, grid, smem: L.Launch(k, L.dim3(grid), (128, 1, 1), smem, (), cpu)  # noqa: E731
    with device.faked("T4"):
        with pytest.raises(L.LaunchDoesNotFit, match="needs sm_80 or newer.*sm_75"):
            gpu(launch(flash, 1, 0))
        assert compiled == []  # refused before NVRTC was asked for an arch the kernel cannot run on
        with pytest.raises(L.LaunchDoesNotFit, match="needs sm_80 or newer"):
            L.EmulatorLauncher(ext=None)(launch(flash, 1, 0))  # nothing reaches the emulator either
    with device.faked("A10"):
        with pytest.raises(L.LaunchDoesNotFit, match="131072 B of shared memory per block, above the 101376 B"):
            gpu(launch(one_block, 1, 131072))
        with pytest.raises(L.LaunchDoesNotFit, match="grid y would be 65536"):
            gpu(launch(one_block, (1, 65536), 0))
        static["smem"] = 40000  # the cubin's own __shared__ counts too (known once compiled)
        with pytest.raises(L.LaunchDoesNotFit, match="101377 B of shared memory"):
            gpu(launch(one_block, 1, 61377))
        assert driver.launches == []
        gpu(launch(one_block, 1, 61376))  # exactly the limit
    assert len(driver.launches) == 1 and compiled == [("mk::fftconv_fwd_kernel<float>", 86)]


# --- the emulator runs the device-dependent plans --------------------------------------------------------

@pytest.mark.parametrize("profile,dtype,n,want", [
    ("A10", F32, 8193, ("multi_pass", 14, (7, 7, 4))),   # one block would need 128 KiB: four-step at N = 2^14
    ("A10", F64, 4097, ("multi_pass", 13, (6, 7, 4))),
    ("2KiB", F32, 20000, ("multi_pass", 15, (8, 7, 0))),  # the row pass's N2 capped below half of log2 N
], ids=["A10-f32-8193", "A10-f64-4097", "2KiB-f32-20000"])
def test_emulator_runs_the_plans_a_smaller_device_gets(ext, profile, dtype, n, want):
    caps = device.with_smem(device.PROFILES["A100"], 2048) if profile == "2KiB" else device.PROFILES[profile]
    g = torch.Generator().manual_seed(n)
    x, k = torch.randn(1, 2, n, generator=g, dtype=dtype), torch.randn(2, n, generator=g, dtype=dtype)
    dy = torch.randn(1, 2, n, generator=g, dtype=dtype)
    emu = L.EmulatorLauncher(ext)
    with device.faked(caps):
        assert fftconv_cuda.config(device.emulated_caps(), n, dtype).summary()[:3] == want
        y = fftconv_cuda.launch_fwd(emu, x, k)
        dx, dk = fftconv_cuda.launch_bwd(emu, dy, x, k)
    size = 2 * fftconv_cuda.fft_size(n)
    xs, ks, dys = (t.double().numpy() for t in (x, k, dy))
    conv = lambda a, b: np.fft.irfft(np.fft.rfft(a, size) * np.fft.rfft(b, size), size)[..., :n]  # noqa: E731
    corr = lambda a, b: np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)[..., :n]  # noqa: E731
    refs = {"y": conv(xs, ks), "dx": corr(dys, ks), "dk": corr(dys, xs).sum(0)}
    tol = 1e-13 if dtype == F64 else 1e-6  # relative to max |ref|: y measured 2.3e-7 / 2.8e-7 (fp32), 6e-16 (fp64)
    for name, got in (("y", y), ("dx", dx), ("dk", dk)):
        ref = refs[name]
        err = np.abs(got.double().numpy() - ref).max() / np.abs(ref).max()
        assert err < tol, (name, err)


# --- every chosen configuration compiles for its profile's arch: no spills, within shared memory ------

def _chosen_kernels(profile) -> dict:
    """{Kernel: largest dynamic shared memory it is launched with} over the configurations the
    tests above record for ``profile``: fftconv at its one-block limit, just above and at its
    longest length; attention (auto) at head dims 64, 128, 256; the other ops."""
    caps = device.PROFILES[profile]
    rec = Recorder()
    with device.faked(profile):
        for dtype in (F32, BF16, F64):
            for n in {fftconv_cuda.one_block_max_len(dtype, caps), fftconv_cuda.one_block_max_len(dtype, caps) + 1,
                      fftconv_cuda.max_len(dtype, caps)}:
                x, k = meta(1, 1, n, dtype=dtype), meta(1, n, dtype=F64 if dtype == F64 else F32)
                fftconv_cuda.launch_fwd(rec, x, k)
                fftconv_cuda.launch_bwd(rec, x, x, k)
            rec.records += _other_op_launches(dtype)
        backend = attention_cuda.AttentionBackend(lambda: rec, "meta")
        kw = dict(scale=0.125, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.1, seed=3,
                  attn_fn="softmax")
        for dtype in (BF16, F16, F32):
            for dh in (64, 128, 256):
                q = meta(1, 70, 2, dh, dtype=dtype)
                o, lse = backend.forward(q, q, q, **kw)
                backend.backward(o, q, q, q, o, lse, **kw)
    out = {}
    for r in rec.records:
        out[r.kernel] = max(out.get(r.kernel, 0), r.smem)
    return out


#: by default: the largest one-block and multi-pass configurations on the small-smem archs (fp32 FFT
#: of 8192 points at 64 KiB, fp64 row pass at 64 KiB), about 6 compiles; --stress: every chosen
#: kernel of every profile (flash attention's take minutes each)
BOUNDED = {"mk::fftconv_fwd_kernel<mk::bf16>", "mk::fft4_row_conv_kernel<double>"}


@pytest.mark.stress
@pytest.mark.parametrize("profile", PROFILES)
def test_chosen_configurations_compile_for_the_profile(profile, stress):
    from megalodon_kernels.cuda import nvrtc

    try:
        nvrtc.nvrtc_binding()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    caps = device.PROFILES[profile]
    chosen = _chosen_kernels(profile)
    assert all(caps.arch >= k.min_arch for k in chosen)  # nothing is chosen that the arch cannot run
    if caps.arch >= 80:
        assert any("flash" in k.name for k in chosen)
    if not stress:
        if profile not in ("T4", "A10", "RTX 5090"):
            pytest.skip("the bounded set compiles for sm_75, sm_86 and sm_120 (--stress: every profile)")
        chosen = {k: smem for k, smem in chosen.items() if k.name in BOUNDED}
        assert len(chosen) == len(BOUNDED)
    for kernel, smem in chosen.items():
        c = nvrtc.compile_kernel(kernel.header, kernel.name, caps.arch)
        assert c.resources.spills == 0, f"{kernel.name} spills {c.resources.spills} B on {caps.sm}"
        assert c.resources.static_smem + smem <= caps.smem_per_block_optin, (kernel.name, caps.sm, smem)


def test_kernels_by_arch_leave_out_only_flash_below_sm80():
    from megalodon_kernels.cuda.instances import all_kernels

    every = all_kernels()
    assert all_kernels(80) == all_kernels(120) == every
    assert set(every) - set(all_kernels(75)) == {k for ks in attention_cuda.FLASH.values() for k in ks.values()}


def test_laplace_under_auto_falls_back_where_flash_cannot_run(use_emulated_cuda):
    from megalodon_kernels import ops

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, 1, 16, generator=g).to(BF16) for _ in range(3))
    with device.faked("T4"):
        o = ops.attention(q, k, v, attn_fn="laplace")
    ref = ops.attention(q, k, v, attn_fn="laplace", backend="torch")
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fftconv_dispatch_follows_the_device(use_emulated_cuda):
    # through the op's dispatcher: on an A10 the CUDA backend runs L = 16384 by the multi-pass FFT
    # (one block would need 128 KiB) and equals the torch backend; above its longest length auto
    # goes elsewhere and backend="cuda" says why, naming the GPU
    import importlib

    from megalodon_kernels import ops
    from megalodon_kernels.ops._dispatch import NoBackendError

    backends = importlib.import_module("megalodon_kernels.ops.fftconv").BACKENDS
    g = torch.Generator().manual_seed(3)
    x, k = torch.randn(1, 1, 16384, generator=g), torch.randn(1, 16384, generator=g) / 100
    with device.faked("A10"):
        assert backends.select("auto", {"x": x, "k": k}, device=x.device, dtype=x.dtype).name == "cuda"
        assert fftconv_cuda.config(device.emulated_caps(), 16384, F32).path == "multi_pass"
        y = ops.fftconv(x, k)
        huge = torch.zeros(1).expand(1, 1, 2**25 + 1)  # no memory behind it
        kh = torch.zeros(1).expand(1, 2**25 + 1)
        assert backends.select("auto", {"x": huge, "k": kh}, device=huge.device, dtype=huge.dtype).name != "cuda"
        with pytest.raises(NoBackendError, match="L <= 33554432 = 2\\^25 on NVIDIA A10"):
            backends.select("cuda", {"x": huge, "k": kh}, device=huge.device, dtype=huge.dtype)
    with device.faked("A100"):
        assert backends.select("auto", {"x": huge, "k": kh}, device=huge.device, dtype=huge.dtype).name == "cuda"
    ref = ops.fftconv(x, k, backend="torch")
    assert (y - ref).abs().max() <= 1e-6 * ref.abs().max()
