// fftconv: kernel spectrum and forward, x in float or bf16, k in fp32. L <= 16384: one block per
// row (fftconv.cuh); longer: the multi-pass four-step FFT (fftconv_long.cuh, needs a workspace).
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

std::int64_t fftconv_max_length() { return std::int64_t(1) << kFft4MaxLog2; }
std::int64_t fftconv_one_block_max_length() { return std::int64_t(1) << kFftMaxLog2; }

std::int64_t fftconv_fft_size(std::int64_t L) {
  std::int64_t n = std::int64_t(1) << kFftMinLog2;
  while (n < L) n *= 2;
  return n;
}

std::int64_t fftconv_workspace_row_floats(std::int64_t L) {
  return L > fftconv_one_block_max_length() ? 2 * fftconv_fft_size(L) : 0;
}

int fftconv_log2n(std::int64_t L) {
  require(L >= 1, "fftconv: L must be >= 1");
  require(L <= fftconv_max_length(), "fftconv: the CUDA kernels handle L <= " + std::to_string(fftconv_max_length()) +
                                         " (got L = " + std::to_string(L) + "); use backend='torch'");
  return ilog2(static_cast<unsigned int>(fftconv_fft_size(L)));
}

void fftconv_kernel_spectrum(const float* k, float* kf, std::int64_t D, std::int64_t L, float* ws,
                             std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L);
  require(D >= 0 && D < (1ll << 31), "fftconv: bad D");
  if (D == 0) return;
  if (log2n > kFftMaxLog2) return fftconv_long_kernel_spectrum(k, kf, D, L, log2n, ws, ws_rows, stream);
  const std::size_t smem = fft_smem_bytes(log2n);
  const auto fftconv_spectrum = &fftconv_spectrum_kernel<float>;
  MK_SET_MAX_DYNAMIC_SMEM(fftconv_spectrum, smem);
  MK_LAUNCH(fftconv_spectrum, static_cast<unsigned int>(D), fft_threads(log2n), smem, stream, k,
            reinterpret_cast<float2*>(kf), static_cast<int>(L), log2n);
}

void fftconv_fwd(int dtype, const void* x, const float* kf, void* y, std::int64_t B, std::int64_t D, std::int64_t L,
                 float* ws, std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L);
  require(B >= 0 && D >= 0 && B * D < (1ll << 31), "fftconv: need B * D < 2^31");
  if (B == 0 || D == 0) return;
  if (log2n > kFftMaxLog2) return fftconv_long_fwd(dtype, x, kf, y, B, D, L, log2n, ws, ws_rows, stream);
  const std::size_t smem = fft_smem_bytes(log2n);
  MK_DISPATCH_FLOAT_BF16(dtype, T, [&] {
    const auto fftconv_fwd = &fftconv_fwd_kernel<T>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_fwd, smem);
    MK_LAUNCH(fftconv_fwd, static_cast<unsigned int>(B * D), fft_threads(log2n), smem, stream,
              static_cast<const T*>(x), reinterpret_cast<const float2*>(kf), static_cast<T*>(y), static_cast<int>(D),
              static_cast<int>(L), log2n);
  });
}

}  // namespace mk
