// Fused bottom-right causal mask + DropKey + softmax over rows of a score tensor, and its backward.
//
// Scores are (Bf, Hf, L, S) contiguous, one row = S logits of query i. Row i sees keys
// j < hi(i) = min(S, i + S - L + 1) when causal (bottom-right alignment, a KV cache of S - L keys),
// and among those the ones the DropKey rule keeps. A row with no visible kept key is all 0; keys
// >= hi are written as 0 and never read. fp32 arithmetic, one rounding on store.
//
// One block per row (grid-stride over rows), blockDim.x = NT threads, thread t owning columns
// t, t + NT, t + 2 NT, ...; the first ITEMS of them stay in registers between the two passes,
// columns beyond ITEMS * NT are read again from global memory, so S has no limit (NT <= 512).
#pragma once

#include "common.cuh"

namespace mk {

constexpr int kSoftmaxItems = 8;
constexpr int kSoftmaxMaxThreads = 512;  // more threads per row would cap ptxas at 32 registers (spills)

// (max, sum of exp(v - max)) pair of an online softmax; max = -inf means empty.
struct MaxSum {
  float m, l;
};
__device__ __forceinline__ MaxSum ms_add(MaxSum a, float v) {
  if (v == -INFINITY) return a;
  if (v > a.m) return {v, a.l * expf(a.m - v) + 1.0f};  // expf(-inf) = 0 covers the empty case
  return {a.m, a.l + expf(v - a.m)};
}
__device__ __forceinline__ MaxSum ms_merge(MaxSum a, MaxSum b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const float m = fmaxf(a.m, b.m);
  return {m, a.l * expf(a.m - m) + b.l * expf(b.m - m)};
}

template <class T, int ITEMS>
__global__ void __launch_bounds__(kSoftmaxMaxThreads) dropkey_softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                   std::int64_t rows, int Hf, int L, int S,
                                                                   bool causal, std::uint32_t key, std::uint32_t thr) {
  MK_STATIC_SMEM(float2, s_part, 32);
  const int NT = blockDim.x;
  const int tid = threadIdx.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int i = static_cast<int>(row % L);
    const std::int64_t bh = row / L;
    const std::uint32_t h = static_cast<std::uint32_t>(bh % Hf);
    const std::uint32_t b = static_cast<std::uint32_t>(bh / Hf);
    const int hi = causal ? imax(0, imin(S, i + S - L + 1)) : S;
    const std::uint32_t rkey = thr ? dropkey::row_key(key, b, h, static_cast<std::uint32_t>(i)) : 0u;
    const T* xr = x + row * S;
    T* yr = y + row * S;

    // pass 1: masked logits, per-thread online (max, sum)
    float v[ITEMS];
    MaxSum acc{-INFINITY, 0.0f};
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      v[k] = -INFINITY;
      if (j < hi && (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j), thr))) v[k] = to_f32(xr[j]);
      acc = ms_add(acc, v[k]);
    }
    for (int j = tid + ITEMS * NT; j < hi; j += NT)
      if (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j), thr)) acc = ms_add(acc, to_f32(xr[j]));

    // block merge: warp butterflies, then every thread folds the warp partials in the same order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float2 other = shfl_xor2(make_float2(acc.m, acc.l), o);
      acc = ms_merge(acc, MaxSum{other.x, other.y});
    }
    if ((tid & 31) == 0) s_part[tid >> 5] = make_float2(acc.m, acc.l);
    __syncthreads();
    MaxSum tot{-INFINITY, 0.0f};
    for (int w = 0; w < (NT >> 5); ++w) tot = ms_merge(tot, MaxSum{s_part[w].x, s_part[w].y});
    __syncthreads();  // s_part is rewritten by the next row

    // pass 2: probabilities (an empty row has tot.m = -inf and gives 0 everywhere)
    const bool empty = tot.m == -INFINITY;
    const float inv = empty ? 0.0f : 1.0f / tot.l;
    const float m = empty ? 0.0f : tot.m;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      if (j < S) yr[j] = from_f32<T>(j < hi ? expf(v[k] - m) * inv : 0.0f);
    }
    for (int j = tid + ITEMS * NT; j < S; j += NT) {
      float p = 0.0f;
      if (j < hi && (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j), thr)))
        p = expf(to_f32(xr[j]) - m) * inv;
      yr[j] = from_f32<T>(p);
    }
  }
}

// dx = y (dy - sum_j y dy); dropped/masked entries have y = 0, so no mask replay; keys >= hi are 0.
template <class T, int ITEMS>
__global__ void __launch_bounds__(kSoftmaxMaxThreads) dropkey_softmax_bwd_kernel(const T* __restrict__ y, const T* __restrict__ dy,
                                                                   T* __restrict__ dx, std::int64_t rows, int L, int S,
                                                                   bool causal) {
  MK_STATIC_SMEM(float, s_part, 32);
  const int NT = blockDim.x;
  const int tid = threadIdx.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int i = static_cast<int>(row % L);
    const int hi = causal ? imax(0, imin(S, i + S - L + 1)) : S;
    const T* yr = y + row * S;
    const T* gr = dy + row * S;
    T* dr = dx + row * S;
    float py[ITEMS], pg[ITEMS];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      py[k] = 0.0f;
      pg[k] = 0.0f;
      if (j < hi) {
        py[k] = to_f32(yr[j]);
        pg[k] = to_f32(gr[j]);
      }
      dot += py[k] * pg[k];
    }
    for (int j = tid + ITEMS * NT; j < hi; j += NT) dot += to_f32(yr[j]) * to_f32(gr[j]);
    dot = block_sum(dot, s_part);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      if (j < S) dr[j] = from_f32<T>(j < hi ? py[k] * (pg[k] - dot) : 0.0f);
    }
    for (int j = tid + ITEMS * NT; j < S; j += NT)
      dr[j] = from_f32<T>(j < hi ? to_f32(yr[j]) * (to_f32(gr[j]) - dot) : 0.0f);
  }
}

}  // namespace mk
