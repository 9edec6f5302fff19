"""Compiled CPU backend of cema ("cpu"): the stages composed (ops/cema/compose.py) with the FFT
form's convolution run by fftconv's compiled kernel (ops/fftconv/cpu_impl.py).

The convolution is where the FFT form spends its time on a CPU, in the library FFTs' passes over
spectrum-sized buffers; the compiled kernel keeps a transform in cache, so the FFT form stays
ahead of the chunked form up to longer lengths than with the torch convolution, until a
transform's buffer leaves the core's caches (``python bench/cema_forms.py time --cpu``): hence
this backend's own ``chunk_min_len``. The recurrence serves the shortest calls (decoding), as in
the torch backend; every other stage, the saved tensors and the numerics are the torch backend's.
Without a working compiler the backend reports itself unavailable and ``auto`` takes torch.
"""
from __future__ import annotations

from ..fftconv import cpu_impl as conv_cpu
from . import compose

#: chunk > 0 keeps the recurrence for calls of up to RECURRENCE_MAX_LEN steps; the chunked form
#: from chunk_min_len steps on, the FFT form with the compiled convolution below.
CONFIG_SPACE: dict = {"chunk": (64,), "chunk_min_len": (32768, 4096, 0), "power_block": (64, 32, 128)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def _convolution() -> compose.Convolution:
    return compose.Convolution(conv_cpu.forward, conv_cpu.backward, fresh=True)


def not_supported_reasons(x, **inputs) -> list[str]:
    return conv_cpu.kernel_reasons(x)  # any L: the lengths the convolution does not take run the chunked form


def _min_len(chunk_min_len: int) -> int:
    """The chunked form also from the first length the compiled convolution does not take."""
    return min(chunk_min_len, conv_cpu.MAX_LEN + 1)


def forward(x, p, log_q, gamma, omega, hx, return_state, weighted=False, *, chunk, chunk_min_len, power_block):
    """-> (y r(B D L) in x's dtype, h c(B D N) or None, compose.Saved)."""
    return compose.forward(x, p, log_q, gamma, omega, hx, return_state, weighted, _convolution(), chunk=chunk,
                           chunk_min_len=_min_len(chunk_min_len), power_block=power_block)


def backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, *, chunk, chunk_min_len, power_block):
    """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
    return compose.backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, compose.Needs(*needs), _convolution(),
                            chunk=chunk, chunk_min_len=_min_len(chunk_min_len), power_block=power_block)
