// ema_hidden fwd (analysis of x in the reverse layout, x float or bf16) and bwd (synthesis of dx +
// coefficient gradients from the saved sums).
#include "cema.cuh"
#include "launchers.h"

namespace mk {

using namespace cema;

namespace cema {

// ema_hidden forward, one thread per (b, d, n): V, W from the partials, h = p V + q**L hx.
__global__ void __launch_bounds__(kFinishThreads)
    ema_hidden_finish_kernel(const float4* __restrict__ partial, const float* __restrict__ p,
                             const float* __restrict__ log_q, const float* __restrict__ hx, float* __restrict__ h,
                             float* __restrict__ v, float* __restrict__ w, int B, int D, int N, std::int64_t L, int Y) {
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  const std::int64_t total = DN * B;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % DN;
    const int b = static_cast<int>(i / DN);
    const float4 a = sum_partials(partial, b, c, D, N, Y);
    float2 hv = make_float2(p[c] * a.x, p[c] * a.y);
    if (hx != nullptr) hv = cadd(hv, cmul(qpow(load_root(log_q, c), L), load_c(hx, i)));
    h[2 * i] = hv.x;
    h[2 * i + 1] = hv.y;
    v[2 * i] = a.x;
    v[2 * i + 1] = a.y;
    if (w != nullptr) {
      w[2 * i] = a.z;
      w[2 * i + 1] = a.w;
    }
  }
}

// ema_hidden coefficient gradients from the saved sums V, W, one thread per (d, n), b in order:
//   dp = sum_b Re(conj(dh) V), dlog_q = sum_b dh conj(p W + L q**L hx), dhx = dh conj(q**L).
__global__ void __launch_bounds__(kFinishThreads)
    ema_hidden_coef_kernel(const float* __restrict__ dh, const float* __restrict__ p, const float* __restrict__ log_q,
                           const float* __restrict__ hx, const float* __restrict__ v, const float* __restrict__ w,
                           float* __restrict__ dp, float* __restrict__ dlog_q, float* __restrict__ dhx, int B, int D,
                           int N, std::int64_t L, bool need_p, bool need_lq) {
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < DN;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float pc = p[c];
    const float2 qL = hx != nullptr ? qpow(load_root(log_q, c), L) : make_float2(0.0f, 0.0f);
    const float2 lqL = make_float2(static_cast<float>(L) * qL.x, static_cast<float>(L) * qL.y);
    float vdp = 0.0f;
    float2 vdl = make_float2(0.0f, 0.0f);
    for (int b = 0; b < B; ++b) {
      const std::int64_t i = static_cast<std::int64_t>(b) * DN + c;
      const float2 g = load_c(dh, i);
      if (need_p) {
        const float2 V = load_c(v, i);
        vdp += g.x * V.x + g.y * V.y;  // Re(conj(g) V)
      }
      if (need_lq) {
        const float2 W = load_c(w, i);
        float2 dq = make_float2(pc * W.x, pc * W.y);
        if (hx != nullptr) dq = cadd(dq, cmul(lqL, load_c(hx, i)));
        vdl = cadd(vdl, cmul(g, cconj(dq)));
      }
      if (hx != nullptr) {
        const float2 r = cmul(g, cconj(qL));
        dhx[2 * i] = r.x;
        dhx[2 * i + 1] = r.y;
      }
    }
    dp[c] = vdp;
    dlog_q[2 * c] = vdl.x;
    dlog_q[2 * c + 1] = vdl.y;
  }
}

}  // namespace cema

void ema_hidden_fwd(int dtype, const void* x, const float* p, const float* log_q, const float* hx, float* h, float* v,
                    float* w, float* workspace, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L,
                    void* stream) {
  check_sizes("ema_hidden", B, D, N, L);
  if (B == 0 || D == 0 || N == 0) return;
  const Layout l = layout(static_cast<int>(N), L);
  const int Y = blocks_along(analysis_tiles(l), D);
  auto* partial = reinterpret_cast<float4*>(workspace);
  const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(Y));
  MK_DISPATCH_FLOAT_BF16(dtype, XT, [&] {
    const XT* xt = static_cast<const XT*>(x);
    if (w != nullptr) {
      const auto cema_analysis_ema_hidden = &cema_analysis_kernel<kAnalysisHidden, XT, true>;
      MK_LAUNCH(cema_analysis_ema_hidden, grid, kThreads, 0, stream, xt, xt, log_q, partial, static_cast<int>(D),
                static_cast<int>(N), L, static_cast<int>(B), false);
    } else {
      const auto cema_analysis_ema_hidden_unweighted = &cema_analysis_kernel<kAnalysisHidden, XT, false>;
      MK_LAUNCH(cema_analysis_ema_hidden_unweighted, grid, kThreads, 0, stream, xt, xt, log_q, partial,
                static_cast<int>(D), static_cast<int>(N), L, static_cast<int>(B), false);
    }
  });
  const auto ema_hidden_finish = &ema_hidden_finish_kernel;
  MK_LAUNCH(ema_hidden_finish, finish_grid(B * D * N), kFinishThreads, 0, stream, partial, p, log_q, hx, h, v, w,
            static_cast<int>(B), static_cast<int>(D), static_cast<int>(N), L, Y);
}

void ema_hidden_bwd(const float* dh, const float* p, const float* log_q, const float* hx, const float* v,
                    const float* w, float* dx, float* dp, float* dlog_q, float* dhx, std::int64_t B, std::int64_t D,
                    std::int64_t N, std::int64_t L, bool need_p, bool need_lq, void* stream) {
  check_sizes("ema_hidden_bwd", B, D, N, L);
  require(!need_p || v != nullptr, "ema_hidden_bwd: dp needs the saved sums V");
  require(!need_lq || w != nullptr, "ema_hidden_bwd: dlog_q needs the saved weighted sums W");
  if (D == 0) return;
  if (dx != nullptr && B > 0) {
    const Layout l = layout(static_cast<int>(N), L);
    const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(blocks_along(synth_tiles(l), D)));
    const auto cema_synth_ema_hidden_dx = &cema_synth_kernel<kSynthHiddenDx>;
    MK_LAUNCH(cema_synth_ema_hidden_dx, grid, kThreads, 0, stream, p, log_q, static_cast<const float*>(nullptr), dh,
              static_cast<float*>(nullptr), dx, static_cast<int>(D), static_cast<int>(N), L, static_cast<int>(B),
              false);
  }
  if (N == 0) return;
  const auto ema_hidden_coef = &ema_hidden_coef_kernel;
  MK_LAUNCH(ema_hidden_coef, finish_grid(D * N), kFinishThreads, 0, stream, dh, p, log_q, hx, v, w, dp, dlog_q, dhx,
            static_cast<int>(B), static_cast<int>(D), static_cast<int>(N), L, need_p, need_lq);
}

}  // namespace mk
