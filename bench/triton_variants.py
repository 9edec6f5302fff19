"""What the tooling needs to know about every Triton backend, next to, not inside, its kernels.

Per op with an ops/<op>/triton_impl.py:

* ``aot_variants(op, space=None)``: every kernel x config x input dtype x tiling the backend can
  launch, as :class:`~megalodon_kernels.bench.aot.Variant` s for ahead-of-time compilation
  (bench/aot.py). ``space`` is one op config space ({knob: [values]}); None means the backend's
  whole CONFIG_SPACE. The autotuner passes one value per knob to get the variants of one config.
* ``bytes_cases(op)``: medium-shape launches for the interpreter byte counter
  (bench/triton_bytes.py), yielding (kernel name, shape text, run) where ``run()`` launches the
  kernel(s) and returns the op's ideal byte count (every input read once, every output written once).
* attention's matmul FLOP counts (:func:`attention_flop_counts`).

This module imports the ops; nothing under ops/ imports it.
"""
from __future__ import annotations

import math
from itertools import product

import torch

from ..ops.attention import triton_impl as attention_impl
from ..ops.cema import triton_chunked as cema_chunked
from ..ops.cema import triton_impl as cema_impl
from ..ops.cema_kernel import triton_impl as cema_kernel_impl
from ..ops.dropkey_softmax import triton_impl as dropkey_impl
from ..ops.ema_hidden import triton_impl as ema_hidden_impl
from ..ops.fftconv import triton_impl as fftconv_impl
from ..ops.rotary import triton_impl as rotary_impl
from ..ops.timestep_norm import triton_impl as timestep_norm_impl
from .aot import Variant

DTYPES = ("fp16", "bf16", "fp32")
#: the launch offsets of split grids (ops/_triton_common.grid_launches): 0 in every launch whose grid
#: fits CUDA's y/z limit, which the JIT sees as divisible by 16
GRID_OFFSETS = (("Y0", "i32"), ("Z0", "i32"))
GRID_DIV16 = frozenset({"Y0", "Z0"})


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _coefficients(D, N, B, seed=0):
    """CEMA coefficients for the byte counter: |q| < 1, any phase, and an initial state."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(D, N, generator=gen) * 0.9 + 0.05
    log_q = torch.complex(-torch.rand(D, N, generator=gen) * 0.1, (2 * torch.rand(D, N, generator=gen) - 1) * math.pi)
    gamma = torch.complex(torch.randn(D, N, generator=gen), torch.randn(D, N, generator=gen)) / math.sqrt(2 * N)
    hx = torch.complex(torch.randn(B, D, N, generator=gen), torch.randn(B, D, N, generator=gen))
    return p, log_q, gamma, hx


# ------------------------------------------------------------------------------------------ rotary

def _rotary_variants(space):
    variants = []
    for dt, br, bp, nw in product(DTYPES, space["block_rows"], space["block_pairs"], space["num_warps"]):
        variants.append(Variant(
            op="rotary", kernel="_rotary_kernel", fn=rotary_impl._rotary_kernel,
            arg_types=(("x_ptr", f"*{dt}"), ("cos_ptr", "*fp32"), ("sin_ptr", "*fp32"), ("out_ptr", f"*{dt}"),
                       ("n_rows", "i32"), ("L", "i32"), ("n_pairs", "i32"), ("half_d", "i32"),
                       ("tab_batch_stride", "i32"), ("sign", "fp32"), *GRID_OFFSETS),
            constexprs=(("OUT_BF16", dt == "bf16"), ("BLOCK_ROWS", br), ("BLOCK_PAIRS", bp)),
            div16=frozenset({"n_rows", "L", "n_pairs", "half_d", "tab_batch_stride"}) | GRID_DIV16,
            num_warps=nw, label=f"{dt} rows={br} pairs={bp} warps={nw}",
        ))
    return variants


def _rotary_bytes():
    """Ideal: x read once, the tables read once, y written once."""
    from ..ops.rotary import rotation_tables

    B, L, H, d = 2, 256, 4, 64
    x = torch.randn(B, L, H, d)
    cos, sin = rotation_tables(torch.arange(L), d, 10000.0, None, False, torch.float32)

    def run():
        y = rotary_impl.forward(x, cos, sin)
        return nbytes(x, cos, sin, y)

    yield "rotary fwd", f"B={B} L={L} H={H} d={d} fp32", run


# --------------------------------------------------------------------------------- dropkey_softmax

def _dropkey_launch_shapes(block_elems):
    """Every (BLOCK_M, BLOCK_S, ONE_PASS) a launch with ``block_elems`` can pick."""
    tiers = dropkey_impl.BLOCK_S_TIERS
    shapes = [(max(1, block_elems // bs), bs, True) for bs in tiers]
    shapes.append((max(1, block_elems // tiers[-1]), tiers[-1], False))
    return shapes


def _dropkey_softmax_variants(space):
    variants = []
    for dt, be, nw in product(DTYPES, space["block_elems"], space["num_warps"]):
        for bm, bs, one in _dropkey_launch_shapes(be):
            for causal, drop in product((True, False), (True, False)):
                tag = f"{dt} m={bm} s={bs} {'1pass' if one else '2pass'} causal={causal} drop={drop} warps={nw}"
                variants.append(Variant(
                    op="dropkey_softmax", kernel="_dropkey_softmax_fwd_kernel",
                    fn=dropkey_impl._dropkey_softmax_fwd_kernel,
                    arg_types=(("x_ptr", f"*{dt}"), ("y_ptr", f"*{dt}"), ("L", "i32"), ("S", "i32"),
                               ("Hf", "i32"), ("shift", "i32"), ("seed_k", "i32"), ("thr_i", "i32"), *GRID_OFFSETS),
                    constexprs=(("OUT_BF16", dt == "bf16"), ("CAUSAL", causal), ("DROP", drop), ("ONE_PASS", one),
                                ("BLOCK_M", bm), ("BLOCK_S", bs)),
                    div16=frozenset({"L", "S"}) | GRID_DIV16, num_warps=nw, label="fwd " + tag,
                ))
                if drop:  # the backward has no DropKey replay: one variant per CAUSAL
                    continue
                tag = f"{dt} m={bm} s={bs} {'1pass' if one else '2pass'} causal={causal} warps={nw}"
                variants.append(Variant(
                    op="dropkey_softmax", kernel="_dropkey_softmax_bwd_kernel",
                    fn=dropkey_impl._dropkey_softmax_bwd_kernel,
                    arg_types=(("dy_ptr", f"*{dt}"), ("y_ptr", f"*{dt}"), ("dx_ptr", f"*{dt}"), ("L", "i32"),
                               ("S", "i32"), ("shift", "i32"), *GRID_OFFSETS),
                    constexprs=(("OUT_BF16", dt == "bf16"), ("CAUSAL", causal), ("ONE_PASS", one),
                                ("BLOCK_M", bm), ("BLOCK_S", bs)),
                    div16=frozenset({"L", "S"}) | GRID_DIV16, num_warps=nw, label="bwd " + tag,
                ))
    return variants


def _visible_elems(BH, L, S, causal):
    if not causal:
        return BH * L * S
    return BH * sum(max(0, min(S, i + S - L + 1)) for i in range(L))


def _dropkey_softmax_bytes():
    """Ideal: the causally visible scores (and y, dy in the backward) read once, every output
    entry written once (entries past the causal limit are written 0 without being read)."""
    B, H, L, S = 2, 4, 256, 256
    x = torch.randn(B, H, L, S)
    kw = dict(causal=True, dropkey_p=0.1, seed=5)
    vis = _visible_elems(B * H, L, S, True)

    def fwd():
        dropkey_impl.forward(x, **kw)
        return 4 * vis + x.numel() * 4

    yield "dropkey_softmax fwd", f"B={B} H={H} L={L} S={S} causal p=0.1 fp32", fwd

    y = dropkey_impl.forward(x, **kw)
    dy = torch.randn_like(x)

    def bwd():
        dropkey_impl.backward(dy, y, **kw)
        return 2 * 4 * vis + x.numel() * 4

    yield "dropkey_softmax bwd", f"B={B} H={H} L={L} S={S} causal fp32", bwd

    xs = torch.randn(1, 2, 20, 5000)  # S > widest window: the multi-pass kernels

    def fwd_long():
        dropkey_impl.forward(xs, causal=False, dropkey_p=0.0, seed=0)
        return 2 * xs.numel() * 4

    yield "dropkey_softmax fwd", "B=1 H=2 L=20 S=5000 2-pass fp32", fwd_long


# ----------------------------------------------------------------------------------- timestep_norm

def _timestep_norm_variants(space):
    """Unpacked rows and packed rows (cu_seqlens: PACKED, the row length read per document, so L
    carries no alignment hint there)."""
    variants = []
    for dt, be, nw, packed in product(DTYPES, space["block_elems"], space["num_warps"], (False, True)):
        for bd in timestep_norm_impl.BLOCK_D_TIERS:
            T, _ = timestep_norm_impl._tiling(bd, be)
            # packed launches pass the int64 document bounds; unpacked ones cu_ptr=None (a constexpr to the JIT)
            c = (("PACKED", packed), ("OUT_BF16", dt == "bf16"), ("BLOCK_T", T), ("BLOCK_D", bd)) + \
                (() if packed else (("cu_ptr", None),))
            cu = (("cu_ptr", "*i64"),) if packed else ()
            div16 = frozenset({"D", "Dg"} if packed else {"L", "D", "Dg"}) | GRID_DIV16
            tag = f"{dt} T={T} D={bd} warps={nw}" + (" packed" if packed else "")
            variants.append(Variant(
                op="timestep_norm", kernel="_timestep_norm_fwd_kernel",
                fn=timestep_norm_impl._timestep_norm_fwd_kernel,
                arg_types=(("x_ptr", f"*{dt}"), ("y_ptr", f"*{dt}"), ("scale_ptr", "*fp32"), ("bias_ptr", "*fp32"),
                           ("pad_ptr", "*u8"), ("pc_ptr", "*i64"), ("pm_ptr", "*fp32"), ("pv_ptr", "*fp32"),
                           ("mu_ptr", "*fp32"), ("rstd_ptr", "*fp32"), ("gmu_ptr", "*fp32"), ("k_ptr", "*fp32"),
                           ("mean_ptr", "*fp32"), ("var_ptr", "*fp32"), *cu,
                           ("L", "i32"), ("D", "i32"), ("G", "i32"), ("Dg", "i32"), ("eps", "fp32"), *GRID_OFFSETS),
                constexprs=c, div16=div16, num_warps=nw, label="fwd " + tag,
            ))
            variants.append(Variant(
                op="timestep_norm", kernel="_timestep_norm_bwd_kernel",
                fn=timestep_norm_impl._timestep_norm_bwd_kernel,
                arg_types=(("x_ptr", f"*{dt}"), ("dy_ptr", f"*{dt}"), ("dx_ptr", f"*{dt}"), ("scale_ptr", "*fp32"),
                           ("pad_ptr", "*u8"), ("pc_ptr", "*i64"), ("nend_ptr", "*i64"), ("mu_ptr", "*fp32"),
                           ("rstd_ptr", "*fp32"), ("gmu_ptr", "*fp32"), ("mu0_ptr", "*fp32"), ("k_ptr", "*fp32"),
                           ("dmean_ptr", "*fp32"), ("dvar_ptr", "*fp32"), ("dscale_ptr", "*fp32"),
                           ("dbias_ptr", "*fp32"), ("dpm_ptr", "*fp32"), ("dpv_ptr", "*fp32"), *cu,
                           ("L", "i32"), ("D", "i32"), ("G", "i32"), ("Dg", "i32"), *GRID_OFFSETS),
                constexprs=c, div16=div16, num_warps=nw, label="bwd " + tag,
            ))
    return variants


def _timestep_norm_bytes():
    """Ideal forward: x, padding mask, prev state, scale, bias read once; y, the saved per-step
    statistics (mu, rstd, gmu: [B, L, G] each), K and (mean, var) written once. Ideal backward:
    x, dy, the saved statistics, the mask and small per-(b, g) inputs read once; dx and the
    [B, D] dscale / dbias partials and dprev written once. Packed (one row of n documents, one
    empty): the states and partials are per document, and the n + 1 document bounds are read."""
    L, D, G = 256, 256, 4
    f = 4
    for B, cu in ((2, None), (1, torch.tensor([0, 37, 37, 150, 256]))):
        n = B if cu is None else cu.numel() - 1
        x = torch.randn(B, L, D)
        scale, bias = torch.randn(D), torch.randn(D)
        pc = torch.full((n,), 3, dtype=torch.int64)
        pm, pv = torch.randn(n, G), torch.rand(n, G) + 0.5
        pad = torch.zeros(B, L, dtype=torch.bool)
        stats = 3 * B * L * G * f
        bounds = 0 if cu is None else 8 * cu.numel()
        shape = f"B={B} L={L} D={D} G={G} fp32" + ("" if cu is None else f" {n} documents")

        def fwd(x=x, scale=scale, bias=bias, pc=pc, pm=pm, pv=pv, pad=pad, cu=cu, n=n, stats=stats, bounds=bounds):
            timestep_norm_impl.forward(x, scale, bias, pc, pm, pv, pad, G, 1e-5, cu_seqlens=cu)
            return (2 * x.numel() * f + stats + B * L + 2 * D * f + 8 * n + 2 * n * G * f + 3 * n * G * f + bounds)

        yield "timestep_norm fwd", shape, fwd
        _, _, _, _, saved = timestep_norm_impl.forward(x, scale, bias, pc, pm, pv, pad, G, 1e-5,
                                                                 cu_seqlens=cu)
        dy = torch.randn_like(x)
        dm, dv = torch.randn(n, G), torch.randn(n, G)

        def bwd(x=x, dy=dy, dm=dm, dv=dv, saved=saved, cu=cu, n=n, stats=stats, bounds=bounds):
            timestep_norm_impl.backward(dy, dm, dv, saved, G, cu_seqlens=cu)
            return (3 * x.numel() * f + stats + B * L + D * f + 16 * n + 4 * n * G * f + 2 * n * D * f
                    + 2 * n * G * f + bounds)

        yield "timestep_norm bwd", shape, bwd


# ------------------------------------------------------------------------------------- cema_kernel

def _cema_kernel_variants(space):
    """fp32 only: the coefficients are fp32 on the Triton path."""
    common = (("p_ptr", "*fp32"), ("lq_ptr", "*fp32"), ("f_ptr", "*i64"), ("g_ptr", "*fp32"),
              ("hx_ptr", "*fp32"), ("D", "i32"), ("N", "i32"), ("L", "i32"), ("B", "i32"), *GRID_OFFSETS)
    div16 = frozenset({"D", "N", "L"}) | GRID_DIV16
    variants = []
    for bm, br, nw, aw, bn in product(space["block_m"], space["block_r"], space["num_warps"],
                                      space["analysis_warps"], cema_kernel_impl.N_TILES):
        size = f"m={bm} r={br} n={bn}"
        variants.append(Variant(
            op="cema_kernel", kernel="_cema_fwd_kernel", fn=cema_kernel_impl._cema_fwd_kernel,
            arg_types=common + (("k_ptr", "*fp32"), ("b_ptr", "*fp32")),
            constexprs=(("BLOCK_M", bm), ("BLOCK_R", br), ("BLOCK_N", bn)),
            div16=div16, num_warps=nw, label=f"fwd {size} warps={nw}"))
        variants.append(Variant(
            op="cema_kernel", kernel="_cema_bwd_kernel", fn=cema_kernel_impl._cema_bwd_kernel,
            arg_types=common + (("LK", "i32"), ("dk_ptr", "*fp32"), ("db_ptr", "*fp32"), ("dp_ptr", "*fp32"),
                                ("dlq_ptr", "*fp32"), ("dg_ptr", "*fp32"), ("dhx_ptr", "*fp32")),
            constexprs=(("BLOCK_M", bm), ("BLOCK_R", br), ("BLOCK_N", bn)),
            div16=div16 | {"LK"}, num_warps=aw, label=f"bwd {size} warps={aw}"))
    return variants


def _cema_kernel_bytes():
    """Ideal: every kernel input read once (p, log|q| = Re log_q, gamma, hx, dk, db, and the D*N int64
    phase table F the launcher derives from arg q in place of Im log_q) and every output written once."""
    D, N, B, L = 4, 16, 2, 4096
    p, log_q, gamma, hx = _coefficients(D, N, B)
    f = cema_kernel_impl.phase_fraction(log_q)

    def fwd():
        k, b = cema_kernel_impl.forward(p, log_q, gamma, L, hx)
        return nbytes(p, log_q.real, gamma, hx, f, k, b)

    def bwd():
        dk, db = torch.randn(D, L), torch.randn(B, D, L)
        out = cema_kernel_impl.backward(dk, db, p, log_q, gamma, L, hx)
        return nbytes(dk, db, p, log_q.real, gamma, hx, f, *out)

    yield "cema_kernel fwd", f"D={D} N={N} B={B} L={L} fp32", fwd
    yield "cema_kernel bwd", f"D={D} N={N} B={B} L={L} fp32", bwd


# -------------------------------------------------------------------------------------- ema_hidden

def _ema_hidden_variants(space):
    div16 = frozenset({"D", "N", "L"}) | GRID_DIV16
    variants = []
    for bm, br, nw, aw, bn in product(space["block_m"], space["block_r"], space["num_warps"],
                                      space["analysis_warps"], cema_kernel_impl.N_TILES):
        size = f"m={bm} r={br} n={bn}"
        for dt in DTYPES:
            variants.append(Variant(
                op="ema_hidden", kernel="_ema_hidden_fwd_kernel", fn=ema_hidden_impl._ema_hidden_fwd_kernel,
                arg_types=(("x_ptr", f"*{dt}"), ("p_ptr", "*fp32"), ("lq_ptr", "*fp32"), ("f_ptr", "*i64"),
                           ("hx_ptr", "*fp32"), ("h_ptr", "*fp32"), ("v_ptr", "*fp32"), ("w_ptr", "*fp32"),
                           ("D", "i32"), ("N", "i32"), ("L", "i32"), ("B", "i32"), ("M", "i32"),
                           ("HAS_HX", "i32"), ("WEIGHTED", "i32")),
                constexprs=(("BLOCK_M", bm), ("BLOCK_R", br), ("BLOCK_N", bn)),
                div16=div16, num_warps=aw, label=f"fwd x={dt} {size} warps={aw}"))
        variants.append(Variant(
            op="ema_hidden", kernel="_ema_hidden_dx_kernel", fn=ema_hidden_impl._ema_hidden_dx_kernel,
            arg_types=(("dh_ptr", "*fp32"), ("p_ptr", "*fp32"), ("lq_ptr", "*fp32"), ("f_ptr", "*i64"),
                       ("dx_ptr", "*fp32"), ("D", "i32"), ("N", "i32"), ("L", "i32"), ("B", "i32"), ("M", "i32"),
                       *GRID_OFFSETS),
            constexprs=(("BLOCK_M", bm), ("BLOCK_R", br), ("BLOCK_N", bn)),
            div16=div16, num_warps=nw, label=f"dx {size} warps={nw}"))
    return variants


def _ema_hidden_bytes():
    """Ideal: every kernel input read once (x, p, Re log_q, hx / dh, p, Re log_q, and the D*N int64
    phase table F derived from arg q in place of Im log_q) and every output written once (h, V, W / dx)."""
    B, D, N, L = 2, 4, 16, 4096
    p, log_q, _, hx = _coefficients(D, N, B)
    f = cema_kernel_impl.phase_fraction(log_q)
    x = torch.randn(B, D, L)

    def fwd():
        h, V, W = ema_hidden_impl.forward(x, p, log_q, hx, True)
        return nbytes(x, p, log_q.real, hx, f, h, V, W)

    def bwd():
        dh = torch.complex(torch.randn(B, D, N), torch.randn(B, D, N))
        dx, *_ = ema_hidden_impl.backward(dh, p, log_q, None, None, None, L, (True, False, False, False))
        return nbytes(dh, p, log_q.real, f, dx)

    yield "ema_hidden fwd", f"B={B} D={D} N={N} L={L} fp32", fwd
    yield "ema_hidden bwd (dx)", f"B={B} D={D} N={N} L={L} fp32", bwd


# ----------------------------------------------------------------------------------------- fftconv

def _fftconv_variants(space):
    """direct_max_len only selects which direct tiles are reachable."""
    variants = []
    for values in product(*(space[k] for k in ("num_warps", "work_warps", "work_bc", "direct_warps"))):
        cfg = dict(zip(("num_warps", "work_warps", "work_bc", "direct_warps"), values))
        longest = max(space["direct_max_len"])
        tiles = tuple(bl for bl in fftconv_impl.DIRECT_TILES
                      if longest > 0 and bl <= max(16, 1 << (longest - 1).bit_length()))
        variants += _fftconv_config_variants(cfg, tiles)
    return variants


def _fftconv_config_variants(cfg, direct_tiles):
    impl = fftconv_impl
    variants = []
    fwd_ints = (("B", "i32"), ("D", "i32"), ("L", "i32"), ("sxb", "i32"), ("sxd", "i32"), ("sxt", "i32"),
                ("HAS_BIAS", "i32"), ("HAS_SKIP", "i32"))
    bwd_ints = (("B", "i32"), ("D", "i32"), ("L", "i32"), ("syb", "i32"), ("syd", "i32"), ("syt", "i32"),
                ("sxb", "i32"), ("sxd", "i32"), ("sxt", "i32"), ("NEED_X", "i32"), ("NEED_K", "i32"),
                ("HAS_SKIP", "i32"))
    div16 = frozenset({"D", "L", "sxb", "sxd", "syb", "syd"})
    for dt in ("fp32", "bf16"):
        fwd_ptrs = (("x_ptr", f"*{dt}"), ("k_ptr", "*fp32"), ("b_ptr", "*fp32"), ("om_ptr", "*fp32"),
                    ("y_ptr", f"*{dt}"))
        bwd_ptrs = (("dy_ptr", f"*{dt}"), ("x_ptr", f"*{dt}"), ("k_ptr", "*fp32"), ("om_ptr", "*fp32"),
                    ("dx_ptr", "*fp32"), ("dk_ptr", "*fp32"), ("dom_ptr", "*fp32"))
        out_bf16 = dt == "bf16"
        for bl in direct_tiles:
            variants.append(Variant(
                op="fftconv", kernel="_direct_fwd_kernel", fn=impl._direct_fwd_kernel, arg_types=fwd_ptrs + fwd_ints,
                constexprs=(("BL", bl), ("OUT_BF16", out_bf16)), div16=div16, num_warps=cfg["direct_warps"],
                label=f"direct fwd x={dt} L<={bl}"))
            variants.append(Variant(
                op="fftconv", kernel="_direct_bwd_kernel", fn=impl._direct_bwd_kernel, arg_types=bwd_ptrs + bwd_ints,
                constexprs=(("BL", bl),), div16=div16, num_warps=cfg["direct_warps"],
                label=f"direct bwd x={dt} L<={bl}"))
        fwd_ptrs_t = fwd_ptrs + (("tw_ptr", "*fp32"),)
        bwd_ptrs_t = bwd_ptrs + (("tw_ptr", "*fp32"),)
        for a in impl.TILE_FACTORS:
            tile = (("A", a), ("LOG_A", impl._log2(a)))
            w = impl.tile_warps(256 * a, cfg["num_warps"])
            variants.append(Variant(
                op="fftconv", kernel="_tile_fwd_kernel", fn=impl._tile_fwd_kernel,
                arg_types=fwd_ptrs_t + fwd_ints + (("PAIRS", "i32"),),
                constexprs=tile + (("OUT_BF16", out_bf16),), div16=div16, num_warps=w, num_stages=impl.FFT_STAGES,
                label=f"tile fwd x={dt} N={256 * a} warps={w}"))
            variants.append(Variant(
                op="fftconv", kernel="_tile_bwd_kernel", fn=impl._tile_bwd_kernel,
                arg_types=bwd_ptrs_t + bwd_ints + (("PAIRS", "i32"),),
                constexprs=tile, div16=div16, num_warps=w, num_stages=impl.FFT_STAGES,
                label=f"tile bwd x={dt} N={256 * a} warps={w}"))
        # the slice path (N > MAX_TILE_FFT): C = SLICE_C point tiles, R and N runtime; the combine
        # kernel's BJ output blocks per program for each R = N / C up to MAX_LENGTH's FFT size
        a = impl.tile_factor(impl.SLICE_C)
        tile = (("A", a), ("LOG_A", impl._log2(a)))
        w = impl.tile_warps(impl.SLICE_C, cfg["num_warps"])
        logs = (("R", "i32"), ("LOG_N", "i32"), ("LOG_R", "i32"))
        n = f"C={impl.SLICE_C} warps={w}"
        if dt == "fp32":
            variants.append(Variant(
                op="fftconv", kernel="_slice_spec_kernel", fn=impl._slice_spec_kernel,
                arg_types=(("k_ptr", "*fp32"), ("tw_ptr", "*fp32"), ("ks_ptr", "*fp32"), ("D", "i32"), ("L", "i32"))
                + logs, constexprs=tile, div16=div16, num_warps=w, num_stages=impl.FFT_STAGES,
                label=f"slice spectrum {n}"))
        conv_args = (("x_ptr", f"*{dt}"), ("ks_ptr", "*fp32"), ("tw_ptr", "*fp32"), ("v_ptr", "*fp32")) \
            + fwd_ints[:6] + (("CONJ", "i32"),) + logs + (("PAIRS", "i32"),)
        for ob in sorted({out_bf16, False}):
            variants.append(Variant(
                op="fftconv", kernel="_slice_conv_kernel", fn=impl._slice_conv_kernel, arg_types=conv_args,
                constexprs=tile + (("OUT_BF16", ob),), div16=div16, num_warps=w, num_stages=impl.FFT_STAGES,
                label=f"slice conv x={dt}{' bf16-out' if ob else ''} {n}"))
        variants.append(Variant(
            op="fftconv", kernel="_slice_dk_kernel", fn=impl._slice_dk_kernel,
            arg_types=(("dy_ptr", f"*{dt}"), ("x_ptr", f"*{dt}"), ("tw_ptr", "*fp32"), ("v_ptr", "*fp32"),
                       ("acc_ptr", "*fp32"), ("dom_ptr", "*fp32")) + bwd_ints[:9]
            + (("NEED_K", "i32"), ("HAS_SKIP", "i32")) + logs + (("PAIRS", "i32"),),
            constexprs=tile, div16=div16, num_warps=w, num_stages=impl.FFT_STAGES, label=f"slice dk x={dt} {n}"))
        bjs = sorted({impl._plan(L, 0)[3] for L in (2 * impl.SLICE_C << i for i in range(12)) if L <= impl.MAX_LENGTH})
        def bc(bj):
            return impl.combine_cols(bj, cfg["work_bc"], impl.SLICE_C)

        for y_dt in sorted({dt, "fp32"}):
            for bj in bjs:
                variants.append(Variant(
                    op="fftconv", kernel="_slice_out_kernel", fn=impl._slice_out_kernel,
                    arg_types=(("v_ptr", "*fp32"), ("tw_ptr", "*fp32"), ("x_ptr", f"*{dt}"), ("b_ptr", "*fp32"),
                               ("om_ptr", "*fp32"), ("y_ptr", f"*{y_dt}")) + fwd_ints + (("HAS_IM", "i32"),) + logs,
                    constexprs=(("C", impl.SLICE_C), ("BJ", bj), ("BC", bc(bj)), ("OUT_BF16", y_dt == "bf16")),
                    div16=div16, num_warps=cfg["work_warps"],
                    label=f"slice combine x={dt} y={y_dt} BJ={bj} BC={bc(bj)} warps={cfg['work_warps']}"))
    return variants


def fftconv_table_bytes(a: int) -> int:
    """Bytes of the distinct twiddle-table entries the N = 256 a point tile transform reads (the
    contiguous tiles of ``twiddle_table``): the 16-point DFT matrix, the block-diagonal diag(F_8, F_8)
    at a = 8, the W_16a twiddle tile (a > 1) and the W_N twiddle tile, cos and sin, plus the one entry
    that ``opaque_zero`` reads; the table's other entries are never touched at this size, so they are
    not part of the ideal."""
    floats = 1 + 2 * 256 + (2 * 256 if a == 8 else 0) + (2 * 256 * a if a > 1 else 0) + 2 * 256 * a
    return 4 * floats


def _fftconv_bytes():
    """The tile path and the direct path. Ideal: x, k (dy) read once, y (dx, dk) written once, plus,
    on the tile path, the twiddle-table entries the transform uses (``fftconv_table_bytes``; read
    once, their re-reads per transform are L1 hits on a GPU and show only in the "total" column)."""
    cfg = dict(fftconv_impl.DEFAULT_CONFIG)
    gen = torch.Generator().manual_seed(0)
    for B, D, L in ((4, 2, 2048), (4, 2, 64)):
        x = torch.randn(B, D, L, generator=gen)
        k = torch.randn(D, L, generator=gen)
        dy = torch.randn(B, D, L, generator=gen)
        plan = fftconv_impl._plan(L, cfg["direct_max_len"])
        table = fftconv_table_bytes(plan[1]) if plan[0] == "tile" else 0

        def fwd(x=x, k=k, table=table):
            return nbytes(x, k, fftconv_impl.forward(x, k, **cfg)) + table

        def bwd(x=x, k=k, dy=dy, table=table):
            return nbytes(dy, x, k, *fftconv_impl.backward(dy, x, k, True, True, **cfg)) + table

        yield f"fftconv fwd ({plan[0]})", f"B={B} D={D} L={L} fp32", fwd
        yield f"fftconv bwd ({plan[0]})", f"B={B} D={D} L={L} fp32", bwd


# -------------------------------------------------------------------------------------------- cema

def _cema_variants(space):
    """cema launches only the stage kernels (cema_kernel, ema_hidden, fftconv, each AOT-compiled under
    its own op with every config of cema's space); the fused bias/skip epilogue and the domega
    reduction are the fftconv kernels' runtime HAS_BIAS / HAS_SKIP flags, so no extra variants exist.
    Listed again here (the bf16 N = 4096 tile kernels, Megalodon's chunk case) so the cema rows of the
    resources report show what the composed op runs."""
    conv_space = {"num_warps": space["conv_warps"], "work_warps": space["work_warps"], "work_bc": space["work_bc"],
                  "direct_warps": space["direct_warps"], "direct_max_len": space["direct_max_len"]}
    out = []
    for v in _fftconv_variants(conv_space):
        if v.kernel.startswith("_tile") and "N=4096" in v.label and "x=bf16" in v.label:
            out.append(Variant(op="cema", kernel=v.kernel, fn=v.fn, arg_types=v.arg_types, constexprs=v.constexprs,
                               div16=v.div16, num_warps=v.num_warps, num_stages=v.num_stages,
                               label="fused " + v.label))
    return out + _cema_chunked_variants(space)


def _cema_chunked_variants(space):
    """The chunked form's kernels (ops/cema/triton_chunked.py) for every chunk > 0 of the space: the
    forward and the backward's scan kernel per x dtype and with/without hx (the scan kernel's dx in
    x's dtype, or fp32 when a state gradient is added to it), the sums kernel per x dtype, the tables
    and the finish kernels."""
    ck = cema_chunked
    tables = (("k_ptr", "*fp32"), ("win_ptr", "*fp32"), ("wout_ptr", "*fp32"), ("a_ptr", "*fp32"),
              ("pw_ptr", "*fp32"), ("hx_ptr", "*fp32"), ("omega_ptr", "*fp32"))
    out = []
    for C, BM, nw in product(space["chunk"], space["chunk_block"], space["chunk_warps"]):
        if C == 0:
            continue
        tiles = (("C", C), ("NP", ck.NP), ("BM", BM))
        for xdt, has_hx in product(("bf16", "fp32"), (False, True)):
            tag = f"C={C} BM={BM} x={xdt} hx={has_hx} warps={nw}"
            flags = (("HAS_HX", has_hx), ("OUT_BF16", xdt == "bf16"), ("PREC", ck.PREC))
            args = (("x_ptr", "*" + xdt), ("y_ptr", "*" + xdt)) + tables + (
                ("D", "i32"), ("L", "i32"), ("N", "i32"), ("nblk", "i32"))
            out.append(Variant(op="cema", kernel="_fwd_kernel", fn=ck._fwd_kernel, arg_types=args,
                               constexprs=tiles + flags, div16=frozenset({"L", "D"}), num_warps=nw,
                               label="chunked " + tag))
            for dxdt in dict.fromkeys((xdt, "fp32")):
                args = ((("x_ptr", "*" + xdt), ("g_ptr", "*" + xdt), ("dx_ptr", "*" + dxdt), ("s_ptr", "*fp32"),
                         ("du_ptr", "*fp32"), ("dhx_ptr", "*fp32")) + tables
                        + (("D", "i32"), ("L", "i32"), ("N", "i32"), ("nblk", "i32")))
                fl = (("HAS_HX", has_hx), ("OUT_BF16", dxdt == "bf16"), ("PREC", ck.PREC), ("X_EXACT", xdt == "bf16"))
                out.append(Variant(op="cema", kernel="_bwd_scan_kernel", fn=ck._bwd_scan_kernel, arg_types=args,
                                   constexprs=tiles + fl, div16=frozenset({"L", "D"}), num_warps=nw,
                                   label=f"chunked {tag} dx={dxdt}"))
        f64 = tuple((n, "*fp64") for n in ("p_ptr", "lq_ptr", "g_ptr"))
        args = f64 + tuple((n, "*fp32") for n in ("k_ptr", "win_ptr", "wout_ptr", "a_ptr", "pw_ptr")) + (("N", "i32"),)
        out.append(Variant(op="cema", kernel="_tables_kernel", fn=ck._tables_kernel, arg_types=args, constexprs=tiles,
                           div16=frozenset(), num_warps=ck.TABLE_WARPS, label=f"chunked tables C={C} BM={BM}"))
        args = f64 + tuple((n, "*fp32") for n in ("dk_ptr", "aw_ptr", "wi_ptr", "pc_ptr")) + tuple(
            (n, "*fp64") for n in ("dp_ptr", "dlq_ptr", "dg_ptr")) + (("N", "i32"),)
        out.append(Variant(op="cema", kernel="_finish_kernel", fn=ck._finish_kernel, arg_types=args,
                           constexprs=(("C", C), ("NP", ck.NP)), div16=frozenset(), num_warps=ck.TABLE_WARPS,
                           label=f"chunked finish C={C}"))
        for xdt in ("bf16", "fp32"):
            args = ((("x_ptr", "*" + xdt), ("g_ptr", "*" + xdt))
                    + tuple((n, "*fp32") for n in ("s_ptr", "du_ptr", "dk_ptr", "aw_ptr", "wi_ptr", "pc_ptr",
                                                    "domega_ptr"))
                    + (("B", "i32"), ("D", "i32"), ("L", "i32"), ("nblk", "i32")))
            out.append(Variant(op="cema", kernel="_bwd_sums_kernel", fn=ck._bwd_sums_kernel, arg_types=args,
                               constexprs=tiles + (("PREC", ck.PREC), ("X_EXACT", xdt == "bf16")),
                               div16=frozenset({"L", "D"}), num_warps=nw,
                               label=f"chunked C={C} BM={BM} x={xdt} warps={nw}"))
    return out


def _cema_bytes():
    """The fused convolution launches of cema. Ideal: forward reads x, k, b, omega (and the twiddle
    table) once and writes y once; backward reads dy, x, k, omega (and the table) once and writes dx,
    dk, domega once (the bias and the skip term cost no pass of their own)."""
    cfg = cema_impl._split(cema_impl.DEFAULT_CONFIG)[1]
    gen = torch.Generator().manual_seed(0)
    B, D, L = 4, 2, 2048
    x = torch.randn(B, D, L, generator=gen)
    k = torch.randn(D, L, generator=gen)
    b = torch.randn(B, D, L, generator=gen)
    om = torch.randn(D, generator=gen)
    dy = torch.randn(B, D, L, generator=gen)
    table = fftconv_table_bytes(fftconv_impl._plan(L, cfg["direct_max_len"])[1])  # the N = 4096 tile's entries

    def fwd():
        return nbytes(x, k, b, om, fftconv_impl.conv_fwd(x, k, bias=b, omega=om, **cfg)) + table

    def bwd():
        return nbytes(dy, x, k, om, *fftconv_impl.conv_bwd(dy, x, k, True, True, om, **cfg)) + table

    yield "cema fused conv fwd", f"B={B} D={D} L={L} fp32", fwd
    yield "cema fused conv bwd", f"B={B} D={D} L={L} fp32", bwd
    yield from _cema_chunked_bytes()


def _cema_chunked_bytes():
    """The chunked form's launches (ops/cema/triton_chunked.py). Ideal: each pass's tables kernel
    reads the float64 coefficients (p, log q, gamma) once and writes the per-feature tables once,
    which the pass's kernels then read once (counted stored and loaded); the forward reads x and
    omega once and writes y once; the backward's scan and sums kernels read x, dy and omega once
    (the sums kernel's second read of x and dy is the same addresses) and write dx, dhx and the
    per-feature sums once, the chunk states S and their gradients dU are written by the scan kernel
    and read by the sums kernel (each once stored, once loaded), and the finish kernel reads the
    sums it needs (not domega) and the coefficients and writes their float64 gradients once."""
    ck = cema_chunked
    cfg = {k: cema_impl.DEFAULT_CONFIG[k] for k in cema_impl.CHUNK_SPACE}
    B, D, N, L = 2, 2, 16, 1000
    gen = torch.Generator().manual_seed(1)
    p, log_q, gamma, _ = _coefficients(D, N, B)
    x = torch.randn(B, D, L, generator=gen)
    om = torch.randn(D, generator=gen)
    dy = torch.randn(B, D, L, generator=gen)
    C, BM = cfg["chunk"], cfg["chunk_block"]
    tab = ck.Tables(p, log_q, gamma, C, BM)
    tables = nbytes(tab.k, tab.win, tab.wout, tab.a, tab.pw)
    coefficients = nbytes(tab.p, tab.lq, tab.gamma)                          # float64, read by the tables kernel
    f32 = 4
    states = B * D * (-(-L // (C * BM)) * BM) * 2 * ck.NP * f32             # S (and dU) [R, nblk*BM, 2, NP]
    sums = D * (C + 2 * ck.NP * C * 2 + 2 * ck.NP + 1) * f32                # dk, A, Wi, pc, domega
    finish = (sums - D * f32) + coefficients   # reads the sums but domega; writes dp, dlq, dgamma (the coefficients' sizes)

    def fwd():
        return nbytes(x, om, ck.conv_fwd(x, p, log_q, gamma, om, None, **cfg)) + coefficients + 2 * tables

    def bwd():
        dx = ck.conv_bwd(dy, x, p, log_q, gamma, om, None, (True,) * 6, torch.float32, **cfg)[0]
        return (nbytes(dy, x, om, dx) + coefficients + 2 * tables + 2 * 2 * states + B * D * 2 * ck.NP * f32 + sums
                + finish)

    yield "cema chunked fwd", f"B={B} D={D} N={N} L={L} C={C} fp32", fwd
    yield "cema chunked bwd", f"B={B} D={D} N={N} L={L} C={C} fp32", bwd


# --------------------------------------------------------------------------------------- attention

#: (dh, dv) pairs compiled ahead of time: realistic head dims, and the 7B config (z_dim 256, value 2048)
ATTENTION_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (256, 2048))

_ATTENTION_SCALARS = (("L", "i32"), ("S", "i32"), ("H", "i32"), ("DH", "i32"), ("DV", "i32"), ("shift", "i32"),
                      ("causal", "i32"), ("chunk", "i32"), ("bc", "i32"), ("seed_k", "i32"), ("thr_i", "i32"),
                      ("scale", "fp32"), *GRID_OFFSETS)


def _attention_launches(dh, dv, BLOCK_M, BLOCK_N, exact=False):
    """Every (kernel, fn, pointer names, extra constexprs, tile constexprs) a forward + backward
    launches for head dims (dh, dv), and the delta kernel's (rows, BLOCK_DV)."""
    impl = attention_impl
    t = impl._tiles(dh, dv, BLOCK_M, BLOCK_N, exact)
    d = (("BLOCK_DH", t["BLOCK_DH"]), ("BLOCK_DV", t["BLOCK_DV"]))
    tiles = {name: (("BLOCK_M", t[name][0]), ("BLOCK_N", t[name][1])) + d for name in ("fwd", "dq", "dkdv")}
    out = [("_attn_fwd_kernel", impl._attn_fwd_kernel, ("q_ptr", "k_ptr", "v_ptr", "o_ptr"), (), tiles["fwd"])]
    ptrs = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr")
    if t["ONE_DV"]:
        out.append(("_attn_bwd_dkdv_kernel", impl._attn_bwd_dkdv_kernel, ptrs,
                    (("COMPUTE_DK", True), ("COMPUTE_DV", True), ("ONE_DV", True)), tiles["dkdv"]))
    else:
        for dk_, dv_ in ((True, False), (False, True)):
            out.append(("_attn_bwd_dkdv_kernel", impl._attn_bwd_dkdv_kernel, ptrs,
                        (("COMPUTE_DK", dk_), ("COMPUTE_DV", dv_), ("ONE_DV", False)), tiles["dkdv"]))
    out.append(("_attn_bwd_dq_kernel", impl._attn_bwd_dq_kernel, ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr"),
                (("ONE_DV", t["ONE_DV"]),), tiles["dq"]))
    return out, (t["dq"][0], t["BLOCK_DV"])


def _attention_variants(space):
    """Every kernel x config x dtype x (DROP, LAPLACE) x tiling for the head dims in
    ATTENTION_HEAD_DIMS, unpacked and packed (cu_seqlens: PACKED, the row lengths read per
    document, so L and S carry no alignment hint there); identical specialisations are listed once."""
    impl = attention_impl
    variants, seen = [], set()
    for dt, bm0, bn0, nw, ns_f, ns_b, mr in product(DTYPES, space["BLOCK_M"], space["BLOCK_N"],
                                                  space["num_warps"], space["num_stages"],
                                                  space.get("num_stages_bwd", [1]), space.get("maxnreg_bwd", [None])):
        prec = impl._prec(dt)
        for dh, dv in ATTENTION_HEAD_DIMS:
            if impl._exact(dt) and dh > impl.MAX_EXACT_HEAD_DIM:
                continue  # refused on the GPU by not_supported_reasons: never launched there
            launches, (bm, bdv) = _attention_launches(dh, dv, bm0, bn0, exact=impl._exact(dt))
            for packed in (False, True):
                # packed launches pass the int64 document bounds; unpacked ones cu_ptr=None (a constexpr to the JIT)
                cu = (("cu_ptr", "*i64"),) if packed else ()
                cu_none = () if packed else (("cu_ptr", None),)
                lengths = () if packed else ("L", "S")
                suffix = " packed" if packed else ""
                key = ("delta", dt, bm, bdv, nw, ns_b, mr, packed)
                if key not in seen:
                    seen.add(key)
                    variants.append(Variant(
                        op="attention", kernel="_attn_bwd_delta_kernel", fn=impl._attn_bwd_delta_kernel,
                        arg_types=(("o_ptr", f"*{dt}"), ("do_ptr", f"*{dt}"), ("delta_ptr", "*fp32"), *cu,
                                   ("L", "i32"), ("H", "i32"), ("DV", "i32"), *GRID_OFFSETS),
                        constexprs=(("PACKED", packed), ("BLOCK_M", bm), ("BLOCK_DV", bdv)) + cu_none,
                        div16=frozenset({*lengths[:1], "DV"}) | GRID_DIV16, num_warps=nw, num_stages=ns_b, maxnreg=mr,
                        label=f"bwd delta {dt} m={bm} dv={bdv} warps={nw} maxnreg={mr}{suffix}"))
                for (name, fn, ptrs, extra, tiles), drop, lap in product(launches, (False, True), (False, True)):
                    consts = (("OUT_BF16", dt == "bf16"), ("DROP", drop), ("LAPLACE", lap), ("PREC", prec)) + extra \
                        + tiles
                    fwd = name == "_attn_fwd_kernel"
                    ns, cap = ((impl.EXACT_FWD_STAGES if impl._exact(dt) else ns_f), None) if fwd else (ns_b, mr)
                    key = (name, dt, consts, nw, ns, cap, packed)
                    if key in seen:
                        continue
                    seen.add(key)
                    types = tuple((n, f"*{dt}") for n in ptrs) + (
                        ("lse_ptr", "*fp32"), ("delta_ptr", "*fp32"), ("bidx_ptr", "*i64")) + cu
                    tag = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in consts[1:])
                    variants.append(Variant(
                        op="attention", kernel=name, fn=fn, arg_types=types + _ATTENTION_SCALARS,
                        constexprs=consts + (("PACKED", packed),) + cu_none,
                        div16=frozenset({*lengths, "DH", "DV"}) | GRID_DIV16, num_warps=nw, num_stages=ns, maxnreg=cap,
                        label=f"{name} {dt} (dh={dh} dv={dv}) {tag} warps={nw} stages={ns}"
                              + ("" if fwd else f" maxnreg={cap}") + suffix))
    return variants


def _visited_tiles(L, S, causal, chunk, bc, rows, keys, by_keys=False):
    """Number of (rows x keys) score tiles the kernels visit: the Python twin of the kernels'
    _key_range / _query_range (``by_keys``: programs own key blocks and walk query blocks, as dk/dv does)."""
    shift, n = S - L, 0
    if not by_keys:
        for i0 in range(0, L, rows):
            p0, p1 = i0 + shift, min(i0 + rows, L) - 1 + shift
            lo, hi = 0, (min(S, p1 + 1) if causal else S)
            if chunk:
                lo, hi = (p0 // chunk - bc) * chunk, min(hi, (p1 // chunk + 1) * chunk)
            lo = max(lo, 0) // keys * keys
            n += max(0, -(-(hi - lo) // keys))
        return n
    for j0 in range(0, S, keys):
        j1 = min(j0 + keys, S)
        lo = j0 - shift if causal else 0
        hi = L
        if chunk:
            lo, hi = max(lo, j0 // chunk * chunk - shift), min(L, ((j1 - 1) // chunk + 1 + bc) * chunk - shift)
        lo = max(lo, 0) // rows * rows
        n += max(0, -(-(hi - lo) // rows))
    return n


def attention_flop_counts(B, L, S, H, dh, dv, causal=True, chunk_size=None, block_causal=False, BLOCK_M=64,
                          BLOCK_N=64, exact=False):
    """{"fwd"|"bwd": (ideal FLOPs, executed tile FLOPs)} of the Triton attention's matmuls.

    Ideal (bench/roofline.py's convention without the elementwise 5 P): fwd 2 P (dh + dv), bwd
    2 P (3 dh + 2 dv) with P the visible (i, j) pairs. Executed: every visited tile at its padded
    size (BLOCK_DH, BLOCK_DV), including the QK^T recomputed per dv tile when dv is tiled."""
    vis = 0
    for i in range(L):
        pos = i + S - L
        for j in range(S):
            ok = (not causal) or j <= pos
            if chunk_size:
                ok = ok and (j // chunk_size == pos // chunk_size
                             or (block_causal and j // chunk_size == pos // chunk_size - 1))
            vis += ok
    P = B * H * vis
    t = attention_impl._tiles(dh, dv, BLOCK_M, BLOCK_N, exact)
    bdh, bdv, nt = t["BLOCK_DH"], t["BLOCK_DV"], -(-dv // t["BLOCK_DV"])
    m = (causal, chunk_size or 0, int(bool(block_causal and chunk_size)))
    bh = B * H
    fm, fn = t["fwd"]
    fwd = bh * _visited_tiles(L, S, *m, fm, fn) * nt * 2 * fm * fn * (bdh + bdv)
    qm, qn = t["dq"]
    dq = bh * _visited_tiles(L, S, *m, qm, qn) * 2 * qm * qn * (2 * bdh + nt * bdv)
    km, kn = t["dkdv"]
    kt = bh * _visited_tiles(L, S, *m, km, kn, by_keys=True)
    if t["ONE_DV"]:
        dkdv = kt * 2 * km * kn * (2 * bdh + 2 * bdv)
    else:  # dk launch (dP over all dv tiles) + dv launch (scores recomputed per dv tile)
        dkdv = kt * 2 * km * kn * (2 * bdh + nt * bdv) + kt * nt * 2 * km * kn * (bdh + bdv)
    return {"fwd": (2 * P * (dh + dv), fwd), "bwd": (2 * P * (3 * dh + 2 * dv), dq + dkdv)}


def _attention_bytes():
    """Ideal forward: q, k, v read once, o and lse written once. Ideal backward: q, k, v, o, dO and
    lse read once, dq, dk, dv written once, plus the [B, H, L] fp32 delta (written by the
    preprocess kernel, read back) that the flash backward needs. The shape text carries the
    matmul FLOPs: ideal (visible pairs) and executed (visited tiles, see attention_flop_counts)."""
    B, H, L, dh, dv = 1, 2, 256, 64, 64
    f = 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, L, H, d, generator=gen) for d in (dh, dh, dv))
    lse_bytes = B * H * L * f
    for label, kw in (("causal", dict(causal=True, chunk_size=None, block_causal=False)),
                      ("chunk64 block_causal p=0.1", dict(causal=True, chunk_size=64, block_causal=True))):
        kw = dict(scale=dh ** -0.5, dropkey_p=0.1 if "p=0.1" in label else 0.0, seed=3, attn_fn="softmax", **kw)
        fl = attention_flop_counts(B, L, L, H, dh, dv, kw["causal"], kw["chunk_size"], kw["block_causal"],
                                   exact=True)
        shape = f"B={B} H={H} L=S={L} dh={dh} dv={dv} {label} fp32"

        def fwd(kw=kw):
            attention_impl.forward(q, k, v, **kw)
            return (2 * q.numel() + 2 * v.numel()) * f + lse_bytes

        yield "attention fwd", f"{shape}; GFLOP ideal {fl['fwd'][0] / 1e9:.3f} kernel {fl['fwd'][1] / 1e9:.3f}", fwd
        o, lse = attention_impl.forward(q, k, v, **kw)
        do = torch.randn(o.shape, generator=gen)

        def bwd(kw=kw, o=o, lse=lse, do=do):
            attention_impl.backward(do, q, k, v, o, lse, **kw)
            return (2 * (q.numel() + k.numel() + v.numel()) + 2 * o.numel()) * f + lse_bytes + 2 * lse_bytes

        yield "attention bwd", f"{shape}; GFLOP ideal {fl['bwd'][0] / 1e9:.3f} kernel {fl['bwd'][1] / 1e9:.3f}", bwd


# ------------------------------------------------------------------------------------ entry points

_DECLARATIONS = {
    "attention": (attention_impl, _attention_variants, _attention_bytes),
    "cema": (cema_impl, _cema_variants, _cema_bytes),
    "cema_kernel": (cema_kernel_impl, _cema_kernel_variants, _cema_kernel_bytes),
    "dropkey_softmax": (dropkey_impl, _dropkey_softmax_variants, _dropkey_softmax_bytes),
    "ema_hidden": (ema_hidden_impl, _ema_hidden_variants, _ema_hidden_bytes),
    "fftconv": (fftconv_impl, _fftconv_variants, _fftconv_bytes),
    "rotary": (rotary_impl, _rotary_variants, _rotary_bytes),
    "timestep_norm": (timestep_norm_impl, _timestep_norm_variants, _timestep_norm_bytes),
}

#: ops whose Triton variants, byte cases are declared here
DECLARED_OPS = tuple(sorted(_DECLARATIONS))


def _declaration(op):
    if op not in _DECLARATIONS:
        raise KeyError(f"no Triton variants declared for op {op!r} (declared: {', '.join(DECLARED_OPS)}); "
                       "add them to bench/triton_variants.py")
    return _DECLARATIONS[op]


def aot_variants(op: str, space: dict | None = None) -> list[Variant]:
    """Every variant ``op``'s Triton backend launches with the configs of ``space`` ({knob: [values]},
    e.g. one value per knob for one config); None: the backend's whole config space on every tested
    Triton release (``CONFIG_SPACE_ALL_RELEASES`` where the module prunes its ``CONFIG_SPACE`` for
    the running release with _triton_common.release_config_space: the report of an older release
    lists the pruned variants too, flagged)."""
    impl, variants, _ = _declaration(op)
    return variants(getattr(impl, "CONFIG_SPACE_ALL_RELEASES", impl.CONFIG_SPACE) if space is None else space)


def bytes_cases(op: str):
    """(kernel name, shape text, run) cases of ``op`` for the interpreter byte counter."""
    return _declaration(op)[2]()
