"""examples/train_packed.py: its smoke run learns (held-out bits per byte fall), its held-out files
are never trained on, and its targets never cross a document boundary."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megalodon_kernels.model import pack

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_packed.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_packed_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_held_out_bits_per_byte_fall(example):
    threads = torch.get_num_threads()
    try:
        curve = example.main(["--smoke"])
    finally:
        torch.set_num_threads(threads)
    steps, bits = zip(*curve)
    assert steps == (0, 20, 40)
    assert all(math.isfinite(b) for b in bits)
    # every evaluation below the one before, and well below where it started
    assert all(later < earlier for earlier, later in zip(bits, bits[1:])), curve
    assert bits[-1] < bits[0] - 2.0, curve


def test_split_is_by_file_and_deterministic(example):
    files = example.stdlib_files()
    names = [name for name, _ in files]
    held = {name for name in names if example.is_held_out(name)}
    assert names == sorted(names) and len(set(names)) == len(names)
    assert 0 < len(held) < len(names) / 4
    assert held == {name for name, _ in example.stdlib_files() if example.is_held_out(name)}
    assert not any(part in example.SKIPPED_DIRS for name in names for part in name.split("/")[:-1])


def test_targets_stay_inside_documents(example):
    tokens, cu = pack([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])])
    targets = example.targets_of(tokens, cu)
    ignore = example.IGNORE
    assert targets.tolist() == [[2, 3, ignore, ignore, 6, ignore]]


def test_documents_cut_long_files_without_losing_bytes(example):
    docs = example.documents([("a.py", b"x" * 10), ("b.py", b"yz")], max_doc=4)
    assert [d.tolist() for d in docs] == [[120] * 4, [120] * 4, [120] * 2, [121, 122]]
