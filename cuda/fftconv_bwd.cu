// fftconv backward: dx (x's dtype) with the per-row product spectra, and dk (fp32).
// L > 16384 routes to the multi-pass launchers of fftconv_long.cu (workspace ws, ws_rows rows).
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

int fftconv_log2n(std::int64_t L);  // fftconv_fwd.cu

void fftconv_bwd_dx(int dtype, const void* dy, const void* x, const float* kf, void* dx, float* prod, std::int64_t B,
                    std::int64_t D, std::int64_t L, float* ws, std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L);
  require(B >= 0 && D >= 0 && B * D < (1ll << 31), "fftconv: need B * D < 2^31");
  if (B == 0 || D == 0 || (dx == nullptr && prod == nullptr)) return;
  if (log2n > kFftMaxLog2) return fftconv_long_bwd_dx(dtype, dy, x, kf, dx, prod, B, D, L, log2n, ws, ws_rows, stream);
  const std::size_t smem = fft_smem_bytes(log2n);
  MK_DISPATCH_FLOAT_BF16(dtype, T, [&] {
    const auto fftconv_bwd_dx = &fftconv_bwd_dx_kernel<T>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_bwd_dx, smem);
    MK_LAUNCH(fftconv_bwd_dx, static_cast<unsigned int>(B * D), fft_threads(log2n), smem, stream,
              static_cast<const T*>(dy), static_cast<const T*>(x), reinterpret_cast<const float2*>(kf),
              static_cast<T*>(dx), reinterpret_cast<float2*>(prod), static_cast<int>(D), static_cast<int>(L), log2n);
  });
}

void fftconv_bwd_dk(const float* prod, float* acc, float* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                    bool accumulate, bool finalize, float* ws, std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L);
  require(nb >= 0 && D >= 0 && D < (1ll << 31) && nb < (1ll << 31), "fftconv: bad sizes");
  if (D == 0) return;
  require(!accumulate || acc != nullptr, "fftconv_bwd_dk: accumulate needs acc");
  require(finalize || acc != nullptr, "fftconv_bwd_dk: a partial sum needs acc");
  require(!finalize || dk != nullptr, "fftconv_bwd_dk: finalize needs dk");
  if (log2n > kFftMaxLog2)
    return fftconv_long_bwd_dk(prod, acc, dk, nb, D, L, log2n, accumulate, finalize, ws, ws_rows, stream);
  const std::size_t smem = finalize ? fft_smem_bytes(log2n) : 0;
  const auto fftconv_bwd_dk = &fftconv_bwd_dk_kernel<float>;
  MK_SET_MAX_DYNAMIC_SMEM(fftconv_bwd_dk, fft_smem_bytes(log2n));
  MK_LAUNCH(fftconv_bwd_dk, static_cast<unsigned int>(D), fft_threads(log2n), smem, stream,
            reinterpret_cast<const float2*>(prod), reinterpret_cast<float2*>(acc), dk, static_cast<int>(nb),
            static_cast<int>(D), static_cast<int>(L), log2n, accumulate, finalize);
}

}  // namespace mk
