"""The chunked form of the Triton cema (ops/cema/triton_chunked.py) in the interpreter, where the
case table of test_cema.py does not reach: several blocks of BM chunks (the scan carried across
blocks, forward and in both backward kernels), a length that is not a multiple of C, every state
lane (N = 16), and the calls it leaves to the FFT form. Bounds from the reference's terms
(tests/support.assert_close), as in test_cema.py."""
import pytest
import torch

from megalodon_kernels.ops._vandermonde import exact_powers
from megalodon_kernels.ops.cema import triton_chunked, triton_impl
from support import cema_coefficients, knobs
from test_cema import F32, BF16, check_cema


@pytest.mark.parametrize("chunk, L, xdtype", [(16, 600, F32), (32, 1100, F32), (16, 530, BF16)],
                         ids=["C16-3_blocks-fp32", "C32-3_blocks-fp32", "C16-3_blocks-bf16"])
def test_blocks_of_chunks(chunk, L, xdtype):
    # 600 / 16 = 37.5 chunks, 1100 / 32 = 34.4: three blocks of 16 chunks, the last one partial, and a
    # partial last chunk; hx, the returned state and its gradient, N = 16 fills every state lane
    check_cema("triton", 1, 2, 16, L, xdtype, F32, with_hx=True, return_state=True, seed=11,
               config={"chunk": chunk})


def test_without_hx_or_state_over_blocks():
    check_cema("triton", 2, 1, 3, 700, F32, F32, with_hx=False, return_state=False, seed=12, config={"chunk": 16})


def test_more_state_lanes_than_the_kernels_run_the_fft_form(monkeypatch):
    # N = 17 > NP: the chunked kernels do not serve it and the FFT form runs (and matches)
    gen = torch.Generator().manual_seed(0)
    p, _, _, _ = cema_coefficients(gen, 2, 17, None, F32)
    assert triton_chunked.unserved_reasons(torch.zeros(1, 2, 8), p) == ["N = 17 > 16 state lanes"]
    calls = []
    monkeypatch.setattr(triton_chunked, "conv_fwd", lambda *a, **k: calls.append(a))
    check_cema("triton", 1, 2, 17, 40, F32, F32, seed=13)
    assert not calls
    with knobs(triton_impl, chunk=32):
        assert triton_impl.chunked_form(torch.zeros(1, 2, 8), p[:, :16], triton_impl.DEFAULT_CONFIG)
        assert not triton_impl.chunked_form(torch.zeros(1, 2, 8), p, triton_impl.DEFAULT_CONFIG)
    with knobs(triton_impl, chunk=0):
        assert not triton_impl.chunked_form(torch.zeros(1, 2, 8), p[:, :16], triton_impl.DEFAULT_CONFIG)


def test_chunked_is_the_default_form():
    assert triton_impl.DEFAULT_CONFIG["chunk"] > 0


def test_the_chunked_form_takes_what_the_fft_form_cannot_run(monkeypatch):
    # no refusal of the FFT form (its length limit, a release's pruned launches) applies where the
    # chunked kernels run; with chunk = 0 (e.g. a tuned entry) such a call runs them as well
    gen = torch.Generator().manual_seed(1)
    c4, c17 = (cema_coefficients(gen, 2, n, None, F32) for n in (4, 17))
    args = lambda c, x: dict(x=x, p=c.p, log_q=c.log_q, gamma=c.gamma, omega=torch.zeros(2))  # noqa: E731
    long_x = torch.empty(1, 2, (1 << 17) + 1)                       # past the FFT form's MAX_LENGTH
    assert triton_impl.not_supported_reasons(**args(c4, long_x)) == []
    assert any("L = 131073" in r for r in triton_impl.not_supported_reasons(**args(c17, long_x)))
    x = torch.zeros(1, 2, 8)
    monkeypatch.setattr(triton_impl, "_fft_form_reasons", lambda x: ["the FFT form is pruned here"])
    fft_config = {**triton_impl.DEFAULT_CONFIG, "chunk": 0}
    assert triton_impl.form_chunk(x, c4.p, fft_config) == triton_impl.CHUNK_SPACE["chunk"][0]
    assert triton_impl.form_chunk(x, c17.p, fft_config) == 0
    assert triton_impl.not_supported_reasons(**args(c4, x)) == []
    assert triton_impl.not_supported_reasons(**args(c17, x)) == ["the FFT form is pruned here"]


def test_tables_are_exact_powers_rounded_once():
    # the tables kernel (float64 powers, its own sine and cosine) against ops/_vandermonde's
    # exact_powers (torch float64) rounded to fp32: equal; lanes n >= N zero
    gen = torch.Generator().manual_seed(5)
    D, N, C, BM, NP = 6, 13, 32, 16, triton_chunked.NP
    p = torch.rand(D, N, generator=gen)
    mag = torch.rand(D, N, generator=gen) * 0.5
    mag[0, :2] = torch.tensor([1e-5, 30.0])                    # 1 - |q| ~ 1e-5, and powers that underflow
    log_q = torch.complex(-mag, torch.rand(D, N, generator=gen) * 60 - 30)   # phases far beyond 2 pi
    gamma = torch.randn(D, N, dtype=torch.complex64, generator=gen)
    tab = triton_chunked.Tables(p, log_q, gamma, C, BM)
    lq, p64, g128 = log_q.to(torch.complex128), p.double(), gamma.to(torch.complex128)
    P = exact_powers(lq, torch.arange(C + 1))
    A = exact_powers(lq, torch.arange(BM + 1) * C)
    f32 = torch.float32
    assert torch.equal(tab.k.view(D, C), ((p64 * g128).unsqueeze(-1) * P[..., :C]).real.sum(1).to(f32))
    win = (p64.unsqueeze(-1) * P[..., :C].flip(-1)).transpose(1, 2)              # [D, C, N]
    wout = g128.unsqueeze(-1) * P[..., 1:]                                        # [D, N, C]
    pw = A.transpose(1, 2)                                                        # [D, BM+1, N]
    hi = A[..., BM].to(torch.complex64)
    for got, want in ((tab.win.view(D, 2, C, NP), win), (tab.wout.view(D, 2, NP, C).transpose(2, 3), wout.transpose(1, 2)),
                      (tab.pw.view(D, 2, BM + 1, NP), pw)):
        assert torch.equal(got[:, 0, :, :N], want.real.to(f32)) and torch.equal(got[:, 1, :, :N], want.imag.to(f32))
        assert not got[..., N:].any()
    a = tab.a.view(D, 6, NP)
    assert torch.equal(a[:, 0, :N], A[..., 1].real.to(f32)) and torch.equal(a[:, 1, :N], A[..., 1].imag.to(f32))
    assert torch.equal(a[:, 2, :N], hi.real) and torch.equal(a[:, 3, :N], hi.imag)
    lo = A[..., BM] - hi.to(torch.complex128)                                     # a**BM's rounding error
    assert (a[:, 4, :N] - lo.real).abs().max() <= 1e-15 and (a[:, 5, :N] - lo.imag).abs().max() <= 1e-15
    assert not a[..., N:].any()
