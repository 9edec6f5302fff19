"""Fused output projection + token cross-entropy for training (the LM head and its loss in one op).

``linear_cross_entropy(hidden, weight, target)`` equals
``F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index=-100)`` (mean over
the tokens whose target is not ``ignore_index``) in value and in the gradients of hidden, weight
and bias, but never materialises the (N, V) logits, their log-softmax or the zero-filled
gradient ``cross_entropy``'s backward starts from. The rows are processed in blocks of
``block_rows`` (default: about 2 MiB of fp32 logits per block, so a block stays in the cache
between the passes over it). Per block, in the forward:

    logits = h_b @ W.T (+ bias)           one GEMM into a reused buffer
    logp   = log_softmax(logits)          the same kernel F.cross_entropy runs
    loss_b = -logp[target]                gathered, summed over non-ignored rows at the end
    p      = exp(logp) - onehot(target)   in place: dL/dlogits up to the factor 1/n_valid
    dh_b   = p @ W                        written straight into dh's rows
    dW    += p.T @ (h_b * valid)          ignored rows contribute nothing

so the whole gradient is known when the forward ends: it is saved (dh (N, D), dW (V, D), db (V,))
instead of the logits, and the backward only scales it by grad_output / n_valid (and zeroes dh on
the ignored rows). That trades the logits' memory (N V) for the gradient's (N D + V D), and one
read of each block instead of the five full (N, V) passes of the unfused path (log_softmax,
zero fill, scatter, log_softmax backward, and the logits written by the GEMM).

Gradients are computed only when one is needed (grad mode on and hidden, weight or bias
requiring grad), so evaluation under ``torch.no_grad()`` costs the forward passes alone.

Precision: the logits GEMM runs in the inputs' dtype (as ``nn.Linear`` would: bf16 logits for a
bf16 model, or the autocast dtype under autocast), the softmax and the loss in float32 (float64
for float64 inputs), and the gradient GEMMs in that same float32/float64 accumulation dtype
(a bf16 model's dW is summed over all rows in fp32 and rounded once).

The op is a torch.library custom op registered like the library's own ops (ops/_library.py:
``torch.ops.megalodon_kernels.linear_cross_entropy``, run with autocast off and on the inputs'
CUDA device): under torch.compile it is one opaque node (``fullgraph=True`` works), and its
real implementation always runs eagerly. That real implementation checks the targets' range (one host read of two
flags per call; on CUDA this is a synchronisation).
"""
from __future__ import annotations

from typing import Optional

import torch

from megalodon_kernels.ops._library import absent, custom_op

__all__ = ["linear_cross_entropy", "default_block_rows"]

#: Bytes of fp32 logits per block: about a core's L2, so the log_softmax / exp / GEMM passes over
#: a block read it from the cache rather than from memory.
_BLOCK_BYTES = 2 << 20


def default_block_rows(vocab: int) -> int:
    """Rows per block for a vocabulary of ``vocab`` (a multiple of 64, at least 64)."""
    return max(64, (_BLOCK_BYTES // (4 * max(vocab, 1))) // 64 * 64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lce_fake(hidden, weight, bias, target, ignore_index, block_rows, grad_hidden, grad_weight):
    acc = _acc_dtype(hidden.dtype)
    scalar = hidden.new_empty((), dtype=acc)
    dh = hidden.new_empty(hidden.shape, dtype=acc) if grad_hidden else absent(hidden, acc)
    dw = weight.new_empty(weight.shape, dtype=acc) if grad_weight else absent(hidden, acc)
    db = weight.new_empty(weight.shape[:1], dtype=acc) if grad_weight and bias is not None \
        else absent(hidden, acc)
    return scalar, hidden.new_empty((), dtype=acc), dh, dw, db


# custom_op runs it with autocast off: autocast would recast the GEMMs below (and break their
# out= buffers); the public function already cast the inputs to the autocast dtype.
@custom_op("linear_cross_entropy", _lce_fake)
def _lce(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
         ignore_index: int, block_rows: int, grad_hidden: bool, grad_weight: bool
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, n_valid, dh, dW, db): the mean loss and the count of non-ignored rows (both in the
    accumulation dtype), and the gradients of the SUM of the per-row losses over non-ignored rows
    except that dh is not yet zeroed on the ignored rows (the backward masks it while scaling)."""
    N, D = hidden.shape
    V = weight.shape[0]
    acc = _acc_dtype(hidden.dtype)
    valid = target != ignore_index
    # One host read for both checks: targets out of range (the gather below would fail with an
    # anonymous index error), and whether any row is ignored (else the masking is skipped).
    in_range = ((target >= 0) & (target < V)) | ~valid
    flags = torch.stack([in_range.all(), valid.all()]).tolist()
    if not flags[0]:
        bad = target[~in_range][0].item()
        raise ValueError(f"target holds {bad}, outside [0, {V}) and not ignore_index ({ignore_index})")
    all_valid = flags[1]
    idx = (target if all_valid else torch.where(valid, target, 0)).unsqueeze(1)
    validf = valid.to(acc)
    logp_target = torch.empty(N, 1, dtype=acc, device=hidden.device)

    need_grad = grad_hidden or grad_weight
    dh = torch.empty(N, D, dtype=acc, device=hidden.device) if grad_hidden else absent(hidden, acc)
    dw = torch.zeros(V, D, dtype=acc, device=hidden.device) if grad_weight else absent(hidden, acc)
    db = torch.zeros(V, dtype=acc, device=hidden.device) if grad_weight and bias is not None \
        else absent(hidden, acc)
    w_acc = weight if weight.dtype == acc else weight.to(acc)  # for the gradient GEMMs

    R = max(1, min(block_rows, N))
    logits_buf = torch.empty(R, V, dtype=hidden.dtype, device=hidden.device)
    logp_buf = logits_buf if hidden.dtype == acc else torch.empty(R, V, dtype=acc, device=hidden.device)
    minus_one = torch.full((R, 1), -1.0, dtype=acc, device=hidden.device)
    wt = weight.t()
    for s in range(0, N, R):
        e = min(s + R, N)
        n = e - s
        hb = hidden[s:e]
        logits = logits_buf[:n]
        if bias is None:
            torch.mm(hb, wt, out=logits)
        else:
            torch.addmm(bias, hb, wt, out=logits)
        logp = logp_buf[:n]
        if logp_buf is logits_buf:  # fp32 / fp64: log_softmax into the logits' own buffer
            torch._log_softmax(logits, 1, False, out=logp)
        else:  # bf16 / fp16 logits, as the model's .float() would upcast them
            torch._log_softmax(logits.to(acc), 1, False, out=logp)
        torch.gather(logp, 1, idx[s:e], out=logp_target[s:e])
        if not need_grad:
            continue
        p = logp.exp_()
        p.scatter_add_(1, idx[s:e], minus_one[:n])  # softmax - onehot(target)
        if grad_hidden:
            torch.mm(p, w_acc, out=dh[s:e])
        if grad_weight:
            hb_acc = hb if hb.dtype == acc else hb.to(acc)
            if not all_valid:
                hb_acc = hb_acc * validf[s:e, None]
            dw.addmm_(p.t(), hb_acc)
            if bias is not None:
                db.addmv_(p.t(), validf[s:e])
    n_valid = validf.sum()
    # mean over non-ignored rows; 0 / 0 = nan when every row is ignored, as F.cross_entropy
    loss = -torch.where(valid, logp_target.squeeze(1), 0.0).sum() / n_valid
    return loss, n_valid, dh, dw, db


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, _, _, _ = inputs
    _, n_valid, dh, dw, db = output
    ctx.mark_non_differentiable(*output[1:])
    # The other outputs never get a gradient: without this, autograd would hand the backward
    # zero-filled (N, D) and (V, D) tensors for them.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(n_valid, dh, dw, db, target)
    ctx.ignore_index = ignore_index
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)


def _backward(ctx, g_loss, *_unused):
    n_valid, dh, dw, db, target = ctx.saved_tensors
    h_dtype, w_dtype, b_dtype = ctx.dtypes
    # dL/d(sum of row losses) = g / n_valid; 0 when no row counts (F.cross_entropy's grads are 0 then)
    scale = torch.where(n_valid > 0, g_loss.to(n_valid.dtype) / n_valid, 0.0)
    g_h = g_w = g_b = None
    if ctx.needs_input_grad[0]:
        row = torch.where(target != ctx.ignore_index, scale, 0.0)
        g_h = (dh * row.unsqueeze(1)).to(h_dtype)
    if ctx.needs_input_grad[1]:
        g_w = (dw * scale).to(w_dtype)
    if b_dtype is not None and ctx.needs_input_grad[2]:
        g_b = (db * scale).to(b_dtype)
    return g_h, g_w, g_b, None, None, None, None, None


_lce.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                         block_rows: Optional[int] = None) -> torch.Tensor:
    """Mean token cross-entropy of the logits ``hidden @ weight.T + bias`` against ``target``,
    fused (see the module docstring): the value and gradients of
    ``F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index=ignore_index)``.

    hidden (..., D) float32 / bfloat16 / float16 / float64; weight (V, D) and bias (V,) of the same
    dtype; target integer (...) (hidden's leading shape), each in [0, V) or ``ignore_index``.
    Returns a scalar in float32 (float64 for float64 inputs); nan if every target is ignored
    (as F.cross_entropy), with zero gradients.
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.dtype.is_floating_point or hidden.dim() < 1:
        raise TypeError(f"hidden must be a floating-point tensor (..., D), got {type(hidden).__name__} "
                        f"{getattr(hidden, 'dtype', '')} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, D) with D = hidden.shape[-1] = {hidden.shape[-1]}, got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(getattr(bias, 'shape', ()))}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype.is_complex \
            or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor, got {type(target).__name__} "
                        f"{getattr(target, 'dtype', '')}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.device != hidden.device or target.device != hidden.device or \
            (bias is not None and bias.device != hidden.device):
        raise ValueError("hidden, weight, bias and target must be on one device")
    if block_rows is None:
        block_rows = default_block_rows(weight.shape[0])
    elif not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be None or an int >= 1, got {block_rows!r}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):  # the logits GEMM in the autocast dtype, as nn.Linear's
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    t = target.reshape(-1).to(torch.int64)
    w = weight.contiguous()
    b = None if bias is None else bias.contiguous()
    grad_on = torch.is_grad_enabled()
    grad_h = grad_on and hidden.requires_grad
    grad_w = grad_on and (weight.requires_grad or (b is not None and b.requires_grad))
    loss, *_ = _lce(h, w, b, t, int(ignore_index), int(block_rows), grad_h, grad_w)
    return loss
