"""CUDA backend of attention: its kernels are cuda/flash_attention.cuh (CuTe flash attention,
forward and the three backward kernels) and cuda/dropkey_softmax.cuh (through
ops/dropkey_softmax/cuda_impl.py); this file is their whole launch path, two paths (see
AttentionBackend):

* "flash": the fused kernels, launched with their Params struct by value.
* "matmul": torch matmuls around the dropkey_softmax kernels.

Both run on a GPU through the NVRTC runtime (cuda/runtime.py) and in the CPU emulator (tests),
from the same :class:`~megalodon_kernels.cuda.launch.Launch` records.
"""
from __future__ import annotations

import ctypes

import torch

from ...cuda import runtime
from ...cuda.backend import Backend
from ...cuda.launch import Kernel, acc_dtype, launch, ptr, struct_arg
from ..dropkey_rule import seed_key, threshold
from ..dropkey_softmax import cuda_impl as dropkey_cuda

#: path: "auto" = the CuTe flash kernel where it supports the inputs, else "matmul" (cuBLAS +
#: dropkey_softmax); "flash" (not tuned: it refuses what it cannot run) is accepted as a forced path
CONFIG_SPACE: dict = {"path": ["auto", "matmul"]}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}

# ------------------------------------------------------------------------------------------------
# flash: configurations (FwdCfg / BwdCfg / FwdSmem / BwdSmem of flash_attention.cuh)
# ------------------------------------------------------------------------------------------------

#: Padded head dims the flash kernels are instantiated for (q/k are zero-padded up to one).
FLASH_HEAD_DIMS = (64, 128, 256)
BM = BN = 64  # query / key rows per tile
#: element type of q/k/v -> the kernels' element type (tensor-core tiles: bf16 and fp16 on a GPU)
FLASH_ELEMENTS = {torch.bfloat16: "cutlass::bfloat16_t", torch.float16: "cutlass::half_t",
                  torch.float32: "float"}
#: emulator only: bf16 through the SM80 TiledMMA with an emulated mma.sync atom (D = 64), so the
#: tensor-core thread-value layouts are checked on a CPU too
EMULATED_MMA_ELEMENT = "mk::flash::bf16_sm80emu"
_ELEMENT_BYTES = {"cutlass::bfloat16_t": 2, "cutlass::half_t": 2, "float": 4, EMULATED_MMA_ELEMENT: 2}


def fwd_dv_tile(D: int) -> int:
    """Columns of v per forward CTA (FwdCfg::DV)."""
    return 128 if D >= 128 else 64


def bwd_dv_tile(D: int) -> int:
    """Columns of v per backward dv CTA and dP chunk (BwdCfg::DV)."""
    return 128 if D >= 256 else 64


def bwd_threads(D: int) -> int:
    """BwdCfg::NT: 256 at D = 256 keeps the 64 x D fp32 accumulators at 64 registers per thread."""
    return 256 if D >= 256 else 128


FWD_THREADS = 2 * BM  # a lane pair per query row


def _tile_bytes(rows: int, cols: int, esize: int) -> int:
    return rows * (cols + 16 // esize) * esize  # rows padded by 16 bytes (smem_elems)


def fwd_smem_bytes(element: str, D: int) -> int:
    e, DV = _ELEMENT_BYTES[element], fwd_dv_tile(D)
    tiles = _tile_bytes(BM, D, e) + _tile_bytes(BN, D, e) + _tile_bytes(BN, DV, e) + _tile_bytes(BM, BN, e)
    return tiles + BM * (BN + 4) * 4 + 3 * BM * 4  # + fp32 scores, (m, l, alpha) per row


def bwd_smem_bytes(element: str, D: int) -> int:
    e, DV = _ELEMENT_BYTES[element], bwd_dv_tile(D)
    tiles = (_tile_bytes(BM, D, e) + _tile_bytes(BN, D, e) + _tile_bytes(BM, DV, e) + _tile_bytes(BN, DV, e)
             + _tile_bytes(BM, BN, e))
    return tiles + 2 * BM * 4  # + lse, delta of the query block


#: CuTe's SM80 tensor-core MMA atoms (mma.sync m16n8k16) and cp.async copies: on an older GPU
#: (sm_75) they compile but reach CuTe's invalid-architecture trap, so the kernels need sm_80.
FLASH_MIN_ARCH = 80
#: grid y is B * H (one CTA row per (batch, head)); larger products run in batch slices
MAX_GRID_Y = 65535


def flash_smem_bytes(element: str, D: int) -> int:
    """The larger dynamic shared memory of the forward and backward kernels (a device that runs
    the flash path must fit both: training needs the backward; the kernels have no static smem)."""
    return max(fwd_smem_bytes(element, D), bwd_smem_bytes(element, D))


def _flash_kernels(element: str, D: int) -> dict[str, Kernel]:
    fwd, bwd = f"mk::flash::FwdCfg<{element}, {D}>", f"mk::flash::BwdCfg<{element}, {D}>"
    names = {"fwd": f"mk::flash::flash_fwd_kernel<{fwd}>",
             "dv": f"mk::flash::flash_bwd_kv_kernel<{bwd}, mk::flash::Grad::kDV>",
             "dk": f"mk::flash::flash_bwd_kv_kernel<{bwd}, mk::flash::Grad::kDK>",
             "dq": f"mk::flash::flash_bwd_q_kernel<{bwd}>"}
    return {k: Kernel("flash_attention.cuh", n, min_arch=FLASH_MIN_ARCH) for k, n in names.items()}


#: (element, D) -> {"fwd", "dv", "dk", "dq": Kernel}: the GPU's (mma.sync tiles) ...
FLASH = {(e, D): _flash_kernels(e, D) for e in ("cutlass::bfloat16_t", "cutlass::half_t") for D in FLASH_HEAD_DIMS}
#: ... and the emulator's extra ones (fp32 FMA tiles; fp32 at D = 256 exceeds the smem limit; the
#: emulated mma.sync at D = 64), which do not compile for a GPU
EMULATOR_FLASH = {**{("float", D): _flash_kernels("float", D) for D in (64, 128)},
                  (EMULATED_MMA_ELEMENT, 64): _flash_kernels(EMULATED_MMA_ELEMENT, 64)}
KERNELS = [k for ks in FLASH.values() for k in ks.values()]  # (the matmul path's: dropkey_softmax's)
EMULATOR_KERNELS = [k for ks in EMULATOR_FLASH.values() for k in ks.values()]


def flash_head_dim(dh: int) -> int | None:
    """The instantiated head dim q/k are zero-padded to (None: dh > 256)."""
    return next((d for d in FLASH_HEAD_DIMS if dh <= d), None)


def flash_kernels(launcher, dtype: torch.dtype, dh: int) -> dict[str, Kernel] | None:
    """The flash kernels ``launcher`` has for q's dtype and head dim (None: none)."""
    D = flash_head_dim(dh)
    table = {**FLASH, **EMULATOR_FLASH} if getattr(launcher, "EMULATOR", False) else FLASH
    return table.get((FLASH_ELEMENTS.get(dtype), D))


def batch_slice(B: int, H: int) -> int:
    """Batch elements per flash launch: all of them while B * H fits grid y, else the most that do."""
    return B if B * H <= MAX_GRID_Y else max(1, MAX_GRID_Y // max(1, H))


def flash_device_reasons(caps, dtype: torch.dtype, dh: int, H: int) -> list[str]:
    """Why the flash kernels for q's dtype and head dim cannot run on a device with ``caps``
    (cuda/device.py): its architecture, its shared memory per block, grid y. A pure function of
    its inputs, called by the backend and by the device-profile tests."""
    D = flash_head_dim(dh)
    element = FLASH_ELEMENTS.get(dtype)
    if D is None or element is None:
        return []
    if caps.arch < FLASH_MIN_ARCH:
        return [f"the flash kernel uses SM80 tensor-core MMA and cp.async, which {caps.name} ({caps.sm}) lacks "
                f"(sm_80 or newer; softmax attention runs on path='matmul' there)"]
    need = flash_smem_bytes(element, D)
    if need > caps.smem_per_block_optin:
        fits = [d for d in FLASH_HEAD_DIMS if flash_smem_bytes(element, d) <= caps.smem_per_block_optin]
        return [f"the flash kernel at head dim {D} ({dtype}) needs {need} B of shared memory per block, "
                f"{caps.name} ({caps.sm}) allows {caps.smem_per_block_optin} B (head dims <= {max(fits, default=0)} "
                f"fit; softmax runs on path='matmul')"]
    if H > MAX_GRID_Y:
        return [f"the flash kernel handles H <= {MAX_GRID_Y} heads (grid y), got {H}"]
    return []


class FlashParams(ctypes.Structure):
    """mk::flash::Params (flash_attention.cuh), field for field: passed by value to every kernel."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "dout", "out", "lse", "delta")),
                *((name, ctypes.c_int) for name in ("B", "H", "L", "S", "ldv", "dv_chunks")),
                ("scale", ctypes.c_float),
                *((name, ctypes.c_int) for name in ("causal", "chunk", "block_causal", "laplace")),
                ("key", ctypes.c_uint32), ("thr", ctypes.c_uint32), ("batch_index", ctypes.c_void_p)]


def _params(B, L, S, H, ldv, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
            batch_index) -> FlashParams:
    chunk = int(chunk_size or 0)
    if L >= 2**30 or S >= 2**30:
        raise ValueError(f"the flash kernel handles L and S < 2**30, got L = {L}, S = {S}")
    if not 0 <= chunk < 2**30:
        raise ValueError(f"chunk_size must be in [1, 2**30) or None, got {chunk_size}")
    if block_causal and not chunk:
        raise ValueError("block_causal needs chunk_size")
    if not 0.0 <= dropkey_p < 1.0:
        raise ValueError(f"dropkey_p must be in [0, 1), got {dropkey_p}")
    return FlashParams(B=B, H=H, L=L, S=S, ldv=ldv, scale=float(scale), causal=bool(causal), chunk=chunk,
                       block_causal=bool(block_causal), laplace=attn_fn == "laplace", key=seed_key(int(seed)),
                       thr=threshold(float(dropkey_p)), batch_index=ptr(batch_index) or None)


def _batch_index(batch_index, B: int, device) -> torch.Tensor | None:
    """A DropKey batch index (B,) as the kernels read it (contiguous int64 on ``device``), or None."""
    if batch_index is None:
        return None
    if tuple(batch_index.shape) != (B,):
        raise ValueError(f"batch_index must have shape ({B},), got {tuple(batch_index.shape)}")
    return batch_index.to(device=device, dtype=torch.int64).contiguous()


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """Contiguous x with the last dim zero-padded to n (zeros change no dot product)."""
    if x.shape[-1] == n:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, n - x.shape[-1])).contiguous()


def _slices(B: int, H: int, batch_index, device):
    """[(b0, b1, batch index of the slice or None)]: batch slices whose B * H fits grid y, each with
    the DropKey batch index of its rows (the kernel hashes b' = batch_index[b] with b counted
    from the slice's first row, so a slice passes the global indices)."""
    step = batch_slice(B, H)
    if step >= B:
        return [(0, B, batch_index)]
    if batch_index is None:
        batch_index = torch.arange(B, dtype=torch.int64, device=device)
    return [(b0, min(B, b0 + step), batch_index[b0:b0 + step]) for b0 in range(0, B, step)]


def _flash_setup(launcher, q, k, v):
    kernels = flash_kernels(launcher, q.dtype, q.shape[-1])
    if kernels is None:
        raise ValueError(f"no flash kernel for {q.dtype} at head dim {q.shape[-1]} (use path='matmul')")
    D = flash_head_dim(q.shape[-1])
    tile = fwd_dv_tile(D)
    ldv = -(-v.shape[-1] // tile) * tile
    return kernels, D, ldv, _pad_last(q, D), _pad_last(k, D), _pad_last(v, ldv)


def flash_fwd(launcher, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
              batch_index=None):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 or None for Laplace) by the flash kernel.
    ``batch_index`` (B,): the DropKey batch index of each row (None: the row)."""
    B, Lq, H, _ = q.shape
    S, dv = k.shape[1], v.shape[-1]
    kernels, D, ldv, qp, kp, vp = _flash_setup(launcher, q, k, v)
    o = torch.empty(B, Lq, H, ldv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    _params(B, Lq, S, H, ldv, scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
            dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, batch_index=None)  # the arguments' checks, also when empty
    bidx_all = _batch_index(batch_index, B, q.device)
    if B * H * Lq > 0:
        element = FLASH_ELEMENTS[q.dtype]
        for b0, b1, bidx in _slices(B, H, bidx_all, q.device):
            prm = _params(b1 - b0, Lq, S, H, ldv, scale=scale, causal=causal, chunk_size=chunk_size,
                          block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, batch_index=bidx)
            prm.q, prm.k, prm.v = ptr(qp[b0:b1]), ptr(kp[b0:b1]), ptr(vp[b0:b1])
            prm.out, prm.lse = ptr(o[b0:b1]), ptr(lse[b0:b1])
            launch(launcher, kernels["fwd"], (-(-Lq // BM), (b1 - b0) * H, ldv // fwd_dv_tile(D)), FWD_THREADS,
                   fwd_smem_bytes(element, D), [struct_arg(prm)], q.device)
    o = o if ldv == dv else o[..., :dv].contiguous()
    return o, (None if attn_fn == "laplace" else lse)


def flash_bwd(launcher, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
              batch_index=None):
    """(dq, dk, dv) in the input dtypes by the flash backward kernels (P regenerated from lse):
    dv per (key block, dv tile), dk per key block, dq per query block; no atomics."""
    B, Lq, H, dh = q.shape
    S, dv = k.shape[1], v.shape[-1]
    kernels, D, ldv, qp, kp, vp = _flash_setup(launcher, q, k, v)
    dop = _pad_last(do.to(q.dtype), ldv)
    if attn_fn == "laplace":
        lse_f = delta = torch.zeros(1, dtype=torch.float32, device=q.device)  # unused by the kernels
    else:
        lse_f = lse.to(torch.float32).contiguous()
        # delta = rowsum(dO * O) in fp32 (B, H, L): one elementwise pass, as the torch backend.
        delta = (do.to(torch.float32) * o.to(torch.float32)).sum(-1).transpose(1, 2).contiguous()
    dq = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    dvp = torch.empty(B, S, H, ldv, dtype=q.dtype, device=q.device)
    DV = bwd_dv_tile(D)
    smem, threads = bwd_smem_bytes(FLASH_ELEMENTS[q.dtype], D), bwd_threads(D)
    per_row = attn_fn != "laplace"  # lse and delta (B, H, L) are read per row; Laplace reads neither
    _params(B, Lq, S, H, ldv, scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
            dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, batch_index=None)  # the arguments' checks, also when empty

    def run(prm, rows, kernel, out, blocks, z=1):
        prm.out = ptr(out)  # the launch copies the struct: each kernel keeps its own output
        launch(launcher, kernels[kernel], (blocks, rows * H, z), threads, smem, [struct_arg(prm)], q.device)

    bidx_all = _batch_index(batch_index, B, q.device)
    if B * H > 0:
        for b0, b1, bidx in _slices(B, H, bidx_all, q.device):
            prm = _params(b1 - b0, Lq, S, H, ldv, scale=scale, causal=causal, chunk_size=chunk_size,
                          block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, batch_index=bidx)
            prm.q, prm.k, prm.v, prm.dout = ptr(qp[b0:b1]), ptr(kp[b0:b1]), ptr(vp[b0:b1]), ptr(dop[b0:b1])
            prm.lse = ptr(lse_f[b0:b1] if per_row else lse_f)
            prm.delta = ptr(delta[b0:b1] if per_row else delta)
            prm.dv_chunks = ldv // DV
            if S > 0:
                run(prm, b1 - b0, "dv", dvp[b0:b1], -(-S // BN), ldv // DV)
                run(prm, b1 - b0, "dk", dk[b0:b1], -(-S // BN))
            if Lq > 0:
                run(prm, b1 - b0, "dq", dq[b0:b1], -(-Lq // BM))
    cut = lambda x, n: x if x.shape[-1] == n else x[..., :n].contiguous()  # noqa: E731
    return cut(dq, dh), cut(dk, dh), cut(dvp, dv)


# ------------------------------------------------------------------------------------------------
# matmul: torch matmuls around the dropkey_softmax kernels
# ------------------------------------------------------------------------------------------------

def _visible(L: int, S: int, chunk_size, block_causal: bool, device) -> torch.Tensor | None:
    """(L, S) bool of the chunk / block_causal visibility (None without chunk_size); the causal
    part is left to the dropkey_softmax kernel. Query i sits at key position i + S - L."""
    if chunk_size is None:
        return None
    pos = torch.arange(L, device=device).view(L, 1) + (S - L)
    cp = torch.div(pos, chunk_size, rounding_mode="floor")
    cj = torch.div(torch.arange(S, device=device).view(1, S), chunk_size, rounding_mode="floor")
    return (cj == cp) | (cj == cp - 1) if block_causal else cj == cp


#: 16-bit q/k/v: the matmul path's products take bf16/fp16 operands with fp32 accumulation and output
#: (cuBLAS's tensor-core GEMMs); fp32 and fp64 inputs keep exact products in their own precision
HALF_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPE_BMM: dict = {}  # (device type, dtype) -> whether torch.bmm(..., out_dtype=float32) runs there


def _bmm_out_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b of 16-bit (n, m, k) x (n, k, p) as an fp32 (n, m, p) GEMM output, or None where this torch /
    device has no such kernel (torch's aten::bmm.dtype is CUDA-only; checked once per device type and dtype)."""
    key = (a.device.type, a.dtype)
    if _OUT_DTYPE_BMM.get(key, True):
        try:
            out = torch.bmm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE_BMM[key] = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE_BMM[key] = False
    return None


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b over leading batch dims, in ``acc``. 16-bit operands stay 16-bit (their products are exact in
    fp32) and accumulate in fp32, the tensor-core GEMM; where that GEMM with an fp32 output is missing
    (the CPU emulator) the same products and sums run on fp32 copies."""
    if a.dtype in HALF_DTYPES and b.dtype == a.dtype:
        lead = a.shape[:-2]
        out = _bmm_out_f32(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
        if out is not None:
            return out.view(*lead, a.shape[-2], b.shape[-1])
    return torch.matmul(a.to(acc), b.to(acc))


def _operand(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The GEMM operand of an fp32 intermediate (P, dS) for inputs like ``like``: rounded to their 16-bit
    dtype, as FlashAttention rounds P before P v (one rounding of values in [0, 1] / of dS), else itself."""
    return x.to(like.dtype) if like.dtype in HALF_DTYPES else x


def _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index, index_offset=None):
    """(P (B, H, L, S), s (B, H, L, S)) of the matmul path (scores masked with -inf), both in
    acc_dtype(q): float64 q/k/v run float64 matmuls and the fp64 dropkey_softmax kernel."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    acc = acc_dtype(q)
    s = _mm(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2), acc)
    s.mul_(scale)
    vis = _visible(L, S, chunk_size, block_causal, q.device)
    if vis is not None:
        s.masked_fill_(~vis, float("-inf"))
    # The kernel's (flat batch, head, row, column) of a (B, H, L, S) tensor are the attention's (b, h, i, j).
    p = dropkey_cuda.softmax_fwd(launcher, s, causal=causal, dropkey_p=dropkey_p, seed=seed,
                                  batch_index=batch_index, index_offset=index_offset)
    return p, s


def chunks_as_batch(L: int, S: int, chunk_size, block_causal: bool) -> int:
    """How many chunks of ``chunk_size`` the matmul path runs as separate batch rows (1: none).

    Block-diagonal attention over n chunks (S == L, no block_causal) is n independent attentions of
    chunk_size rows each: as batch rows the scores are n C x C blocks, not an L x L matrix masked
    to its diagonal (n times the work and memory). DropKey's mask stays the call's: each chunk row
    passes its batch index and its start as the rule's index offset."""
    if chunk_size is None or block_causal or S != L or L <= chunk_size or L % chunk_size:
        return 1
    return L // chunk_size


#: the matmul path's transient score memory (s and P in fp32, P's 16-bit copy: SCORE_BYTES a score) per
#: slice of batch rows: larger batches run in slices, each still whole GEMMs
SCORE_BYTES = 10
SLICE_SCORE_BYTES = 2 << 30


def _rows_per_slice(H: int, L: int, S: int) -> int:
    return max(1, SLICE_SCORE_BYTES // max(1, SCORE_BYTES * H * L * S))


def _batch_index(batch_index, B: int, device) -> torch.Tensor:
    """The DropKey batch index of each row (the row itself unless given), to slice with the rows."""
    return torch.arange(B, device=device) if batch_index is None else batch_index


def _chunk_rows(batch_index, B: int, n: int, C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(DropKey batch index, index offset) of the B * n chunk rows: row b * n + c is batch b's chunk c,
    which starts at c * C."""
    index = _batch_index(batch_index, B, device).repeat_interleave(n)
    return index, (torch.arange(n, device=device) * C).repeat(B)


def _split(x: torch.Tensor, n: int) -> torch.Tensor:
    B, L = x.shape[:2]
    return x.reshape(B * n, L // n, *x.shape[2:])


def _merge(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(x.shape[0] // n, n * x.shape[1], *x.shape[2:])


def matmul_fwd(launcher, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
               batch_index=None, index_offset=None):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 (fp64 for float64 q); -inf for rows with no
    visible kept key). ``batch_index`` (B,): the DropKey batch index of each row (None: the row);
    ``index_offset`` (B,): the row's DropKey (i, j) offset (None: 0)."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        o = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype, device=q.device)
        return o, torch.full((B, H, L), float("-inf"), dtype=acc_dtype(q), device=q.device)
    n = chunks_as_batch(L, S, chunk_size, block_causal)
    rows = _rows_per_slice(H, L // n, S // n)
    if n == 1 and B > rows:
        index, offset = _batch_index(batch_index, B, q.device), index_offset
        parts = [matmul_fwd(launcher, q[i:i + rows], k[i:i + rows], v[i:i + rows], scale=scale, causal=causal,
                            chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p, seed=seed,
                            batch_index=index[i:i + rows], index_offset=None if offset is None else offset[i:i + rows])
                 for i in range(0, B, rows)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    if n > 1:
        index, offset = _chunk_rows(batch_index, B, n, L // n, q.device)
        o, lse = matmul_fwd(launcher, _split(q, n), _split(k, n), _split(v, n), scale=scale, causal=causal,
                            chunk_size=None, block_causal=False, dropkey_p=dropkey_p, seed=seed,
                            batch_index=index, index_offset=offset)
        return _merge(o, n), lse.view(B, n, H, L // n).transpose(1, 2).reshape(B, H, L)
    p, s = _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index,
                  index_offset)
    o = _mm(_operand(p, q), v.transpose(1, 2), p.dtype).transpose(1, 2).to(q.dtype).contiguous()
    # lse from the largest probability: p_max = exp(s_max - lse) exactly where s is largest.
    pmax, idx = p.max(dim=-1, keepdim=True)
    lse = (s.gather(-1, idx) - pmax.log()).squeeze(-1)
    lse = lse.masked_fill(pmax.squeeze(-1) == 0, float("-inf"))
    return o, lse


def matmul_bwd(launcher, do, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
               batch_index=None, index_offset=None):
    """(dq, dk, dv) in the input dtypes; P is recomputed by the forward kernel (same DropKey mask)."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    n = chunks_as_batch(L, S, chunk_size, block_causal)
    rows = _rows_per_slice(H, L // n, S // n)
    if n == 1 and B > rows:
        index, offset = _batch_index(batch_index, B, q.device), index_offset
        parts = [matmul_bwd(launcher, do[i:i + rows], q[i:i + rows], k[i:i + rows], v[i:i + rows], scale=scale,
                            causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                            seed=seed, batch_index=index[i:i + rows],
                            index_offset=None if offset is None else offset[i:i + rows]) for i in range(0, B, rows)]
        return tuple(torch.cat(g) for g in zip(*parts))
    if n > 1:
        index, offset = _chunk_rows(batch_index, B, n, L // n, q.device)
        grads = matmul_bwd(launcher, _split(do, n), _split(q, n), _split(k, n), _split(v, n), scale=scale,
                           causal=causal, chunk_size=None, block_causal=False, dropkey_p=dropkey_p, seed=seed,
                           batch_index=index, index_offset=offset)
        return tuple(_merge(g, n) for g in grads)
    p, _ = _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index,
                  index_offset)
    acc = p.dtype
    # (B, H, T, d) operands: 16-bit inputs stay 16-bit (fp32 accumulation), else acc_dtype(q)
    dot, qt, kt, vt = (x.transpose(1, 2) for x in (do.to(q.dtype), q, k, v))
    pt = _operand(p, q)
    dv = _mm(pt.transpose(-1, -2), dot, acc)
    dp = _mm(dot, vt.transpose(-1, -2), acc).contiguous()
    ds = _operand(dropkey_cuda.softmax_bwd(launcher, dp, p, causal=causal), q)  # P (dP - rowsum(P dP)); 0 where P = 0
    dq = _mm(ds, kt, acc).mul_(scale)
    dk = _mm(ds.transpose(-1, -2), qt, acc).mul_(scale)
    back = lambda x, like: x.transpose(1, 2).to(like.dtype).contiguous()  # noqa: E731
    return back(dq, q), back(dk, k), back(dv, v)


#: path="auto" takes the matmul path for 16-bit softmax attention on a GPU while the score tensors of one
#: batch row (its slice's floor: SCORE_BYTES a score) stay within this many bytes
AUTO_MATMUL_SCORE_BYTES = 4 << 30


def auto_prefers_matmul(device_type: str, dtype: torch.dtype, q_shape, S: int, dv: int, chunk_size,
                        block_causal: bool) -> bool:
    """Whether path="auto" runs 16-bit softmax attention on the matmul path although flash could run it.

    The flash kernels tile v in fwd_dv_tile columns and recompute q k^T (and the softmax) once per tile,
    so their work grows with dv / tile; the matmul path forms the scores once and runs both products as
    cuBLAS tensor-core GEMMs. Measured on an H200 at B1 L4096 H4 dz256 bf16
    (bench/results/gpu/h200_run4/attn/attention_paths.md), forward+backward flash / matmul: 1.09 at
    dv 256, 1.73 at 1024, 2.54 at 2048: at dv above one flash tile the GEMMs win, at the price of
    materialising the scores, hence the memory cap. Only on a GPU: the emulator's "auto" keeps the
    flash kernels it exists to check."""
    if device_type != "cuda" or dtype not in HALF_DTYPES:
        return False
    B, L, H, dh = q_shape
    D = flash_head_dim(dh)
    if D is None or dv <= fwd_dv_tile(D):
        return False
    n = chunks_as_batch(L, S, chunk_size, block_causal)
    return SCORE_BYTES * H * (L // n) * (S // n) <= AUTO_MATMUL_SCORE_BYTES


class AttentionBackend(Backend):
    """attention on the CUDA kernels, two paths.

    * "flash" (cuda/flash_attention.cuh, CuTe): fused forward (online softmax, saved lse) and
      backward (dv, dk, dq kernels, no atomics), every mask mode, DropKey, Laplace; q/k are
      zero-padded to head dim 64, 128 or 256 and v to the kernel's dv tile. bf16/fp16 on the GPU
      (mma.sync), also fp32 in the emulator.
    * "matmul": scores = scale * q k^T per (b, h) by cuBLAS with fp32 output (16-bit q/k: their
      tensor-core GEMM with fp32 accumulation; fp32 / fp64 q/k: that precision throughout),
      the chunk / block_causal visibility as -inf, then the fused causal + DropKey + softmax
      kernel (cuda/dropkey_softmax.cuh; the package's DropKey rule with (b, h, i, j) = the
      score indices) and P v, with P (and the backward's dS) rounded to the 16-bit input dtype
      for the GEMM as FlashAttention does; the backward recomputes P with that kernel and uses
      its softmax backward. Block-diagonal chunks (S == L, no block_causal) run as
      batch rows of C x C scores (chunks_as_batch). It materialises the scores (fp32, fp64 for
      fp64) and has no Laplace. "auto" takes it for 16-bit softmax on a GPU where flash would
      recompute the scores per v tile (auto_prefers_matmul), and where the flash
      kernel has no instantiated configuration (fp32 on the GPU, head dim > 256, dv = 0) or the
      device cannot run it (flash_device_reasons): sm_75 (T4), whose GPUs lack the SM80 MMA and
      cp.async the flash tiles use, and head dim 256 on GPUs with less than 112384 B of shared
      memory per block (sm_86/89/120: 101376 B). Its kernels need nothing beyond sm_75: the scores are fp32
      (fp64) matmuls and the softmax kernel uses warp shuffles only.

    Grid y of the flash kernels is B * H; above 65535 they run in batch slices (one launch each,
    the DropKey batch index passed so every row keeps its own mask).
      float64 q/k/v always take this path, in fp64 throughout (float64 matmuls, the fp64
      dropkey_softmax kernel): the flash kernel's tensor-core tiles have no fp64 configuration,
      so fp64 with attn_fn="laplace" (flash only) is refused.
    """

    _INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    CONFIG_SPACE = CONFIG_SPACE
    DEFAULT_CONFIG = DEFAULT_CONFIG  # the module's dict: a test that sets its path sets both

    def flash_reasons(self, q, v) -> list[str]:
        """Why the flash kernel cannot run these inputs ([] if it can)."""
        if q.dtype == torch.float64:
            return ["the flash kernel has no float64 configuration (its mma tensor-core tiles take "
                    "bfloat16/float16; float64 runs on path='matmul')"]
        if q.dtype not in FLASH_ELEMENTS:
            return [f"the flash kernel takes float32/bfloat16/float16, got {q.dtype}"]
        if flash_head_dim(q.shape[-1]) is None:
            return [f"the flash kernel handles head dims <= {FLASH_HEAD_DIMS[-1]}, got {q.shape[-1]}"]
        if v.shape[-1] == 0:
            return ["the flash kernel needs dv > 0"]
        try:
            kernels = flash_kernels(self.ext, q.dtype, q.shape[-1])
        except Exception as exc:  # no launcher here (no CuPy / driver / device)
            return [str(exc)]
        if kernels is None:
            return [f"no flash kernel is instantiated for {q.dtype} at head dim {flash_head_dim(q.shape[-1])} "
                    f"(float32 runs on the matmul path on a GPU)"]
        # the device's architecture, shared memory and grid (cuda/device.py): what would trap or not launch
        return flash_device_reasons(self.caps(q), q.dtype, q.shape[-1], q.shape[2])

    def _path(self, q, v, attn_fn, path, k=None, chunk_size=None, block_causal=False):
        path = path or self.DEFAULT_CONFIG.get("path", "auto")
        if path not in ("auto", "flash", "matmul"):
            raise ValueError(f"path must be 'auto', 'flash' or 'matmul', got {path!r}")
        if path == "auto":
            path = "matmul" if self.flash_reasons(q, v) else "flash"
            if path == "flash" and attn_fn == "softmax" and k is not None and auto_prefers_matmul(
                    q.device.type, q.dtype, q.shape, k.shape[1], v.shape[-1], chunk_size, block_causal):
                path = "matmul"
        if path == "flash" and self.flash_reasons(q, v):
            raise ValueError("; ".join(self.flash_reasons(q, v)) + " (use path='matmul' or backend='torch')")
        if path == "matmul" and attn_fn != "softmax":
            raise ValueError(f"attn_fn={attn_fn!r} is not supported by the CUDA matmul path (use backend='torch')")
        return path

    def not_supported_reasons(self, q, k=None, v=None, *, attn_fn="softmax", **_other_inputs) -> list[str]:
        named = {n: t for n, t in (("q", q), ("k", k), ("v", v)) if t is not None}
        # an unavailable backend (no GPU, no CuPy) gives that one reason, not also "needs cuda tensors"
        unavailable = self._available()
        reasons = unavailable or self._arch_reasons(named.values())
        if not unavailable and any(t.device.type != self.device_type for t in named.values()):
            bad = next(n for n, t in named.items() if t.device.type != self.device_type)
            reasons.append(f"needs {self.device_type} tensors, got {bad} on {named[bad].device} (use backend='torch')")
        if q.dtype not in self._INPUT_DTYPES:
            reasons.append(f"the CUDA attention takes float32, bfloat16, float16 or float64 q/k/v, got {q.dtype} "
                           f"(use backend='torch')")
        if reasons:
            return reasons
        path = self.DEFAULT_CONFIG.get("path", "auto")
        if path == "flash":  # a forced flash path: say why it cannot run here (e.g. float64) up front
            flash = self.flash_reasons(q, q if v is None else v)
            if flash:
                reasons.append(f"path='flash' is configured but {'; '.join(flash)} (use path='auto' or 'matmul', "
                               f"or backend='torch')")
            return reasons
        if attn_fn == "softmax":
            return reasons
        flash = self.flash_reasons(q, q if v is None else v) if path != "matmul" else ["path='matmul'"]
        if flash:
            reasons.append(f"attn_fn={attn_fn!r} needs the flash kernel ({'; '.join(flash)}); the CUDA matmul + "
                           f"dropkey_softmax path has no laplace (use backend='torch')")
        return reasons

    def forward(self, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                      path=None, batch_index=None, **_config):
        kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                  seed=seed, batch_index=batch_index)
        if self._path(q, v, attn_fn, path, k, chunk_size, block_causal) == "flash":
            return flash_fwd(self.ext, q, k, v, attn_fn=attn_fn, **kw)
        return matmul_fwd(self.ext, q, k, v, **kw)

    def backward(self, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                      attn_fn, path=None, batch_index=None, **_config):
        kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                  seed=seed, batch_index=batch_index)
        if self._path(q, v, attn_fn, path, k, chunk_size, block_causal) == "flash":
            return flash_bwd(self.ext, do, q, k, v, o, lse, attn_fn=attn_fn, **kw)
        return matmul_bwd(self.ext, do, q, k, v, **kw)


# The backend module's names over the GPU launcher (tests build AttentionBackend over the emulator).
_GPU = AttentionBackend(runtime.gpu_launcher)


def not_supported_reasons(q, k=None, v=None, *, attn_fn="softmax", **other_inputs) -> list[str]:
    return _GPU.not_supported_reasons(q, k, v, attn_fn=attn_fn, **other_inputs)


def forward(q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, path=None,
            batch_index=None):
    return _GPU.forward(q, k, v, scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal,
                        dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, path=path, batch_index=batch_index)


def backward(do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn, path=None,
             batch_index=None):
    return _GPU.backward(do, q, k, v, o, lse, scale=scale, causal=causal, chunk_size=chunk_size,
                         block_causal=block_causal, dropkey_p=dropkey_p, seed=seed, attn_fn=attn_fn, path=path,
                         batch_index=batch_index)
