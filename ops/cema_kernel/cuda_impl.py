"""CUDA backend of cema_kernel: cuda/cema.cuh through megalodon_kernels.cuda._C (see cuda/backend.py).
When the extension is not built, not_supported_reasons says how to build it."""
from ...cuda.backend import cema_kernel as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
cema_kernel_fwd = _backend.cema_kernel_fwd
cema_kernel_bwd = _backend.cema_kernel_bwd
