// timestep_norm fwd/bwd for float, bf16 and double x. Statistics, scale, bias, state and workspace
// are acc_t<T> arrays: fp32 for float/bf16 x, fp64 for double x (cuda/kernels.py allocates them
// in the accumulation dtype; the launchers take them untyped and cast once here).
#include "launchers.h"
#include "timestep_norm.cuh"

namespace mk {

namespace {
struct TsnShape {
  std::int64_t rows, total;
  int Dg, chunks, chunk;
};
TsnShape tsn_shape(std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G) {
  require(B >= 0 && L >= 0 && D >= 1 && G >= 1 && D % G == 0, "timestep_norm: need D >= 1 and G dividing D");
  require(L < (1ll << 31) && D < (1ll << 31) && B * G < (1ll << 31), "timestep_norm: sizes must be < 2^31");
  TsnShape s;
  s.rows = B * L * G;
  s.total = B * L * D;
  s.Dg = static_cast<int>(D / G);
  // chunks: a power of two in [32, 128], about 16 steps each for short sequences
  int ch = 32;
  while (ch < kTsnMaxChunks && static_cast<std::int64_t>(ch) * 16 < L) ch *= 2;
  s.chunks = ch;
  s.chunk = static_cast<int>((L + ch - 1) / ch);
  return s;
}
unsigned int row_grid(std::int64_t rows) { return grid_1d((rows + 7) / 8); }
unsigned int elem_grid(std::int64_t n) { return grid_1d((n + 255) / 256, 1 << 16); }
}  // namespace

// Elements of acc_t<T> (floats, or doubles for double x): 3 per row (fwd: the (gmu, gvar) pairs,
// bwd: (gmu, ds, db)) plus the dscale/dbias partial sums.
std::int64_t timestep_norm_workspace_floats(std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G) {
  return 3 * B * L * G + 2 * static_cast<std::int64_t>(kTsnSlots) * D;
}

void timestep_norm_fwd(int dtype, const void* x, const void* scale, const void* bias, const std::int64_t* prev_count,
                       const void* prev_mean, const void* prev_var, const bool* padding_mask, void* y,
                       std::int64_t* count, void* mean, void* var, void* cummean, void* cumrstd, void* workspace,
                       std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G, double eps, void* stream) {
  const TsnShape s = tsn_shape(B, L, D, G);
  require(eps > 0.0, "timestep_norm: eps must be > 0");
  if (B == 0) return;
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using A = acc_t<T>;
    auto acc = [](void* p) { return static_cast<A*>(p); };
    auto cacc = [](const void* p) { return static_cast<const A*>(p); };
    pair_t<A>* stats = static_cast<pair_t<A>*>(workspace);
    if (s.rows > 0) {
      const auto tsn_moments = &tsn_moments_kernel<T>;
      MK_LAUNCH(tsn_moments, row_grid(s.rows), kTsnRowThreads, 0, stream, static_cast<const T*>(x), padding_mask,
                stats, s.rows, static_cast<int>(G), s.Dg);
    }
    const auto tsn_scan_fwd = &tsn_scan_fwd_kernel<A>;
    MK_LAUNCH(tsn_scan_fwd, static_cast<unsigned int>(B * G), s.chunks, 0, stream,
              static_cast<const pair_t<A>*>(stats), padding_mask, prev_count, cacc(prev_mean), cacc(prev_var),
              acc(cummean), acc(cumrstd), count, acc(mean), acc(var), static_cast<int>(L), static_cast<int>(G),
              s.chunk, static_cast<A>(eps));
    if (s.total > 0) {
      const auto tsn_normalize = &tsn_normalize_kernel<T>;
      MK_LAUNCH(tsn_normalize, elem_grid(s.total), 256, 0, stream, static_cast<const T*>(x), padding_mask,
                static_cast<const A*>(acc(cummean)), static_cast<const A*>(acc(cumrstd)), cacc(scale), cacc(bias),
                static_cast<T*>(y), s.total, static_cast<int>(D), s.Dg);
    }
  });
}

void timestep_norm_bwd(int dtype, const void* dy, const void* dmean, const void* dvar, const void* x,
                       const void* scale, const std::int64_t* prev_count, const void* prev_mean,
                       const bool* padding_mask, const void* cummean, const void* cumrstd, void* dx, void* dscale,
                       void* dbias, void* dprev_mean, void* dprev_var, void* workspace, std::int64_t B,
                       std::int64_t L, std::int64_t D, std::int64_t G, void* stream) {
  const TsnShape s = tsn_shape(B, L, D, G);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using A = acc_t<T>;
    auto acc = [](void* p) { return static_cast<A*>(p); };
    auto cacc = [](const void* p) { return static_cast<const A*>(p); };
    A* grads = acc(workspace);
    A* part = grads + 3 * s.rows;
    const T* xt = static_cast<const T*>(x);
    const T* dyt = static_cast<const T*>(dy);
    if (B > 0) {
      if (s.rows > 0) {
        const auto tsn_row_grads = &tsn_row_grads_kernel<T>;
        MK_LAUNCH(tsn_row_grads, row_grid(s.rows), kTsnRowThreads, 0, stream, xt, dyt, padding_mask, cacc(scale),
                  cacc(cummean), grads, s.rows, static_cast<int>(G), s.Dg);
      }
      const auto tsn_scan_bwd = &tsn_scan_bwd_kernel<A>;
      MK_LAUNCH(tsn_scan_bwd, static_cast<unsigned int>(B * G), s.chunks, 0, stream, grads, padding_mask, prev_count,
                cacc(prev_mean), cacc(cummean), cacc(cumrstd), cacc(dmean), cacc(dvar), acc(dprev_mean),
                acc(dprev_var), static_cast<int>(L), static_cast<int>(G), s.chunk);
      if (s.total > 0) {
        const auto tsn_dx = &tsn_dx_kernel<T>;
        MK_LAUNCH(tsn_dx, elem_grid(s.total), 256, 0, stream, xt, dyt, padding_mask, cacc(cumrstd),
                  static_cast<const A*>(grads), cacc(scale), static_cast<T*>(dx), s.total, static_cast<int>(D), s.Dg);
      }
    }
    const auto tsn_param_partial = &tsn_param_partial_kernel<T>;
    MK_LAUNCH(tsn_param_partial, dim3(static_cast<unsigned int>((D + 31) / 32), kTsnSlots / 8), dim3(32, 8), 0, stream,
              xt, dyt, padding_mask, cacc(cummean), cacc(cumrstd), part, B * L, static_cast<int>(D), s.Dg);
    const auto tsn_param_reduce = &tsn_param_reduce_kernel<A>;
    MK_LAUNCH(tsn_param_reduce, elem_grid(D), 256, 0, stream, static_cast<const A*>(part), acc(dscale), acc(dbias),
              static_cast<int>(D), kTsnSlots);
  });
}

}  // namespace mk
