"""ops/_layout.py: the tiled transposed copies equal torch's copies, values and gradients."""
import pytest
import torch

from megalodon_kernels.ops import _layout


@pytest.mark.parametrize("shape, dims", [((2, 300, 257), (1, 2)), ((3, 65, 1030), (1, 2)), ((700, 129), (0, 1)),
                                         ((2, 5, 64, 300), (1, 3))], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.bfloat16], ids=str)
def test_contiguous_equals_torch(shape, dims, dtype):
    x = torch.randn(shape).to(dtype)
    view = x.transpose(*dims)
    assert view.numel() >= _layout.MIN_ELEMS and view.stride(-1) != 1  # the tiled path runs
    got = _layout.contiguous(view)
    assert got.is_contiguous() and got.shape == view.shape
    assert torch.equal(got, view.contiguous())


def test_other_layouts_pass_through():
    x = torch.randn(4, 300, 300)
    assert _layout.contiguous(x) is x  # already contiguous: no copy
    sliced = x[:, :, :200]  # last dimension still the fastest: torch's copy is fine
    assert torch.equal(_layout.contiguous(sliced), sliced.contiguous())


def test_transpose_contiguous_gradient():
    x = torch.randn(2, 257, 300, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 300, 257, dtype=torch.float64)
    y = _layout.transpose_contiguous(x, 1, 2)
    assert y.is_contiguous() and torch.equal(y, x.transpose(1, 2))
    (g,) = torch.autograd.grad((y * w).sum(), x)
    assert torch.equal(g, w.transpose(1, 2))
