"""megalodon_kernels: fused kernels for Megalodon-family long-context sequence models.

Public entry points::

    from megalodon_kernels import ops        # autograd ops with torch / triton / cuda backends
    from megalodon_kernels import reference  # float64 NumPy references (tests, tuner)

``python -m megalodon_kernels`` prints versions, which backends are usable here, and runs a
self-check of every op against its reference.

``import megalodon_kernels`` is enough for ``torch.ops.megalodon_kernels.<op>`` to resolve, so a
program saved with ``torch.export.save`` loads with ``torch.export.load`` in a fresh process.
The ops register when ``megalodon_kernels.ops`` is imported; this file does not import it (the
autotune runtime and the CUDA loader import this package and must not pull the ops in, see
tests/test_autotune.py), it puts a namespace on ``torch.ops`` that imports the ops the first time
a name in it is looked up. Cost of ``import megalodon_kernels``: torch's import, which every user
of the ops pays anyway, and the CUDA loader's launch descriptions module (a few ms: see below);
the ops' own ~70 ms come only with the first lookup or ``ops`` import.

It also tells the CUDA loader (``cuda/instances.py``) where the kernel list comes from: the ops
hand over their launch descriptions, lazily, so the loader, a layer below the ops, never imports
them by name (tests/test_layering.py).
"""

import importlib

import torch
from torch._ops import _OpNamespace

__version__ = "0.1.0"

# The package's own name, spelled out: pytest also runs this file as the package ``main`` (the
# checkout's folder), and that run must register the ops of ``megalodon_kernels``, not a second copy.
_PACKAGE = "megalodon_kernels"
_NAMESPACE = "megalodon_kernels"  # ops/_library.py NAMESPACE (not imported: that would load the ops)


class _RegisteringNamespace(_OpNamespace):
    """``torch.ops.megalodon_kernels``: a torch op namespace that registers the ops before its
    first lookup. Lookups torch answers from the instance (a found op is cached on it) never get here."""

    registers_the_ops = True  # what a second run of this file recognises (its class is another object)
    # torch names an op after its namespace's __module__ (torch._ops -> "torch.ops.<ns>.<op>" in a
    # saved program); the class attribute would otherwise say "megalodon_kernels".
    __module__ = _OpNamespace.__module__

    def __getattr__(self, name):
        if not name.startswith("_"):
            # A lookup during the ops' own import finds the module in sys.modules (a no-op).
            importlib.import_module(f"{_PACKAGE}.ops")
        return super().__getattr__(name)


_existing = vars(torch.ops).get(_NAMESPACE)
if _existing is None:
    setattr(torch.ops, _NAMESPACE, _RegisteringNamespace(_NAMESPACE))
    torch.ops._dir.append(_NAMESPACE)
elif not getattr(type(_existing), "registers_the_ops", False):
    # Someone looked the namespace up before this import: replacing it would drop the op objects
    # it already handed out, so register the ops now instead.
    importlib.import_module(f"{_PACKAGE}.ops")


def _cuda_launch_descriptions() -> list:
    """The ops' CUDA launch descriptions, imported on the CUDA loader's first request."""
    return importlib.import_module(f"{_PACKAGE}.ops").cuda_launch_descriptions()


importlib.import_module(f"{_PACKAGE}.cuda.instances").provide(_cuda_launch_descriptions)
