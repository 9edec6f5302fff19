// cema_kernel fwd (synthesis of k and the bias b) and bwd (analysis of dk, db + coefficient gradients).
#include "cema.cuh"
#include "launchers.h"

namespace mk {

using namespace cema;

namespace cema {

// cema_kernel backward, one thread per coefficient (d, n): with S, S1 of dk and T, T1 of each db_b
//   dp = Re(S gamma), dgamma = conj(S p) + sum_b conj(T hx_b), dlog_q = conj(S1 p gamma) + sum_b conj(T1 gamma hx_b),
//   dhx_b = conj(T gamma)  (0 without db). Sums over b in order: deterministic.
__global__ void __launch_bounds__(kFinishThreads)
    cema_bwd_finish_kernel(const float4* __restrict__ partial, const float* __restrict__ p,
                           const float* __restrict__ gamma, const float* __restrict__ hx, float* __restrict__ dp,
                           float* __restrict__ dlog_q, float* __restrict__ dgamma, float* __restrict__ dhx, int D,
                           int N, int B, int Y, bool has_k, bool has_b, bool weighted) {
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < DN;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float pc = p[c];
    const float2 g = load_c(gamma, c);
    float vdp = 0.0f;
    float2 vdg = make_float2(0.0f, 0.0f), vdl = make_float2(0.0f, 0.0f);
    if (has_k) {
      const float4 a = sum_partials(partial, 0, c, D, N, Y);
      const float2 S = make_float2(a.x, a.y);
      vdp = S.x * g.x - S.y * g.y;
      vdg = make_float2(S.x * pc, -S.y * pc);
      if (weighted) vdl = cconj(cmul(make_float2(a.z, a.w), make_float2(pc * g.x, pc * g.y)));
    }
    for (int b = 0; b < B; ++b) {
      const std::int64_t hc = static_cast<std::int64_t>(b) * DN + c;
      if (!has_b) {
        dhx[2 * hc] = 0.0f;
        dhx[2 * hc + 1] = 0.0f;
        continue;
      }
      const float4 a = sum_partials(partial, b + (has_k ? 1 : 0), c, D, N, Y);
      const float2 Tb = make_float2(a.x, a.y);
      const float2 h = load_c(hx, hc);
      const float2 dh = cconj(cmul(Tb, g));
      dhx[2 * hc] = dh.x;
      dhx[2 * hc + 1] = dh.y;
      vdg = cadd(vdg, cconj(cmul(Tb, h)));
      if (weighted) vdl = cadd(vdl, cconj(cmul(make_float2(a.z, a.w), cmul(g, h))));
    }
    dp[c] = vdp;
    dgamma[2 * c] = vdg.x;
    dgamma[2 * c + 1] = vdg.y;
    dlog_q[2 * c] = vdl.x;
    dlog_q[2 * c + 1] = vdl.y;
  }
}

}  // namespace cema

std::int64_t cema_workspace_floats(std::int64_t rows, std::int64_t D, std::int64_t N, std::int64_t L) {
  check_sizes("cema workspace", 0, D, N, L);
  const Layout l = layout(static_cast<int>(N), L);
  return 4 * rows * D * blocks_along(analysis_tiles(l), D) * N;
}

void cema_kernel_fwd(const float* p, const float* log_q, const float* gamma, const float* hx, float* k, float* b,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, void* stream) {
  check_sizes("cema_kernel", B, D, N, L);
  require(hx != nullptr || B == 0, "cema_kernel: B > 0 needs hx");
  if (D == 0) return;
  const Layout l = layout(static_cast<int>(N), L);
  const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(blocks_along(synth_tiles(l), D)));
  const auto cema_synth_fwd = &cema_synth_kernel<kSynthCema>;
  MK_LAUNCH(cema_synth_fwd, grid, kThreads, 0, stream, p, log_q, gamma, hx, k, b, static_cast<int>(D),
            static_cast<int>(N), L, static_cast<int>(1 + B), true);
}

void cema_kernel_bwd(const float* dk, const float* db, const float* p, const float* log_q, const float* gamma,
                     const float* hx, float* dp, float* dlog_q, float* dgamma, float* dhx, float* workspace,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, bool weighted, void* stream) {
  check_sizes("cema_kernel_bwd", B, D, N, L);
  require(hx != nullptr || B == 0, "cema_kernel_bwd: B > 0 needs hx");
  if (D == 0 || N == 0) return;
  const bool has_k = dk != nullptr;
  const bool has_b = db != nullptr && B > 0;
  const int rows = (has_k ? 1 : 0) + (has_b ? static_cast<int>(B) : 0);
  const Layout l = layout(static_cast<int>(N), L);
  const int Y = blocks_along(analysis_tiles(l), D);
  auto* partial = reinterpret_cast<float4*>(workspace);
  if (rows > 0) {
    const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(Y));
    if (weighted) {
      const auto cema_analysis_bwd = &cema_analysis_kernel<kAnalysisCema, float, true>;
      MK_LAUNCH(cema_analysis_bwd, grid, kThreads, 0, stream, dk, db, log_q, partial, static_cast<int>(D),
                static_cast<int>(N), L, rows, has_k);
    } else {
      const auto cema_analysis_bwd_unweighted = &cema_analysis_kernel<kAnalysisCema, float, false>;
      MK_LAUNCH(cema_analysis_bwd_unweighted, grid, kThreads, 0, stream, dk, db, log_q, partial, static_cast<int>(D),
                static_cast<int>(N), L, rows, has_k);
    }
  }
  const auto cema_bwd_finish = &cema_bwd_finish_kernel;
  MK_LAUNCH(cema_bwd_finish, finish_grid(D * N), kFinishThreads, 0, stream, partial, p, gamma, hx, dp, dlog_q, dgamma,
            dhx, static_cast<int>(D), static_cast<int>(N), static_cast<int>(B), Y, has_k, has_b, weighted);
}

}  // namespace mk
