// fftconv: kernel spectrum and forward, x in float, bf16 or double (k converted by the caller to
// x's arithmetic type: fp32, or fp64 for double x). Up to the one-block limit (L <= 16384 in
// float / bf16, L <= 8192 in double, 128 KiB of shared memory either way): one block per row
// (fftconv.cuh); longer: the multi-pass four-step FFT (fftconv_long.cuh, needs a workspace).
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

namespace {
bool is_fp64(int dtype) { return dtype == kFloat64; }
int one_block_max_log2(int dtype) { return is_fp64(dtype) ? FftCfg<double>::kMaxLog2 : FftCfg<float>::kMaxLog2; }
int multi_pass_max_log2(int dtype) { return is_fp64(dtype) ? FftCfg<double>::k4MaxLog2 : FftCfg<float>::k4MaxLog2; }
}  // namespace

std::int64_t fftconv_max_length(int dtype) { return std::int64_t(1) << multi_pass_max_log2(dtype); }
std::int64_t fftconv_one_block_max_length(int dtype) { return std::int64_t(1) << one_block_max_log2(dtype); }

std::int64_t fftconv_fft_size(std::int64_t L) {
  std::int64_t n = std::int64_t(1) << kFftMinLog2;
  while (n < L) n *= 2;
  return n;
}

std::int64_t fftconv_workspace_row_floats(std::int64_t L, int dtype) {
  // one row of N complex values of the arithmetic type, counted in 4-byte floats
  return L > fftconv_one_block_max_length(dtype) ? (is_fp64(dtype) ? 4 : 2) * fftconv_fft_size(L) : 0;
}

std::int64_t fftconv_one_block_max_smem_bytes() {
  return static_cast<std::int64_t>(imax(fft_smem_bytes<float>(FftCfg<float>::kMaxLog2),
                                        fft_smem_bytes<double>(FftCfg<double>::kMaxLog2)));
}

int fftconv_log2n(std::int64_t L, int dtype) {
  require(L >= 1, "fftconv: L must be >= 1");
  const std::int64_t max_len = fftconv_max_length(dtype);
  require(L <= max_len, "fftconv: the CUDA kernels handle L <= " + std::to_string(max_len) +
                            (is_fp64(dtype) ? " in float64" : "") + " (got L = " + std::to_string(L) +
                            "); use backend='torch'");
  return ilog2(static_cast<unsigned int>(fftconv_fft_size(L)));
}

bool fftconv_multi_pass(int log2n, int dtype) { return log2n > one_block_max_log2(dtype); }

void fftconv_kernel_spectrum(int dtype, const void* k, void* kf, std::int64_t D, std::int64_t L, void* ws,
                             std::int64_t ws_rows, void* stream) {
  require(dtype == kFloat32 || dtype == kFloat64, "fftconv: k's spectrum is computed in float32 or float64");
  const int log2n = fftconv_log2n(L, dtype);
  require(D >= 0 && D < (1ll << 31), "fftconv: bad D");
  if (D == 0) return;
  if (fftconv_multi_pass(log2n, dtype))
    return fftconv_long_kernel_spectrum(dtype, k, kf, D, L, log2n, ws, ws_rows, stream);
  auto launch = [&](auto r) {
    using R = decltype(r);
    const std::size_t smem = fft_smem_bytes<R>(log2n);
    const auto fftconv_spectrum = &fftconv_spectrum_kernel<R>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_spectrum, smem);
    MK_LAUNCH(fftconv_spectrum, static_cast<unsigned int>(D), fft_threads<R>(log2n), smem, stream,
              static_cast<const R*>(k), static_cast<cplx_t<R>*>(kf), static_cast<int>(L), log2n);
  };
  if (dtype == kFloat64) launch(double{});
  else launch(float{});
}

void fftconv_fwd(int dtype, const void* x, const void* kf, void* y, std::int64_t B, std::int64_t D, std::int64_t L,
                 void* ws, std::int64_t ws_rows, void* stream) {
  const int log2n = fftconv_log2n(L, dtype);
  require(B >= 0 && D >= 0 && B * D < (1ll << 31), "fftconv: need B * D < 2^31");
  if (B == 0 || D == 0) return;
  if (fftconv_multi_pass(log2n, dtype)) return fftconv_long_fwd(dtype, x, kf, y, B, D, L, log2n, ws, ws_rows, stream);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using R = acc_t<T>;
    const std::size_t smem = fft_smem_bytes<R>(log2n);
    const auto fftconv_fwd = &fftconv_fwd_kernel<T>;
    MK_SET_MAX_DYNAMIC_SMEM(fftconv_fwd, smem);
    MK_LAUNCH(fftconv_fwd, static_cast<unsigned int>(B * D), fft_threads<R>(log2n), smem, stream,
              static_cast<const T*>(x), static_cast<const cplx_t<R>*>(kf), static_cast<T*>(y), static_cast<int>(D),
              static_cast<int>(L), log2n);
  });
}

}  // namespace mk
