// Fused bottom-right causal mask + DropKey + softmax over rows of a score tensor, and its backward.
//
// Scores are (Bf, Hf, L, S) contiguous, one row = S logits of query i. Row i sees keys
// j < hi(i) = min(S, i + S - L + 1) when causal (bottom-right alignment, a KV cache of S - L keys),
// and among those the ones the DropKey rule keeps, with (b, h, i, j) = (flat batch, head, row,
// column), or b = batch_index[flat batch] when batch_index is given (packed document rows), and i, j
// shifted by index_offset[flat batch] when that is given (chunks run as batch rows). A row with no visible kept key is all 0; keys
// >= hi are written as 0 and never read. Arithmetic in acc_t<T> (fp32 for float/bf16 scores, fp64
// with exp in double for double scores), one rounding on store; the DropKey decisions are 32-bit
// integer arithmetic and so identical for every T.
//
// One block per row (grid-stride over rows), blockDim.x = NT threads, thread t owning columns
// t, t + NT, t + 2 NT, ...; the first ITEMS of them stay in registers between the two passes,
// columns beyond ITEMS * NT are read again from global memory, so S has no limit (NT <= 512).
#pragma once

#include "common.cuh"

namespace mk {

constexpr int kSoftmaxItems = 8;
constexpr int kSoftmaxMaxThreads = 512;  // more threads per row would cap ptxas at 32 registers (spills)

// exp in the accumulation type (expf(-inf) = exp(-inf) = 0 covers the empty cases below).
__device__ __forceinline__ float acc_exp(float v) { return expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }

// (max, sum of exp(v - max)) pair of an online softmax; max = -inf means empty.
template <class A>
struct MaxSum {
  A m, l;
};
template <class A>
__device__ __forceinline__ MaxSum<A> ms_add(MaxSum<A> a, A v) {
  if (v == -INFINITY) return a;
  if (v > a.m) return {v, a.l * acc_exp(a.m - v) + A(1)};  // exp(-inf) = 0 covers the empty case
  return {a.m, a.l + acc_exp(v - a.m)};
}
template <class A>
__device__ __forceinline__ MaxSum<A> ms_merge(MaxSum<A> a, MaxSum<A> b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const A m = a.m > b.m ? a.m : b.m;
  return {m, a.l * acc_exp(a.m - m) + b.l * acc_exp(b.m - m)};
}
// The pair through a butterfly shuffle: one float2 exchange in fp32, two 64-bit shuffles in fp64.
__device__ __forceinline__ MaxSum<float> ms_shfl_xor(MaxSum<float> a, int o) {
  const float2 v = shfl_xor2(make_float2(a.m, a.l), o);
  return {v.x, v.y};
}
__device__ __forceinline__ MaxSum<double> ms_shfl_xor(MaxSum<double> a, int o) {
  return {__shfl_xor_sync(kFullMask, a.m, o), __shfl_xor_sync(kFullMask, a.l, o)};
}

template <class T, int ITEMS>
__global__ void __launch_bounds__(kSoftmaxMaxThreads) dropkey_softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                   std::int64_t rows, int Hf, int L, int S,
                                                                   bool causal, std::uint32_t key, std::uint32_t thr,
                                                                   const std::int64_t* __restrict__ batch_index,
                                                                   const std::int64_t* __restrict__ index_offset) {
  using A = acc_t<T>;
  MK_STATIC_SMEM(MaxSum<A>, s_part, 32);
  const int NT = blockDim.x;
  const int tid = threadIdx.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int i = static_cast<int>(row % L);
    const std::int64_t bh = row / L;
    const std::uint32_t h = static_cast<std::uint32_t>(bh % Hf);
    const std::uint32_t b = static_cast<std::uint32_t>(batch_index ? batch_index[bh / Hf] : bh / Hf);
    // DropKey's (i, j) of this row within the call: the row's own plus its flat batch's offset (a chunk
    // of a block-diagonal attention run as a batch row keeps the mask of its place in the sequence)
    const std::uint32_t off = index_offset ? static_cast<std::uint32_t>(index_offset[bh / Hf]) : 0u;
    const int hi = causal ? imax(0, imin(S, i + S - L + 1)) : S;
    const std::uint32_t rkey = thr ? dropkey::row_key(key, b, h, static_cast<std::uint32_t>(i) + off) : 0u;
    const T* xr = x + row * S;
    T* yr = y + row * S;

    // pass 1: masked logits, per-thread online (max, sum)
    A v[ITEMS];
    MaxSum<A> acc{-INFINITY, A(0)};
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      v[k] = -INFINITY;
      if (j < hi && (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j) + off, thr))) v[k] = to_acc(xr[j]);
      acc = ms_add(acc, v[k]);
    }
    for (int j = tid + ITEMS * NT; j < hi; j += NT)
      if (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j) + off, thr)) acc = ms_add(acc, to_acc(xr[j]));

    // block merge: warp butterflies, then every thread folds the warp partials in the same order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = ms_merge(acc, ms_shfl_xor(acc, o));
    if ((tid & 31) == 0) s_part[tid >> 5] = acc;
    __syncthreads();
    MaxSum<A> tot{-INFINITY, A(0)};
    for (int w = 0; w < (NT >> 5); ++w) tot = ms_merge(tot, s_part[w]);
    __syncthreads();  // s_part is rewritten by the next row

    // pass 2: probabilities (an empty row has tot.m = -inf and gives 0 everywhere)
    const bool empty = tot.m == -INFINITY;
    const A inv = empty ? A(0) : A(1) / tot.l;
    const A m = empty ? A(0) : tot.m;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      if (j < S) yr[j] = from_acc<T>(j < hi ? acc_exp(v[k] - m) * inv : A(0));
    }
    for (int j = tid + ITEMS * NT; j < S; j += NT) {
      A p = A(0);
      if (j < hi && (thr == 0 || dropkey::keep(rkey, static_cast<std::uint32_t>(j) + off, thr)))
        p = acc_exp(to_acc(xr[j]) - m) * inv;
      yr[j] = from_acc<T>(p);
    }
  }
}

// dx = y (dy - sum_j y dy); dropped/masked entries have y = 0, so no mask replay; keys >= hi are 0.
template <class T, int ITEMS>
__global__ void __launch_bounds__(kSoftmaxMaxThreads) dropkey_softmax_bwd_kernel(const T* __restrict__ y, const T* __restrict__ dy,
                                                                   T* __restrict__ dx, std::int64_t rows, int L, int S,
                                                                   bool causal) {
  using A = acc_t<T>;
  MK_STATIC_SMEM(A, s_part, 32);
  const int NT = blockDim.x;
  const int tid = threadIdx.x;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int i = static_cast<int>(row % L);
    const int hi = causal ? imax(0, imin(S, i + S - L + 1)) : S;
    const T* yr = y + row * S;
    const T* gr = dy + row * S;
    T* dr = dx + row * S;
    A py[ITEMS], pg[ITEMS];
    A dot = A(0);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      py[k] = A(0);
      pg[k] = A(0);
      if (j < hi) {
        py[k] = to_acc(yr[j]);
        pg[k] = to_acc(gr[j]);
      }
      dot += py[k] * pg[k];
    }
    for (int j = tid + ITEMS * NT; j < hi; j += NT) dot += to_acc(yr[j]) * to_acc(gr[j]);
    dot = block_sum(dot, s_part);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int j = tid + k * NT;
      if (j < S) dr[j] = from_acc<T>(j < hi ? py[k] * (pg[k] - dot) : A(0));
    }
    for (int j = tid + ITEMS * NT; j < S; j += NT)
      dr[j] = from_acc<T>(j < hi ? to_acc(yr[j]) * (to_acc(gr[j]) - dot) : A(0));
  }
}

}  // namespace mk
