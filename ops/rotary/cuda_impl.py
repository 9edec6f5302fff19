"""CUDA backend of rotary: cuda/rotary.cuh through megalodon_kernels.cuda._C (see cuda/backend.py).
When the extension is not built, not_supported_reasons says how to build it."""
from ...cuda.backend import rotary as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
rotary_fwd = _backend.rotary_fwd
rotary_bwd = _backend.rotary_bwd
