"""CUDA C++ kernels of megalodon_kernels (see cuda/README.md).

Every op's CUDA path is a launch description in its ``ops/<op>/cuda_impl.py``; this package holds
what the descriptions share: :mod:`.launch` (launch records, the emulator launcher),
:mod:`.runtime` (the GPU launcher), :mod:`.nvrtc` (run-time compilation and its cache),
:mod:`.instances` (every instantiation), :mod:`.backend` (the backends' common base) and
:mod:`.build` (the CPU emulator extension, nvcc resource reports). No extension is built at
install time.

Imports nothing from the rest of the package.
"""
