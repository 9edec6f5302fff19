"""CUDA backend of timestep_norm: cuda/timestep_norm.cuh through megalodon_kernels.cuda._C
(see cuda/backend.py). mean/var and the saved statistics are fp32 (float64 for float64 x)."""
from ...cuda.backend import timestep_norm as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
timestep_norm_fwd = _backend.timestep_norm_fwd
timestep_norm_bwd = _backend.timestep_norm_bwd
