"""The interpreter byte counter counts exactly the unmasked lanes' bytes."""
import torch
import triton
import triton.language as tl

from megalodon_kernels.bench.triton_bytes import count_bytes


@triton.jit
def _copy_prefix(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    v = tl.load(x_ptr + o, mask=m, other=0.0)
    tl.store(y_ptr + o, v + tl.load(x_ptr + o, mask=m, other=0.0), mask=m)  # x read twice


def test_masked_lanes_cost_nothing_and_repeats_count_in_total_not_unique():
    x = torch.randn(64)
    y = torch.zeros(64, dtype=torch.float64)
    with count_bytes() as c:
        _copy_prefix[(1,)](x, y, 37, BLOCK=64)
    assert torch.equal(y[:37], (2 * x[:37]).double()) and torch.all(y[37:] == 0)
    assert c.loaded == 2 * 37 * 4
    assert c.stored == 37 * 8
    assert c.loaded_unique == 37 * 4 and c.stored_unique == 37 * 8


def test_counter_is_removed_after_the_block():
    x = torch.randn(8)
    y = torch.empty(8, dtype=torch.float64)
    with count_bytes() as c:
        pass
    _copy_prefix[(1,)](x, y, 8, BLOCK=8)
    assert c.total == 0


def test_every_triton_op_reports_its_bytes_against_the_ideal():
    from megalodon_kernels.bench.aot import TRITON_OPS
    from megalodon_kernels.bench.triton_bytes import measure

    for op in TRITON_OPS:
        rows = measure(op)
        assert rows, f"{op}: bench/triton_variants.py declares no byte cases"
        for name, shape, c, ideal in rows:
            uniq = c.loaded_unique + c.stored_unique
            print(f"{name} {shape}: total {c.total} unique {uniq} ideal {ideal}")
            # Every input byte is read and every output byte written (no skipped work) ...
            assert uniq >= ideal, name
            # ... and no address beyond the op's inputs/outputs is touched more than once per launch.
            assert uniq <= 1.05 * ideal, name


def test_fftconv_tile_path_moves_the_ideal_data_bytes_at_n_2048_and_4096():
    """Issue 39's byte criterion on the tile path (the twiddle table excepted): the forward and the
    one-pass backward read each input once and write each output once at the 2048- and 4096-point
    tiles (the two-pass backward read dy four times there: 1.86x)."""
    from megalodon_kernels.bench.fftconv_data_bytes import ratios

    for L in (1000, 2048):
        fwd, _, bwd, _ = ratios(2, 1, L)
        assert abs(fwd - 1.0) < 1e-9 and abs(bwd - 1.0) < 1e-9, (L, fwd, bwd)
