// cema_kernel fwd (synthesis of k and the bias b) and bwd (analysis of dk, db + coefficient gradients).
#include "cema.cuh"
#include "launchers.h"

namespace mk {

using namespace cema;

namespace cema {

template <class R>
void cema_fwd_impl(const R* p, const R* log_q, const R* gamma, const R* hx, R* k, R* b, std::int64_t B,
                   std::int64_t D, std::int64_t N, std::int64_t L, void* stream) {
  const Layout l = layout(static_cast<int>(N), L);
  const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(blocks_along(synth_tiles<R>(l), D)));
  const auto cema_synth_fwd = &cema_synth_kernel<kSynthCema, R>;
  MK_LAUNCH(cema_synth_fwd, grid, kThreads, 0, stream, p, log_q, gamma, hx, k, b, static_cast<int>(D),
            static_cast<int>(N), L, static_cast<int>(1 + B), true);
}

template <class R>
void cema_bwd_impl(const R* dk, const R* db, const R* p, const R* log_q, const R* gamma, const R* hx, R* dp,
                   R* dlog_q, R* dgamma, R* dhx, R* workspace, std::int64_t B, std::int64_t D, std::int64_t N,
                   std::int64_t L, bool weighted, void* stream) {
  const bool has_k = dk != nullptr;
  const bool has_b = db != nullptr && B > 0;
  const int rows = (has_k ? 1 : 0) + (has_b ? static_cast<int>(B) : 0);
  const Layout l = layout(static_cast<int>(N), L);
  const int Y = blocks_along(analysis_tiles<R>(l), D);
  auto* partial = reinterpret_cast<c4_t<R>*>(workspace);
  if (rows > 0) {
    const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(Y));
    if (weighted) {
      const auto cema_analysis_bwd = &cema_analysis_kernel<kAnalysisCema, R, R, true>;
      MK_LAUNCH(cema_analysis_bwd, grid, kThreads, 0, stream, dk, db, log_q, partial, static_cast<int>(D),
                static_cast<int>(N), L, rows, has_k);
    } else {
      const auto cema_analysis_bwd_unweighted = &cema_analysis_kernel<kAnalysisCema, R, R, false>;
      MK_LAUNCH(cema_analysis_bwd_unweighted, grid, kThreads, 0, stream, dk, db, log_q, partial, static_cast<int>(D),
                static_cast<int>(N), L, rows, has_k);
    }
  }
  const auto cema_bwd_finish = &cema_bwd_finish_kernel<R>;
  MK_LAUNCH(cema_bwd_finish, finish_grid(D * N), kFinishThreads, 0, stream, partial, p, gamma, hx, dp, dlog_q, dgamma,
            dhx, static_cast<int>(D), static_cast<int>(N), static_cast<int>(B), Y, has_k, has_b, weighted);
}

}  // namespace cema

std::int64_t cema_workspace_elems(int real, std::int64_t rows, std::int64_t D, std::int64_t N, std::int64_t L) {
  check_sizes("cema workspace", 0, D, N, L);
  const Layout l = layout(static_cast<int>(N), L);
  std::int64_t Y = 0;
  dispatch_real(real, "cema workspace", [&](auto r) { Y = blocks_along(analysis_tiles<decltype(r)>(l), D); });
  return 4 * rows * D * Y * N;
}

void cema_kernel_fwd(int real, const void* p, const void* log_q, const void* gamma, const void* hx, void* k, void* b,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, void* stream) {
  check_sizes("cema_kernel", B, D, N, L);
  require(hx != nullptr || B == 0, "cema_kernel: B > 0 needs hx");
  if (D == 0) return;
  dispatch_real(real, "cema_kernel", [&](auto r) {
    using R = decltype(r);
    cema_fwd_impl<R>(static_cast<const R*>(p), static_cast<const R*>(log_q), static_cast<const R*>(gamma),
                     static_cast<const R*>(hx), static_cast<R*>(k), static_cast<R*>(b), B, D, N, L, stream);
  });
}

void cema_kernel_bwd(int real, const void* dk, const void* db, const void* p, const void* log_q, const void* gamma,
                     const void* hx, void* dp, void* dlog_q, void* dgamma, void* dhx, void* workspace,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, bool weighted, void* stream) {
  check_sizes("cema_kernel_bwd", B, D, N, L);
  require(hx != nullptr || B == 0, "cema_kernel_bwd: B > 0 needs hx");
  if (D == 0 || N == 0) return;
  dispatch_real(real, "cema_kernel_bwd", [&](auto r) {
    using R = decltype(r);
    cema_bwd_impl<R>(static_cast<const R*>(dk), static_cast<const R*>(db), static_cast<const R*>(p),
                     static_cast<const R*>(log_q), static_cast<const R*>(gamma), static_cast<const R*>(hx),
                     static_cast<R*>(dp), static_cast<R*>(dlog_q), static_cast<R*>(dgamma), static_cast<R*>(dhx),
                     static_cast<R*>(workspace), B, D, N, L, weighted, stream);
  });
}

}  // namespace mk
