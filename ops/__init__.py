"""Public ops of megalodon_kernels (docs/design.md, The ops), each a differentiable torch.library
custom op ``torch.ops.megalodon_kernels.<name>`` with a backward op ``<name>_bwd`` (ops/_library.py),
so torch.compile(fullgraph=True) and torch.export see one node per call.

Every op takes ``backend="auto" | "torch" | "triton" | "cuda"``; see ``_dispatch.py`` for how
"auto" resolves and ``MEGALODON_KERNELS_BACKEND`` to force one.
"""
from . import dropkey_rule
from ._packing import document_positions
from .attention import attention
from .cema import cema
from .cema_kernel import cema_kernel
from .dropkey_softmax import dropkey_softmax
from .ema_hidden import ema_hidden
from .fftconv import fftconv
from .rotary import rotary
from .timestep_norm import timestep_norm

__all__ = ["attention", "cema", "cema_kernel", "document_positions", "dropkey_rule", "dropkey_softmax", "ema_hidden",
           "fftconv", "rotary", "timestep_norm"]
