"""Tuning layer of the autotuner: measures candidates and produces the tables the runtime reads.

* ``tuner``: checks every candidate against the float64 reference, then times it.
* ``harness.<op>``: per op, how to build a case, run it forward and backward through the public
  op, and compute its reference.

This layer sits above the ops: it imports them, the references and NumPy. Nothing under an op
call imports it; only the command line (``python -m megalodon_kernels.autotune``) and tests do.
"""
