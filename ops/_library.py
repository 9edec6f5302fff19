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
* The implementation runs with the device of the op's first tensor argument current
  (``torch.cuda.device``), entered here once for every backend and for both the forward and the
  backward op: Triton launches on the current device, not the tensors'. CPU tensors enter nothing.
* An output that does not exist for these arguments (``b`` without ``hx``, ``h`` without
  ``return_state``, a gradient nobody asked for) is an empty placeholder (:func:`absent`),
  decided by the arguments alone; the public function turns it back into None.

Eager calls take a shorter road to the same code (:class:`Op`). The dispatcher's road (boxing
the arguments, the Python autograd kernel, a redispatch, the Python backend kernel, the
dynamo-disable wrapper, the wrapper's context managers) measured ~8 us per forward call without
autograd, ~20 us with it and ~30 us per forward + backward in a tight loop of tiny calls on one
core of the shared 2-core x86 CPU, and several times that between large kernels (the Python runs
out of cache): a large part of a small op's time on a CPU. When nothing can observe the
difference (plain dense tensors, no torch.compile/export/jit tracing, no dispatch or function
mode, no functorch transform or forward-mode AD level, no profiler, the default dispatch-key
state), :class:`Op` calls the real implementation itself,
under the same below-autograd guard the dispatcher's autograd kernel uses, and records the same
autograd node (the registered setup_context and backward, in a ``torch.autograd.Function``).
Anything else (and every argument of an unexpected type, so the schema's own errors and
conversions stay) goes through the dispatcher as before.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
import torch.autograd.forward_ad as _forward_ad

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
    single = isinstance(outputs, torch.Tensor)
    outs = tuple(t if t.is_contiguous() and not (t.is_conj() or t.is_neg())
                 else t.resolve_conj().resolve_neg().contiguous() for t in ((outputs,) if single else outputs))
    # One C++ pass (the check torch.library runs after an implementation) answers the common case:
    # nothing shared, nothing to copy. Only when it finds a shared storage does the loop below
    # decide which outputs to copy.
    if not torch._C._any_output_is_alias_to_input_or_output(tuple(inputs), {}, outs):
        return outs[0] if single else outs
    return _fresh_copies(outs, inputs, single)


def _fresh_copies(outputs, inputs, single):
    taken = _storages(inputs)
    seen = {id(t) for t in inputs}
    result = []
    for t in outputs:
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


#: Whether this torch build can hold CUDA (or ROCm) tensors at all: on a CPU-only build no call
#: looks for a device (the CPU path's cost stays zero; tests set it to fake a second GPU).
CUDA_BUILD = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def cuda_device(t) -> torch.device | None:
    """The device to run a call on: its lead tensor's device when that is a CUDA device, else None
    (tests fake a second device here; see tests/test_device_guard.py)."""
    return t.device if t.is_cuda else None


def _lead_argument(schema) -> tuple[str, int] | None:
    """(name, position) of the schema's first required tensor argument: the tensor whose device a
    call runs on (every op's inputs share one device; the public functions check it)."""
    for i, a in enumerate(schema.arguments):
        if isinstance(a.type, torch._C.TensorType):
            return a.name, i
    return None


def _on_device(device: torch.device):
    """Make ``device`` current while a backend runs: Triton launches on the current device, and
    the CUDA backends allocate and launch there too. Entered only for CUDA tensors."""
    return torch.cuda.device(device)


def custom_op(name: str, fake, *, tags=()):
    """Register ``fn`` as ``torch.ops.megalodon_kernels.<name>`` (schema from its annotations)
    with the fake implementation ``fake``; returns the op (an :class:`Op`)."""
    def register(fn):
        lead = None  # (name, position) of the tensor whose device the call runs on; set below

        @functools.wraps(fn)
        def real(*args, **kwargs):
            t = None
            if CUDA_BUILD and lead is not None:
                t = kwargs.get(lead[0]) if lead[0] in kwargs else args[lead[1]] if lead[1] < len(args) else None
            device = cuda_device(t) if isinstance(t, torch.Tensor) else None
            with (_on_device(device) if device is not None else contextlib.nullcontext()), \
                    _lazy_views_resolved(), _autocast_off():
                out = fn(*args, **kwargs)
            return _fresh(out, list(args) + list(kwargs.values()))

        # the schema comes from the annotations, evaluated in fn's module (they may be strings)
        real.__signature__ = inspect.signature(fn, eval_str=True)

        op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(), tags=tags)
        op.register_fake(fake)
        lead = _lead_argument(op._opoverload._schema)
        return Op(op, fn, real, lead)
    return register


# ---------------------------------------------------------------------------------------------
# The eager fast path


def _tls_states() -> dict:
    """raw (exclude, include) dispatch-key sets of the thread-local states the fast path accepts
    -> (whether the dispatcher would run the op's autograd kernel there, or skip it in inference
    mode or inside another op's below-autograd guard; whether autocast is off). Read in a fresh
    thread, whose state is the default whatever the importing thread is doing. Autocast adds no
    kernel for a custom op (the real implementation turns it off), so it may be on or off. None
    of these states excludes the lazy-view keys (see _lazy_views_resolved)."""
    states = {}
    K = torch._C.DispatchKey

    def record(autograd: bool):
        ex, inc = torch._C._dispatch_tls_local_exclude_set(), torch._C._dispatch_tls_local_include_set()
        for drop in ((), (K.AutocastCPU,), (K.AutocastCUDA,), (K.AutocastCPU, K.AutocastCUDA)):
            e = ex
            for k in drop:
                e = e.remove(k)
            states[(e.raw_repr(), inc.raw_repr())] = (autograd, not drop)

    def read():
        record(True)
        with torch._C._AutoDispatchBelowAutograd():
            record(False)
        with torch.inference_mode():
            record(False)
            with torch._C._AutoDispatchBelowAutograd():
                record(False)

    t = threading.Thread(target=read)
    t.start()
    t.join()
    return states


_TLS_STATES = _tls_states()
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(profiler_ok: bool = False) -> bool:
    """Whether this call runs in plain eager mode: not traced by torch.compile, torch.export or
    torch.jit, no dispatch or function mode (fake tensors, functionalization, ``torch.device``
    contexts, debug modes), no functorch transform (vmap, grad), and unless ``profiler_ok`` no
    profiler (whose trace should show every op), no forward-mode AD level (dual tensors). The
    dispatch-key state is :class:`Op`'s check."""
    return not (torch.compiler.is_compiling() or torch._C._is_tracing() or torch._C._len_torch_dispatch_stack()
                or torch._C._len_torch_function_stack() or torch._C._functorch.peek_interpreter_stack() is not None
                or _forward_ad._current_level >= 0 or (not profiler_ok and torch._C._autograd._profiler_enabled()))


def plain_tensor(t) -> bool:
    """A dense strided CPU or CUDA tensor of the plain Tensor (or Parameter) type: no subclass
    (fake, functional, user subclasses), no meta, sparse or nested tensor."""
    return (type(t) in _PLAIN_TYPES and t.layout is torch.strided and (t.is_cpu or t.is_cuda)
            and not t.is_nested)


def _arg_kinds(schema) -> tuple | None:
    """Per schema argument (kind, optional, default or _NO_DEFAULT), kind = "tensor" or the
    Python type an eager argument must have for the fast path; None: this op always goes
    through the dispatcher (a schema type the fast path does not check)."""
    types = {torch._C.IntType: int, torch._C.FloatType: float, torch._C.BoolType: bool, torch._C.StringType: str}
    kinds = []
    for a in schema.arguments:
        t = a.type
        optional = isinstance(t, torch._C.OptionalType)
        base = t.getElementType() if optional else t
        if isinstance(base, torch._C.TensorType):
            kind = "tensor"
        elif type(base) in types:
            kind = types[type(base)]
        else:
            return None
        kinds.append((kind, optional, a.default_value if a.has_default_value() else _NO_DEFAULT))
    return tuple(kinds)


_NO_DEFAULT = object()

_backward_imports_done = False


def _do_backward_imports() -> None:
    """torch.autograd's first backward of a process imports torch.fx.experimental.symbolic_shapes
    (and sympy: ~0.3 s). The dispatcher's road imported it at an op's first call; the fast path
    does the same at the first call that records a node, so that one-time cost stays where it
    was (a first forward) instead of landing inside the first backward."""
    global _backward_imports_done
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    _backward_imports_done = True


class Op:
    """A registered custom op: calling it runs the dispatcher's path, or in plain eager use the
    same implementation and autograd glue directly (module docstring). Every other attribute is
    the ``torch.library`` op's (``register_autograd`` also arms the fast path's autograd)."""

    def __init__(self, op, fn, real, lead=None):
        self._op = op
        self._fn = fn  # the implementation as written
        self._real = real  # what the dispatcher runs: fn with lazy views on, autocast off, fresh outputs
        self._lead = None if lead is None else lead[1]  # position of the tensor whose device the call runs on
        self._kinds = _arg_kinds(op._opoverload._schema)
        self._function = None  # the autograd.Function of the fast path, once register_autograd ran

    def __getattr__(self, name):
        return getattr(self._op, name)

    def register_autograd(self, backward, *, setup_context):
        self._op.register_autograd(backward, setup_context=setup_context)
        run = self._run

        def forward(ctx, *args):
            plain = args[-1]
            args = args[:-1]
            with torch._C._AutoDispatchBelowAutograd():  # as the dispatcher's autograd kernel runs it
                out = run(args, plain)
                setup_context(ctx=ctx, inputs=args, output=out)
            return out

        def backward_(ctx, *grads):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[:-1]  # the op's own inputs, as in torch.library's node
            try:
                return *backward(ctx, *grads), None
            finally:
                ctx.needs_input_grad = needs

        # the node autograd records: the name torch.library gives its own, same ctx API (the last
        # input, whether autocast is off, is a bool: autograd hands it no gradient slot)
        self._function = type(f"GeneratedBackwardFor_{NAMESPACE}_{self._op._name.split('::')[-1]}_default",
                              (torch.autograd.Function,),
                              {"forward": staticmethod(forward), "backward": staticmethod(backward_)})

    def _run(self, args, plain):
        """The implementation on ``args``; ``plain``: the thread's state is the default (autocast
        off, lazy views on), so the dispatcher's wrapper has nothing to change."""
        if plain:
            # the device guard of ``real``, inlined (on a CUDA build, CPU tensors cost one attribute read)
            device = cuda_device(args[self._lead]) if CUDA_BUILD and self._lead is not None else None
            if device is None:
                return _fresh(self._fn(*args), args)
            with _on_device(device):
                return _fresh(self._fn(*args), args)
        return self._real(*args)

    def _eager_args(self, args):
        """The full positional arguments when the fast path may run these, else None."""
        kinds = self._kinds
        if kinds is None or len(args) > len(kinds) or not plain_eager():
            return None
        for value, (kind, optional, _) in zip(args, kinds):
            if value is None:
                if not optional:
                    return None
            elif kind == "tensor":
                if not (type(value) in _PLAIN_TYPES and value.layout is torch.strided and (value.is_cpu or value.is_cuda)
                        and not value.is_nested):  # plain_tensor, inlined: this runs for every argument of every call
                    return None
            elif type(value) is not kind:
                return None  # e.g. an int for a float: the dispatcher converts it
        if len(args) < len(kinds):  # the defaults the dispatcher's setup_context inputs hold
            rest = tuple(default for _, _, default in kinds[len(args):])
            if _NO_DEFAULT in rest:
                return None
            args = args + rest
        return args

    def __call__(self, *args, **kwargs):
        full = None if kwargs else self._eager_args(args)
        if full is not None:
            state = _TLS_STATES.get((torch._C._dispatch_tls_local_exclude_set().raw_repr(),
                                     torch._C._dispatch_tls_local_include_set().raw_repr()))
            if state is not None:
                autograd, plain = state
                if not (autograd and torch.is_grad_enabled() and torch._C._any_requires_grad(*full)):
                    with torch._C._AutoDispatchBelowAutograd():
                        return self._run(full, plain)
                if self._function is not None:
                    if not _backward_imports_done:
                        _do_backward_imports()
                    return self._function.apply(*full, plain)
                # no autograd registered (a backward op under create_graph): the dispatcher's error path
        return self._op(*args, **kwargs)


def grad_or_none(g: torch.Tensor | None, needed: bool):
    """A backward op's placeholder (empty) gradient back to None for autograd."""
    return g if needed else None
