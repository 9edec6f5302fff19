// fftconv backward: dx (x's dtype) with the per-row product spectra, and dk (float or double, the
// arithmetic type). Above the one-block limit (L > 16384 in float / bf16, L > 8192 in double) the
// multi-pass launchers of fftconv_long.cu run (workspace ws, ws_rows rows).
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

int fftconv_log2n(std::int64_t L, int dtype);        // fftconv_fwd.cu
bool fftconv_multi_pass(int log2n, int dtype);       // fftconv_fwd.cu

void fftconv_bwd_dx(int dtype, const void* dy, const void* x, const void* kf, void* dx, void* prod, std::int64_t B,
                    std::int64_t D, std::int64_t L, void* ws, std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L, dtype);
  require(B >= 0 && D >= 0 && B * D < (1ll << 31), "fftconv: need B * D < 2^31");
  if (B == 0 || D == 0 || (dx == nullptr && prod == nullptr)) return;
  if (fftconv_multi_pass(log2n, dtype))
    return fftconv_long_bwd_dx(dtype, dy, x, kf, dx, prod, B, D, L, log2n, ws, ws_rows, stream);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using R = acc_t<T>;
    const std::size_t smem = fft_smem_bytes<R>(log2n);
    const auto fftconv_bwd_dx = &fftconv_bwd_dx_kernel<T>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_bwd_dx, smem);
    MK_LAUNCH(fftconv_bwd_dx, static_cast<unsigned int>(B * D), fft_threads<R>(log2n), smem, stream,
              static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const cplx_t<R>*>(kf),
              static_cast<T*>(dx), static_cast<cplx_t<R>*>(prod), static_cast<int>(D), static_cast<int>(L), log2n);
  });
}

void fftconv_bwd_dk(int dtype, const void* prod, void* acc, void* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                    bool accumulate, bool finalize, void* ws, std::int64_t ws_rows, void* stream) {
  require(dtype == kFloat32 || dtype == kFloat64, "fftconv_bwd_dk: dk is computed in float32 or float64");
  const int log2n = fftconv_log2n(L, dtype);
  require(nb >= 0 && D >= 0 && D < (1ll << 31) && nb < (1ll << 31), "fftconv: bad sizes");
  if (D == 0) return;
  require(!accumulate || acc != nullptr, "fftconv_bwd_dk: accumulate needs acc");
  require(finalize || acc != nullptr, "fftconv_bwd_dk: a partial sum needs acc");
  require(!finalize || dk != nullptr, "fftconv_bwd_dk: finalize needs dk");
  if (fftconv_multi_pass(log2n, dtype))
    return fftconv_long_bwd_dk(dtype, prod, acc, dk, nb, D, L, log2n, accumulate, finalize, ws, ws_rows, stream);
  auto launch = [&](auto r) {
    using R = decltype(r);
    using C = cplx_t<R>;
    const std::size_t smem = finalize ? fft_smem_bytes<R>(log2n) : 0;
    const auto fftconv_bwd_dk = &fftconv_bwd_dk_kernel<R>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_bwd_dk, fft_smem_bytes<R>(log2n));
    MK_LAUNCH(fftconv_bwd_dk, static_cast<unsigned int>(D), fft_threads<R>(log2n), smem, stream,
              static_cast<const C*>(prod), static_cast<C*>(acc), static_cast<R*>(dk), static_cast<int>(nb),
              static_cast<int>(D), static_cast<int>(L), log2n, accumulate, finalize);
  };
  if (dtype == kFloat64) launch(double{});
  else launch(float{});
}

}  // namespace mk
