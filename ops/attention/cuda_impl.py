"""CUDA backend of attention (see cuda/backend.py AttentionBackend): through
megalodon_kernels.cuda._C; when the extension is not built, not_supported_reasons says how to
build it."""
from ...cuda.backend import attention as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
attention_fwd = _backend.attention_fwd
attention_bwd = _backend.attention_bwd
