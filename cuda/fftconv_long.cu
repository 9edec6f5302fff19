// fftconv above the one-block limit: the four-step passes of fftconv_long.cuh (instantiations and
// launchers), in float (float / bf16 inputs) or double. The public launchers (fftconv_fwd.cu,
// fftconv_bwd.cu) route here when N > 2^FftCfg<R>::kMaxLog2.
#include "fftconv_long.cuh"
#include "launchers.h"

namespace mk {

namespace {

struct Fft4Launch {
  Fft4Plan p;
  unsigned int col_groups, row_blocks;
  int col_threads, row_threads;
  std::size_t col_smem, row_smem;
};

template <class R>
Fft4Launch fft4_launch(int log2n) {
  require(log2n > FftCfg<R>::kMaxLog2 && log2n <= FftCfg<R>::k4MaxLog2, "fftconv: no multi-pass plan for this length");
  Fft4Launch l;
  l.p = fft4_plan<R>(log2n);
  l.col_groups = 1u << (l.p.log2n2 - l.p.log2c);
  l.row_blocks = (1u << (l.p.log2n1 - 1)) + 1;
  l.col_threads = fft4_col_threads<R>(l.p);
  l.row_threads = fft4_row_threads<R>(l.p);
  l.col_smem = fft4_col_smem_bytes<R>(l.p);
  l.row_smem = fft4_row_smem_bytes<R>(l.p);
  return l;
}

void check_ws(const void* ws, std::int64_t ws_rows) {
  require(ws != nullptr && ws_rows >= 1,
          "fftconv: L above the one-block limit needs a workspace of at least one row (N complex values)");
  require(ws_rows < (1ll << 31), "fftconv: workspace rows must be < 2^31");
}

// The arithmetic type of the k spectrum / dk launchers: float or double by code.
template <class F>
void dispatch_real(int dtype, F f) {
  if (dtype == kFloat32) return f(float{});
  if (dtype == kFloat64) return f(double{});
  throw std::invalid_argument("fftconv: the spectrum / dk arithmetic type must be float32 (0) or float64 (4), got " +
                              std::to_string(dtype));
}

// pass 1 over `rows` rows of src (length L each) into ws
template <class T, bool FLIP>
void col_fwd(const Fft4Launch& l, const T* src, cplx_t<acc_t<T>>* ws, std::int64_t rows, std::int64_t L,
             void* stream) {
  if constexpr (FLIP) {
    const auto fft4_col_fwd_flip = &fft4_col_fwd_kernel<T, true>;
    MK_SET_MAX_DYNAMIC_SMEM(fft4_col_fwd_flip, l.col_smem);
    MK_LAUNCH(fft4_col_fwd_flip, dim3(static_cast<unsigned int>(rows), l.col_groups), l.col_threads, l.col_smem,
              stream, src, ws, static_cast<int>(L), l.p);
  } else {
    const auto fft4_col_fwd = &fft4_col_fwd_kernel<T, false>;
    MK_SET_MAX_DYNAMIC_SMEM(fft4_col_fwd, l.col_smem);
    MK_LAUNCH(fft4_col_fwd, dim3(static_cast<unsigned int>(rows), l.col_groups), l.col_threads, l.col_smem, stream,
              src, ws, static_cast<int>(L), l.p);
  }
}

// pass 3 over `rows` rows of ws into dst
template <class T, bool FLIP>
void col_inv(const Fft4Launch& l, const cplx_t<acc_t<T>>* ws, T* dst, std::int64_t rows, std::int64_t L,
             void* stream) {
  if constexpr (FLIP) {
    const auto fft4_col_inv_flip = &fft4_col_inv_kernel<T, true>;
    MK_SET_MAX_DYNAMIC_SMEM(fft4_col_inv_flip, l.col_smem);
    MK_LAUNCH(fft4_col_inv_flip, dim3(static_cast<unsigned int>(rows), l.col_groups), l.col_threads, l.col_smem,
              stream, ws, dst, static_cast<int>(L), l.p);
  } else {
    const auto fft4_col_inv = &fft4_col_inv_kernel<T, false>;
    MK_SET_MAX_DYNAMIC_SMEM(fft4_col_inv, l.col_smem);
    MK_LAUNCH(fft4_col_inv, dim3(static_cast<unsigned int>(rows), l.col_groups), l.col_threads, l.col_smem, stream,
              ws, dst, static_cast<int>(L), l.p);
  }
}

template <class R>
void row_spectrum(const Fft4Launch& l, const cplx_t<R>* ws, cplx_t<R>* spec, std::int64_t rows, void* stream) {
  const auto fft4_row_spectrum = &fft4_row_spectrum_kernel<R>;
  MK_SET_MAX_DYNAMIC_SMEM(fft4_row_spectrum, l.row_smem);
  MK_LAUNCH(fft4_row_spectrum, dim3(static_cast<unsigned int>(rows), l.row_blocks), l.row_threads, l.row_smem, stream,
            ws, spec, l.p);
}

template <class R>
void row_conv(const Fft4Launch& l, cplx_t<R>* ws, const cplx_t<R>* kf, cplx_t<R>* prod, std::int64_t D,
              std::int64_t row0, std::int64_t rows, bool out, void* stream) {
  const auto fft4_row_conv = &fft4_row_conv_kernel<R>;
  MK_SET_MAX_DYNAMIC_SMEM(fft4_row_conv, l.row_smem);
  MK_LAUNCH(fft4_row_conv, dim3(static_cast<unsigned int>(rows), l.row_blocks), l.row_threads, l.row_smem, stream, ws,
            kf, prod, static_cast<int>(D), row0, out, l.p);
}

template <class R>
std::size_t long_max_smem(bool rows) {
  std::size_t worst = 0;
  for (int log2n = FftCfg<R>::kMaxLog2 + 1; log2n <= FftCfg<R>::k4MaxLog2; ++log2n) {
    const Fft4Plan p = fft4_plan<R>(log2n);
    worst = imax(worst, rows ? fft4_row_smem_bytes<R>(p) : fft4_col_smem_bytes<R>(p));
  }
  return worst;
}

}  // namespace

std::int64_t fftconv_long_max_smem_bytes(bool rows) {
  return static_cast<std::int64_t>(imax(long_max_smem<float>(rows), long_max_smem<double>(rows)));
}

void fftconv_long_twiddle_probe(const std::uint32_t* a, void* out, std::int64_t n, int s, double sign, int dtype,
                                void* stream) {
  require(n >= 0 && n < (1ll << 31) && s >= 0 && s < 127, "fftconv_long_twiddle_probe: bad sizes");
  if (n == 0) return;
  dispatch_real(dtype, [&](auto r) {
    using R = decltype(r);
    const auto fft4_twiddle_probe = &fft4_twiddle_probe_kernel<R>;
    MK_LAUNCH(fft4_twiddle_probe, static_cast<unsigned int>((n + 255) / 256), 256, 0, stream,
              reinterpret_cast<const unsigned int*>(a), static_cast<cplx_t<R>*>(out), static_cast<int>(n), s,
              static_cast<R>(sign));
  });
}

void fftconv_long_kernel_spectrum(int dtype, const void* k, void* kf, std::int64_t D, std::int64_t L, int log2n,
                                  void* ws, std::int64_t ws_rows, void* stream) {
  check_ws(ws, ws_rows);
  dispatch_real(dtype, [&](auto r) {
    using R = decltype(r);
    const Fft4Launch l = fft4_launch<R>(log2n);
    const std::int64_t bins = (std::int64_t(1) << log2n) + 1;
    auto* w = static_cast<cplx_t<R>*>(ws);
    for (std::int64_t d0 = 0; d0 < D; d0 += ws_rows) {
      const std::int64_t rows = imin(ws_rows, D - d0);
      col_fwd<R, false>(l, static_cast<const R*>(k) + d0 * L, w, rows, L, stream);
      row_spectrum<R>(l, w, static_cast<cplx_t<R>*>(kf) + d0 * bins, rows, stream);
    }
  });
}

void fftconv_long_fwd(int dtype, const void* x, const void* kf, void* y, std::int64_t B, std::int64_t D,
                      std::int64_t L, int log2n, void* ws, std::int64_t ws_rows, void* stream) {
  check_ws(ws, ws_rows);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using R = acc_t<T>;
    const Fft4Launch l = fft4_launch<R>(log2n);
    auto* w = static_cast<cplx_t<R>*>(ws);
    for (std::int64_t r0 = 0; r0 < B * D; r0 += ws_rows) {
      const std::int64_t rows = imin(ws_rows, B * D - r0);
      col_fwd<T, false>(l, static_cast<const T*>(x) + r0 * L, w, rows, L, stream);
      row_conv<R>(l, w, static_cast<const cplx_t<R>*>(kf), nullptr, D, r0, rows, true, stream);
      col_inv<T, false>(l, w, static_cast<T*>(y) + r0 * L, rows, L, stream);
    }
  });
}

void fftconv_long_bwd_dx(int dtype, const void* dy, const void* x, const void* kf, void* dx, void* prod,
                         std::int64_t B, std::int64_t D, std::int64_t L, int log2n, void* ws, std::int64_t ws_rows,
                         void* stream) {
  check_ws(ws, ws_rows);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using R = acc_t<T>;
    const Fft4Launch l = fft4_launch<R>(log2n);
    const std::int64_t bins = (std::int64_t(1) << log2n) + 1;
    auto* w = static_cast<cplx_t<R>*>(ws);
    auto* pr = static_cast<cplx_t<R>*>(prod);
    for (std::int64_t r0 = 0; r0 < B * D; r0 += ws_rows) {
      const std::int64_t rows = imin(ws_rows, B * D - r0);
      if (pr) {  // prod = rfft(x), multiplied by G = rfft(flip dy) below
        col_fwd<T, false>(l, static_cast<const T*>(x) + r0 * L, w, rows, L, stream);
        row_spectrum<R>(l, w, pr + r0 * bins, rows, stream);
      }
      col_fwd<T, true>(l, static_cast<const T*>(dy) + r0 * L, w, rows, L, stream);
      row_conv<R>(l, w, static_cast<const cplx_t<R>*>(kf), pr ? pr + r0 * bins : nullptr, D, r0, rows,
                  dx != nullptr, stream);
      if (dx) col_inv<T, true>(l, w, static_cast<T*>(dx) + r0 * L, rows, L, stream);
    }
  });
}

void fftconv_long_bwd_dk(int dtype, const void* prod, void* acc, void* dk, std::int64_t nb, std::int64_t D,
                         std::int64_t L, int log2n, bool accumulate, bool finalize, void* ws, std::int64_t ws_rows,
                         void* stream) {
  if (finalize) check_ws(ws, ws_rows);
  dispatch_real(dtype, [&](auto r) {
    using R = decltype(r);
    using C = cplx_t<R>;
    const Fft4Launch l = fft4_launch<R>(log2n);
    const std::int64_t chunk = finalize ? ws_rows : D;
    const std::size_t smem = finalize ? l.row_smem : 0;
    const auto fft4_row_dk = &fft4_row_dk_kernel<R>;
    MK_SET_MAX_DYNAMIC_SMEM(fft4_row_dk, l.row_smem);
    auto* w = static_cast<C*>(ws);
    for (std::int64_t d0 = 0; d0 < D; d0 += chunk) {
      const std::int64_t rows = imin(chunk, D - d0);
      MK_LAUNCH(fft4_row_dk, dim3(static_cast<unsigned int>(rows), l.row_blocks), l.row_threads, smem, stream,
                static_cast<const C*>(prod), static_cast<C*>(acc), w, static_cast<int>(nb), static_cast<int>(D), d0,
                accumulate, finalize, l.p);
      if (finalize) col_inv<R, true>(l, w, static_cast<R*>(dk) + d0 * L, rows, L, stream);
    }
  });
}

}  // namespace mk
