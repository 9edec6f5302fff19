"""What of tests/test_gpu.py can break on the CPU: its subprocess script and its fixtures.

The GPU tests run only on a lent GPU; a mistake in their plumbing (a script that does not parse, a
CPU-side fixture swapping the real CUDA backend for the emulator) would otherwise surface only
there, costing rare device minutes (both did in the H200 run of bench/results/gpu/h200_run1).
"""
from __future__ import annotations

import ast
import importlib

import pytest

fftconv = importlib.import_module("megalodon_kernels.ops.fftconv")


def test_the_fresh_process_script_parses():
    from tests import test_gpu

    tree = ast.parse(test_gpu.FRESH_PROCESS_SCRIPT)
    assert any(isinstance(node, ast.Assert) for node in ast.walk(tree))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda"])
def test_gpu_marked_cuda_tests_keep_the_real_backend(backend):
    """tests/conftest.py swaps the emulator in for ``backend="cuda"`` tests, but not for ``gpu`` ones."""
    assert not fftconv.BACKENDS._modules["cuda"].startswith("(emulated)")


@pytest.mark.parametrize("backend", ["cuda"])
def test_unmarked_cuda_tests_get_the_emulator(backend, request):
    from tests.conftest import NO_EMULATOR

    if NO_EMULATOR:
        pytest.skip(NO_EMULATOR)
    assert fftconv.BACKENDS._modules["cuda"].startswith("(emulated)")
