"""CUDA backend of dropkey_softmax: cuda/dropkey_softmax.cuh (fused causal mask + the package's
DropKey rule + softmax) through megalodon_kernels.cuda._C (see cuda/backend.py)."""
from ...cuda.backend import dropkey_softmax as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
dropkey_softmax_fwd = _backend.dropkey_softmax_fwd
dropkey_softmax_bwd = _backend.dropkey_softmax_bwd
