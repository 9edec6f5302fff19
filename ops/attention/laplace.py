"""Mega's Laplace attention function, the one Python definition of its constants (the torch and
Triton backends read them from here; cuda/flash_attention.cuh and reference/attention.py hold
copies that tests/test_attention_layouts.py pins to these values)::

    laplace(s) = 0.5 * (1 + erf((s - MU) / (SIGMA * sqrt 2)))     laplace'(s) = N(s; MU, SIGMA^2)
"""
import math

MU = math.sqrt(0.5)
SIGMA = math.sqrt(1.0 / (4.0 * math.pi))
#: 1 / (SIGMA sqrt 2): the erf argument's scale
INV = 1.0 / (SIGMA * math.sqrt(2.0))
#: 1 / (SIGMA sqrt(2 pi)): the derivative's peak
PDF = 1.0 / (SIGMA * math.sqrt(2.0 * math.pi))
#: 1 / (2 SIGMA^2): the derivative's exponent scale
HALF_INV_VAR = 0.5 / SIGMA**2
