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

Calls go through the dispatcher (torch.library's own autograd and backend kernels), with two
exceptions, both in :class:`Op` and both for a plain eager call (no tracer, mode or transform;
plain tensors; decoding, evaluation, an eager training step):

* a call autograd will not record (``torch.no_grad()``, inference mode, or no input that requires
  grad) runs the same wrapper the dispatcher's backend kernel runs, directly;
* a call autograd records runs that wrapper inside the op's own ``torch.autograd.Function`` with
  the op's registered ``setup_context`` and ``backward`` (:meth:`Op.register_autograd`): what
  torch.library's autograd kernel runs (its generated autograd.Function), without the
  dispatcher's trips from Python to C++ and back around it.

The dispatcher's road costs tens of microseconds per no-grad call and about a hundred more per
recorded forward + backward (bench/results/library_fast_path.md, bench/results/host_cost.md), a
large part of a small op's time and of a decoded token's. Whether a call is plain eager is
:func:`plain_eager`, which reads private torch names; :func:`direct_calls_ok` checks once, on
the running torch, that it still sees each thing it must (a function mode, a dispatch mode, a
vmap level, a forward-AD level) and otherwise turns both exceptions off: every call then takes
the dispatcher's road (same results, slower). torch.compile, torch.export, opcheck, functorch
transforms, forward AD, tensor subclasses (DTensor, fake and functional tensors) and the profiler
always see torch.library's op.

The other private ``torch._C`` names this module reads: :func:`_fresh` (torch.library's own
alias check) has a Python fallback where a torch release drops it; :func:`_lazy_views_resolved`
(the thread's dispatch-key state) has none that keeps results right, so there a missing name is
an AttributeError at the call, never a silently wrong result.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
import torch.autograd.forward_ad as _forward_ad

NAMESPACE = "megalodon_kernels"


def absent(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The placeholder for an output that does not exist: an empty (0,) tensor."""
    return like.new_empty(0, dtype=dtype or like.dtype)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatcher trip when ``t`` already has that dtype (the common
    case in the ops' glue: ~1 us per call saved; ``.to`` would return ``t`` itself then too)."""
    return t if t.dtype == dtype else t.to(dtype)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A fake implementation's output like ``t``: contiguous, as every real output is (see _fresh)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


#: filled(): the kept defaults, (shape, fill, dtype, place) -> tensor, at most MAX_KEPT
_KEPT: dict = {}
MAX_KEPT = 64
#: id -> a tensor filled() made, while it lives (an op's value check may skip it: see is_filled)
_FILLED = weakref.WeakValueDictionary()


_ASK, _FRESH = object(), object()  # filled()'s place: not given (ask fill_place); a tracer's (a new tensor)


def filled(shape: tuple, fill, dtype: torch.dtype, device: torch.device, place=_ASK) -> torch.Tensor:
    """A tensor of ``shape`` holding ``fill``: what a public function passes for an input the caller
    left out (timestep_norm's initial state) and the op only reads. In plain eager mode one kept
    tensor per (shape, fill, dtype, :func:`kept_place`) serves every call, rebuilt if anything wrote
    to it (its version counter); it never reaches the caller (an op's outputs are fresh tensors, see
    _fresh). On a GPU that saves a fill launch per tensor and call. Under a tracer, while a CUDA
    graph is captured, or on another device it is a new tensor. In plain eager mode :func:`is_filled`
    then knows it, for as long as it is unchanged. ``place``: :func:`fill_place` of ``device``, asked
    once by a caller that fills several tensors."""
    if place is _ASK:
        place = fill_place(device)
    if place is _FRESH:
        return torch.full(shape, fill, dtype=dtype, device=device)
    if place is not None:
        t = _KEPT.get((shape, fill, dtype, place))
        if t is not None and t._version == 0:
            return t
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):  # a normal tensor: an inference tensor keeps no version counter
            t = torch.full(shape, fill, dtype=dtype, device=device)
    else:
        t = torch.full(shape, fill, dtype=dtype, device=device)
    if place is not None:
        if len(_KEPT) >= MAX_KEPT:
            _KEPT.clear()
        _KEPT[(shape, fill, dtype, place)] = t
    _FILLED[id(t)] = t
    return t


def fill_place(device: torch.device):
    """The ``place`` argument of :func:`filled` for this call: a tracer's (new tensors, never known to
    is_filled) outside plain eager mode, else :func:`kept_place`."""
    return kept_place(device) if plain_eager(profiler_ok=True) else _FRESH


def kept_place(device: torch.device):
    """Where a kept tensor of :func:`filled` may serve calls on ``device``: "cpu"; on a CUDA device
    (device, current stream), so that no stream reads one before the stream that filled it has
    run; None (keep nothing) while the current stream captures a CUDA graph (a graph must not read
    a tensor that a later eviction frees), for a device other than the current one (whose capture
    state torch does not answer for) and on other device types. Tests fake a stream here."""
    if device.type == "cpu":
        return "cpu"
    return cuda_stream_place(device)


def cuda_stream_place(device: torch.device):
    """(device, its current stream) for a CUDA ``device`` that is the current device and not
    capturing a CUDA graph; None otherwise: where a tensor made in one eager call may serve the
    next ones (filled's defaults, rotary's tables)."""
    if (device.type != "cuda" or (device.index is not None and device.index != torch.cuda.current_device())
            or torch.cuda.is_current_stream_capturing()):
        return None
    return device, torch.cuda.current_stream(device).cuda_stream


def is_filled(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor :func:`filled` made, unchanged since: its values are the fill, so an
    op's check of them (one that would cost kernel launches on a GPU) can be skipped."""
    return _FILLED.get(id(t)) is t and t._version == 0


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def _fresh(outputs, inputs):
    """Outputs as a custom op must return them: contiguous, conjugation resolved, sharing no
    storage with an input or with another output (a backend may return an input unchanged, e.g.
    a ``.to`` that was a no-op)."""
    single = isinstance(outputs, torch.Tensor)
    outs = (outputs,) if single else tuple(outputs)
    for t in outs:  # the common case (every output already right) builds nothing new
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            outs = tuple(t if t.is_contiguous() and not (t.is_conj() or t.is_neg())
                         else t.resolve_conj().resolve_neg().contiguous() for t in outs)
            break
    # One C++ pass (the check torch.library runs after an implementation) answers the common case:
    # nothing shared, nothing to copy. Only when it finds a shared storage does the loop below
    # decide which outputs to copy.
    if _ALIAS_CHECK is not None and not _ALIAS_CHECK(inputs if type(inputs) is tuple else tuple(inputs), {}, outs):
        return outs[0] if single else outs
    return _fresh_copies(outs, inputs, single)


#: torch.library's own check that no output aliases an input or another output (one C++ pass);
#: without it (a torch release that renames it) every call takes _fresh_copies' Python loop.
_ALIAS_CHECK = getattr(torch._C, "_any_output_is_alias_to_input_or_output", None)


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


#: Whether any autocast is on (one C++ call; the per-device public queries where a torch lacks it).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))
_EXCLUDED = torch._C._dispatch_tls_is_dispatch_key_excluded


def _guards(device: torch.device | None):
    """What a backend runs inside (the device made current, lazy views on, autocast off), as one
    context manager; None when none of them applies (a CPU call with no autocast and no excluded
    view keys: most calls)."""
    views = _EXCLUDED(_VIEW_KEYS[0]) or _EXCLUDED(_VIEW_KEYS[1]) or _EXCLUDED(_VIEW_KEYS[2])
    if device is None and not views and not _ANY_AUTOCAST():
        return None
    stack = contextlib.ExitStack()
    if device is not None:
        stack.enter_context(_on_device(device))
    stack.enter_context(_lazy_views_resolved())
    stack.enter_context(_autocast_off())
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
    with the fake implementation ``fake``; returns the op (an :class:`Op` around torch.library's ``CustomOpDef``)."""
    def register(fn):
        lead = None  # (name, position) of the tensor whose device the call runs on; set below

        @functools.wraps(fn)
        def real(*args, **kwargs):
            device = None
            if CUDA_BUILD and lead is not None:
                t = kwargs.get(lead[0]) if lead[0] in kwargs else args[lead[1]] if lead[1] < len(args) else None
                device = cuda_device(t) if isinstance(t, torch.Tensor) else None
            guards = _guards(device)
            if guards is None:  # the common case: nothing to enter (a with block costs ~1 us here)
                out = fn(*args, **kwargs)
            else:
                with guards:
                    out = fn(*args, **kwargs)
            return _fresh(out, (*args, *kwargs.values()) if kwargs else args)

        # the schema comes from the annotations, evaluated in fn's module (they may be strings)
        real.__signature__ = inspect.signature(fn, eval_str=True)

        op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(), tags=tags)
        op.register_fake(fake)
        lead = _lead_argument(op._opoverload._schema)
        return Op(op, real)
    return register


# ---------------------------------------------------------------------------------------------
# Whether a call runs in plain eager mode (for an op's own caches, e.g. rotary's tables)


def _probe(owner, name):
    return getattr(owner, name, None)


#: What plain_eager asks, each a private torch name that may go: (tracing by torch.jit, a dispatch
#: mode, a function mode, a functorch transform, the profiler). One missing: plain_eager answers
#: False, so the callers build their tensors afresh as under a tracer (correct, a little slower).
_EAGER_PROBES = (_probe(torch._C, "_is_tracing"), _probe(torch._C, "_len_torch_dispatch_stack"),
                 _probe(torch._C, "_len_torch_function_stack"),
                 _probe(getattr(torch._C, "_functorch", None), "peek_interpreter_stack"),
                 _probe(getattr(torch._C, "_autograd", None), "_profiler_enabled"))
_PROBES_OK = all(p is not None for p in _EAGER_PROBES) and hasattr(_forward_ad, "_current_level")
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(profiler_ok: bool = False) -> bool:
    """Whether this call runs in plain eager mode: not traced by torch.compile, torch.export or
    torch.jit, no dispatch or function mode (fake tensors, functionalization, ``torch.device``
    contexts, debug modes), no functorch transform (vmap, grad), no forward-mode AD level (dual
    tensors), and unless ``profiler_ok`` no profiler (whose trace should show every op). False
    where this torch lacks a name the check reads (see _EAGER_PROBES)."""
    if not _PROBES_OK:
        return False
    tracing, dispatch_modes, function_modes, transforms, profiling = _EAGER_PROBES
    return not (torch.compiler.is_compiling() or tracing() or dispatch_modes() or function_modes()
                or transforms() is not None or _forward_ad._current_level >= 0
                or (not profiler_ok and profiling()))


def plain_tensor(t) -> bool:
    """A dense strided CPU or CUDA tensor of the plain Tensor (or Parameter) type: no subclass
    (fake, functional, user subclasses), no meta, sparse or nested tensor."""
    return (type(t) in _PLAIN_TYPES and t.layout is torch.strided and (t.is_cpu or t.is_cuda)
            and not t.is_nested)


def _self_check() -> bool:
    """Whether :func:`plain_eager` answers right on this torch: True in plain eager, False under a
    function mode, a dispatch mode, a vmap level and a forward-AD level."""
    if not _PROBES_OK or not plain_eager():
        return False
    seen = []
    try:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        class _NoFunctionMode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        class _NoDispatchMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with _NoFunctionMode():
            seen.append(plain_eager())
        with _NoDispatchMode():
            seen.append(plain_eager())
        with _forward_ad.dual_level():
            seen.append(plain_eager())
        torch.func.vmap(lambda t: seen.append(plain_eager()) or t)(torch.zeros(2))
    except Exception:  # a torch where one of these contexts works differently: no direct calls
        return False
    return seen == [False] * 4


_SELF_CHECK: list = []  # [result] once run: the first call of any op runs it


def direct_calls_ok() -> bool:
    """Whether :class:`Op` may call an implementation directly (:func:`_self_check`, run once)."""
    if not _SELF_CHECK:
        ok = _self_check()
        if not ok:
            import logging

            logging.getLogger("megalodon_kernels").info(
                "torch %s: megalodon_kernels' eager shortcut failed its self-check; every op call goes through "
                "the torch.library dispatcher (same results, more overhead per call)", torch.__version__)
        _SELF_CHECK.append(ok)
    return _SELF_CHECK[0]


_DISPATCHER, _DIRECT, _RECORDED = 0, 1, 2  # the roads of an eager call (Op._road)


class Op:
    """A registered custom op: calling it runs torch.library's op (the dispatcher), or for a plain
    eager call (:func:`plain_eager`, plain tensors, no container argument) one of two shortcuts:
    a call autograd will not record runs the op's implementation directly; a call it records runs
    the same implementation inside the op's own ``torch.autograd.Function``, with the op's
    registered ``setup_context`` and ``backward`` (:meth:`register_autograd`), as torch.library's
    autograd kernel does. Every other attribute is the ``CustomOpDef``'s."""

    def __init__(self, op, real):
        self._op = op
        self._real = real  # what the dispatcher's backend kernel runs: lazy views on, autocast off, fresh outputs
        self._eager_autograd = None  # the autograd.Function of recorded eager calls (register_autograd)
        params = list(real.__signature__.parameters.values())
        self._arity = len(params)
        #: the schema's defaults, filled in for a recorded call that leaves them out (torch.library's
        #: autograd kernel hands setup_context every input, defaults included)
        self._defaults = tuple(p.default for p in params)

    def __getattr__(self, name):
        return getattr(self._op, name)

    def register_autograd(self, backward, *, setup_context=None):
        """torch.library's ``register_autograd``, and the same two functions for recorded eager calls."""
        self._op.register_autograd(backward, setup_context=setup_context)
        self._eager_autograd = _eager_autograd(self._op._name, self._real, backward, setup_context)

    def __call__(self, *args, **kwargs):
        # plain_eager first: under torch.compile it is False at once, and nothing after it is traced
        if plain_eager() and direct_calls_ok():
            road = self._road(args if not kwargs else (*args, *kwargs.values()))
            if road == _DIRECT:
                return self._real(*args, **kwargs)
            if road == _RECORDED and not kwargs and self._eager_autograd is not None:
                if len(args) < self._arity:
                    args = (*args, *self._defaults[len(args):])
                    missing = [i for i, a in enumerate(args) if a is inspect.Parameter.empty]
                    if missing:  # a required argument left out: the dispatcher says which
                        return self._op(*args[:missing[0]])
                return self._eager_autograd.apply(*args)
        return self._op(*args, **kwargs)

    @staticmethod
    def _road(values) -> int:
        """_DIRECT: no value autograd would record and every tensor a plain one; _RECORDED: the
        same but some tensor requires grad (with grad mode on); _DISPATCHER: a tensor that is not
        a plain one, or a container other than a list or tuple of plain scalars (a ``bool[]``
        argument such as cema_kernel's ``needs``: the implementation reads it as it is)."""
        grad = torch.is_grad_enabled()
        road = _DIRECT
        for v in values:
            kind = type(v)
            if kind in _SCALAR_TYPES:  # most arguments; one set lookup
                continue
            if kind in _PLAIN_TYPES:
                if not (v.layout is _STRIDED and (v.is_cpu or v.is_cuda) and not v.is_nested):
                    return _DISPATCHER
                if grad and v.requires_grad:
                    road = _RECORDED
            elif isinstance(v, torch.Tensor):  # a subclass
                return _DISPATCHER
            elif isinstance(v, (list, tuple, dict)) and (type(v) is dict or not all(map(_is_scalar, v))):
                return _DISPATCHER
        return road


_SCALAR_TYPES = frozenset((type(None), bool, int, float, str))
_STRIDED = torch.strided


def _is_scalar(v) -> bool:
    return v is None or type(v) in (bool, int, float)


def _eager_autograd(name: str, real, backward, setup_context):
    """The autograd.Function a recorded plain eager call of op ``name`` runs: what torch.library's
    autograd kernel runs (its generated autograd.Function: the op's implementation, then
    ``setup_context(ctx, inputs, output)``; ``backward(ctx, *grads)``) minus the dispatcher's
    trips into and out of Python around it (bench/results/host_cost.md). Its backward calls the
    backward op, which takes the direct road (grad mode is off in a backward) or, when the
    gradient itself is recorded (create_graph), the dispatcher."""
    def forward(ctx, *args):
        out = real(*args)
        if setup_context is not None:
            setup_context(ctx=ctx, inputs=args, output=out)
        return out

    return type(f"EagerAutogradFor_{NAMESPACE}_{name.split('::')[-1]}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def grad_or_none(g: torch.Tensor | None, needed: bool):
    """A backward op's placeholder (empty) gradient back to None for autograd."""
    return g if needed else None
