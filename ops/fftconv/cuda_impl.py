"""CUDA backend of fftconv: cuda/fftconv.cuh (one block per row, L <= 16384; float64: L <= 8192)
and, for longer L up to 2^27 (float64: 2^25), the multi-pass four-step FFT of
cuda/fftconv_long.cuh, through megalodon_kernels.cuda._C (see cuda/backend.py)."""
from ...cuda.backend import fftconv as _backend

DEFAULT_CONFIG = _backend.DEFAULT_CONFIG
not_supported_reasons = _backend.not_supported_reasons
fftconv_fwd = _backend.fftconv_fwd
fftconv_bwd = _backend.fftconv_bwd
