"""PyTorch backend of fftconv: zero-padded real FFTs, or a Toeplitz matmul for short sequences.

FFT path: with n = 2 * nextpow2(L) (so n >= 2L - 1 and the circular product never wraps),
y = irfft(rfft(x, n) * rfft(k, n), n)[:L]. The adjoints are cross-correlations, i.e. products with
conjugated spectra, and the k-gradient is summed over the batch in the frequency domain:

    dx = irfft(DY * conj(K), n)[:L]        dk = irfft(sum_b DY_b * conj(X_b), n)[:L]

Direct path (L <= ``direct_max_len``, where FFT overheads dominate): the causal Toeplitz matrix
Kt[d, t, s] = k[d, t-s] (t >= s, else 0) is built with ``unfold`` (ops/_toeplitz.py, shared with
cema's chunked form) and applied as one batched matmul over d; dx uses Kt transposed and dk sums
the diagonals of G[d] = dy[d]^T x[d] (the batch summed inside the matmul).

Both compute in float32 (float64 if x or k is float64) whatever the input dtypes; the caller rounds.
"""
from __future__ import annotations

import torch

from .._layout import contiguous
from .._toeplitz import diagonal_sums, toeplitz

#: direct_max_len: lengths up to this use the O(L^2) Toeplitz matmul, above it the O(L log L) FFT
#: path (0: always the FFT); the default is where the two cross on a CPU, tunable per length bucket.
CONFIG_SPACE: dict = {"direct_max_len": (16, 0, 64, 256, 1024)}
DEFAULT_CONFIG: dict = {name: values[0] for name, values in CONFIG_SPACE.items()}


def not_supported_reasons(**inputs) -> list[str]:
    return []  # every device and dtype torch supports


def compute_dtype(*dtypes) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def fft_size(length: int) -> int:
    return 2 * (1 << (length - 1).bit_length())


def forward(x, k, out_dtype=None, *, direct_max_len):
    """y r(B D L) = causal conv of x r(B D L) with k r(D L), in ``out_dtype`` (default x's dtype)."""
    cd = compute_dtype(x.dtype, k.dtype)
    out_dtype = out_dtype or x.dtype
    L = x.shape[-1]
    xc, kc = contiguous(x.to(cd)), k.to(cd)  # a transposed view would be transposed by the FFT's padding copy, untiled
    if L <= direct_max_len:
        y = torch.matmul(xc.transpose(0, 1), toeplitz(kc).transpose(-1, -2))   # [D, B, L]
        return y.transpose(0, 1).to(out_dtype)
    n = fft_size(L)
    spec = torch.fft.rfft(xc, n=n)                                                 # [B, D, n/2+1]
    spec.mul_(torch.fft.rfft(kc, n=n))  # in place: no second spectrum-sized buffer to allocate and fill
    return torch.fft.irfft(spec, n=n)[..., :L].to(out_dtype)


def backward(dy, x, k, need_x=True, need_k=True, *, direct_max_len):
    """-> (dx r(B D L) or None, dk r(D L) or None), both in the compute dtype."""
    cd = compute_dtype(x.dtype, k.dtype)
    L = x.shape[-1]
    dyc = contiguous(dy.to(cd))  # an expanded (stride-0) or transposed upstream gradient slows bmm and FFT
    dx = dk = None
    if L <= direct_max_len:
        dyt = dyc.transpose(0, 1)                                                  # [D, B, L]
        if need_x:
            dx = torch.matmul(dyt, toeplitz(k.to(cd))).transpose(0, 1)
        if need_k:
            dk = diagonal_sums(torch.matmul(dyt.transpose(-1, -2), x.to(cd).transpose(0, 1)))
        return dx, dk
    n = fft_size(L)
    DY = torch.fft.rfft(dyc, n=n)                                                  # [B, D, n/2+1]
    # The products run in place on spectra that are not needed afterwards (X's, then DY once the
    # k-gradient has read it): no further spectrum-sized buffers to allocate and fault in.
    if need_k:
        X = torch.fft.rfft(contiguous(x.to(cd)), n=n)
        cross = X.conj_physical_().mul_(DY).sum(0)                                 # [D, n/2+1]
        dk = torch.fft.irfft(cross, n=n)[..., :L]
    if need_x:
        dx = torch.fft.irfft(DY.mul_(torch.fft.rfft(k.to(cd), n=n).conj()), n=n)[..., :L]
    return dx, dk
