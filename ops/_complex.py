"""Complex tensors as the Triton kernels read them."""
from __future__ import annotations

import torch


def interleaved(t: torch.Tensor) -> torch.Tensor:
    """Contiguous float view of a complex tensor with (re, im) interleaved in its last axis."""
    return torch.view_as_real(t.resolve_conj().contiguous())
