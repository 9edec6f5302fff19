"""Float64 NumPy references, forward AND backward, one per op and per stage.

Explicit and obvious on purpose (loops and direct sums where that is clearest): they define
the semantics that every backend is tested against. They import NumPy only and take the same
argument names as the ops in ``megalodon_kernels.ops``. Backward functions take the upstream
gradient(s) of every output and return the gradients of every differentiable input, with
PyTorch's complex convention (grad_z = dL/dRe z + i dL/dIm z).
"""
