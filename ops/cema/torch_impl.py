"""PyTorch backend of cema: the stages' torch backends composed (ops/cema/compose.py), with the
convolution by fftconv's torch backend (zero-padded FFTs, or a Toeplitz matmul up to
``direct_max_len``) and the chunked form from ``chunk_min_len`` steps on.
"""
from __future__ import annotations

import functools

from ..fftconv import torch_impl as conv_torch
from . import compose

#: The knobs of the stages it composes (see cema_kernel and fftconv), ``chunk``: the chunk length
#: of the chunked form (0: never chunked), and ``chunk_min_len``: the lengths from which the
#: chunked form runs (below: the FFT form; where they cross: ``python bench/cema_forms.py time``).
CONFIG_SPACE: dict = {"chunk": (64, 0, 128), "chunk_min_len": (4096, 0), "power_block": (64, 32, 128),
                      "direct_max_len": (16, 0, 256)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(**inputs) -> list[str]:
    return []  # every device and dtype torch supports


def _convolution(direct_max_len: int) -> compose.Convolution:
    return compose.Convolution(functools.partial(conv_torch.forward, direct_max_len=direct_max_len),
                               functools.partial(conv_torch.backward, direct_max_len=direct_max_len), fresh=False)


def forward(x, p, log_q, gamma, omega, hx, return_state, weighted=False, *, chunk, chunk_min_len, power_block,
            direct_max_len):
    """-> (y r(B D L) in x's dtype, h c(B D N) or None, compose.Saved)."""
    return compose.forward(x, p, log_q, gamma, omega, hx, return_state, weighted, _convolution(direct_max_len),
                           chunk=chunk, chunk_min_len=chunk_min_len, power_block=power_block)


def backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, needs, *, chunk, chunk_min_len, power_block,
             direct_max_len):
    """-> (dx, dp, dlog_q, dgamma, domega, dhx), any of them None when not needed; dy/dh may be None."""
    return compose.backward(dy, dh, x, p, log_q, gamma, omega, hx, saved, compose.Needs(*needs),
                            _convolution(direct_max_len), chunk=chunk, chunk_min_len=chunk_min_len,
                            power_block=power_block)
