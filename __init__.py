"""megalodon_kernels: fused kernels for Megalodon-family long-context sequence models.

Public entry points::

    from megalodon_kernels import ops        # autograd ops with torch / triton / cuda backends
    from megalodon_kernels import reference  # float64 NumPy references (tests, tuner)

``python -m megalodon_kernels`` prints versions, which backends are usable here, and runs a
self-check of every op against its reference.
"""

__version__ = "0.1.0"
