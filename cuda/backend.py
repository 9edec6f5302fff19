"""The backend-object base shared by every op's CUDA backend (``_Backend``: availability, device
and dtype reasons over a getter of the launcher or extension), and the backends of the ops still
on compiled launchers (dropkey_softmax, attention), as their ``ops/<op>/cuda_impl.py`` exposes them.

Each ``<Op>Backend`` has the backend-module interface of ops/_dispatch.py (``DEFAULT_CONFIG``,
``not_supported_reasons(**inputs)`` (inputs it does not use are ignored, so an op may pass more),
the op's ``*_fwd``/``*_bwd``) over an extension getter and
a device type. The module-level instances use the product extension on CUDA tensors, so an
``ops/<op>/cuda_impl.py`` only re-exports them; tests build the same classes over the CPU
emulator (``device_type="cpu"``) to run the ops' autograd Functions end to end.

Imports nothing from the rest of the package.
"""
from __future__ import annotations

import torch

from . import extension, extension_error
from . import kernels as K


def _product_ext():
    mod = extension()
    if mod is None:
        raise RuntimeError(extension_error())
    return mod


class _Backend:
    DEFAULT_CONFIG: dict = {}
    #: the op's kernels also run in float64 (double accumulation; kernels.FP64_DTYPE_CODES)
    FP64 = False

    def _dtype_reason(self, name: str, t: torch.Tensor, what: str = "the CUDA kernels take") -> list[str]:
        """Why the kernels cannot take ``t``'s dtype (empty when they can)."""
        if t.dtype in (K.FP64_DTYPE_CODES if self.FP64 else K.DTYPE_CODES):
            return []
        return [f"{what} {K._dtype_names(self.FP64)} {name}, got {t.dtype} (use backend='torch')"]

    def __init__(self, get_ext=_product_ext, device_type: str = "cuda"):
        self._get_ext = get_ext
        self.device_type = device_type

    @property
    def ext(self):
        return self._get_ext()

    def _available(self) -> list[str]:
        try:
            self._get_ext()
        except Exception as exc:  # not built (product) / no compiler (emulator)
            return [str(exc)]
        return []

    def _reasons(self, named: dict, dtype_of: str) -> list[str]:
        reasons = self._available()
        for name, t in named.items():
            if t.device.type != self.device_type:
                reasons.append(f"needs {self.device_type} tensors, got {name} on {t.device} "
                               f"(use backend='torch')")
                break
        reasons += self._dtype_reason(dtype_of, named[dtype_of])
        return reasons


class DropKeySoftmaxBackend(_Backend):
    FP64 = True  # double scores: exp and sums in double, the same DropKey decisions

    def not_supported_reasons(self, scores, **_other_inputs) -> list[str]:
        return self._reasons({"scores": scores}, "scores")

    def dropkey_softmax_fwd(self, scores, *, causal, dropkey_p, seed):
        return K.dropkey_softmax_fwd(self.ext, scores, causal=causal, dropkey_p=dropkey_p, seed=seed)

    def dropkey_softmax_bwd(self, dy, y, *, causal, dropkey_p=0.0, seed=0):
        return K.dropkey_softmax_bwd(self.ext, dy, y, causal=causal)


# --- attention ---
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
        return K.attention_matmul_fwd(self.ext, q, k, v, **kw)

    def attention_bwd(self, do, q, k, v, o, lse, *, scale, causal, chunk_size, block_causal, dropkey_p, seed,
                      attn_fn, path=None, batch_index=None, **_config):
        kw = dict(scale=scale, causal=causal, chunk_size=chunk_size, block_causal=block_causal, dropkey_p=dropkey_p,
                  seed=seed, batch_index=batch_index)
        if self._path(q, v, attn_fn, path) == "flash":
            return K.attention_flash_bwd(self.ext, do, q, k, v, o, lse, attn_fn=attn_fn, **kw)
        return K.attention_matmul_bwd(self.ext, do, q, k, v, **kw)
# --- end attention ---

# The product backends (CUDA tensors, megalodon_kernels.cuda._C): ops/<op>/cuda_impl.py re-exports these.
dropkey_softmax = DropKeySoftmaxBackend()
attention = AttentionBackend()


