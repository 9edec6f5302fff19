"""Host cost per op call and backend: what our Python and torch's dispatch add to the math (issue 41).

    python bench/host_cost.py [--ops ...] [--backends torch cpu triton cuda] [--calls 100] [--rounds 15]
                              [--clock wall|cpu] [--decode] [--compile inductor] [--json FILE] [--out FILE]
    python bench/host_cost.py --real ...        # on a GPU: CUDA tensors, real launches, no stubs
    python bench/host_cost.py --compare BEFORE.json AFTER.json   # our part, before and after

For each op and backend, one forward under ``torch.no_grad()`` and one forward + backward (inputs
that require grad, ``torch.autograd.backward`` of the outputs with fixed gradients) of a tiny
float32 input, one thread. Without ``--real`` the Triton and CUDA backends run their host code on
CPU tensors with the launch a no-op at the lowest level (bench/launch_stubs.py: Triton's compiled
launcher, CuPy's driver call), so what is timed is our Python and torch's dispatch.

Each call is timed at five levels, the same inputs, interleaved round by round (the median of
``--rounds`` batches of ``--calls`` calls each); the levels are recorded from one public call:

* ``public``: the public function (``ops.fftconv(...)``);
* ``op``: the custom op(s) the public function called, with the same arguments (torch.library's
  dispatcher, or ops/_library.py's eager roads);
* ``real``: the same calls to each op's implementation wrapper (``Op._real``: device guard,
  lazy views, autocast off, fresh outputs, the op's body with ``select``);
* ``direct``: the backend functions the op called (``module.forward(...)`` / ``backward``), with
  the same arguments: the same math called directly;
* ``select``: the ``OpBackends.select`` calls the op made.

so that ``public - op`` is the public function's checks and glue, ``op - real`` the custom-op and
autograd plumbing, ``real - direct - select`` the wrapper, and ``public - direct`` our part (the
issue's target: at most 25 us forward, 80 us forward + backward). Three more levels in the same
rounds:

* ``glue``: the public function with every backend call answered by its recorded output (no
  math): our code alone. ``public - direct - glue`` is how much slower our code runs between the
  math's ATen calls than alone (on this CPU the math's kernels leave caches and branch predictors
  cold for the Python between them);
* ``twin`` and ``twin clones``: a torch.library custom op with the op's schema and an empty body
  (it returns copies of the recorded outputs; with autograd, it saves as many tensors, marks the
  same outputs non-differentiable and returns precomputed gradients), called through the
  dispatcher, and the copies alone: ``twin - twin clones`` is torch's own custom-op machinery for
  a call of this signature (the road compile, export and every non-plain eager call take);
* ``twin beside``: the twin's call followed by the math (the ``direct`` calls), as one call.
  ``twin beside - direct - twin clones`` is torch.library's road measured the way ours is (beside
  the same math, minus the math alone): the control for ``public - direct - glue``. When torch's
  own machinery also costs more beside the math than alone, by about as much as ours, the excess is
  the machine's (the math's kernels leave the caches cold for any host code around them), not a
  property of our code.

Each row ends with a verdict: within the target, or which torch part alone costs more than the
target (torch's autograd around the math, ``bare - direct``; torch.library's road,
``twin - twin clones``) with its figure, and whether ours is above it too. Inside ``direct``, one extra
instrumented pass times the launch road (Triton's ``JITFunction.run`` / our ``GpuLauncher``),
its argument packing (Triton's binder / the C values and pointer array) and the allocations
(``torch.empty*``, ``zeros*``, ``new_empty``, ``new_zeros``); the timers' own cost, measured, is
subtracted.

Anchors in the same run: a torch native op of the same tensor arity (``torch.cat`` of that many
(4,) tensors: one ATen op, one autograd node) and the smallest torch.library custom op with an
autograd formula (a clone), through the dispatcher. ``--decode``: host time per generated token of
the tiny model at batch 1: ``generate``'s eager static step, the compiled static step
(``StaticDecoder(compile=...)``, fullgraph) and the general path through the ops (bench/decode.py).
"""
from __future__ import annotations

import os

if __name__ == "__main__" and "--real" not in os.sys.argv:
    # Triton decides at decoration whether a kernel is interpreted: the stubs need JIT kernels
    # (only when run as a script: a test that imports this module keeps its interpreter)
    os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

if str(Path(__file__).parent) not in sys.path:  # appended: never ahead of a test directory's modules
    sys.path.append(str(Path(__file__).parent))
from dispatch_overhead import CLOCKS  # noqa: E402
import launch_stubs  # noqa: E402

from megalodon_kernels import ops  # noqa: E402
from megalodon_kernels.ops import _dispatch, _library  # noqa: E402

OPS = ("attention", "cema", "cema_kernel", "dropkey_softmax", "ema_hidden", "fftconv", "rotary", "timestep_norm")
BACKENDS = ("torch", "cpu", "triton", "cuda")
TARGET_FWD_US, TARGET_BOTH_US = 25.0, 80.0


def op_module(op):
    return importlib.import_module(f"megalodon_kernels.ops.{op}")


def cases(device):
    """op -> call(backend, grad): one public call on tiny float32 inputs (fresh leaves per case)."""
    def leaves(grad, *shapes_dtypes):
        g = torch.Generator().manual_seed(0)
        out = []
        for shape, dtype in shapes_dtypes:
            t = torch.randn(*shape, generator=g, dtype=dtype)
            if dtype == torch.float32 and len(shape) == 2 and shape[0] == 3 and shape[1] == 2:  # p: in (0, 1)
                t = t.abs() / (1 + t.abs())
            out.append(t.to(device).requires_grad_(grad))
        return out

    def coefficients(grad):
        p, lq, gamma = leaves(grad, ((3, 2), torch.float32), ((3, 2), torch.complex64), ((3, 2), torch.complex64))
        with torch.no_grad():
            lq.copy_(torch.complex(-lq.real.abs() - 0.1, lq.imag))
        return p, lq, gamma

    def build(op, grad):
        f32 = torch.float32
        if op == "attention":
            q, k, v = leaves(grad, ((1, 5, 2, 4), f32), ((1, 5, 2, 4), f32), ((1, 5, 2, 4), f32))
            return lambda b: ops.attention(q, k, v, scale=0.5, backend=b)
        if op == "cema":
            x, omega = leaves(grad, ((2, 3, 6), f32), ((3,), f32))
            p, lq, gamma = coefficients(grad)
            hx, = leaves(grad, ((2, 3, 2), torch.complex64))
            return lambda b: ops.cema(x, p, lq, gamma, omega, hx, return_state=True, backend=b)
        if op == "cema_kernel":
            p, lq, gamma = coefficients(grad)
            return lambda b: ops.cema_kernel(p, lq, gamma, 6, backend=b)
        if op == "dropkey_softmax":
            s, = leaves(grad, ((1, 2, 4, 5), f32))
            return lambda b: ops.dropkey_softmax(s, True, 0.2, 3, backend=b)
        if op == "ema_hidden":
            x, = leaves(grad, ((2, 3, 6), f32))
            p, lq, _ = coefficients(grad)
            return lambda b: ops.ema_hidden(x, p, lq, backend=b)
        if op == "fftconv":
            x, k = leaves(grad, ((2, 3, 8), f32), ((3, 8), f32))
            return lambda b: ops.fftconv(x, k, backend=b)
        if op == "rotary":
            x, = leaves(grad, ((1, 5, 2, 4), f32))
            pos = torch.arange(5, device=device)
            return lambda b: ops.rotary(x, pos, backend=b)
        if op == "timestep_norm":
            x, w, bias = leaves(grad, ((2, 5, 4), f32), ((4,), f32), ((4,), f32))
            return lambda b: ops.timestep_norm(x, w, bias, 2, backend=b)
        raise ValueError(op)
    return build


def grads_for(out):
    """The outputs autograd tracks and a fixed gradient for each (ones; complex: ones + 0j)."""
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


# ---------------------------------------------------------------------------------------------
# recording one call: the custom-op calls, the backend calls and the select calls it made


class Recorder:
    """Stands for a backend module while one call is recorded: every call of one of its functions
    (but its reasons) is kept (name, args, kwargs), the outermost ones only."""

    def __init__(self, module, calls):
        self._module, self._calls, self._depth = module, calls, [0]
        self.outputs = []  # what each kept call returned, in the same order

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if not callable(value) or name == "not_supported_reasons" or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            outer = self._depth[0] == 0
            if outer:
                self._calls.append((name, args, kwargs))
                self.outputs.append(None)
                at = len(self.outputs) - 1
            self._depth[0] += 1
            try:
                out = value(*args, **kwargs)
                if outer:
                    self.outputs[at] = out
                return out
            finally:
                self._depth[0] -= 1
        return call


def _detached(out):
    """``out`` with every tensor in it detached (tuples, named tuples and lists rebuilt)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        items = [_detached(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    if isinstance(out, list):
        return [_detached(v) for v in out]
    return out


@contextlib.contextmanager
def recording(op_backends, name, module):
    """-> (op_calls, backend_calls, select_calls, backend_outputs) filled while the block runs
    (backend_outputs[i]: what backend_calls[i] returned)."""
    op_calls, backend_calls, select_calls = [], [], []
    depth = [0]
    op_call, select = _library.Op.__call__, _dispatch.OpBackends.select

    def recorded_op_call(self, *args, **kwargs):
        if depth[0] == 0:
            op_calls.append((self, args, kwargs))
        depth[0] += 1
        try:
            return op_call(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def recorded_select(self, backend, inputs, **kw):
        select_calls.append((self, backend, dict(inputs), kw))
        return select(self, backend, inputs, **kw)

    _library.Op.__call__, _dispatch.OpBackends.select = recorded_op_call, recorded_select
    recorder = Recorder(module, backend_calls)
    try:
        with op_backends.use(name, recorder):
            yield op_calls, backend_calls, select_calls, recorder.outputs
    finally:
        _library.Op.__call__, _dispatch.OpBackends.select = op_call, select


# ---------------------------------------------------------------------------------------------
# the instrumented pass: launch road, argument packing, allocations inside the direct calls


class Timers:
    def __init__(self, clock):
        self.clock, self.total, self.count = clock, {}, {}

    def wrap(self, key, fn):
        clock, total, count = self.clock, self.total, self.count
        total.setdefault(key, 0)
        count.setdefault(key, 0)

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[key] += clock() - start
                count[key] += 1
        return timed


_ALLOC = [(torch, "empty"), (torch, "empty_like"), (torch, "zeros"), (torch, "zeros_like"),
          (torch, "empty_strided"), (torch.Tensor, "new_empty"), (torch.Tensor, "new_zeros")]


@contextlib.contextmanager
def instrumented(timers, backend):
    """Time the allocations and the launch road (and its packing) while the block runs."""
    saved = []

    def patch(owner, name, key):
        fn = getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, timers.wrap(key, fn))

    for owner, name in _ALLOC:
        patch(owner, name, "allocations")
    if backend == "triton":
        import triton.runtime.jit as jit

        patch(jit.JITFunction, "run", "launch road")
        _BINDER_TIMERS[0] = timers
    if backend == "cuda":
        from megalodon_kernels.cuda import runtime

        patch(runtime.GpuLauncher, "__call__", "launch road")
        patch(runtime, "c_value", "argument packing")
        patch(runtime.CupyDriver, "launch", "argument packing")  # the pointer array (+ the no-op call)
    try:
        yield
    finally:
        _BINDER_TIMERS[0] = None
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def timer_cost_us(clock) -> float:
    """What one timed wrapper adds around a call, in us (subtracted from the instrumented pieces)."""
    timers = Timers(clock)
    f = timers.wrap("x", lambda: None)
    g = lambda: None  # noqa: E731
    n = 20000
    start = clock()
    for _ in range(n):
        f()
    wrapped = clock() - start
    start = clock()
    for _ in range(n):
        g()
    return max(0.0, (wrapped - (clock() - start)) / n / 1e3)


#: the Timers of the instrumented pass while it runs (Triton's binders report to it)
_BINDER_TIMERS = [None]


def time_triton_binders():
    """Every Triton binder made from now on (argument binding and specialization: Triton's
    argument packing) times itself while an instrumented pass runs; returns the undo."""
    import triton.runtime.jit as jit

    make = jit.create_function_from_signature

    def binder(*a, **kw):
        fn = make(*a, **kw)

        def bound(*args, **kwargs):
            timers = _BINDER_TIMERS[0]
            if timers is None:
                return fn(*args, **kwargs)
            start = timers.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.total["argument packing"] = timers.total.get("argument packing", 0) + timers.clock() - start
                timers.count["argument packing"] = timers.count.get("argument packing", 0) + 1
        return bound
    jit.create_function_from_signature = binder
    return lambda: setattr(jit, "create_function_from_signature", make)


# ---------------------------------------------------------------------------------------------


#: with --real: wait for the GPU at the end of each timed batch (its queued kernels finish inside it)
SYNC = [lambda: None]


def interleaved(levels: dict, calls: int, rounds: int, clock) -> dict:
    """{level: median us per call}: each round times every level once, in turn."""
    sync = SYNC[0]
    for fn in levels.values():
        fn()
        fn()
    sync()
    times = {name: [] for name in levels}
    for _ in range(rounds):
        for name, fn in levels.items():
            start = clock()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((clock() - start) / calls / 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def replay_ops(op_calls, real=False):
    """The recorded custom-op calls again; ``real``: their implementations, grad mode off (as the
    dispatcher's and autograd's roads run them)."""
    def run():
        out = None
        for op, args, kwargs in op_calls:
            out = op(*args, **kwargs)
        return out

    def run_real():
        with torch.no_grad():
            for op, args, kwargs in op_calls:
                op._real(*args, **kwargs)
    return run_real if real else run


def replay_backend(module, calls):
    """The recorded backend calls again, grad mode off (as the ops run them)."""
    fns = [(getattr(module, name), args, kwargs) for name, args, kwargs in calls]

    def run():
        with torch.no_grad():
            for fn, args, kwargs in fns:
                fn(*args, **kwargs)
    return run


def replay_select(calls):
    def run():
        with torch.no_grad():
            for backends, backend, inputs, kw in calls:
                backends.select(backend, inputs, **kw)
    return run


def call_signature(op, args, kwargs):
    """(multi, templates, nondiff, saved, grads) of one recorded op call (autograd records it):
    whether it returns a tuple, a copy of each output, the outputs the op's setup_context marks
    non-differentiable (residuals), as many tensors to save as its autograd node saves, and a
    gradient (zeros) for each input that requires one (None for the others)."""
    out = op(*args, **kwargs)
    multi = isinstance(out, tuple)
    outs = out if multi else (out,)
    templates = [t.detach().clone() for t in outs]
    nondiff = tuple(i for i, t in enumerate(outs) if t.is_floating_point() or t.is_complex()
                    if not t.requires_grad)
    node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
    n_saved = len(node.saved_tensors) if node is not None else 0
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    pool = tensors + templates
    saved = [pool[i % len(pool)] for i in range(n_saved)]
    grads = tuple(torch.zeros_like(a) if isinstance(a, torch.Tensor) and a.requires_grad else None
                  for a in (*args, *kwargs.values()))
    return multi, templates, nondiff, saved, grads


_TWINS = [0]  # twin ops registered in this process (each needs a name of its own)


def library_twin(op, args, kwargs, graded):
    """(twin, clones): ``twin`` calls a torch.library custom op with the schema of ``op`` whose
    implementation only returns copies of the recorded outputs (and, for a call autograd records,
    whose registered setup_context saves as many tensors and marks the same outputs
    non-differentiable, and whose backward returns precomputed gradients), through the
    dispatcher; ``clones`` makes the same copies. ``twin - clones`` is what torch's custom-op
    machinery (the dispatcher, torch.library's autograd kernel, its generated autograd.Function)
    costs for a call of this signature, none of our code: the road torch.compile, export and every
    non-plain eager call take, which our eager roads go around."""
    with torch.enable_grad() if graded else torch.no_grad():
        multi, templates, nondiff, saved, grads = call_signature(op, args, kwargs)
    schema = str(op._opoverload._schema)
    _TWINS[0] += 1
    name = f"host_cost_twin::{op._name.split('::')[-1]}_{os.getpid()}_{_TWINS[0]}"

    def impl(*a, **k):
        res = tuple(t.clone() for t in templates)
        return res if multi else res[0]

    twin = torch.library.custom_op(name, impl, mutates_args=(), schema=schema[schema.index("("):])
    twin.register_fake(impl)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*saved)
        if nondiff:
            outs = output if multi else (output,)
            ctx.mark_non_differentiable(*(outs[i] for i in nondiff))

    def backward(ctx, *g):
        ctx.saved_tensors
        return grads

    twin.register_autograd(backward, setup_context=setup_context)
    values = (*args, *kwargs.values())
    if not graded:
        return (lambda: twin(*values)), (lambda: impl())
    out_grads = grads_for(twin(*values))[1]
    return (lambda: torch.autograd.backward(grads_for(twin(*values))[0], out_grads)), (lambda: impl())


def glue_level(public, module, backend_calls, outputs, detach):
    """``public`` with every backend call answered by the output the recorded call gave (no math):
    what our code costs alone, not interleaved with the math's own work (the public level minus
    this is how much slower our code runs between the math's ATen calls: caches and branch
    predictors the math used). With ``detach`` each returned tensor is a new detached view
    (autograd wraps a new tensor per call, as it does a backend's output; ~0.5 us each, counted
    here)."""
    names = sorted({c[0] for c in backend_calls})
    own = {n: vars(module)[n] for n in names if n in vars(module)}
    at = [0]

    def answer(name):
        def call(*args, **kwargs):
            i = at[0]
            if backend_calls[i][0] != name:  # the call took another road than the recorded one
                raise RuntimeError(f"glue level: backend call {i} is {name}, recorded {backend_calls[i][0]}")
            at[0] = i + 1
            return _detached(outputs[i]) if detach else outputs[i]
        return call
    answers = {n: answer(n) for n in names}

    def run():
        at[0] = 0
        for n, f in answers.items():
            setattr(module, n, f)
        try:
            public()
        finally:
            for n in names:
                if n in own:
                    setattr(module, n, own[n])
                else:
                    delattr(module, n)
    return run


def autograd_floor(fwd_calls, module, fwd_backend, bwd_backend):
    """(empty, clones, bare): torch's own autograd cost for a call of this signature.

    ``empty`` calls, for each recorded forward op call, an autograd.Function with the same
    arguments that returns as many outputs of the same shapes and dtypes (clones; those the op
    marks non-differentiable, its residuals, marked alike), saves as many tensors and returns a gradient for each input that requires one (precomputed), then runs the
    backward with the same output gradients; ``clones`` makes the same clones. ``bare`` is the
    same autograd.Function doing the op's math: the recorded backend forward calls in its
    forward, the backward calls in its backward: the math plus torch's autograd, none of our
    code. ``bare - direct`` is what autograd costs around this math (more than ``empty -
    clones``: the math between the autograd steps runs them with colder caches), ``public -
    bare`` what is ours."""
    floors = []
    fwd_fns = [(getattr(module, name), args, kwargs) for name, args, kwargs in fwd_backend]
    bwd_fns = [(getattr(module, name), args, kwargs) for name, args, kwargs in bwd_backend]
    for op, args, kwargs in fwd_calls:
        multi, templates, nondiff, saved, grads = call_signature(op, args, kwargs)

        def make(math_fwd, math_bwd, templates=templates, saved=saved, multi=multi, grads=grads, nondiff=nondiff):
            def forward(ctx, *a):
                for fn, fargs, fkwargs in math_fwd:
                    fn(*fargs, **fkwargs)
                ctx.save_for_backward(*saved)
                res = tuple(t.clone() for t in templates)
                if nondiff:
                    ctx.mark_non_differentiable(*(res[i] for i in nondiff))
                return res if multi else res[0]

            def backward(ctx, *g):
                ctx.saved_tensors
                for fn, fargs, fkwargs in math_bwd:
                    fn(*fargs, **fkwargs)
                return grads
            return type(f"Floor_{op._name}", (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "backward": staticmethod(backward)})

        empty, bare = make((), ()), make(fwd_fns, bwd_fns)
        fwd_fns = bwd_fns = ()  # the math once per call
        out_grads = grads_for(empty.apply(*args, *kwargs.values()))[1]
        floors.append((empty, bare, (*args, *kwargs.values()), out_grads, templates))

    def run_empty():
        for empty, _, args, out_grads, _ in floors:
            torch.autograd.backward(grads_for(empty.apply(*args))[0], out_grads)

    def run_bare():
        for _, bare, args, out_grads, _ in floors:
            torch.autograd.backward(grads_for(bare.apply(*args))[0], out_grads)

    def run_clones():
        for _, _, _, _, templates in floors:
            tuple(t.clone() for t in templates)
    return run_empty, run_clones, run_bare


def backend_object(op, name, stubs):
    """(OpBackends, the module to run as ``name``): a host-only stand-in for Triton/CUDA on CPU."""
    backends = op_module(op).BACKENDS
    if name not in backends._declared:
        return backends, None
    swapped = launch_stubs.host_only_backends(op, name, stubs.get("cuda")) if stubs else None
    module = swapped if swapped is not None else backends._load(name)
    return backends, module


def beside(first, math):
    """One call of ``first`` and then the math (the control level ``twin beside``)."""
    def run():
        first()
        math()
    return run


def twin_costs(r) -> tuple:
    """(torch.library's road for the signature alone, the same beside the math or None) of one
    row's levels: ``twin - twin clones`` and ``twin beside - direct - twin clones``."""
    if "twin" not in r:
        return None, None
    alone = r["twin"] - r["twin clones"]
    return alone, (r["twin beside"] - r["direct"] - r["twin clones"] if "twin beside" in r else None)


def measure(op, name, build, calls, rounds, clock, stubs, timer_us):
    backends, module = backend_object(op, name, stubs)
    if module is None:
        return {"skipped": f"no {name} backend of {op}"}
    if isinstance(module, Exception):
        return {"skipped": f"{type(module).__name__}: {module}"}
    nograd, graded = build(op, False), build(op, True)
    row = {}
    with backends.use(name, module):
        # the reasons on these inputs (a refusal is reported, not timed)
        try:
            with torch.no_grad():
                nograd(name)
        except Exception as exc:
            return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    for phase in ("forward", "forward+backward"):
        fn = nograd if phase == "forward" else graded
        grad_ctx = torch.no_grad if phase == "forward" else contextlib.nullcontext
        with grad_ctx(), recording(backends, name, module) as (op_calls, backend_calls, select_calls, backend_outputs):
            out = fn(name)
            n_fwd = len(backend_calls)  # the backend calls of the forward; the rest are the backward's
            if phase != "forward":
                outs, gs = grads_for(out)
                torch.autograd.backward(outs, gs)
        with backends.use(name, module):
            with grad_ctx():
                if phase == "forward":
                    public, op_level = (lambda: fn(name)), replay_ops(op_calls)
                else:
                    outs, gs = grads_for(fn(name))
                    fwd_ops = [c for c in op_calls if not c[0]._name.endswith("_bwd")]
                    op_outs, op_gs = grads_for(replay_ops(fwd_ops)())

                    def public():
                        torch.autograd.backward(grads_for(fn(name))[0], gs)

                    def op_level():
                        torch.autograd.backward(grads_for(replay_ops(fwd_ops)())[0], op_gs)
                levels = {"public": public, "op": op_level, "real": replay_ops(op_calls, real=True),
                          "direct": replay_backend(module, backend_calls), "select": replay_select(select_calls)}
                if phase != "forward":
                    levels["floor"], levels["floor clones"], levels["bare"] = autograd_floor(
                        fwd_ops, module, backend_calls[:n_fwd], backend_calls[n_fwd:])
                levels["glue"] = glue_level(public, module, backend_calls, backend_outputs, phase != "forward")
                twins = [library_twin(op_, a, k, phase != "forward") for op_, a, k in op_calls
                         if not op_._name.endswith("_bwd")]
                levels["twin"] = lambda: [t() for t, _ in twins]
                levels["twin clones"] = lambda: [c() for _, c in twins]
                levels["twin beside"] = beside(levels["twin"], levels["direct"])
                got = interleaved(levels, calls, rounds, clock)
                # the instrumented pass over the direct calls
                timers = Timers(clock)
                direct = replay_backend(module, backend_calls)
                with instrumented(timers, name):
                    direct()
                    for key in timers.total:
                        timers.total[key] = timers.count[key] = 0
                    n = max(calls, 20)
                    for _ in range(n):
                        direct()
                pieces = {k: max(0.0, timers.total[k] / n / 1e3 - timer_us * timers.count[k] / n)
                          for k in timers.total}
                if "launch road" in pieces:  # the packing timers run inside the launch road's
                    pieces["launch road"] = max(0.0, pieces["launch road"]
                                                - timer_us * timers.count.get("argument packing", 0) / n)
                pieces.update({f"{k} (count)": timers.count[k] / n for k in timers.count})
        got["pieces"] = pieces
        got["calls"] = {"op": [c[0]._name for c in op_calls], "backend": [c[0] for c in backend_calls],
                        "select": len(select_calls)}
        row[phase] = got
    return row


def native_anchor(arity, calls, rounds, clock, device):
    """torch.cat of ``arity`` (4,) tensors: forward no_grad, forward + backward."""
    xs = [torch.randn(4, device=device) for _ in range(arity)]
    gs = [x.clone().requires_grad_() for x in xs]
    g = torch.ones(4 * arity, device=device)
    with torch.no_grad():
        fwd = interleaved({"n": lambda: torch.cat(xs)}, calls, rounds, clock)["n"]
    both = interleaved({"n": lambda: torch.cat(gs).backward(g)}, calls, rounds, clock)["n"]
    return fwd, both


def library_anchor(calls, rounds, clock, device):
    """The smallest torch.library custom op with an autograd formula (a clone), through the
    dispatcher, and the same clone called directly: what torch's custom-op machinery costs."""
    lib = "host_cost_anchor"
    name = f"{lib}::clone_{os.getpid()}"

    @torch.library.custom_op(name, mutates_args=())
    def clone(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    clone.register_fake(lambda x: torch.empty_like(x))
    clone.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)
    x, g = torch.randn(4, device=device), torch.ones(4, device=device)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        fwd = interleaved({"lib": lambda: clone(x), "direct": lambda: x.clone()}, calls, rounds, clock)
    both = interleaved({"lib": lambda: clone(xg).backward(g), "direct": lambda: xg.clone().backward(g)},
                       calls, rounds, clock)
    return fwd, both


def tensor_arity(op, build):
    n = [0]
    fn = build(op, False)
    orig = _library.Op.__call__

    def count(self, *args, **kwargs):
        if not n[0]:
            n[0] = sum(isinstance(a, torch.Tensor) for a in list(args) + list(kwargs.values()))
        return orig(self, *args, **kwargs)
    _library.Op.__call__ = count
    try:
        with torch.no_grad():
            fn("torch")
    finally:
        _library.Op.__call__ = orig
    return n[0]


def decode_host(compile_backend: str, steps: int, rounds: int):
    """Per-token latency (wall and thread CPU, median ms) of the tiny model at batch 1: the eager
    static step, the compiled static step and the general ops path (bench/decode.py)."""
    from decode import build as build_model
    from decode import step_latencies

    model = build_model("tiny")
    lat, cpu, calls, compile_s = step_latencies(model, 64, steps, rounds, compile_backend)
    return {name: {"wall_ms": statistics.median(lat[name]) * 1e3, "cpu_ms": statistics.median(cpu[name]) * 1e3,
                   "aten_calls": calls[name]} for name in lat} | {"compile_s": compile_s}


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


def commit() -> str:
    try:
        here = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


def verdict(r, phase) -> str:
    """Whether our part of one row is within the issue's target; if not, the torch part that alone
    costs more than the target, with its figure, and whether ours is above that torch part too.
    torch.library's road counts when it costs more than the target alone, or beside the math
    (measured the way ours is: ``twin beside``)."""
    target = TARGET_FWD_US if phase == "forward" else TARGET_BOTH_US
    ours = r["public"] - r["direct"]
    if ours <= target:
        return "within"
    twin, twin_beside = twin_costs(r)
    worst = max(twin, twin_beside if twin_beside is not None else twin) if twin is not None else None
    notes = []
    if phase != "forward" and r["bare"] - r["direct"] > target:
        notes.append(f"torch's autograd around the math alone {r['bare'] - r['direct']:.0f} (ours beyond it "
                     f"{r['public'] - r['bare']:.0f})")
    if worst is not None and worst > target:
        notes.append(f"torch.library's own road for this signature alone {twin:.0f}"
                     + (f", beside the math {twin_beside:.0f}" if twin_beside is not None else "")
                     + (" (ours is below it)" if ours <= worst else ""))
    if not notes:
        if "glue" not in r:
            return "over: ours"
        return (f"over: ours ({r['glue']:.0f} alone, {ours - r['glue']:.0f} more when run between the math's calls; "
                f"torch.library's road {twin:.0f}"
                + (f" alone, {twin_beside:.0f} beside the math" if twin_beside is not None else "") + ")"
                if twin is not None else f"over: ours ({r['glue']:.0f} alone)")
    return "over: " + "; ".join(notes) + ("" if phase != "forward" or (worst is not None and ours <= worst)
                                          else "; ours is above it too")


def twin_cell(r) -> str:
    """torch.library's road for the row's signature: alone, and beside the math in parentheses."""
    alone, beside_math = twin_costs(r)
    if alone is None:
        return "-"
    return f"{alone:.1f}" + (f" ({beside_math:.1f})" if beside_math is not None else "")


def table(result) -> list[str]:
    lines = []
    for phase, target in (("forward", TARGET_FWD_US), ("forward+backward", TARGET_BOTH_US)):
        both = phase != "forward"
        lines += ["", f"### {phase} (target: ours <= {target:.0f} us)", "",
                  "| op | backend | public | direct (the math) | **ours = public - direct** | ours alone (no math) | "
                  "checks + glue | custom-op + autograd plumbing | wrapper | select | launch road (its packing) | "
                  "allocations (n) | "
                  + ("autograd, empty body | **autograd around the math (bare - direct)** | **ours beyond it "
                     "(public - bare)** | " if both else "")
                  + "torch.library op, same signature, empty body: alone (beside the math) | native op, same arity "
                  "| verdict |",
                  "|---|---|" + "---:|" * (15 if both else 12) + "---|"]
        for op, by_backend in result["ops"].items():
            for name, row in by_backend.items():
                if "skipped" in row:
                    lines.append(f"| {op} | {name} | skipped: {row['skipped']} |" + " |" * (15 if both else 12))
                    continue
                r = row[phase]
                p = r["pieces"]
                ours = r["public"] - r["direct"]
                launch = (f"{p['launch road']:.1f} ({p.get('argument packing', 0):.1f})" if "launch road" in p else "-")
                native = result["native"][str(result["arity"][op])][1 if both else 0]
                floor = r["floor"] - r["floor clones"] if both else None
                around = r["bare"] - r["direct"] if both else None
                glue = f"{r['glue']:.1f}" if "glue" in r else "-"
                twin = twin_cell(r)
                lines.append(
                    f"| {op} | {name} | {r['public']:.1f} | {r['direct']:.1f} | **{ours:.1f}** | {glue} | "
                    f"{r['public'] - r['op']:.1f} | {r['op'] - r['real']:.1f} | "
                    f"{r['real'] - r['direct'] - r['select']:.1f} | {r['select']:.1f} | {launch} | "
                    f"{p.get('allocations', 0):.1f} ({p.get('allocations (count)', 0):.0f}) | "
                    + (f"{floor:.1f} | **{around:.1f}** | **{r['public'] - r['bare']:.1f}** | " if both else "")
                    + f"{twin} | {native:.1f} | {verdict(r, phase)} |")
    return lines


def compare(before: dict, after: dict) -> list[str]:
    """Markdown: our part (public - direct) per op, backend and phase in two results (--json
    files of two trees), with after's split: our code alone (glue), torch.library's own road for
    the signature (twin), for forward + backward torch's autograd around the math and ours beyond
    it, and the verdict."""
    lines = [f"before: commit {before['commit']}, load `{before['load_before']}`; after: commit {after['commit']}, "
             f"load `{after['load_before']}`"]
    for phase, target in (("forward", TARGET_FWD_US), ("forward+backward", TARGET_BOTH_US)):
        both = phase != "forward"
        lines += ["", f"#### {phase} (target: ours <= {target:.0f} us)", "",
                  "| op | backend | ours before | **ours after** | of which our code alone (no math) | "
                  + ("torch's autograd around the math | ours beyond it | " if both else "")
                  + "torch.library's own road, same signature, empty body: alone (beside the math) | "
                  "verdict (after) |",
                  "|---|---|---:|---:|---:|" + ("---:|---:|" if both else "") + "---:|---|"]
        for op, by_backend in after["ops"].items():
            for name, row in by_backend.items():
                old = before["ops"].get(op, {}).get(name, {})
                if "skipped" in row or "skipped" in old or not old:
                    continue
                r0, r = old[phase], row[phase]
                cells = [f"{r0['public'] - r0['direct']:.1f}", f"**{r['public'] - r['direct']:.1f}**",
                         f"{r['glue']:.1f}" if "glue" in r else "-"]
                if both:
                    cells += [f"{r['bare'] - r['direct']:.1f}", f"{r['public'] - r['bare']:.1f}"]
                cells += [twin_cell(r), verdict(r, phase)]
                lines.append(f"| {op} | {name} | " + " | ".join(cells) + " |")
    return lines


def median_of(results: list):
    """One result from repeated runs of the same command (--merge): the median of every number
    (element by element in lists of numbers), the first run's text; the runs' `uptime` lines all kept."""
    first = results[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in results if isinstance(r, dict) and k in r]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):  # counts (ints) stay ints
        return statistics.median_low(results) if isinstance(first, int) else statistics.median(results)
    if isinstance(first, list) and first and all(isinstance(v, (int, float)) for v in first):
        return [statistics.median(col) for col in zip(*results)]
    return first


def merged(paths: list[str]) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    result = median_of(runs)
    for key in ("load_before", "load_after"):
        result[key] = " / ".join(r[key].split("load average: ")[-1] for r in runs)
    result["runs"] = len(runs)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--calls", type=int, default=100, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=15, help="timed batches per level (the median is reported)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--real", action="store_true", help="no stubs: CUDA tensors and real launches (on a GPU)")
    parser.add_argument("--decode", action="store_true", help="also the tiny model's per-token host time at batch 1")
    parser.add_argument("--compile", default="inductor", help="with --decode: the compiled static step's backend")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--json", help="write the raw result here")
    parser.add_argument("--out", help="write the markdown report here (else print it)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                        help="only print the before/after table of two --json results")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge --json results of repeated runs of one command (the median of each "
                             "number) into --json and --out")
    args = parser.parse_args(argv)
    if args.compare:
        print("\n".join(compare(*(json.loads(Path(f).read_text()) for f in args.compare))))
        return 0
    if args.merge:
        result = merged(args.merge)
        args.clock, args.rounds, args.calls = result["clock"], result["rounds"], result["calls"]
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        text = "\n".join(report(result, args)) + "\n"
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text)
        return 0
    torch.set_num_threads(1)
    clock = CLOCKS[args.clock]
    device = torch.device("cuda" if args.real else "cpu")
    if args.real and not torch.cuda.is_available():
        parser.error("--real needs a CUDA device")
    if args.real:
        SYNC[0] = torch.cuda.synchronize
    load_before = load()
    stubs = None
    stack = contextlib.ExitStack()
    timer_us = timer_cost_us(clock)
    if not args.real:
        stubs = {"cuda": launch_stubs.stubbed_cuda_launcher()}
        if "triton" in args.backends:
            stack.enter_context(launch_stubs.stubbed_triton())
            stack.callback(time_triton_binders())
    build = cases(device)
    result = {"torch": torch.__version__, "commit": commit(), "device": str(device), "clock": args.clock,
              "calls": args.calls, "rounds": args.rounds, "timer_us": timer_us, "ops": {}, "arity": {}, "native": {}}
    with stack:
        for op in args.ops:
            result["arity"][op] = tensor_arity(op, build)
            result["ops"][op] = {}
            for name in args.backends:
                result["ops"][op][name] = measure(op, name, build, args.calls, args.rounds, clock, stubs, timer_us)
                print(f"{op} {name}: " + ("skipped" if "skipped" in result["ops"][op][name] else
                      " / ".join(f"{ph} public {r['public']:.1f} direct {r['direct']:.1f}"
                                 for ph, r in result["ops"][op][name].items())), file=sys.stderr, flush=True)
        for arity in sorted(set(result["arity"].values())):
            result["native"][str(arity)] = native_anchor(arity, args.calls, args.rounds, clock, device)
        fwd, both = library_anchor(args.calls, args.rounds, clock, device)
        result["library_anchor"] = {"forward": fwd, "forward+backward": both}
    if args.decode:
        result["decode"] = decode_host(args.compile, args.decode_steps, max(3, args.rounds // 3))
    result["load_before"], result["load_after"] = load_before, load()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    lines = report(result, args)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


def report(result, args) -> list[str]:
    lib = result["library_anchor"]
    lines = [f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {result['commit']}, torch "
             f"{result['torch']}, {result['device']} tensors, 1 thread, {args.clock} clock, "
             + (f"median of {result['runs']} runs, each " if result.get("runs") else "")
             + f"median of {args.rounds} "
             f"rounds x {args.calls} calls per level; timer cost subtracted from the pieces: "
             f"{result['timer_us']:.2f} us per timed call", "",
             f"- `uptime` before: `{result['load_before']}`", f"- `uptime` after: `{result['load_after']}`", "",
             "All times in us per call. torch.library's own floor in this run (a clone custom op with an "
             f"autograd formula, through the dispatcher, minus the clone called directly): forward "
             f"{lib['forward']['lib'] - lib['forward']['direct']:.1f} us, forward + backward "
             f"{lib['forward+backward']['lib'] - lib['forward+backward']['direct']:.1f} us."]
    lines += table(result)
    if "decode" in result:
        d = result["decode"]
        lines += ["", "### decode, tiny model, batch 1 (ms per token)", "",
                  "| step | wall ms/token | thread CPU ms/token | ATen calls per token |", "|---|---:|---:|---:|"]
        for name in ("eager", "compiled", "general"):
            lines.append(f"| {name} | {d[name]['wall_ms']:.3f} | {d[name]['cpu_ms']:.3f} | {d[name]['aten_calls']:.0f} |")
        lines.append(f"\n(compiled with {args.compile} in {d['compile_s']:.0f} s)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
