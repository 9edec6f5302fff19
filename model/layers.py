"""Megalodon layers on top of megalodon_kernels.ops (the composition: docs/math.md, model).

Module and parameter names follow upstream exactly, so ``state_dict()`` keys match the
upstream consolidated checkpoints. Every sequence-mixing computation (TimestepNorm, CEMA, RoPE,
attention) goes through ``megalodon_kernels.ops`` with the configured backend; what stays in
plain PyTorch is per-position work (linear layers, RMSNorm / LayerNorm, gates).

Shapes: B batch, L length, D model_dim, N cema_ndim, G norm groups, H heads, dz / dv head dims.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from megalodon_kernels import ops
from megalodon_kernels.ops._layout import transpose_contiguous

from .cache import LayerState
from .config import MegalodonConfig

__all__ = ["ComplexEMA", "TimestepNorm", "RMSNorm", "LayerNorm", "MegalodonAttention", "NormalizedFFN",
           "MegalodonBlock", "init_linear"]


def _backend_fn(backend: Union[str, dict]):
    if isinstance(backend, dict):
        return lambda name: backend.get(name, "auto")
    return lambda name: backend


def init_linear(layer: nn.Linear, mode: str) -> None:
    """Upstream's ``get_init_fn(init_mode)`` for linear weights; biases are zero.

    'he' is kaiming_normal with a = sqrt(5) (std = 1/sqrt(3 fan_in)); 'bert' N(0, 0.02^2);
    'gaussian' truncated N(0, 1) on [-3, 3]; 'xavier' xavier_uniform; 'none' keeps PyTorch's
    default (upstream leaves the memory uninitialised because a checkpoint overwrites it).
    """
    w = layer.weight
    if w.is_meta:  # shapes only (deferred init): nothing to fill
        return
    with torch.no_grad():
        if mode == "he":
            nn.init.kaiming_normal_(w, a=math.sqrt(5.0))
        elif mode == "bert":
            nn.init.normal_(w, mean=0.0, std=0.02)
        elif mode == "gaussian":
            nn.init.trunc_normal_(w, mean=0.0, std=1.0, a=-3.0, b=3.0)
        elif mode == "xavier":
            nn.init.xavier_uniform_(w)
        elif mode != "none":
            raise ValueError(f"unknown init_mode {mode!r}")
        if layer.bias is not None:
            layer.bias.zero_()


def fresh_view(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.view(shape)`` for a module's output, without making it an autograd view of ``t``.

    A module wrapped in FSDP2's ``fully_shard`` must not return a view: FSDP2 hooks the output for
    its pre-backward all-gather, and an in-place op on a view (``out += y``) would drop that hook
    (it warns). ``aten._unsafe_view`` (what ``torch.matmul`` returns its folded GEMM through) shares
    the storage like ``view``; it is safe only because ``t`` is a temporary that no autograd node
    saved and nothing else writes: callers pass the output of an addmm or an in-place chain on one,
    never a saved tensor. Without autograd a view is harmless (FSDP2 hooks nothing then) and
    ``view`` is the cheaper call (~3.5 us against ~8 us through torch.ops, measured on one core of
    this repository's shared CPU): decoding keeps it.
    """
    if not t.requires_grad:
        return t.view(shape)
    return torch.ops.aten._unsafe_view.default(t, shape)


def _fuse_residual(p: float, training: bool, x: torch.Tensor) -> bool:
    """Whether a residual sum may go into the output projection's GEMM: no dropout between the
    projection and the sum, and no autocast (under autocast the projection's output is in the
    autocast dtype while the residual stream keeps its own, so the sum must stay a separate,
    type-promoting add)."""
    return (p == 0 or not training) and not torch.is_autocast_enabled(x.device.type)


# ---------------------------------------------------------------------------------------------
# Norms


class TimestepNorm(nn.Module):
    """Causal cumulative group norm (docs/math.md, TimestepNorm) through ``ops.timestep_norm``.

    State (upstream names): buffer ``prior_count`` () int64; ``prior_mean`` and ``prior_logv`` (G,)
    (Parameters if prior_count > 0, else buffers); Parameters ``weight`` and ``bias`` (D,), zeros,
    the applied scale being ``weight + 1``. The default previous state is
    (prior_count, prior_mean, exp(prior_logv)).

    Upstream refuses num_groups None / == D unless prior_count > 1; the group op handles
    G == D fine, so we allow it.
    """

    def __init__(self, num_features: int, num_groups: Optional[int] = None, prior_count: int = 0,
                 eps: float = 1e-5, backend: Union[str, dict] = "auto"):
        super().__init__()
        G = num_features if num_groups is None else num_groups
        if num_features % G:
            raise ValueError(f"num_groups ({G}) must divide num_features ({num_features})")
        self.num_features, self.num_groups, self.eps = num_features, G, eps
        self.backend = _backend_fn(backend)("timestep_norm")
        self.register_buffer("prior_count", torch.tensor(prior_count, dtype=torch.int64))
        if prior_count > 0:
            self.prior_mean = nn.Parameter(torch.zeros(G))
            self.prior_logv = nn.Parameter(torch.zeros(G))
        else:
            self.register_buffer("prior_mean", torch.zeros(G))
            self.register_buffer("prior_logv", torch.zeros(G))
        self.weight = nn.Parameter(torch.zeros(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def initial_state(self, n: int, dtype: torch.dtype):
        """The prior state of n sequences (or documents): count int64 (n,), mean and var r(n G)
        in ``dtype`` (the statistics' dtype: float32, or float64 for float64 inputs)."""
        # fresh tensors, never views of the buffers (expand(1).contiguous() would be one): a
        # streaming cache updates them in place
        fresh = torch.contiguous_format
        return (self.prior_count.expand(n).clone(memory_format=fresh),
                self.prior_mean.to(dtype).expand(n, -1).clone(memory_format=fresh),
                self.prior_logv.to(dtype).exp().expand(n, -1).clone(memory_format=fresh))

    def forward(self, x: torch.Tensor, prev_count: Optional[torch.Tensor] = None,
                prev_mean: Optional[torch.Tensor] = None, prev_var: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None, *, cu_seqlens: Optional[torch.Tensor] = None):
        """x r(B L D) -> (y r(B L D), count int64 (B,), mean r(B G), var r(B G)).

        With ``cu_seqlens`` (n + 1,), x is one packed row (B = 1) of n documents: the statistics
        restart at every document start, and the previous and returned states are per document,
        (n,) and r(n G)."""
        n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        if prev_count is None or prev_mean is None or prev_var is None:
            prev_count, prev_mean, prev_var = (given if given is not None else prior for given, prior in
                                               zip((prev_count, prev_mean, prev_var), self.initial_state(n, acc)))
        # +1 in fp32 (upstream adds it in the parameter dtype, which rounds in bf16).
        scale = self.weight.to(acc) + 1.0
        return ops.timestep_norm(x, scale, self.bias, self.num_groups, prev_count, prev_mean, prev_var,
                                 padding_mask, self.eps, cu_seqlens=cu_seqlens, backend=self.backend)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, num_groups={self.num_groups}, eps={self.eps}"


class _RMSNormFn(torch.autograd.Function):
    """y = x r s, r = 1 / sqrt(mean(x^2) + eps) per row, s (D,) or None; x float32 / float64.

    The same math as the composition of torch ops, in fewer passes over the (rows, D) tensors
    (each pass reads or writes every element once; the tensors of the bench model are several MB,
    so the passes and their fresh allocations, not the arithmetic, cost the time):
    forward: one reduction (vector_norm) and one out-of-place multiply, the weight applied in
    place; backward, with gx = g x: gx (one pass), then two GEMVs read it for
    sum_j g_j s_j x_j (= gx @ s) and ds (= gx.T @ r), and dx = r (g s - x r^2 mean(g s x)) is
    written over gx in place. The composed ops took four passes forward and about a dozen
    backward (autograd's mul/pow/mean backward and the (rows, D) -> D weight-gradient sum).
    """

    @staticmethod
    def forward(ctx, x, s, eps):
        d = x.shape[-1]
        # mean(x^2) as |x|^2 / d: one reduction pass, no x^2 temporary
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()
        y = x * r
        if s is not None:
            # In place saves a (rows, D) allocation in eager. Under torch.compile it saves nothing
            # (inductor fuses the two multiplies) and torch 2.11's dynamo returns zero gradients for
            # every input of a Function whose forward mutates its own output (2.13 does not), so
            # the compiled form multiplies out of place.
            y = y * s if torch.compiler.is_compiling() else y.mul_(s)
        ctx.save_for_backward(x, r, s)
        return y

    @staticmethod
    @once_differentiable  # the backward writes with out= / in place: no double backward through it
    def backward(ctx, g):
        # a backward called inside an autocast region would otherwise run the GEMVs in bf16
        with torch.autocast(g.device.type, enabled=False):
            return _RMSNormFn._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        x, r, s = ctx.saved_tensors
        d = x.shape[-1]
        need_x = ctx.needs_input_grad[0]
        need_s = s is not None and ctx.needs_input_grad[1]
        gx = g * x
        rows = gx.reshape(-1, d)
        ds = torch.mv(rows.t(), r.reshape(-1)) if need_s else None
        dx = None
        if need_x:
            dot = torch.mv(rows, s).view(r.shape) if s is not None else gx.sum(-1, keepdim=True)
            k = dot.mul_(r.pow(3)).div_(d)  # r^3 / d * sum_j g_j s_j x_j
            # dx = r g s - k x, written over gx (no longer needed once the GEMVs have read it)
            if s is not None:
                dx = torch.mul(x, k.div_(r).neg_(), out=gx).addcmul_(g, s).mul_(r)
            else:
                dx = torch.mul(x, k.neg_(), out=gx).addcmul_(g, r)
        return dx, ds, None


class _SiluGateFn(torch.autograd.Function):
    """a * silu(u), saving what autograd's mul and silu would save (a, u, silu(u)), with a
    backward that writes silu's gradient over the temporary g * a (``silu_backward`` with
    ``grad_input=``): one fresh (rows, features) tensor less per call than autograd's three."""

    @staticmethod
    def forward(ctx, a, u):
        s = F.silu(u)
        ctx.save_for_backward(a, u, s)
        return a * s

    @staticmethod
    @once_differentiable  # the backward writes in place: no double backward through it
    def backward(ctx, g):
        a, u, s = ctx.saved_tensors
        da = g * s if ctx.needs_input_grad[0] else None
        du = None
        if ctx.needs_input_grad[1]:
            t = g * a
            du = torch.ops.aten.silu_backward.grad_input(t, u, grad_input=t)
        return da, du


def _silu_gate(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a * silu(u) (the attention gate, SwiGLU); the Function needs one dtype and one shape (its
    gradients are returned as computed), else the plain ops."""
    if a.dtype == u.dtype and a.shape == u.shape:
        return _SiluGateFn.apply(a, u)
    return a * F.silu(u)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (weight + 1), statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        if affine:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        scale = None if self.weight is None else self.weight.to(xf.dtype) + 1.0
        return _RMSNormFn.apply(xf, scale, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * (weight + 1) + bias."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        if affine:
            self.weight = nn.Parameter(torch.zeros(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight + 1.0
        return F.layer_norm(x, (self.dim,), w, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


# ---------------------------------------------------------------------------------------------
# CEMA


class ComplexEMA(nn.Module):
    """Multi-dimensional complex EMA (docs/math.md, cema and model) through ``ops.cema``.

    Parameters (upstream names and shapes): alpha (D, N, 1), delta (D, N, 1), theta (D, 1, 1),
    gamma (D, N, 2) (real view of a complex weight), omega (D, 1). Coefficients, recomputed on
    every call (no eval-mode cache that could go stale), in fp32 (fp64 for fp64
    parameters) whatever the parameter dtype:

        p      = sigmoid(alpha)
        log_q  = log(1 - sigmoid(alpha) sigmoid(delta)) + i theta_n,
        theta_n = n sigmoid(theta) 2 pi / N,  n = 1..N
        gamma_c = (gamma[..., 0] + i gamma[..., 1]) sqrt(1/N)

    log|q| is formed without cancellation: log1p(-a d) while a d < 1/2, else
    log(sigmoid(-alpha) + sigmoid(alpha) sigmoid(-delta)) (= 1 - a d exactly), so a decay close to
    1 keeps its fp32 digits.
    """

    def __init__(self, embed_dim: int, ndim: int = 16, backend: Union[str, dict] = "auto"):
        super().__init__()
        self.embed_dim, self.ndim = embed_dim, ndim
        self.scale = math.sqrt(1.0 / ndim)
        self.backend = _backend_fn(backend)("cema")
        self.alpha = nn.Parameter(torch.zeros(embed_dim, ndim, 1))
        self.delta = nn.Parameter(torch.zeros(embed_dim, ndim, 1))
        self.theta = nn.Parameter(torch.zeros(embed_dim, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(embed_dim, ndim, 2))
        self.omega = nn.Parameter(torch.zeros(embed_dim, 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Upstream init without torch.distributed: the theta permutation comes from
        ``generator`` (or torch's default one)."""
        D = self.embed_dim
        if self.alpha.is_meta:
            return
        nn.init.normal_(self.alpha, 0.0, 0.2, generator=generator)
        nn.init.normal_(self.delta, 0.0, 0.2, generator=generator)
        idx = torch.randperm(D, generator=generator)
        f = torch.exp(torch.arange(1, D + 1, dtype=torch.float64) * (-math.log(D) / D))[idx]
        self.theta.copy_(torch.log(f / (1.0 - f)).view(D, 1, 1))
        nn.init.normal_(self.gamma, 0.0, 1.0, generator=generator)
        self.gamma[:, :, 1] = 0.0
        nn.init.trunc_normal_(self.omega, 0.0, 0.25, -1.0, 1.0, generator=generator)

    def coefficients(self):
        """(p r(D N), log_q c(D N), gamma c(D N)) in fp32/complex64 (fp64/complex128 for fp64 params)."""
        dt = torch.float64 if self.alpha.dtype == torch.float64 else torch.float32
        D, N = self.embed_dim, self.ndim
        alpha, delta = self.alpha.to(dt).view(D, N), self.delta.to(dt).view(D, N)
        a, d = torch.sigmoid(alpha), torch.sigmoid(delta)
        ad = a * d
        one_minus = torch.sigmoid(-alpha) + a * torch.sigmoid(-delta)
        small = ad < 0.5
        # Each branch only sees inputs it is selected for, so the other's gradient is never inf * 0.
        log_abs = torch.where(small, torch.log1p(-torch.where(small, ad, 0.0)),
                              torch.log(torch.where(small, 1.0, one_minus)))
        n = torch.arange(1, N + 1, dtype=dt, device=alpha.device)
        phase = torch.sigmoid(self.theta.to(dt).view(D, 1)) * (2.0 * math.pi / N) * n
        log_q = torch.complex(log_abs, phase)
        gamma = torch.view_as_complex(self.gamma.to(dt).contiguous()) * self.scale
        return a, log_q, gamma

    def forward(self, x: torch.Tensor, hx: Optional[torch.Tensor] = None, return_state: bool = False, *,
                cu_seqlens: Optional[torch.Tensor] = None):
        """x r(B D L), hx c(B D N) or None -> (y r(B D L) in x's dtype, h c(B D N) or None).

        With ``cu_seqlens`` (n + 1,), x is one packed row (B = 1) of n documents, each starting
        from its own state: hx and h are c(n D N)."""
        p, log_q, gamma = self.coefficients()
        return ops.cema(x, p, log_q, gamma, self.omega.view(self.embed_dim), hx, return_state,
                        cu_seqlens=cu_seqlens, backend=self.backend)

    def extra_repr(self) -> str:
        return f"edim={self.embed_dim}, ndim={self.ndim}"


# ---------------------------------------------------------------------------------------------
# Moving-average gated attention (the "mega" sub-layer)


def _incoming(state: LayerState):
    """(count, mean, var, hx complex) to start a call from. With autograd on, copies: the ops save
    their inputs for the backward, and the state is overwritten in place after the call."""
    ts = (state.norm_count, state.norm_mean, state.norm_var, state.hx)
    if torch.is_grad_enabled():
        ts = tuple(t.clone() for t in ts)
    return ts[:3] + (torch.complex(ts[3][:, 0], ts[3][:, 1]),)


def _row_view(state: LayerState, b: int) -> LayerState:
    """Row b of a filled state as views (in-place updates reach the batch's tensors)."""
    return LayerState(**{name: getattr(state, name)[b:b + 1] for name in
                         ("k", "v", "length", "norm_count", "norm_mean", "norm_var", "hx")})


class MegalodonAttention(nn.Module):
    """Upstream's MovingAverageGatedAttention (docs/math.md, model); state_dict names ``timenorm.*``,
    ``cema.*``, ``rmsnorm.weight``, ``wv``, ``wz``, ``wr``, ``wh1``, ``wh2``, ``gamma``, ``beta``.

    forward(x r(B L D), state=None) -> r(B L D), the block input plus the attention branch.

    Attention is causal and block-diagonal over chunks of ``chunk_size`` positions counted from
    the start of the sequence; q and k are rotated (RoPE) with their position inside their chunk.
    Any L works: the last chunk may be partial. With a :class:`LayerState` the call continues a
    stream: TimestepNorm starts from the carried (count, mean, var), CEMA from the carried hidden
    state, and the new queries attend to the cached (already rotated) keys of the unfinished
    chunk; the state is updated in place. A stream split anywhere equals one call on the whole.

    With ``cu_seqlens`` (n + 1,), x is one packed row (B = 1) of n documents, and each runs as if
    it were a sequence of its own: TimestepNorm statistics, CEMA state, attention chunks and RoPE
    positions all restart at every document start, and no query sees another document's keys.
    """

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        D, Z, E, H = cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.num_heads
        self.mdim, self.zdim, self.hdim, self.num_heads = D, Z, E, H
        self.z_head_dim, self.v_head_dim = cfg.z_head_dim, cfg.v_head_dim
        self.chunk_size = cfg.chunk_size
        self.rope_base = cfg.rope_theta
        self.dropout, self.hidden_dropout = cfg.dropout, cfg.hidden_dropout
        self.dropkey_p = cfg.dropkey_rate
        self.attn_fn = cfg.attn_fn
        be = _backend_fn(cfg.backend)
        self._attn_backend, self._rotary_backend = be("attention"), be("rotary")

        self.timenorm = TimestepNorm(D, cfg.norm_num_groups, cfg.norm_prior_count, cfg.norm_eps, cfg.backend)
        self.cema = ComplexEMA(D, cfg.cema_ndim, cfg.backend)
        self.rmsnorm = RMSNorm(D, cfg.norm_eps, affine=cfg.norm_affine)
        self.znorm = RMSNorm(self.z_head_dim, cfg.norm_eps, affine=False)
        self.wv = nn.Linear(D, E)
        self.wz = nn.Linear(D, Z)
        self.wr = nn.Linear(D, E)
        self.wh1 = nn.Linear(D, D)
        self.wh2 = nn.Linear(E, D, bias=False)
        self.gamma = nn.Parameter(torch.zeros(2, Z))
        self.beta = nn.Parameter(torch.zeros(2, Z))
        for lin in (self.wv, self.wz, self.wr, self.wh1, self.wh2):
            init_linear(lin, cfg.init_mode)

    def _dropout(self, x, p):
        return F.dropout(x, p, self.training) if p > 0 else x

    def forward(self, x: torch.Tensor, state: Optional[LayerState] = None, *,
                carry: Optional[tuple] = None, on_carry=None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``carry`` / ``on_carry`` serve chunk parallelism (:mod:`..parallel`), with gradients:
        ``carry = (prev_count, prev_mean, prev_var, hx)`` (any may be None) is the incoming state
        of a slice starting on a chunk boundary, one per sequence (with ``cu_seqlens``: one per
        document, leading size n), and ``on_carry(count, mean, var, h)`` is called with the
        outgoing state (not detached, in the same layout) right after the CEMA, before the
        attention.

        With a :class:`LayerState` of B rows (rows may be at different lengths), x r(B L D)
        continues every row, updating the state in place; with a state of n fresh rows and
        ``cu_seqlens`` (n + 1,), x is one packed row of n documents (a prefill) and row d receives
        document d's final state. One token per row in eval mode, autograd not recording, runs
        :func:`.decode.mega_step` (fixed shapes, no host read); rows at different chunk positions
        with L > 1 run one at a time."""
        if state is None:
            if carry is not None:
                return self._run(x, *carry, cu_seqlens=cu_seqlens, on_carry=on_carry)[0]
            return self._run(x, cu_seqlens=cu_seqlens, on_carry=on_carry)[0]
        if carry is not None:
            raise ValueError("pass either a streaming state or a carry, not both")
        if not isinstance(state, LayerState):
            raise TypeError(f"state must be a LayerState, got {type(state).__name__}")
        B, L, _ = x.shape
        rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if state.length.shape[0] != rows:
            raise ValueError(f"state has {state.length.shape[0]} rows but x brings {rows} sequences")
        if state.k.shape[1] != self.chunk_size:
            raise ValueError(f"state was made for chunk_size {state.k.shape[1]}, this layer has {self.chunk_size}")
        if cu_seqlens is not None:
            return self._prefill_packed(x, state, cu_seqlens, on_carry)
        if L == 1 and not self.training and on_carry is None and not (torch.is_grad_enabled()
                                                                       and self.wz.weight.requires_grad):
            from .decode import layer_constants, mega_step
            return mega_step(self, layer_constants(self), x[:, 0], state)[:, None]
        self._fill_state(state, B, x)
        offsets = state.chunk_offsets.tolist()  # a host read: once per multi-token call
        if any(o != offsets[0] for o in offsets):
            # rows at different chunk positions: their chunks do not line up, so one at a time
            # (row views: the in-place updates land in the batch's tensors)
            return torch.cat([self.forward(x[b:b + 1], _row_view(state, b), on_carry=on_carry) for b in range(B)])
        return self._continue(x, state, offsets[0] if offsets else 0, on_carry)

    def _fill_state(self, state: LayerState, n: int, x: torch.Tensor) -> None:
        """Statistics and CEMA state of a state created without them: the priors and zero."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        if state.norm_count is None:
            state.norm_count, state.norm_mean, state.norm_var = self.timenorm.initial_state(n, acc)
        if state.hx is None:
            cdt = torch.float64 if self.cema.alpha.dtype == torch.float64 else torch.float32
            state.hx = torch.zeros(n, 2, self.mdim, self.cema.ndim, dtype=cdt, device=x.device)

    @staticmethod
    def _store_stats(state: LayerState, count, mean, var, h) -> None:
        state.norm_count.copy_(count)
        state.norm_mean.copy_(mean)
        state.norm_var.copy_(var)
        state.hx[:, 0].copy_(h.real)
        state.hx[:, 1].copy_(h.imag)

    def _continue(self, x, state: LayerState, offset: int, on_carry):
        """Every row at chunk position ``offset``: the live cached slots join the new keys."""
        L = x.shape[1]
        C = self.chunk_size
        past = (state.k[:, :offset], state.v[:, :offset]) if offset > 0 else None
        out, count, mean, var, h, k_all, v_all = self._run(x, *_incoming(state), offset=offset, past=past,
                                                           need_state=True, on_carry=on_carry)
        S = k_all.shape[1]
        keep = S % C  # keys of the unfinished chunk go to slots 0..keep-1
        state.k[:, :keep] = k_all[:, S - keep:].detach()
        state.v[:, :keep] = v_all[:, S - keep:].detach()
        self._store_stats(state, count.detach(), mean.detach(), var.detach(), h.detach())
        state.length.add_(L)
        return out

    def _prefill_packed(self, x, state: LayerState, cu_seqlens, on_carry):
        """A packed row of n documents into n fresh rows (their lengths must be 0)."""
        if bool((state.length != 0).any()):
            raise ValueError("a packed prefill (cu_seqlens with a state) needs fresh rows (length 0); continue rows "
                             "that already hold tokens with unpacked calls")
        n = cu_seqlens.shape[0] - 1
        self._fill_state(state, n, x)
        out, count, mean, var, h, k_all, v_all = self._run(x, *_incoming(state), cu_seqlens=cu_seqlens,
                                                           need_state=True, on_carry=on_carry)
        # row d's live slots: the last (L_d mod C) keys of document d
        C = self.chunk_size
        cu = cu_seqlens.tolist()
        rows, slots, src = [], [], []
        for d in range(n):
            keep = (cu[d + 1] - cu[d]) % C
            rows += [d] * keep
            slots += list(range(keep))
            src += list(range(cu[d + 1] - keep, cu[d + 1]))
        if rows:
            dev = x.device
            idx = (torch.tensor(rows, device=dev), torch.tensor(slots, device=dev))
            src_t = torch.tensor(src, device=dev)
            state.k.index_put_(idx, k_all[0, src_t].detach().to(state.k.dtype))
            state.v.index_put_(idx, v_all[0, src_t].detach().to(state.v.dtype))
        self._store_stats(state, count.detach(), mean.detach(), var.detach(), h.detach())
        state.length.add_((cu_seqlens[1:] - cu_seqlens[:-1]).to(state.length))
        return out

    def _run(self, x, prev_count=None, prev_mean=None, prev_var=None, hx=None, *, offset: int = 0, past=None,
             cu_seqlens=None, on_carry=None, need_state: bool = False):
        """The sub-layer from an incoming state -> (out, count, mean, var, h, k_all, v_all):
        ``past`` = the live (keys, values) of the rows' current chunk, ``offset`` their number."""
        B, L, D = x.shape
        H, dz, dv, C = self.num_heads, self.z_head_dim, self.v_head_dim, self.chunk_size
        # 1-2. TimestepNorm (carried statistics)
        out_tsn, count, mean, var = self.timenorm(x, prev_count, prev_mean, prev_var, cu_seqlens=cu_seqlens)
        # 3. CEMA over time on (B, D, L); no activation after it
        y, h = self.cema(out_tsn.transpose(1, 2), hx, return_state=need_state or on_carry is not None,
                         cu_seqlens=cu_seqlens)
        if on_carry is not None:
            on_carry(count, mean, var, h)
        # One copy to (B, L, D) rows here saves one in each of the three linears reading mx below.
        out_cema = transpose_contiguous(y, 1, 2)
        # 4. RMSNorm
        mx = self._dropout(self.rmsnorm(out_cema), self.hidden_dropout)
        # 5-6. shared z -> normalised per head -> q, k by scale/offset
        z = self.znorm(self.wz(mx).view(B, L, H, dz)).view(B, L, self.zdim)
        # q = z (gamma_0 + 1) / sqrt(dz) + beta_0 and k likewise, each one addcmul pass into its own
        # contiguous (B, L, Z) tensor (a (B, L, 2, Z) broadcast would leave q and k as strided
        # halves, copied again before the rotary)
        scale = (self.gamma + 1.0) / math.sqrt(dz)
        q = torch.addcmul(self.beta[0], z, scale[0])
        k = torch.addcmul(self.beta[1], z, scale[1])
        # 7-8. value from the TimestepNorm output, gate from mx
        v = F.silu(self.wv(out_tsn))
        u_gate = self.wr(mx)  # the gate r = silu(u_gate), applied with the attention output below
        # 9. chunked attention; RoPE positions are relative to each chunk's start (chunks of a
        # packed row start at each document's start)
        if cu_seqlens is None:
            pos = torch.remainder(torch.arange(offset, offset + L, device=x.device), C)
        else:
            pos = torch.remainder(ops.document_positions(cu_seqlens, L), C)
        q = ops.rotary(q.reshape(B, L, H, dz), pos, self.rope_base, backend=self._rotary_backend)
        k = ops.rotary(k.reshape(B, L, H, dz), pos, self.rope_base, backend=self._rotary_backend)
        v = v.reshape(B, L, H, dv)
        if past is not None:
            k_all = torch.cat([past[0].to(k.dtype), k], dim=1)
            v_all = torch.cat([past[1].to(v.dtype), v], dim=1)
        else:
            k_all, v_all = k, v
        # q and k come out of fp32 parameters (gamma, beta): under autocast v is already in the
        # autocast dtype, and attention takes one dtype, the matmul dtype autocast chose for v.
        q, k_all = q.to(v_all.dtype), k_all.to(v_all.dtype)
        dropkey_p = self.dropkey_p if self.training else 0.0
        attn = ops.attention(q, k_all, v_all, scale=1.0, causal=True, chunk_size=C, dropkey_p=dropkey_p,
                             attn_fn=self.attn_fn, cu_seqlens=cu_seqlens, backend=self._attn_backend)
        # 10-12. gate, output projections, residual
        attn = self._dropout(_silu_gate(attn.reshape(B, L, self.hdim), u_gate), self.hidden_dropout)
        if _fuse_residual(self.dropout, self.training, x):
            # x + wh1(mx) + wh2(attn) accumulated in one buffer: wh2's GEMM adds into wh1's output
            # (beta = 1) and x is added in place, instead of two out-of-place sums
            # (on 2-D tensors: an in-place op on a view would cost autograd a CopySlices node)
            out = self.wh1(mx.reshape(B * L, D))
            out.addmm_(attn.reshape(B * L, self.hdim), self.wh2.weight.t())
            out = fresh_view(out.add_(x.reshape(B * L, D)), (B, L, D))
        else:
            out = self._dropout(self.wh1(mx) + self.wh2(attn), self.dropout) + x

        return out, count, mean, var, h, k_all, v_all

    def extra_repr(self) -> str:
        return (f"mdim={self.mdim}, zdim={self.zdim}, hdim={self.hdim}, heads={self.num_heads}, "
                f"chunk={self.chunk_size}")


# ---------------------------------------------------------------------------------------------
# FFN and block


class NormalizedFFN(nn.Module):
    """Upstream's NormalizedFeedForwardNetwork: names ``norm.*``, ``fc1``, ``fc2``,
    ``fc3`` (SwiGLU only), ``alpha`` (rescale only, init 0.1 * 0.5**layer_id).

    forward(y, residual) = residual + alpha * dropout(fc2(dropout(act(LN(y))))), with
    act(u) = silu(fc1 u) * fc3 u (SwiGLU) or silu(fc1 u).
    """

    def __init__(self, cfg: MegalodonConfig, layer_id: int = 0):
        super().__init__()
        D, Fh = cfg.model_dim, cfg.ffn_hidden_dim
        self.swiglu = cfg.swiglu
        self.dropout, self.hidden_dropout = cfg.dropout, cfg.hidden_dropout
        self.norm = LayerNorm(D, cfg.norm_eps, affine=cfg.norm_affine)
        self.fc1 = nn.Linear(D, Fh, bias=False)
        self.fc2 = nn.Linear(Fh, D, bias=False)
        self.fc3 = nn.Linear(D, Fh, bias=False) if cfg.swiglu else None
        for lin in (self.fc1, self.fc2, self.fc3):
            if lin is not None:
                init_linear(lin, cfg.init_mode)
        if cfg.rescale_nffn:
            self.alpha = nn.Parameter(torch.full((D,), 0.1 * 0.5 ** layer_id))
        else:
            self.register_parameter("alpha", None)

    def forward(self, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        u = self.norm(y)
        hidden = F.silu(self.fc1(u)) if self.fc3 is None else _silu_gate(self.fc3(u), self.fc1(u))
        if self.hidden_dropout > 0:
            hidden = F.dropout(hidden, self.hidden_dropout, self.training)
        if _fuse_residual(self.dropout, self.training, residual):
            if self.alpha is not None:
                return torch.addcmul(residual, self.fc2(hidden), self.alpha)  # one pass for * alpha and +
            # residual + fc2(hidden) with the sum in the GEMM (beta = 1): no separate add pass
            shape = residual.shape
            return fresh_view(torch.addmm(residual.reshape(-1, shape[-1]), hidden.reshape(-1, hidden.shape[-1]),
                                          self.fc2.weight.t()), shape)
        out = self.fc2(hidden)
        if self.dropout > 0:
            out = F.dropout(out, self.dropout, self.training)
        if self.alpha is not None:
            out = out * self.alpha
        return out + residual


class MegalodonBlock(nn.Module):
    """mega then nffn with the two-hop residual: out = x + alpha * FFN(LN(mega(x)))."""

    def __init__(self, cfg: MegalodonConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.mega = MegalodonAttention(cfg)
        self.nffn = NormalizedFFN(cfg, layer_id)

    def forward(self, x: torch.Tensor, state: Optional[LayerState] = None, *,
                carry: Optional[tuple] = None, on_carry=None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``carry`` / ``on_carry`` (chunk parallelism) and ``cu_seqlens`` (a packed row): see
        :meth:`MegalodonAttention.forward`."""
        return self.nffn(self.mega(x, state, carry=carry, on_carry=on_carry, cu_seqlens=cu_seqlens), x)
