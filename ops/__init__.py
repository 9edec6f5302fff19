"""Public ops of megalodon_kernels (docs/design.md, The ops), each a differentiable torch.library
custom op ``torch.ops.megalodon_kernels.<name>`` with a backward op ``<name>_bwd`` (ops/_library.py),
so torch.compile(fullgraph=True) and torch.export see one node per call.

Every op takes ``backend="auto" | "torch" | "triton" | "cuda" | "cpu"``: each has torch and
Triton backends; every op but cema a CUDA one; timestep_norm, fftconv and cema a compiled CPU one
(``ops/<op>/<backend>_impl.py``, docs/design.md has the table). See ``_dispatch.py`` for how
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


def cuda_launch_descriptions() -> list:
    """The ops' CUDA launch descriptions (``ops/<op>/cuda_impl.py``, each with its ``KERNELS``),
    handed to the CUDA loader (cuda/instances.py) by the package's ``__init__``: the loader never
    imports the ops itself."""
    from .attention import cuda_impl as attention_cuda
    from .cema_kernel import cuda_impl as cema_kernel_cuda
    from .dropkey_softmax import cuda_impl as dropkey_softmax_cuda
    from .ema_hidden import cuda_impl as ema_hidden_cuda
    from .fftconv import cuda_impl as fftconv_cuda
    from .rotary import cuda_impl as rotary_cuda
    from .timestep_norm import cuda_impl as timestep_norm_cuda

    return [rotary_cuda, timestep_norm_cuda, cema_kernel_cuda, ema_hidden_cuda, fftconv_cuda, dropkey_softmax_cuda,
            attention_cuda]

