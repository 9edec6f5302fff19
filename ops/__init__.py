"""Public ops of megalodon_kernels (DESIGN.md section 2), each a PyTorch autograd function.

Every op takes ``backend="auto" | "torch" | "triton" | "cuda"``; see ``_dispatch.py`` for how
"auto" resolves and ``MEGALODON_KERNELS_BACKEND`` to force one.
"""
from .rotary import rotary

__all__ = ["rotary"]
