"""Compiled CPU backend of cema ("cpu"): the torch backend's composition (ops/cema/torch_impl.py)
with its FFT form's convolution run by fftconv's compiled kernel (ops/fftconv/cpu_impl.py).

The convolution is where the FFT form spends its time on a CPU: in the library FFTs' passes over
spectrum-sized buffers in memory. With the compiled kernel the FFT form is faster than the chunked
form (C x C Toeplitz matmuls) below L = 16384, on par there, and slower from 32768 on, where a
transform's buffer leaves the core's caches (fwd+bwd, B 1, D 256, N 16, one thread:
``python bench/cema_forms.py time --shapes 1,256,4096 1,256,16384 1,256,32768 --cpu``). The
recurrence serves the shortest calls (decoding), as in the torch backend. Every other stage, the
saved tensors and the numerics are the torch backend's; without a working compiler the backend
reports itself unavailable and ``auto`` takes the torch backend.
"""
from __future__ import annotations

from ..fftconv import cpu_impl as conv
from . import torch_impl

#: chunk > 0 keeps the recurrence for calls of up to RECURRENCE_MAX_LEN steps; the chunked form
#: from chunk_min_len steps on, the FFT form with the compiled convolution below.
DEFAULT_CONFIG: dict = {"chunk": 64, "chunk_min_len": 32768, "power_block": 64}


def not_supported_reasons(x, **inputs) -> list[str]:
    return conv.kernel_reasons(x)  # any L: the lengths the convolution does not take run the chunked form


def _min_len(chunk_min_len: int) -> int:
    """The chunked form also from the first length the compiled convolution does not take."""
    return min(chunk_min_len, conv.MAX_LEN + 1)


def cema_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted=False, *, chunk, chunk_min_len, power_block):
    return torch_impl.cema_fwd(x, p, log_q, gamma, omega, hx, return_state, weighted, chunk=chunk,
                               chunk_min_len=_min_len(chunk_min_len), power_block=power_block, direct_max_len=0,
                               conv=conv)


def cema_bwd(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, *, chunk, chunk_min_len, power_block):
    return torch_impl.cema_bwd(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, chunk=chunk,
                               chunk_min_len=_min_len(chunk_min_len), power_block=power_block, direct_max_len=0,
                               conv=conv)
