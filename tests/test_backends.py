"""Backend availability across ops: the CUDA backends' reasons for refusing inputs name the fix,
and the ops with float64 kernels accept float64 and name the dtype they refuse."""
import pytest
import torch


def test_cuda_reasons_name_the_fix(emulated):
    from megalodon_kernels.ops.fftconv import cuda_impl

    L = 2**27 + 1  # beyond the multi-pass FFT (expanded views: no memory)
    why = cuda_impl.not_supported_reasons(torch.zeros(1, dtype=torch.float16).expand(1, 1, L),
                                          torch.zeros(1).expand(1, L))
    text = " ".join(why)
    assert "CUDA backend is unavailable" in text  # no GPU runtime here, with the reason
    # ... as the one reason about where it runs (not also "needs cuda tensors"), then the input limits
    assert "cuda tensors" not in text and "L <= 134217728" in text
    assert "float16" in text and "backend='torch'" in text  # a refused dtype, and where to go instead


def test_cuda_fp64_backends_accept_float64_and_name_the_refused_dtype(emulated):

    x64 = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    for op, arg in (("rotary", "x"), ("dropkey_softmax", "scores"), ("timestep_norm", "x")):
        impl = emulated[op]
        t = x64[0] if op == "timestep_norm" else x64
        assert impl.not_supported_reasons(**{arg: t}) == [], op
        why = impl.not_supported_reasons(**{arg: t.half()})
        assert any(f"float64 {arg}, got torch.float16" in r for r in why), (op, why)
    with pytest.raises(TypeError, match="float64 x, got torch.float16"):
        emulated["rotary"].forward(x64.half(), torch.ones(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))
