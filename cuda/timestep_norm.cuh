// TimestepNorm (spec 4, with the fixes of spec 8): causal cumulative group norm over time.
//
// Forward, per batch b and group g of Dg = D / G features, every unmasked step t is one Welford
// observation (its group mean gmu_t and population variance gvar_t), merged into the running
// state (n, mu, M2) that starts at the prior (prev_count, prev_mean, prev_count * prev_var):
//   1. tsn_moments_kernel   one warp per (b, t, g) row: gmu_t, gvar_t (two passes, fp32)
//   2. tsn_scan_fwd_kernel  one block per (b, g), thread c owns the time chunk c: a Kahan-
//      compensated Welford pass gives the chunk summary, a Blelloch exclusive scan over the chunk
//      summaries (Chan's merge, the prior at the root) gives every chunk its prefix state, and a
//      second Kahan-Welford pass from that prefix writes cummean_t and cumrstd_t = 1/sqrt(var_t + eps)
//   3. tsn_normalize_kernel y = (x - mu_t) * rstd_t * scale + bias, 0 on padded steps.
// Backward (spec 4.3): the reverse recursion of the carries (u, v) = (dL/dmu, dL/dvar) is affine,
//   (u, v)_before_t = M_t (u, v)_after_t,  M_t(u, v) = (c1 u + b_t v + beta_t, c1 v + alpha_t),
// so each chunk composes its steps' maps into one exact affine map (the chunk Jacobian plus an
// offset), the maps carry (dmean, dvar) across chunks, and a last pass per chunk writes dgmu_t and
// dgvar_t; then dx elementwise and deterministic dscale/dbias partial sums.
// Fixes of upstream's defects: padded steps hold the carried state in cummean/cumrstd (so
// cummean[t-1] is the mean entering t, spec 8.2); a padded step is an identity map, so no 0/0
// from empty leading chunks (8.4); no thread returns before a barrier (8.5); no +inf sentinel,
// genuine inf/NaN inputs propagate (8.6); the statistics are fp32 whatever the input dtype (8.7).
#pragma once

#include "common.cuh"

namespace mk {

constexpr int kTsnMaxChunks = 128;   // threads (time chunks) of the scan kernels
constexpr int kTsnRowThreads = 256;  // 8 warps = 8 rows per block in the row kernels
constexpr int kTsnSlots = 64;        // row slices of the dscale/dbias partial sums (8 x 8)

// Running Welford state with Kahan compensation of the mean and M2 sums.
struct KahanWelford {
  long long n;
  float mu, m2, c_mu, c_m2;
};
__device__ __forceinline__ void kahan_add(float& sum, float& comp, float v) {
  const float y = v - comp;
  const float t = sum + y;
  comp = (t - sum) - y;
  sum = t;
}
__device__ __forceinline__ void kw_observe(KahanWelford& s, float gmu, float gvar) {
  s.n += 1;
  const float delta = gmu - s.mu;
  // fast reciprocal (MUFU.RCP, ~1 ulp for these integer counts): IEEE division and __frcp_rn call
  // a slow-path subroutine whose calling convention made ptxas spill in the scan kernel
  kahan_add(s.mu, s.c_mu, delta * __fdividef(1.0f, static_cast<float>(s.n)));
  kahan_add(s.m2, s.c_m2, gvar + delta * (gmu - s.mu));  // gvar + delta^2 (n - 1) / n
}

// Chunk summary for the scan: (count, mean, M2) with Chan's associative merge; an empty side is
// the identity and is returned exactly (the prior with count 0 stays "mean = prev_mean").
struct Summary {
  long long n;
  float mu, m2;
};
__device__ __forceinline__ Summary chan_merge(Summary a, Summary b) {
  if (b.n == 0) return a;
  if (a.n == 0) return b;
  const long long n = a.n + b.n;
  const float fb = static_cast<float>(b.n) * __fdividef(1.0f, static_cast<float>(n));
  const float delta = b.mu - a.mu;
  return {n, a.mu + delta * fb, a.m2 + b.m2 + delta * delta * static_cast<float>(a.n) * fb};
}

// Work-efficient (Blelloch) exclusive scan over blockDim.x (a power of two) entries of shared
// memory with an associative, not necessarily commutative, op(earlier, later); `root` is the
// value entering entry 0. Called by every thread of the block (barriers inside).
template <class V, class Op>
__device__ __forceinline__ void blelloch_exclusive_scan(V* a, V root, Op op) {
  const int n = blockDim.x;
  const int tid = threadIdx.x;
  for (int d = 1; d < n; d <<= 1) {  // up-sweep: a[i] = sum of its subtree
    __syncthreads();
    const int i = (tid + 1) * 2 * d - 1;
    if (i < n) a[i] = op(a[i - d], a[i]);
  }
  __syncthreads();
  if (tid == 0) a[n - 1] = root;
  for (int d = n >> 1; d >= 1; d >>= 1) {  // down-sweep: left <- prefix, right <- prefix + left
    __syncthreads();
    const int i = (tid + 1) * 2 * d - 1;
    if (i < n) {
      const V left = a[i - d];
      a[i - d] = a[i];
      a[i] = op(a[i], left);
    }
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// stats[row] = (gmu, gvar) for row = (b * L + t) * G + g; padded steps get (0, 0) and are never read.
template <class T>
__global__ void __launch_bounds__(kTsnRowThreads) tsn_moments_kernel(const T* __restrict__ x, const bool* __restrict__ pad,
                                                                      float2* __restrict__ stats, std::int64_t rows,
                                                                      int G, int Dg) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += warps) {
    const std::int64_t bt = row / G;
    float gmu = 0.0f, gvar = 0.0f;
    if (!pad[bt]) {  // uniform over the warp
      const T* xr = x + row * Dg;
      float s = 0.0f;
      for (int j = lane; j < Dg; j += 32) s += to_f32(xr[j]);
      gmu = warp_sum(s) / static_cast<float>(Dg);
      float q = 0.0f;
      for (int j = lane; j < Dg; j += 32) {
        const float c = to_f32(xr[j]) - gmu;
        q += c * c;
      }
      gvar = warp_sum(q) / static_cast<float>(Dg);
    }
    if (lane == 0) stats[row] = make_float2(gmu, gvar);
  }
}

struct ChanOp {
  __device__ __forceinline__ Summary operator()(Summary a, Summary b) const { return chan_merge(a, b); }
};

// One block per (b, g): blockIdx.x = b * G + g; blockDim.x chunks (power of two <= kTsnMaxChunks).
__global__ void __launch_bounds__(kTsnMaxChunks) tsn_scan_fwd_kernel(
    const float2* __restrict__ stats, const bool* __restrict__ pad, const std::int64_t* __restrict__ prev_count,
    const float* __restrict__ prev_mean, const float* __restrict__ prev_var, float* __restrict__ cummean,
    float* __restrict__ cumrstd, std::int64_t* __restrict__ count, float* __restrict__ mean_out,
    float* __restrict__ var_out, int L, int G, int chunk, float eps) {
  MK_STATIC_SMEM(Summary, s_sum, kTsnMaxChunks);
  const int bg = blockIdx.x;
  const int b = bg / G;
  const int g = bg - b * G;
  const int c = threadIdx.x;
  const int t0 = imin(L, c * chunk);
  const int t1 = imin(L, t0 + chunk);
  const bool* pb = pad + static_cast<std::int64_t>(b) * L;
  auto at = [&](int t) { return (static_cast<std::int64_t>(b) * L + t) * G + g; };

  // 1. chunk summary
  KahanWelford s{0, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int t = t0; t < t1; ++t) {
    if (pb[t]) continue;
    const float2 st = stats[at(t)];
    kw_observe(s, st.x, st.y);
  }
  s_sum[c] = Summary{s.n, s.mu, s.m2};

  // 2. prefix of every chunk: prior (+) chunks before it
  const long long n0 = prev_count[b];
  const float pvar = prev_var[bg];
  const Summary prior{n0, prev_mean[bg], static_cast<float>(n0) * pvar};
  blelloch_exclusive_scan(s_sum, prior, ChanOp{});
  const Summary pre = s_sum[c];

  // 3. re-scan the chunk from its prefix; padded steps repeat the carried state
  KahanWelford r{pre.n, pre.mu, pre.m2, 0.0f, 0.0f};
  for (int t = t0; t < t1; ++t) {
    if (!pb[t]) {
      const float2 st = stats[at(t)];
      kw_observe(r, st.x, st.y);
    }
    const float var = r.n > 0 ? r.m2 * __fdividef(1.0f, static_cast<float>(r.n)) : pvar;
    cummean[at(t)] = r.mu;
    cumrstd[at(t)] = rsqrtf(var + eps);
  }
  if (c == static_cast<int>(blockDim.x) - 1) {  // the last chunk ends with the final state
    mean_out[bg] = r.mu;
    var_out[bg] = r.n > 0 ? r.m2 * __fdividef(1.0f, static_cast<float>(r.n)) : pvar;
    if (g == 0) count[b] = r.n;
  }
}

template <class T>
__global__ void __launch_bounds__(256) tsn_normalize_kernel(const T* __restrict__ x, const bool* __restrict__ pad,
                                                            const float* __restrict__ cummean,
                                                            const float* __restrict__ cumrstd,
                                                            const float* __restrict__ scale,
                                                            const float* __restrict__ bias, T* __restrict__ y,
                                                            std::int64_t total, int D, int Dg) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const int G = D / Dg;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const std::int64_t bt = e / D;
    const int i = static_cast<int>(e - bt * D);
    float out = 0.0f;
    if (!pad[bt]) {
      const std::int64_t sg = bt * G + i / Dg;
      out = (to_f32(x[e]) - cummean[sg]) * cumrstd[sg] * scale[i] + bias[i];
    }
    y[e] = from_f32<T>(out);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// grads[row] = (gmu, ds, db): ds = sum_i dy_i scale_i (x_i - mu_t), db = sum_i dy_i scale_i.
template <class T>
__global__ void __launch_bounds__(kTsnRowThreads) tsn_row_grads_kernel(
    const T* __restrict__ x, const T* __restrict__ dy, const bool* __restrict__ pad, const float* __restrict__ scale,
    const float* __restrict__ cummean, float* __restrict__ grads, std::int64_t rows, int G, int Dg) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += warps) {
    const std::int64_t bt = row / G;
    const int g = static_cast<int>(row - bt * G);
    float gmu = 0.0f, ds = 0.0f, db = 0.0f;
    if (!pad[bt]) {
      const T* xr = x + row * Dg;
      const T* gr = dy + row * Dg;
      const float* sc = scale + static_cast<std::int64_t>(g) * Dg;
      const float mu = cummean[row];
      float sx = 0.0f, sds = 0.0f, sdb = 0.0f;
      for (int j = lane; j < Dg; j += 32) {
        const float xv = to_f32(xr[j]);
        const float gs = to_f32(gr[j]) * sc[j];
        sx += xv;
        sds += gs * (xv - mu);
        sdb += gs;
      }
      gmu = warp_sum(sx) / static_cast<float>(Dg);
      ds = warp_sum(sds);
      db = warp_sum(sdb);
    }
    if (lane == 0) {
      grads[3 * row] = gmu;
      grads[3 * row + 1] = ds;
      grads[3 * row + 2] = db;
    }
  }
}

// Affine map (u, v) -> (A u + Bc v + ou, A v + ov) on the carries (dL/dmu, dL/dvar).
struct CarryMap {
  float A, Bc, ou, ov;
};

// One block per (b, g), blockDim.x chunks. Overwrites grads[row] (gmu, ds, db) with
// (gmu, dgmu, dgvar) on unmasked steps, writes dprev_mean and dprev_var.
__global__ void __launch_bounds__(kTsnMaxChunks) tsn_scan_bwd_kernel(
    float* __restrict__ grads, const bool* __restrict__ pad, const std::int64_t* __restrict__ prev_count,
    const float* __restrict__ prev_mean, const float* __restrict__ cummean, const float* __restrict__ cumrstd,
    const float* __restrict__ dmean, const float* __restrict__ dvar, float* __restrict__ dprev_mean,
    float* __restrict__ dprev_var, int L, int G, int chunk) {
  MK_STATIC_SMEM(long long, s_live, kTsnMaxChunks);
  MK_STATIC_SMEM(CarryMap, s_map, kTsnMaxChunks);
  MK_STATIC_SMEM(float2, s_carry, kTsnMaxChunks);  // carries (u, v) at the END of each chunk
  const int bg = blockIdx.x;
  const int b = bg / G;
  const int g = bg - b * G;
  const int c = threadIdx.x;
  const int nch = blockDim.x;
  const int t0 = imin(L, c * chunk);
  const int t1 = imin(L, t0 + chunk);
  const bool* pb = pad + static_cast<std::int64_t>(b) * L;
  auto at = [&](int t) { return (static_cast<std::int64_t>(b) * L + t) * G + g; };
  const float pmean = prev_mean[bg];
  auto mu_before = [&](int t) { return t == 0 ? pmean : cummean[at(t - 1)]; };

  // counts: live steps per chunk, exclusive prefix (+ prev_count) = count entering each chunk
  long long live = 0;
  for (int t = t0; t < t1; ++t) live += pb[t] ? 0 : 1;
  s_live[c] = live;
  blelloch_exclusive_scan(s_live, static_cast<long long>(prev_count[b]),
                          [](long long a, long long x) { return a + x; });
  const long long n_end = s_live[c] + live;  // count after the chunk's last step

  // step map coefficients at live step t with n = count after t
  auto step = [&](int t, long long n, float& c1, float& c2, float& bt, float& alpha, float& beta, float2& dg) {
    const float nf = static_cast<float>(n);
    c2 = 1.0f / nf;
    c1 = static_cast<float>(static_cast<double>(n - 1) / static_cast<double>(n));
    const std::int64_t row = at(t);
    const float gmu = grads[3 * row];
    const float ds = grads[3 * row + 1];
    const float db = grads[3 * row + 2];
    const float r = cumrstd[row];
    const float r3h = 0.5f * r * r * r;
    bt = -2.0f * c1 * c2 * (gmu - mu_before(t));
    alpha = -c1 * r3h * ds;
    beta = -c1 * r * db - bt * r3h * ds;
    dg = make_float2(r * db, r3h * ds);  // the direct terms subtracted from (u, v)
  };

  // 1. chunk map, composed backwards from the chunk's end (identity for an all-padded chunk)
  CarryMap F{1.0f, 0.0f, 0.0f, 0.0f};
  {
    long long n = n_end;
    for (int t = t1 - 1; t >= t0; --t) {
      if (pb[t]) continue;
      float c1, c2, bt, alpha, beta;
      float2 dg;
      step(t, n, c1, c2, bt, alpha, beta, dg);
      F = CarryMap{c1 * F.A, c1 * F.Bc + bt * F.A, c1 * F.ou + bt * F.ov + beta, c1 * F.ov + alpha};
      --n;
    }
  }
  s_map[c] = F;
  __syncthreads();

  // 2. carries across chunks, from the end of the sequence (nch <= 128 steps, one thread)
  if (c == 0) {
    float u = dmean[bg], v = dvar[bg];
    for (int k = nch - 1; k >= 0; --k) {
      s_carry[k] = make_float2(u, v);
      const CarryMap M = s_map[k];
      const float nu = M.A * u + M.Bc * v + M.ou;
      v = M.A * v + M.ov;
      u = nu;
    }
    dprev_mean[bg] = u;
    dprev_var[bg] = v;
  }
  __syncthreads();

  // 3. the chunk again from its true end carries: dgmu_t, dgvar_t
  float u = s_carry[c].x, v = s_carry[c].y;
  long long n = n_end;
  for (int t = t1 - 1; t >= t0; --t) {
    if (pb[t]) continue;
    float c1, c2, bt, alpha, beta;
    float2 dg;
    step(t, n, c1, c2, bt, alpha, beta, dg);
    const float du = u - dg.x;
    const float dv = v - dg.y;
    const std::int64_t row = at(t);
    const float gmu = grads[3 * row];
    grads[3 * row + 1] = c2 * du + 2.0f * c1 * c2 * dv * (gmu - mu_before(t));  // dgmu
    grads[3 * row + 2] = c2 * dv;                                               // dgvar
    u = c1 * du + bt * dv;
    v = c1 * dv;
    --n;
  }
}

template <class T>
__global__ void __launch_bounds__(256) tsn_dx_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                     const bool* __restrict__ pad, const float* __restrict__ cumrstd,
                                                     const float* __restrict__ grads, const float* __restrict__ scale,
                                                     T* __restrict__ dx, std::int64_t total, int D, int Dg) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const int G = D / Dg;
  const float inv_dg = 1.0f / static_cast<float>(Dg);
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const std::int64_t bt = e / D;
    const int i = static_cast<int>(e - bt * D);
    float out = 0.0f;
    if (!pad[bt]) {
      const std::int64_t row = bt * G + i / Dg;
      const float gmu = grads[3 * row], dgmu = grads[3 * row + 1], dgvar = grads[3 * row + 2];
      out = to_f32(dy[e]) * scale[i] * cumrstd[row] + dgmu * inv_dg + 2.0f * dgvar * (to_f32(x[e]) - gmu) * inv_dg;
    }
    dx[e] = from_f32<T>(out);
  }
}

// Partial sums over row slices: part[slot][i] for slot = blockIdx.y * blockDim.y + threadIdx.y
// (kTsnSlots slots), Kahan-compensated; tsn_param_reduce_kernel adds the slots in a fixed order.
template <class T>
__global__ void __launch_bounds__(256) tsn_param_partial_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                                const bool* __restrict__ pad,
                                                                const float* __restrict__ cummean,
                                                                const float* __restrict__ cumrstd,
                                                                float* __restrict__ part, std::int64_t BL, int D,
                                                                int Dg) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int slot = blockIdx.y * blockDim.y + threadIdx.y;
  const int slots = gridDim.y * blockDim.y;
  if (i >= D) return;  // no barrier in this kernel
  const int G = D / Dg;
  const int g = i / Dg;
  float ss = 0.0f, cs = 0.0f, sb = 0.0f, cb = 0.0f;
  for (std::int64_t bt = slot; bt < BL; bt += slots) {
    if (pad[bt]) continue;
    const std::int64_t e = bt * D + i;
    const std::int64_t row = bt * G + g;
    const float d = to_f32(dy[e]);
    kahan_add(ss, cs, d * (to_f32(x[e]) - cummean[row]) * cumrstd[row]);
    kahan_add(sb, cb, d);
  }
  part[static_cast<std::int64_t>(slot) * D + i] = ss;
  part[static_cast<std::int64_t>(slots + slot) * D + i] = sb;
}

__global__ void __launch_bounds__(256) tsn_param_reduce_kernel(const float* __restrict__ part, float* __restrict__ dscale,
                                                               float* __restrict__ dbias, int D, int slots) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < D; i += gridDim.x * blockDim.x) {
    float ss = 0.0f, cs = 0.0f, sb = 0.0f, cb = 0.0f;
    for (int k = 0; k < slots; ++k) {
      kahan_add(ss, cs, part[static_cast<std::int64_t>(k) * D + i]);
      kahan_add(sb, cb, part[static_cast<std::int64_t>(slots + k) * D + i]);
    }
    dscale[i] = ss;
    dbias[i] = sb;
  }
}

}  // namespace mk
