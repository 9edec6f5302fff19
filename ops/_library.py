"""The torch.library registration every public op goes through (docs/design.md, Custom ops).

Each public op is two custom ops in the ``megalodon_kernels`` namespace, ``<op>`` (forward) and
``<op>_bwd`` (backward), plus a fake implementation of each (shapes and dtypes only, never a
tensor's values) and an autograd registration that calls the backward op. torch.compile and
torch.export then see one opaque node per call, on every backend.

Rules the ops follow (so that a fake implementation can describe the real one exactly):

* The backend is resolved inside the real implementation (``OpBackends.select`` reads the
  environment, the autotune tables and a cache: nothing a tracer should see); the schema carries
  only the ``backend`` argument. The backward op resolves it again from the same inputs, which
  the cache answers with the same choice.
* What the forward returns for the backward (the residuals) is an op-level contract that every
  backend produces with the same shapes and dtypes, whichever backend runs.
* An output that does not exist for these arguments (``b`` without ``hx``, ``h`` without
  ``return_state``, a gradient nobody asked for) is an empty placeholder (:func:`absent`),
  decided by the arguments alone; the public function turns it back into None.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

NAMESPACE = "megalodon_kernels"


def absent(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The placeholder for an output that does not exist: an empty (0,) tensor."""
    return like.new_empty(0, dtype=dtype or like.dtype)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A fake implementation's output like ``t``: contiguous, as every real output is (see _fresh)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def _fresh(outputs, inputs):
    """Outputs as a custom op must return them: contiguous, conjugation resolved, sharing no
    storage with an input or with another output (a backend may return an input unchanged, e.g.
    a ``.to`` that was a no-op)."""
    taken = _storages(inputs)
    seen = {id(t) for t in inputs}
    single = isinstance(outputs, torch.Tensor)
    result = []
    for t in ((outputs,) if single else outputs):
        t = t.resolve_conj().resolve_neg().contiguous()
        if id(t) in seen:
            t = t.clone()
        seen.add(id(t))
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in taken:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            taken.add(ptr)
        result.append(t)
    return result[0] if single else tuple(result)


#: Dispatch keys that implement lazy views (``x.conj()``, ``-x`` of a conjugate, zero tensors).
_VIEW_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative, torch._C.DispatchKey.ZeroTensor)


def _lazy_views_resolved():
    """Run a backend with the lazy-view dispatch keys enabled. A custom op called from a graph that
    AOTAutograd compiled (e.g. the ``aot_eager`` backend) runs with these keys in the thread's
    excluded set, where ``dh.conj() * V`` would silently multiply by dh itself; the backends use
    conj() views freely, so every real implementation runs with the keys back on."""
    if not any(map(torch._C._dispatch_tls_is_dispatch_key_excluded, _VIEW_KEYS)):
        return contextlib.nullcontext()
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for k in _VIEW_KEYS:
        excluded = excluded.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _autocast_off():
    """Run a backend with autocast off: an op takes its inputs' dtypes as they come (its own
    dtype rules, docs/design.md), and autocast would otherwise recast the matmuls inside it."""
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for d in on:
        stack.enter_context(torch.autocast(d, enabled=False))
    return stack


def custom_op(name: str, fake, *, tags=()):
    """Register ``fn`` as ``torch.ops.megalodon_kernels.<name>`` (schema from its annotations)
    with the fake implementation ``fake``; returns the op."""
    def register(fn):
        @functools.wraps(fn)
        def real(*args, **kwargs):
            with _lazy_views_resolved(), _autocast_off():
                out = fn(*args, **kwargs)
            return _fresh(out, list(args) + list(kwargs.values()))

        # the schema comes from the annotations, evaluated in fn's module (they may be strings)
        real.__signature__ = inspect.signature(fn, eval_str=True)

        op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(), tags=tags)
        op.register_fake(fake)
        return op
    return register


def grad_or_none(g: torch.Tensor | None, needed: bool):
    """A backward op's placeholder (empty) gradient back to None for autograd."""
    return g if needed else None
