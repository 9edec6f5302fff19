"""Baselines: each op written the way a user would without this library (plain PyTorch).

These are the reference points of the benchmark's speed-up column, not correctness references
(tests/ and reference/ hold those). Each takes the same tensors as the library op:

* ``vandermonde_exp``: CEMA kernel k[d, j] = Re sum_n p gamma q**j with one complex ``exp`` per
  (d, n, j) element (the [D, N, L] power tensor is materialised, as upstream Mega/Megalodon do).
* ``ema_hidden_einsum``: last CEMA state from the same per-element power tensor and an einsum.
* ``direct_conv``: the O(L^2) causal convolution, a depthwise ``conv1d`` over a left-padded x.
* ``torch_fft``: the causal convolution with ``torch.fft.rfft`` of size 2L (no pow2 rounding).
* ``cema_composed``: vandermonde_exp + torch_fft + omega * x.
* ``cumsum_norm``: TimestepNorm from cumsum(x) and cumsum(x^2) per group (the numerically naive
  form the library avoids).
* ``materialized``: chunked causal attention that builds the full [C, C] probability matrix per
  chunk, with post-softmax dropout (upstream Megalodon's attention without a fused kernel).
* ``softmax_dropout``: causal masked_fill + softmax + post-softmax dropout on given scores.
* ``complex_rope``: RoPE via ``torch.polar`` and ``view_as_complex`` (LLaMA style), adjacent pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BASELINES"]


def vandermonde_exp(p, log_q, gamma, length):
    j = torch.arange(length, device=p.device, dtype=p.dtype)
    powers = torch.exp(log_q[..., None] * j)  # [D, N, L] complex, one exp per element
    return ((p * gamma)[..., None] * powers).sum(1).real  # [D, L]


def ema_hidden_einsum(x, p, log_q):
    L = x.shape[-1]
    j = torch.arange(L - 1, -1, -1, device=x.device, dtype=p.dtype)
    powers = torch.exp(log_q[..., None] * j)  # [D, N, L]: q**(L-1-j)
    return p * torch.einsum("bdl,dnl->bdn", x.to(powers.dtype), powers)


def direct_conv(x, k):
    B, D, L = x.shape
    w = k.to(x.dtype).flip(-1)[:, None, :]  # [D, 1, L]: conv1d correlates, so flip for a convolution
    return F.conv1d(F.pad(x, (L - 1, 0)), w, groups=D)


def torch_fft(x, k):
    L = x.shape[-1]
    n = 2 * L
    y = torch.fft.irfft(torch.fft.rfft(x.float(), n=n) * torch.fft.rfft(k.float(), n=n), n=n)[..., :L]
    return y.to(x.dtype)


def cema_composed(x, p, log_q, gamma, omega):
    k = vandermonde_exp(p, log_q, gamma, x.shape[-1])
    return torch_fft(x, k) + omega[:, None] * x


def cumsum_norm(x, scale, bias, num_groups, eps=1e-5):
    B, L, D = x.shape
    xg = x.float().view(B, L, num_groups, D // num_groups)
    count = torch.arange(1, L + 1, device=x.device, dtype=torch.float32)[None, :, None] * xg.shape[-1]
    mean = xg.sum(-1).cumsum(1) / count  # [B, L, G]
    var = (xg * xg).sum(-1).cumsum(1) / count - mean * mean
    y = (xg - mean[..., None]) * torch.rsqrt(var + eps)[..., None]
    return (y.view(B, L, D) * scale + bias).to(x.dtype)


def materialized(q, k, v, chunk, scale, dropout_p):
    B, L, H, dh = q.shape
    C = min(chunk, L)
    nc = L // C

    def blocks(t):  # [B, L, H, d] -> [B, nc, H, C, d]
        return t.view(B, nc, C, H, t.shape[-1]).transpose(2, 3)

    s = blocks(q) @ blocks(k).transpose(-1, -2) * scale  # [B, nc, H, C, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    probs = s.float().masked_fill(causal, float("-inf")).softmax(-1).to(q.dtype)
    probs = F.dropout(probs, dropout_p, training=True)
    o = probs @ blocks(v)  # [B, nc, H, C, dv]
    return o.transpose(2, 3).reshape(B, L, H, v.shape[-1])


def softmax_dropout(scores, dropout_p):
    L, S = scores.shape[-2:]
    causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).triu(S - L + 1)
    probs = scores.float().masked_fill(causal, float("-inf")).softmax(-1).to(scores.dtype)
    return F.dropout(probs, dropout_p, training=True)


def complex_rope(x, positions, base=10000.0):
    B, L, H, d = x.shape
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    cis = torch.polar(torch.ones(L, d // 2, device=x.device), positions.float()[:, None] * inv_freq)
    xc = torch.view_as_complex(x.float().reshape(B, L, H, d // 2, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(-2).to(x.dtype)


#: op -> names of its baselines (the providers that are not library backends)
BASELINES: dict[str, tuple[str, ...]] = {
    "cema_kernel": ("vandermonde_exp",),
    "ema_hidden": ("ema_hidden_einsum",),
    "fftconv": ("direct_conv", "torch_fft"),
    "cema": ("cema_composed",),
    "timestep_norm": ("cumsum_norm",),
    "attention": ("materialized",),
    "dropkey_softmax": ("softmax_dropout",),
    "rotary": ("complex_rope",),
}
