// TimestepNorm (docs/math.md, TimestepNorm, also for where and why it deviates from upstream):
// causal cumulative group norm over time.
//
// Forward, per state row s and group g of Dg = D / G features, every unmasked step t is one Welford
// observation (its group mean gmu_t and population variance gvar_t), merged into the running
// state (n, mu, M2) that starts at the prior (prev_count, prev_mean, prev_count * prev_var). A
// state row is a batch element b (steps b * L + [0, L)), or with packed rows (cu_seqlens, x of
// one batch element) a document d (steps [cu_seqlens[d], cu_seqlens[d + 1]), its own prior and
// returned state): only the scan kernels see the difference, the row kernels run over steps.
// Shift: every statistic is taken of x - K, K per (s, g) the lower median of the finite row
// means of the row's first kTsnShiftSteps unpadded steps (the torch backend takes the median over
// the whole row, Triton over its first chunk: K only changes rounding). Where K/2 <= x <= 2K,
// x - K is exact (Sterbenz) and the running mean is a small offset from K, so x - mu_t keeps the
// precision of the data's spread instead of its magnitude (an unshifted fp32 mean near 1e3 alone
// costs ~3e-5 absolute). cummean is relative to K; the returned mean adds K back. tsn_shift_kernel
// writes K per (s, g) and per step (the row kernels read it at their (step, g) row); the forward
// saves both for the backward (ops/timestep_norm/cuda_impl.py).
//   0. tsn_shift_kernel     one warp per (s, g): K, and K at each of the row's steps
//   1. tsn_moments_kernel   one warp per (step, g) row: gmu_t, gvar_t of x - K (two passes, fp32)
//   2. tsn_scan_fwd_kernel  one block per (s, g), thread c owns the time chunk c: a Kahan-
//      compensated Welford pass gives the chunk summary, a Blelloch exclusive scan over the chunk
//      summaries (Chan's merge, the prior at the root) gives every chunk its prefix state, and a
//      second Kahan-Welford pass from that prefix writes cummean_t and cumrstd_t = 1/sqrt(var_t + eps)
//   3. tsn_normalize_kernel y = (x - mu_t) * rstd_t * scale + bias, 0 on padded steps.
// Backward (docs/math.md, TimestepNorm): the reverse recursion of the carries (u, v) = (dL/dmu, dL/dvar) is affine,
//   (u, v)_before_t = M_t (u, v)_after_t,  M_t(u, v) = (c1 u + b_t v + beta_t, c1 v + alpha_t),
// c1 = (n_t - 1) / n_t. It runs in the torch backend's scaled form, U = u / n and V = v / n (n the
// count where the carry is taken), where every step only ADDS terms: V_(t-1) = V_t + b_t and
// U_(t-1) = U_t + a_t - q_t V_(t-1). Multiplying by c1 at every step instead compounded its
// roundings along a chunk of L / 128 steps (fp32 dx 6.6e-5 at L = 2^20). So each chunk composes its
// steps into (U, V) -> (U + Bc V + ou, V + ov) with Kahan-compensated sums, the maps carry
// (dmean, dvar) / n_end across chunks, and a last pass per chunk writes dgmu_t and dgvar_t; then
// dx elementwise and deterministic dscale/dbias partial sums.
// Where upstream's kernels go wrong and these do not: padded steps hold the carried state in
// cummean/cumrstd (so cummean[t-1] is the mean entering t); a padded step is an identity map, so
// no 0/0 from empty leading chunks; no thread returns before a barrier; no +inf sentinel, genuine
// inf/NaN inputs propagate; the statistics are fp32 whatever the input dtype, fp64 for double x:
// every kernel computes in A = acc_t<T> and the statistics, state, side inputs (scale, bias,
// prev stats) and workspace are arrays of A.
#pragma once

#include "common.cuh"

namespace mk {

constexpr int kTsnMaxChunks = 128;   // threads (time chunks) of the scan kernels
constexpr int kTsnRowThreads = 256;  // 8 warps = 8 rows per block in the row kernels
constexpr int kTsnSlots = 64;        // row slices of the dscale/dbias partial sums (8 x 8)
constexpr int kTsnShiftSteps = 32;   // unpadded steps whose row means choose the shift K (one per lane)

// 1 / n for a count n >= 1 and 1 / sqrt(v) for v = var + eps > 0, in the accumulation type.
// fp32: fast reciprocal (MUFU.RCP, ~1 ulp for these integer counts): IEEE division and __frcp_rn
// call a slow-path subroutine whose calling convention made ptxas spill in the scan kernel.
// fp64: the same holds for IEEE division, __drcp_rn and rsqrt(double) (8 bytes of spills in the
// scan kernel), so the hardware estimate (rcp/rsqrt.approx.ftz.f64 = MUFU.RCP64H / RSQ64H: only
// the high word, ~20 mantissa bits, is meaningful) is refined by Newton steps, each squaring the
// relative error: three steps reach rounding level even from a 2^-10 estimate (a few ulp). The
// emulator models the estimate as the correctly rounded value with its low word cleared.
__device__ __forceinline__ double f64_estimate_hi(double v) {
#if MK_EMULATOR
  std::uint64_t u;
  std::memcpy(&u, &v, 8);
  u &= 0xFFFFFFFF00000000ull;
  std::memcpy(&v, &u, 8);
#endif
  return v;
}
__device__ __forceinline__ float rcp_count(float n) { return __fdividef(1.0f, n); }
__device__ __forceinline__ double rcp_count(double n) {
#if MK_EMULATOR
  double r = f64_estimate_hi(1.0 / n);
#else
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(n));
#endif
  for (int k = 0; k < 3; ++k) r = fma(r, fma(-n, r, 1.0), r);  // r (2 - n r)
  return r;
}
__device__ __forceinline__ float acc_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double acc_rsqrt(double v) {
#if MK_EMULATOR
  double r = f64_estimate_hi(1.0 / std::sqrt(v));
#else
  double r;
  asm("rsqrt.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(v));
#endif
  for (int k = 0; k < 3; ++k) r = r * fma(-0.5 * v, r * r, 1.5);  // r (3 - v r^2) / 2
  // v = +inf (an infinite input's variance) has the estimate 0 and inf * 0 = NaN above; NaN stays NaN
  return v == INFINITY ? 0.0 : r;
}

// (a, b) pair of A stored as one 8- or 16-byte word (float2 / double2 loads).
template <class A>
struct Pair;
template <>
struct Pair<float> {
  using type = float2;
  static __device__ __forceinline__ float2 make(float a, float b) { return make_float2(a, b); }
};
template <>
struct Pair<double> {
  using type = double2;
  static __device__ __forceinline__ double2 make(double a, double b) { return make_double2(a, b); }
};
template <class A>
using pair_t = typename Pair<A>::type;

// Running Welford state with Kahan compensation of the mean and M2 sums.
template <class A>
struct KahanWelford {
  long long n;
  A mu, m2, c_mu, c_m2;
};
template <class A>
__device__ __forceinline__ void kahan_add(A& sum, A& comp, A v) {
  const A y = v - comp;
  const A t = sum + y;
  comp = (t - sum) - y;
  sum = t;
}
template <class A>
__device__ __forceinline__ void kw_observe(KahanWelford<A>& s, A gmu, A gvar) {
  if (s.n == 0) {  // the first observation is the state: (gmu - prev_mean) * rcp(1) would carry rcp's
    s.n = 1;       // error (up to 2 ulp for __fdividef) times an arbitrary distance into mu, and into M2
    s.mu = gmu;    // through delta * (gmu - mu); prev_mean of a count-0 prior must not matter
    s.m2 = gvar;
    s.c_mu = s.c_m2 = A(0);
    return;
  }
  s.n += 1;
  const A delta = gmu - s.mu;
  kahan_add(s.mu, s.c_mu, delta * rcp_count(static_cast<A>(s.n)));
  kahan_add(s.m2, s.c_m2, gvar + delta * (gmu - s.mu));  // gvar + delta^2 (n - 1) / n
}

// Chunk summary for the scan: (count, mean, M2) with Chan's associative merge; an empty side is
// the identity and is returned exactly (the prior with count 0 stays "mean = prev_mean").
template <class A>
struct Summary {
  long long n;
  A mu, m2;
};
template <class A>
__device__ __forceinline__ Summary<A> chan_merge(Summary<A> a, Summary<A> b) {
  if (b.n == 0) return a;
  if (a.n == 0) return b;
  const long long n = a.n + b.n;
  const A fb = static_cast<A>(b.n) * rcp_count(static_cast<A>(n));
  const A delta = b.mu - a.mu;
  return {n, a.mu + delta * fb, a.m2 + b.m2 + delta * delta * static_cast<A>(a.n) * fb};
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

// The steps of a scan block's state row s: [start, start + len) of the flattened step axis.
struct TsnSteps {
  std::int64_t start;
  int len;
};
__device__ __forceinline__ TsnSteps tsn_steps(const std::int64_t* __restrict__ cu_seqlens, int s, int L) {
  if (cu_seqlens == nullptr) return {static_cast<std::int64_t>(s) * L, L};
  const std::int64_t start = cu_seqlens[s];
  return {start, static_cast<int>(cu_seqlens[s + 1] - start)};
}

// Time chunks of a state row of len steps: the smallest power of two in [32, blockDim.x] giving
// chunks of at most about 16 steps. Chosen per row, not from the block size (which the launch
// takes from L, the longest a row can be): a short document then does the work of an unpacked
// call of its own length (short chunks, a scan and carry pass over 32 chunks), not one thread
// walking it serially, and gets that call's result bit for bit, since the chunks past its own
// are empty (the scan's identity) and leave every merge unchanged. Unpacked, len = L gives
// blockDim.x itself.
__device__ __forceinline__ int tsn_chunks(int len) {
  int n = 32;
  while (n < static_cast<int>(blockDim.x) && n * 16 < len) n <<= 1;
  return n;
}

// ------------------------------------------------------------------------------------------------
// Shift
// ------------------------------------------------------------------------------------------------

// One warp per state row and group sg = s * G + g (nG of them). K = the lower median of the
// finite raw row means of the row's first kTsnShiftSteps unpadded steps (0 when there is none),
// written to kshift[sg] and to kstep[(step, g)] for every step of the row. A median, not the
// first mean, so an outlier first step does not move K away from the bulk of the data.
template <class T>
__global__ void __launch_bounds__(kTsnRowThreads) tsn_shift_kernel(const T* __restrict__ x,
                                                                   const bool* __restrict__ pad,
                                                                   const std::int64_t* __restrict__ cu_seqlens,
                                                                   acc_t<T>* __restrict__ kshift,
                                                                   acc_t<T>* __restrict__ kstep, int nG, int L,
                                                                   int G, int Dg) {
  using A = acc_t<T>;
  MK_STATIC_SMEM(A, s_means, kTsnRowThreads);  // kTsnShiftSteps candidates per warp
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  A* means = s_means + warp * kTsnShiftSteps;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int sg = blockIdx.x * (blockDim.x >> 5) + warp; sg < nG; sg += warps) {  // uniform over the warp
    const int s = sg / G;
    const int g = sg - s * G;
    const TsnSteps steps = tsn_steps(cu_seqlens, s, L);
    // 1. the finite row means of the first unpadded steps, in step order, into means[0, got)
    int got = 0;
    for (int t0 = 0; t0 < steps.len && got < kTsnShiftSteps; t0 += 32) {
      const int t = t0 + lane;
      const bool live = t < steps.len && !pad[steps.start + t];
      A m = A(0);
      if (live) {
        const T* xr = x + ((steps.start + t) * G + g) * static_cast<std::int64_t>(Dg);
        for (int j = 0; j < Dg; ++j) m += to_acc(xr[j]);
        m /= static_cast<A>(Dg);
      }
      const bool ok = live && m - m == A(0);  // finite: inf - inf and NaN - NaN are NaN
      const unsigned int bal = __ballot_sync(kFullMask, ok);
      const int slot = got + __popc(bal & ((1u << lane) - 1u));
      if (ok && slot < kTsnShiftSteps) means[slot] = m;
      got = imin(kTsnShiftSteps, got + __popc(bal));
    }
    __syncwarp();
    // 2. the lower median: the candidate with (got - 1) / 2 others before it in (value, slot) order
    A pick = A(0);
    if (lane < got) {
      const A v = means[lane];
      int rank = 0;
      for (int k = 0; k < got; ++k) {
        const A w = means[k];
        rank += (w < v || (w == v && k < lane)) ? 1 : 0;
      }
      if (rank == (got - 1) / 2) pick = v;
    }
    const A K = warp_sum(pick);  // exactly one lane holds it (0 + v + 0 ... is exact); 0 if got = 0
    if (lane == 0) kshift[sg] = K;
    for (int t = lane; t < steps.len; t += 32) kstep[(steps.start + t) * G + g] = K;
    __syncwarp();  // means[] is rewritten for the warp's next row
  }
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// stats[row] = (gmu, gvar) of x - K for row = (b * L + t) * G + g; padded steps get (0, 0) and are
// never read.
template <class T>
__global__ void __launch_bounds__(kTsnRowThreads) tsn_moments_kernel(const T* __restrict__ x, const bool* __restrict__ pad,
                                                                      const acc_t<T>* __restrict__ kstep,
                                                                      pair_t<acc_t<T>>* __restrict__ stats,
                                                                      std::int64_t rows, int G, int Dg) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += warps) {
    const std::int64_t bt = row / G;
    A gmu = A(0), gvar = A(0);
    if (!pad[bt]) {  // uniform over the warp
      const T* xr = x + row * Dg;
      const A k = kstep[row];
      A s = A(0);
      for (int j = lane; j < Dg; j += 32) s += to_acc(xr[j]) - k;
      gmu = warp_sum(s) / static_cast<A>(Dg);
      A q = A(0);
      for (int j = lane; j < Dg; j += 32) {
        const A c = (to_acc(xr[j]) - k) - gmu;
        q += c * c;
      }
      gvar = warp_sum(q) / static_cast<A>(Dg);
    }
    if (lane == 0) stats[row] = Pair<A>::make(gmu, gvar);
  }
}

template <class A>
struct ChanOp {
  __device__ __forceinline__ Summary<A> operator()(Summary<A> a, Summary<A> b) const { return chan_merge(a, b); }
};

// One block per (s, g): blockIdx.x = s * G + g; blockDim.x threads (a power of two <=
// kTsnMaxChunks), the first tsn_chunks(len) of them own a chunk each. cu_seqlens: nullptr, or
// the (n + 1) document bounds (then s is the document d and the prior/state arrays are per
// document). stats and cummean are relative to kshift[sg]; the prior and the returned mean are not.
template <class A>
__global__ void __launch_bounds__(kTsnMaxChunks) tsn_scan_fwd_kernel(
    const pair_t<A>* __restrict__ stats, const bool* __restrict__ pad, const std::int64_t* __restrict__ cu_seqlens,
    const A* __restrict__ kshift,
    const std::int64_t* __restrict__ prev_count, const A* __restrict__ prev_mean, const A* __restrict__ prev_var,
    A* __restrict__ cummean, A* __restrict__ cumrstd, std::int64_t* __restrict__ count, A* __restrict__ mean_out,
    A* __restrict__ var_out, int L, int G, A eps) {
  MK_STATIC_SMEM(Summary<A>, s_sum, kTsnMaxChunks);
  const int sg = blockIdx.x;
  const int s = sg / G;
  const int g = sg - s * G;
  const int c = threadIdx.x;
  const TsnSteps steps = tsn_steps(cu_seqlens, s, L);
  const int nch = tsn_chunks(steps.len);
  const int chunk = static_cast<int>((static_cast<std::int64_t>(steps.len) + nch - 1) / nch);
  const int t0 = imin(steps.len, c * chunk);
  const int t1 = imin(steps.len, t0 + chunk);
  const bool* pb = pad + steps.start;
  auto at = [&](int t) { return (steps.start + t) * G + g; };

  // 1. chunk summary
  KahanWelford<A> w{0, A(0), A(0), A(0), A(0)};
  for (int t = t0; t < t1; ++t) {
    if (pb[t]) continue;
    const pair_t<A> st = stats[at(t)];
    kw_observe(w, st.x, st.y);
  }
  s_sum[c] = Summary<A>{w.n, w.mu, w.m2};

  // 2. prefix of every chunk: prior (+) chunks before it
  const long long n0 = prev_count[s];
  const A pvar = prev_var[sg];
  const Summary<A> prior{n0, prev_mean[sg] - kshift[sg], static_cast<A>(n0) * pvar};
  blelloch_exclusive_scan(s_sum, prior, ChanOp<A>{});
  const Summary<A> pre = s_sum[c];

  // 3. re-scan the chunk from its prefix; padded steps repeat the carried state
  KahanWelford<A> r{pre.n, pre.mu, pre.m2, A(0), A(0)};
  for (int t = t0; t < t1; ++t) {
    if (!pb[t]) {
      const pair_t<A> st = stats[at(t)];
      kw_observe(r, st.x, st.y);
    }
    const A var = r.n > 0 ? r.m2 * rcp_count(static_cast<A>(r.n)) : pvar;
    cummean[at(t)] = r.mu;
    cumrstd[at(t)] = acc_rsqrt(var + eps);
  }
  if (c == nch - 1) {  // the row's last chunk ends with the final state
    // K read again rather than held across the scan. A row with nothing observed has no live
    // step, so K = 0 and the prior mean comes back bit for bit (a select on that here made ptxas
    // spill in double)
    mean_out[sg] = r.mu + kshift[sg];
    var_out[sg] = r.n > 0 ? r.m2 * rcp_count(static_cast<A>(r.n)) : pvar;
    if (g == 0) count[s] = r.n;
  }
}

template <class T>
__global__ void __launch_bounds__(256) tsn_normalize_kernel(const T* __restrict__ x, const bool* __restrict__ pad,
                                                            const acc_t<T>* __restrict__ kstep,
                                                            const acc_t<T>* __restrict__ cummean,
                                                            const acc_t<T>* __restrict__ cumrstd,
                                                            const acc_t<T>* __restrict__ scale,
                                                            const acc_t<T>* __restrict__ bias, T* __restrict__ y,
                                                            std::int64_t total, int D, int Dg) {
  using A = acc_t<T>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const int G = D / Dg;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const std::int64_t bt = e / D;
    const int i = static_cast<int>(e - bt * D);
    A out = A(0);
    if (!pad[bt]) {
      const std::int64_t sg = bt * G + i / Dg;
      out = ((to_acc(x[e]) - kstep[sg]) - cummean[sg]) * cumrstd[sg] * scale[i] + bias[i];
    }
    y[e] = from_acc<T>(out);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// grads[row] = (gmu, ds, db): ds = sum_i dy_i scale_i (x_i - mu_t), db = sum_i dy_i scale_i; gmu
// and mu_t relative to K.
template <class T>
__global__ void __launch_bounds__(kTsnRowThreads) tsn_row_grads_kernel(
    const T* __restrict__ x, const T* __restrict__ dy, const bool* __restrict__ pad, const acc_t<T>* __restrict__ kstep,
    const acc_t<T>* __restrict__ scale, const acc_t<T>* __restrict__ cummean, acc_t<T>* __restrict__ grads,
    std::int64_t rows, int G, int Dg) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += warps) {
    const std::int64_t bt = row / G;
    const int g = static_cast<int>(row - bt * G);
    A gmu = A(0), ds = A(0), db = A(0);
    if (!pad[bt]) {
      const T* xr = x + row * Dg;
      const T* gr = dy + row * Dg;
      const A* sc = scale + static_cast<std::int64_t>(g) * Dg;
      const A mu = cummean[row];
      const A k = kstep[row];
      A sx = A(0), sds = A(0), sdb = A(0);
      for (int j = lane; j < Dg; j += 32) {
        const A xv = to_acc(xr[j]) - k;
        const A gs = to_acc(gr[j]) * sc[j];
        sx += xv;
        sds += gs * (xv - mu);
        sdb += gs;
      }
      gmu = warp_sum(sx) / static_cast<A>(Dg);
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

// The map (U, V) -> (U + Bc V + ou, V + ov) of a run of steps on the scaled carries, each sum with
// its Kahan compensation.
template <class A>
struct CarryMap {
  A Bc, ou, ov, c_Bc, c_ou, c_ov;
};

// One block per (s, g), the chunks of tsn_scan_fwd_kernel. Overwrites grads[row] (gmu, ds, db)
// with (gmu, dgmu, dgvar) on unmasked steps, writes dprev_mean and dprev_var (per document with
// cu_seqlens; a row with nothing observed passes (dmean, dvar) through). Scaled carries: at a live
// step t with n = the count after it, r = rstd_t, (gmu, ds, db) its row gradients and mu_b the mean
// entering it,
//   a_t = -r db / n,  b_t = -r^3 ds / (2 n),  q_t = 2 (gmu - mu_b) / n (0 at a first observation)
//   V_(t-1) = V_t + b_t,  U_(t-1) = U_t + a_t - q_t V_(t-1)
//   dgvar_t = V_(t-1),    dgmu_t = U_t + a_t + (n - 1) q_t V_(t-1)
// from (U, V) = (dmean, dvar) / n_end at the row's end; before the first step (u, v) = n0 (U, V).
template <class A>
__global__ void __launch_bounds__(kTsnMaxChunks) tsn_scan_bwd_kernel(
    A* __restrict__ grads, const bool* __restrict__ pad, const std::int64_t* __restrict__ cu_seqlens,
    const A* __restrict__ kshift, const std::int64_t* __restrict__ prev_count, const A* __restrict__ prev_mean,
    const A* __restrict__ cummean, const A* __restrict__ cumrstd, const A* __restrict__ dmean,
    const A* __restrict__ dvar, A* __restrict__ dprev_mean, A* __restrict__ dprev_var, int L, int G) {
  // 128 chunks: 1 KiB + 3 (fp32) or 6 KiB (fp64) + 1 or 2 KiB of static shared memory
  MK_STATIC_SMEM(long long, s_live, kTsnMaxChunks + 1);  // [kTsnMaxChunks]: the row's final count
  MK_STATIC_SMEM(CarryMap<A>, s_map, kTsnMaxChunks);
  MK_STATIC_SMEM(pair_t<A>, s_carry, kTsnMaxChunks);  // scaled carries (U, V) at the END of each chunk
  const int sg = blockIdx.x;
  const int s = sg / G;
  const int g = sg - s * G;
  const int c = threadIdx.x;
  const TsnSteps steps = tsn_steps(cu_seqlens, s, L);
  const int nch = tsn_chunks(steps.len);
  const int chunk = static_cast<int>((static_cast<std::int64_t>(steps.len) + nch - 1) / nch);
  const int t0 = imin(steps.len, c * chunk);
  const int t1 = imin(steps.len, t0 + chunk);
  const bool* pb = pad + steps.start;
  auto at = [&](int t) { return (steps.start + t) * G + g; };
  const A pmean = prev_mean[sg] - kshift[sg];  // in cummean's frame (relative to K)
  auto mu_before = [&](int t) { return t == 0 ? pmean : cummean[at(t - 1)]; };

  // counts: live steps per chunk, exclusive prefix (+ prev_count) = count entering each chunk
  long long live = 0;
  for (int t = t0; t < t1; ++t) live += pb[t] ? 0 : 1;
  s_live[c] = live;
  const long long n0 = prev_count[s];
  blelloch_exclusive_scan(s_live, n0, [](long long a, long long x) { return a + x; });
  const long long n_end = s_live[c] + live;  // count after the chunk's last step
  if (c == static_cast<int>(blockDim.x) - 1) s_live[kTsnMaxChunks] = n_end;  // past the row's chunks: the total

  // the terms of live step t with n = count after t: a_t, b_t, q_t and (n - 1) q_t
  auto step = [&](int t, long long n, A& a, A& b, A& q, A& cross) {
    const A inv_n = A(1) / static_cast<A>(n);
    const std::int64_t row = at(t);
    const A ds = grads[3 * row + 1];
    const A db = grads[3 * row + 2];
    const A r = cumrstd[row];
    a = -r * db * inv_n;
    b = A(-0.5) * r * r * r * ds * inv_n;
    // the prior mean enters only through an earlier observation: with n = 1 (nothing before)
    // an arbitrary prev_mean of a count-0 prior must not reach anything, not even as 0 * inf
    const A d = n > 1 ? A(2) * (grads[3 * row] - mu_before(t)) : A(0);
    q = d * inv_n;
    cross = d * static_cast<A>(static_cast<double>(n - 1) / static_cast<double>(n));
  };

  // 1. chunk map, composed backwards from the chunk's end (identity for an all-padded chunk)
  CarryMap<A> F{A(0), A(0), A(0), A(0), A(0), A(0)};
  {
    long long n = n_end;
    for (int t = t1 - 1; t >= t0; --t) {
      if (pb[t]) continue;
      A a, b, q, cross;
      step(t, n, a, b, q, cross);
      kahan_add(F.ov, F.c_ov, b);
      kahan_add(F.ou, F.c_ou, a - q * F.ov);
      kahan_add(F.Bc, F.c_Bc, -q);
      --n;
    }
  }
  s_map[c] = F;
  __syncthreads();

  // 2. carries across chunks, from the end of the row (nch <= 128 steps, one thread)
  if (c == 0) {
    const long long total = s_live[kTsnMaxChunks];
    if (total == n0) {  // nothing observed: mean and var ARE the prior's, gradients pass straight through
      dprev_mean[sg] = dmean[sg];
      dprev_var[sg] = dvar[sg];
    } else {
      const A inv_end = A(1) / static_cast<A>(total);
      A U = dmean[sg] * inv_end, V = dvar[sg] * inv_end, cU = A(0), cV = A(0);
      for (int k = nch - 1; k >= 0; --k) {
        s_carry[k] = Pair<A>::make(U, V);
        const CarryMap<A> M = s_map[k];
        kahan_add(U, cU, M.Bc * V + M.ou);
        kahan_add(V, cV, M.ov);
      }
      dprev_mean[sg] = static_cast<A>(n0) * U;  // 0 without a prior
      dprev_var[sg] = static_cast<A>(n0) * V;
    }
  }
  __syncthreads();

  // 3. the chunk again from its true end carries: dgmu_t, dgvar_t (the threads past the row's
  // chunks have no steps and no carries; nor does a row with nothing observed)
  if (c >= nch || s_live[kTsnMaxChunks] == n0) return;  // no barrier below
  A U = s_carry[c].x, V = s_carry[c].y, cU = A(0), cV = A(0);
  long long n = n_end;
  for (int t = t1 - 1; t >= t0; --t) {
    if (pb[t]) continue;
    A a, b, q, cross;
    step(t, n, a, b, q, cross);
    kahan_add(V, cV, b);  // V_(t-1)
    const std::int64_t row = at(t);
    grads[3 * row + 1] = U + a + cross * V;  // dgmu
    grads[3 * row + 2] = V;                  // dgvar
    kahan_add(U, cU, a - q * V);             // U_(t-1)
    --n;
  }
}

template <class T>
__global__ void __launch_bounds__(256) tsn_dx_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                     const bool* __restrict__ pad,
                                                     const acc_t<T>* __restrict__ kstep,
                                                     const acc_t<T>* __restrict__ cumrstd,
                                                     const acc_t<T>* __restrict__ grads,
                                                     const acc_t<T>* __restrict__ scale, T* __restrict__ dx,
                                                     std::int64_t total, int D, int Dg) {
  using A = acc_t<T>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const int G = D / Dg;
  const A inv_dg = A(1) / static_cast<A>(Dg);
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const std::int64_t bt = e / D;
    const int i = static_cast<int>(e - bt * D);
    A out = A(0);
    if (!pad[bt]) {
      const std::int64_t row = bt * G + i / Dg;
      const A gmu = grads[3 * row], dgmu = grads[3 * row + 1], dgvar = grads[3 * row + 2];
      out = to_acc(dy[e]) * scale[i] * cumrstd[row] + dgmu * inv_dg + A(2) * dgvar * ((to_acc(x[e]) - kstep[row]) - gmu) * inv_dg;
    }
    dx[e] = from_acc<T>(out);
  }
}

// Partial sums over row slices: part[slot][i] for slot = blockIdx.y * blockDim.y + threadIdx.y
// (kTsnSlots slots), Kahan-compensated; tsn_param_reduce_kernel adds the slots in a fixed order.
template <class T>
__global__ void __launch_bounds__(256) tsn_param_partial_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                                const bool* __restrict__ pad,
                                                                const acc_t<T>* __restrict__ kstep,
                                                                const acc_t<T>* __restrict__ cummean,
                                                                const acc_t<T>* __restrict__ cumrstd,
                                                                acc_t<T>* __restrict__ part, std::int64_t BL, int D,
                                                                int Dg) {
  using A = acc_t<T>;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int slot = blockIdx.y * blockDim.y + threadIdx.y;
  const int slots = gridDim.y * blockDim.y;
  if (i >= D) return;  // no barrier in this kernel
  const int G = D / Dg;
  const int g = i / Dg;
  A ss = A(0), cs = A(0), sb = A(0), cb = A(0);
  for (std::int64_t bt = slot; bt < BL; bt += slots) {
    if (pad[bt]) continue;
    const std::int64_t e = bt * D + i;
    const std::int64_t row = bt * G + g;
    const A d = to_acc(dy[e]);
    const A dr = d * cumrstd[row];  // (this order: no spills in fp32 on sm_80)
    kahan_add(ss, cs, dr * ((to_acc(x[e]) - kstep[row]) - cummean[row]));
    kahan_add(sb, cb, d);
  }
  part[static_cast<std::int64_t>(slot) * D + i] = ss;
  part[static_cast<std::int64_t>(slots + slot) * D + i] = sb;
}

template <class A>
__global__ void __launch_bounds__(256) tsn_param_reduce_kernel(const A* __restrict__ part, A* __restrict__ dscale,
                                                               A* __restrict__ dbias, int D, int slots) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < D; i += gridDim.x * blockDim.x) {
    A ss = A(0), cs = A(0), sb = A(0), cb = A(0);
    for (int k = 0; k < slots; ++k) {
      kahan_add(ss, cs, part[static_cast<std::int64_t>(k) * D + i]);
      kahan_add(sb, cb, part[static_cast<std::int64_t>(slots + k) * D + i]);
    }
    dscale[i] = ss;
    dbias[i] = sb;
  }
}

}  // namespace mk
