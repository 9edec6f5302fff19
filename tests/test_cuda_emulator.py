"""Semantics of the SIMT emulator (cuda/emu) that runs the CUDA kernels on the CPU.

Toy kernels in cuda/emu/emu_api.cu pin down what the kernel tests rely on: barriers, every
warp shuffle variant and width, votes, static/dynamic shared memory, 2-D blocks, atomics over
several OS threads, bf16 rounding; and that broken kernels are caught: a missing barrier (by
the reversed fiber order), divergent full-mask shuffles (deadlock report), a barrier after an
early return, divergent __syncthreads, masks naming missing lanes, traps, bad launches.
"""
import os
import shutil

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="the emulator extension needs a C++ compiler (g++)")


@pytest.fixture(scope="module")
def ext():
    from megalodon_kernels.cuda import build

    mod = build.load_emulator()
    yield mod
    mod.emulator_set_reverse(-1)
    mod.emulator_set_threads(-1)


def run(ext, name, inp, out_len, grid=1, block=32, smem=0, init=float("nan")):
    inp = torch.as_tensor(inp, dtype=torch.float32).contiguous()
    out = torch.full((out_len,), init, dtype=torch.float32)
    ext.emulator_selftest(name, inp.data_ptr(), out.data_ptr(), inp.numel(), grid, block, smem)
    return out.numpy()


def test_barrier_orders_shared_memory(ext, order):
    x = np.arange(256, dtype=np.float32)
    np.testing.assert_array_equal(run(ext, "reverse_block", x, 256, block=256), x[::-1])


def test_missing_barrier_is_caught_by_one_of_the_fiber_orders(ext):
    # Each thread writes buf[t] and reads buf[n-1-t] without a barrier: in natural order thread
    # 0 reads before thread n-1 wrote, in reversed order thread n-1 reads before thread 0 wrote.
    x = np.arange(256, dtype=np.float32) + 1.0
    for rev in (0, 1):
        ext.emulator_set_reverse(rev)
        out = run(ext, "reverse_block_racy_poisoned", x, 256, block=256)
        half = slice(0, 128) if rev == 0 else slice(128, 256)  # the threads that read too early
        assert np.isnan(out[half]).all(), f"order {rev}: the race went unnoticed"
    ext.emulator_set_reverse(-1)


def test_plain_shared_keeps_stale_values_across_launches(ext):
    # Plain __shared__ is a static thread_local: not poisoned, so a second identical launch reads
    # the first launch's values and the race hides. This is why kernels use MK_STATIC_SMEM.
    x = np.arange(256, dtype=np.float32) + 7.0
    ext.emulator_set_reverse(0)
    run(ext, "reverse_block_racy", x, 256, block=256)
    again = run(ext, "reverse_block_racy", x, 256, block=256)
    ext.emulator_set_reverse(-1)
    np.testing.assert_array_equal(again, x[::-1])


def test_env_var_reverses_the_order(ext, monkeypatch):
    x = np.arange(64, dtype=np.float32) + 1.0
    ext.emulator_set_reverse(-1)  # defer to MK_EMU_REVERSE
    monkeypatch.setenv("MK_EMU_REVERSE", "0")
    natural = run(ext, "reverse_block_racy_poisoned", x, 64, block=64)
    monkeypatch.setenv("MK_EMU_REVERSE", "1")
    reversed_ = run(ext, "reverse_block_racy_poisoned", x, 64, block=64)
    assert np.isnan(natural[:32]).all() and not np.isnan(natural[32:]).any()
    assert np.isnan(reversed_[32:]).all() and not np.isnan(reversed_[:32]).any()


def _shfl_model(v):
    """NumPy model of the CUDA shuffle semantics used in the 'shuffles' toy kernel (one warp)."""
    lane = np.arange(32)

    def src_idx(src, width):
        return (lane & ~(width - 1)) + (src & (width - 1))

    def up(d, width):
        seg = lane & ~(width - 1)
        return np.where(lane - seg >= d, lane - d, lane)

    def down(d, width):
        seg = lane & ~(width - 1)
        return np.where(lane - seg + d < width, lane + d, lane)

    def xor(m, width):
        s = lane ^ m
        return np.where((s & ~(width - 1)) == (lane & ~(width - 1)), s, lane)

    cols = [v[src_idx(31 - lane, 32)], v[src_idx(lane + 3, 8)], v[up(3, 32)], v[up(2, 16)], v[down(5, 32)],
            v[down(1, 4)], v[xor(13, 32)], v[xor(6, 4)]]
    votes = np.full(32, np.count_nonzero(v > 0) + (1000 if (v > 100).any() else 0) + (10000 if (v > -100).all() else 0))
    return np.stack(cols + [votes], axis=1).astype(np.float32)


def test_shuffle_variants_and_widths(ext, order):
    rng = np.random.default_rng(0)
    v = rng.standard_normal(64).astype(np.float32)
    v[40] = 150.0
    out = run(ext, "shuffles", v, 64 * 9, block=64).reshape(64, 9)
    for w in range(2):
        np.testing.assert_array_equal(out[32 * w:32 * (w + 1)], _shfl_model(v[32 * w:32 * (w + 1)]))


def test_wide_shuffles_and_half_warp_masks(ext, order):
    v = np.arange(32, dtype=np.float32)
    out = run(ext, "shuffles_wide", v, 96, block=32).reshape(32, 3)
    lane = np.arange(32)
    np.testing.assert_array_equal(out[:, 0], 3.0 * v[lane ^ 1])
    np.testing.assert_array_equal(out[:, 1], v[np.where(lane + 2 < 32, lane + 2, lane)])
    np.testing.assert_array_equal(out[:, 2], v[lane ^ 8])


def test_two_dimensional_blocks_number_lanes_linearly(ext, order):
    v = np.arange(128, dtype=np.float32)
    out = run(ext, "block2d", v, 128, grid=2, block=64)  # blocks (16, 4)
    lin = np.arange(128)
    np.testing.assert_array_equal(out, v[lin ^ 1] + 1000.0 * ((lin % 64) // 16))


def test_dynamic_shared_memory_and_opt_in(ext, order):
    v = np.arange(4 * 128, dtype=np.float32)
    out = run(ext, "dynamic_sum", v, 4, grid=4, block=128, smem=128 * 4)
    np.testing.assert_array_equal(out, v.reshape(4, 128).sum(1))
    with pytest.raises(RuntimeError, match="dynamic shared memory above 49152"):
        run(ext, "dynamic_sum", v, 4, grid=4, block=128, smem=64 * 1024)
    out = run(ext, "dynamic_sum_optin", v, 4, grid=4, block=128, smem=100 * 1024)
    np.testing.assert_array_equal(out, v.reshape(4, 128).sum(1))
    with pytest.raises(RuntimeError, match="above the per-block limit 166912"):
        run(ext, "dynamic_sum_optin", v, 4, grid=4, block=128, smem=200 * 1024)


def test_atomics_across_os_threads(ext):
    v = np.ones(50_000, dtype=np.float32)
    ext.emulator_set_threads(2)
    try:
        out = run(ext, "atomic_sum", v, 1, grid=8, block=64, init=0.0)
    finally:
        ext.emulator_set_threads(-1)
    assert out[0] == 50_000.0  # integers below 2^24: exact in any order


def test_block_sum(ext, order):
    v = np.arange(200, dtype=np.float32)
    out = run(ext, "block_sum", v, 256, block=256)
    np.testing.assert_array_equal(out, np.full(256, v.sum(), dtype=np.float32))


def test_bf16_round_to_nearest_even_matches_torch(ext):
    specials = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0 + 2**-9, 1.0 + 3 * 2**-9, 3.0e38, 3.4e38,
                         np.inf, -np.inf, 1e-40, -1e-45, 65504.0], dtype=np.float32)
    rng = np.random.default_rng(1)
    v = np.concatenate([specials, rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 2000)])
    v = v.astype(np.float32)
    out = run(ext, "to_bf16", v, v.size, grid=(v.size + 255) // 256, block=256)
    want = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    nan = run(ext, "to_bf16", np.array([np.nan], dtype=np.float32), 1)
    assert np.isnan(nan[0])


# ------------------------------------------------------------------------------------------------
# Broken kernels must be reported, not silently "work"
# ------------------------------------------------------------------------------------------------

def test_divergent_full_mask_shuffle_is_a_reported_deadlock(ext, order):
    with pytest.raises(RuntimeError) as info:
        run(ext, "divergent_shuffle_deadlock", np.zeros(64, np.float32), 64, block=64)
    msg = str(info.value)
    print(msg)
    assert "deadlock in kernel divergent_shuffle_deadlock block (0,0,0)" in msg
    assert "__shfl_xor_sync" in msg and "__syncthreads" in msg


def test_divergent_shuffle_call_sites(ext, order):
    with pytest.raises(RuntimeError, match="divergent warp-synchronous calls"):
        run(ext, "divergent_shuffle_sites", np.zeros(32, np.float32), 32)


def test_barrier_after_early_return(ext, order):
    with pytest.raises(RuntimeError, match="barrier after early return"):
        run(ext, "barrier_after_return", np.zeros(40, np.float32), 64, block=64)  # threads 40-63 return
    # no thread returns early: fine
    out = run(ext, "barrier_after_return", np.arange(64, dtype=np.float32), 64, block=64)
    np.testing.assert_array_equal(out, np.arange(64, dtype=np.float32)[::-1])


def test_divergent_syncthreads(ext, order):
    with pytest.raises(RuntimeError, match="divergent __syncthreads"):
        run(ext, "divergent_barrier", np.zeros(64, np.float32), 64, block=64)


def test_full_mask_shuffle_in_partial_warp(ext):
    with pytest.raises(RuntimeError, match="names lanes that do not exist"):
        run(ext, "partial_warp_shuffle", np.zeros(48, np.float32), 48, block=48)


def test_trap_and_recovery(ext, order):
    with pytest.raises(RuntimeError, match=r"kernel trap_kernel block \(0,0,0\): __trap"):
        run(ext, "trap", np.zeros(32, np.float32), 32)
    x = np.arange(32, dtype=np.float32)  # the emulator is usable after an aborted launch
    np.testing.assert_array_equal(run(ext, "reverse_block", x, 32), x[::-1])


def test_invalid_launch_configuration(ext):
    with pytest.raises(RuntimeError, match="invalid block size"):
        run(ext, "reverse_block", np.zeros(4, np.float32), 4, block=2048)
    with pytest.raises(RuntimeError, match="invalid grid size"):
        run(ext, "reverse_block", np.zeros(4, np.float32), 4, grid=0)
