"""Autotuning for megalodon_kernels: which backend and config each op runs, per device, dtype and
shape key (docs/design.md, "Autotune").

Two layers, so that what runs under every op call never loads the tuning tools:

* Runtime (below the ops; imports no op and nothing from ``tuning``):

  * ``registry``: each op declares its key function (how inputs are bucketed) and its config space
    (backend -> knob -> allowed values); standard library only, the ops import it.
  * ``cache``: JSON tables per device (``tables/`` holds the shipped ones), validated on load,
    written atomically under a lock; ``cache.lookup`` is what the dispatcher asks.
  * ``device``: which device a table belongs to.
  * ``shapes``: the shape sets ``a100``, ``h100`` (paper 7B) and ``cpu``; plain data.

* Tuning (above the ops; imports them, the references and NumPy):

  * ``tuning.tuner``: checks every candidate against the float64 reference, then times it.
  * ``tuning.harness.<op>``: how to build, run and check one op's tuning cases.
  * ``python -m megalodon_kernels.autotune``: regenerate, show, verify, clear; it imports the
    tuning layer only inside the commands that tune or verify.

Importing this package imports nothing.
"""
