"""CUDA backend of attention, two paths (see AttentionBackend).

* "matmul": a launch description (this file): torch matmuls and the dropkey_softmax kernels
  (cuda/dropkey_softmax.cuh, launched by ops/dropkey_softmax/cuda_impl.py), run on a GPU by the
  NVRTC runtime (cuda/runtime.py) and in the CPU emulator (tests) from the same launch records.
* "flash": the CuTe kernels (cuda/flash_attention.cuh) through the compiled launchers of the
  extension megalodon_kernels.cuda._C (cuda/kernels.py); when the extension is not built,
  not_supported_reasons says how to build it.
"""
from __future__ import annotations

import torch

from ...cuda import kernels as K
from ...cuda.launch import EmulatorLauncher, acc_dtype
from ...cuda import runtime
from ...cuda.backend import _Backend
from ..dropkey_softmax import cuda_impl as dropkey_cuda


def _visible(L: int, S: int, chunk_size, block_causal: bool, device) -> torch.Tensor | None:
    """(L, S) bool of the chunk / block_causal visibility (None without chunk_size); the causal
    part is left to the dropkey_softmax kernel. Query i sits at key position i + S - L."""
    if chunk_size is None:
        return None
    pos = torch.arange(L, device=device).view(L, 1) + (S - L)
    cp = torch.div(pos, chunk_size, rounding_mode="floor")
    cj = torch.div(torch.arange(S, device=device).view(1, S), chunk_size, rounding_mode="floor")
    return (cj == cp) | (cj == cp - 1) if block_causal else cj == cp


def _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index):
    """(P (B, H, L, S), s (B, H, L, S)) of the matmul path (scores masked with -inf), both in
    acc_dtype(q): float64 q/k/v run float64 matmuls and the fp64 dropkey_softmax kernel."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    acc = acc_dtype(q)
    s = torch.matmul(q.transpose(1, 2).to(acc), k.transpose(1, 2).to(acc).transpose(-1, -2))
    s.mul_(scale)
    vis = _visible(L, S, chunk_size, block_causal, q.device)
    if vis is not None:
        s.masked_fill_(~vis, float("-inf"))
    # The kernel's (flat batch, head, row, column) of a (B, H, L, S) tensor are the attention's (b, h, i, j).
    p = dropkey_cuda.softmax_fwd(launcher, s, causal=causal, dropkey_p=dropkey_p, seed=seed,
                                  batch_index=batch_index)
    return p, s


def matmul_fwd(launcher, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                         batch_index=None):
    """(o (B, L, H, dv) in q's dtype, lse (B, H, L) fp32 (fp64 for float64 q); -inf for rows with no
    visible kept key). ``batch_index`` (B,): the DropKey batch index of each row (None: the row)."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        o = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype, device=q.device)
        return o, torch.full((B, H, L), float("-inf"), dtype=acc_dtype(q), device=q.device)
    p, s = _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index)
    o = torch.matmul(p, v.transpose(1, 2).to(p.dtype)).transpose(1, 2).to(q.dtype).contiguous()
    # lse from the largest probability: p_max = exp(s_max - lse) exactly where s is largest.
    pmax, idx = p.max(dim=-1, keepdim=True)
    lse = (s.gather(-1, idx) - pmax.log()).squeeze(-1)
    lse = lse.masked_fill(pmax.squeeze(-1) == 0, float("-inf"))
    return o, lse


def matmul_bwd(launcher, do, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                         batch_index=None):
    """(dq, dk, dv) in the input dtypes; P is recomputed by the forward kernel (same DropKey mask)."""
    B, L, H, _ = q.shape
    S = k.shape[1]
    if B * H * L * S == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    p, _ = _probs(launcher, q, k, scale, causal, chunk_size, block_causal, dropkey_p, seed, batch_index)
    acc = lambda x: x.transpose(1, 2).to(p.dtype)  # noqa: E731  (B, H, T, d) in acc_dtype(q)
    dot, qt, kt, vt = acc(do), acc(q), acc(k), acc(v)
    dv = torch.matmul(p.transpose(-1, -2), dot)
    dp = torch.matmul(dot, vt.transpose(-1, -2)).contiguous()
    ds = dropkey_cuda.softmax_bwd(launcher, dp, p, causal=causal)  # P (dP - rowsum(P dP)); 0 where P = 0
    dq = torch.matmul(ds, kt).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qt).mul_(scale)
    back = lambda x, like: x.transpose(1, 2).to(like.dtype).contiguous()  # noqa: E731
    return back(dq, q), back(dk, k), back(dv, v)


class AttentionBackend(_Backend):
    """attention on the CUDA kernels, two paths.

    * "flash" (cuda/flash_attention.cuh, CuTe): fused forward (online softmax, saved lse) and
      backward (dv, dk, dq kernels, no atomics), every mask mode, DropKey, Laplace; q/k are
      zero-padded to head dim 64, 128 or 256 and v to the kernel's dv tile. bf16/fp16 on the GPU
      (mma.sync), also fp32 in the emulator.
    * "matmul": scores = scale * q k^T per (b, h) by torch.matmul (cuBLAS on a GPU) in fp32,
      the chunk / block_causal visibility as -inf, then the fused causal + DropKey + softmax
      kernel (cuda/dropkey_softmax.cuh; the package's DropKey rule with (b, h, i, j) = the
      score indices) and P v; the backward recomputes P with that kernel and uses its softmax
      backward. It materialises the L x S fp32 (fp64) scores and has no Laplace. Used where the flash
      kernel has no compiled configuration (fp32 on the GPU, head dim > 256, dv = 0).
      float64 q/k/v always take this path, in fp64 throughout (float64 matmuls, the fp64
      dropkey_softmax kernel): the flash kernel's tensor-core tiles have no fp64 configuration,
      so fp64 with attn_fn="laplace" (flash only) is refused.
    """

    _INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    #: path: "auto" (flash where it supports the inputs, else matmul), "flash" or "matmul".
    DEFAULT_CONFIG: dict = {"path": "auto"}

    def __init__(self, get_ext=None, device_type: str = "cuda", get_launcher=None):
        super().__init__(*(() if get_ext is None else (get_ext,)), device_type=device_type)
        self._get_launcher = get_launcher

    @property
    def launcher(self):
        """What runs the matmul path's launch records: the given launcher, else the emulator when
        the extension is the emulator's (tests), else the NVRTC runtime."""
        if self._get_launcher is not None:
            return self._get_launcher()
        ext = self.ext
        return EmulatorLauncher(ext) if ext.EMULATOR else runtime.gpu_launcher()

    def flash_reasons(self, q, v) -> list[str]:
        """Why the flash kernel cannot run these inputs ([] if it can)."""
        if q.dtype == torch.float64:
            return ["the flash kernel has no float64 configuration (its mma tensor-core tiles take "
                    "bfloat16/float16; float64 runs on path='matmul')"]
        if q.dtype not in K.ATTN_DTYPE_CODES:
            return [f"the flash kernel takes float32/bfloat16/float16, got {q.dtype}"]
        if K.flash_head_dim(q.shape[-1]) is None:
            return [f"the flash kernel handles head dims <= {K.FLASH_HEAD_DIMS[-1]}, got {q.shape[-1]}"]
        if v.shape[-1] == 0:
            return ["the flash kernel needs dv > 0"]
        if q.shape[0] * q.shape[2] > 65535:  # B * H is the grid's y dimension
            return [f"the flash kernel handles B * H <= 65535, got {q.shape[0] * q.shape[2]}"]
        try:
            tile = K.flash_dv_tile(self.ext, q.dtype, q.shape[-1])
        except Exception as exc:  # extension not built
            return [str(exc)]
        if tile == 0:
            return [f"no flash kernel is compiled for {q.dtype} at head dim {K.flash_head_dim(q.shape[-1])} "
                    f"(float32 runs on the matmul path on a GPU)"]
        return []

    def _path(self, q, v, attn_fn, path):
        path = path or self.DEFAULT_CONFIG.get("path", "auto")
        if path not in ("auto", "flash", "matmul"):
            raise ValueError(f"path must be 'auto', 'flash' or 'matmul', got {path!r}")
        if path == "auto":
            path = "matmul" if self.flash_reasons(q, v) else "flash"
        if path == "flash" and self.flash_reasons(q, v):
            raise ValueError("; ".join(self.flash_reasons(q, v)) + " (use path='matmul' or backend='torch')")
        if path == "matmul" and attn_fn != "softmax":
            raise ValueError(f"attn_fn={attn_fn!r} is not supported by the CUDA matmul path (use backend='torch')")
        return path

    def not_supported_reasons(self, q, k=None, v=None, *, attn_fn="softmax", **_other_inputs) -> list[str]:
        named = {n: t for n, t in (("q", q), ("k", k), ("v", v)) if t is not None}
        reasons = self._available()
        if any(t.device.type != self.device_type for t in named.values()):
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

    def attention_fwd(self, q, k, v, *, scale, causal, chunk_size, block_causal, dropkey_p, seed, attn_fn,
                      path=None, batch_index=None, **_config):
        kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                  seed=seed, batch_index=batch_index)
        if self._path(q, v, attn_fn, path) == "flash":
            return K.attention_flash_fwd(self.ext, q, k, v, attn_fn=attn_fn, **kw)
        return matmul_fwd(self.launcher, q, k, v, **kw)

    def attention_bwd(self, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                      attn_fn, path=None, batch_index=None, **_config):
        kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                  seed=seed, batch_index=batch_index)
        if self._path(q, v, attn_fn, path) == "flash":
            return K.attention_flash_bwd(self.ext, do, q, k, v, o, lse, attn_fn=attn_fn, **kw)
        return matmul_bwd(self.launcher, do, q, k, v, **kw)


_backend = AttentionBackend()
DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
attention_fwd = _backend.attention_fwd
attention_bwd = _backend.attention_bwd
