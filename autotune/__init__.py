"""Autotuning for megalodon_kernels (DESIGN.md section 4).

* ``registry``: each op declares its key function (how inputs are bucketed) and its config space
  (backend -> knob -> allowed values); cheap to import, the ops import it.
* ``cache``: JSON tables per device, validated on load, written atomically under a lock;
  ``cache.lookup`` is what the dispatcher asks.
* ``tuner``: checks every candidate against the float64 reference, then times it.
* ``shapes``: the shape sets ``a100``, ``h100`` (paper 7B) and ``cpu``.
* ``python -m megalodon_kernels.autotune``: regenerate, show, verify, clear.

Importing this package imports nothing heavy: the tuner, the harnesses and the references load
only when tuning.
"""
