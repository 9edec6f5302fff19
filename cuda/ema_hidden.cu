// ema_hidden fwd (analysis of x in the reverse layout) and bwd (synthesis of dx + coefficient gradients
// from the saved sums). Coefficients, outputs and sums in R = float or double; x float32 or bf16 with
// float coefficients, float32, bf16 or float64 with double coefficients (widened to double on load).
#include "cema.cuh"
#include "launchers.h"

namespace mk {

using namespace cema;

namespace cema {

template <class R>
void ema_hidden_fwd_impl(int dtype, const void* x, const R* p, const R* log_q, const R* hx, R* h, R* v, R* w,
                         R* workspace, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, void* stream) {
  const Layout l = layout(static_cast<int>(N), L);
  const int Y = blocks_along(analysis_tiles<R>(l), D);
  auto* partial = reinterpret_cast<c4_t<R>*>(workspace);
  const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(Y));
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, XT, [&] {
    if constexpr (std::is_same_v<R, float> && std::is_same_v<XT, double>) {
      // fp32 coefficients compute in fp32 (as the torch backend: x.to(p.dtype)); kernels.py casts x.
      throw std::invalid_argument("ema_hidden: float64 x needs float64 coefficients (cast x to float32)");
    } else {
      const XT* xt = static_cast<const XT*>(x);
      if (w != nullptr) {
        const auto cema_analysis_ema_hidden = &cema_analysis_kernel<kAnalysisHidden, XT, R, true>;
        MK_LAUNCH(cema_analysis_ema_hidden, grid, kThreads, 0, stream, xt, xt, log_q, partial, static_cast<int>(D),
                  static_cast<int>(N), L, static_cast<int>(B), false);
      } else {
        const auto cema_analysis_ema_hidden_unweighted = &cema_analysis_kernel<kAnalysisHidden, XT, R, false>;
        MK_LAUNCH(cema_analysis_ema_hidden_unweighted, grid, kThreads, 0, stream, xt, xt, log_q, partial,
                  static_cast<int>(D), static_cast<int>(N), L, static_cast<int>(B), false);
      }
    }
  });
  const auto ema_hidden_finish = &ema_hidden_finish_kernel<R>;
  MK_LAUNCH(ema_hidden_finish, finish_grid(B * D * N), kFinishThreads, 0, stream, partial, p, log_q, hx, h, v, w,
            static_cast<int>(B), static_cast<int>(D), static_cast<int>(N), L, Y);
}

template <class R>
void ema_hidden_bwd_impl(const R* dh, const R* p, const R* log_q, const R* hx, const R* v, const R* w, R* dx, R* dp,
                         R* dlog_q, R* dhx, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L,
                         bool need_p, bool need_lq, void* stream) {
  if (dx != nullptr && B > 0) {
    const Layout l = layout(static_cast<int>(N), L);
    const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(blocks_along(synth_tiles<R>(l), D)));
    const auto cema_synth_ema_hidden_dx = &cema_synth_kernel<kSynthHiddenDx, R>;
    MK_LAUNCH(cema_synth_ema_hidden_dx, grid, kThreads, 0, stream, p, log_q, static_cast<const R*>(nullptr), dh,
              static_cast<R*>(nullptr), dx, static_cast<int>(D), static_cast<int>(N), L, static_cast<int>(B),
              false);
  }
  if (N == 0) return;
  const auto ema_hidden_coef = &ema_hidden_coef_kernel<R>;
  MK_LAUNCH(ema_hidden_coef, finish_grid(D * N), kFinishThreads, 0, stream, dh, p, log_q, hx, v, w, dp, dlog_q, dhx,
            static_cast<int>(B), static_cast<int>(D), static_cast<int>(N), L, need_p, need_lq);
}

}  // namespace cema

void ema_hidden_fwd(int dtype, int real, const void* x, const void* p, const void* log_q, const void* hx, void* h,
                    void* v, void* w, void* workspace, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L,
                    void* stream) {
  check_sizes("ema_hidden", B, D, N, L);
  if (B == 0 || D == 0 || N == 0) return;
  dispatch_real(real, "ema_hidden", [&](auto r) {
    using R = decltype(r);
    ema_hidden_fwd_impl<R>(dtype, x, static_cast<const R*>(p), static_cast<const R*>(log_q),
                           static_cast<const R*>(hx), static_cast<R*>(h), static_cast<R*>(v), static_cast<R*>(w),
                           static_cast<R*>(workspace), B, D, N, L, stream);
  });
}

void ema_hidden_bwd(int real, const void* dh, const void* p, const void* log_q, const void* hx, const void* v,
                    const void* w, void* dx, void* dp, void* dlog_q, void* dhx, std::int64_t B, std::int64_t D,
                    std::int64_t N, std::int64_t L, bool need_p, bool need_lq, void* stream) {
  check_sizes("ema_hidden_bwd", B, D, N, L);
  require(!need_p || v != nullptr, "ema_hidden_bwd: dp needs the saved sums V");
  require(!need_lq || w != nullptr, "ema_hidden_bwd: dlog_q needs the saved weighted sums W");
  if (D == 0) return;
  dispatch_real(real, "ema_hidden_bwd", [&](auto r) {
    using R = decltype(r);
    ema_hidden_bwd_impl<R>(static_cast<const R*>(dh), static_cast<const R*>(p), static_cast<const R*>(log_q),
                           static_cast<const R*>(hx), static_cast<const R*>(v), static_cast<const R*>(w),
                           static_cast<R*>(dx), static_cast<R*>(dp), static_cast<R*>(dlog_q), static_cast<R*>(dhx),
                           B, D, N, L, need_p, need_lq, stream);
  });
}

}  // namespace mk
