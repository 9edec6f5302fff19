"""CUDA backend of ema_hidden: cuda/cema.cuh through megalodon_kernels.cuda._C (see cuda/backend.py).
When the extension is not built, not_supported_reasons says how to build it."""
from ...cuda.backend import ema_hidden as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
ema_hidden_fwd = _backend.ema_hidden_fwd
ema_hidden_bwd = _backend.ema_hidden_bwd
