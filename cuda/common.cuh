// Shared device helpers: dtype conversion, warp/block reductions, the DropKey rule.
// Every kernel source includes this first; it brings in the real CUDA headers under nvcc and
// the SIMT emulator (emu/emu.cuh) under a host compiler.
#pragma once

#include "emu/emu.cuh"

namespace mk {

using bf16 = __nv_bfloat16;

// Accumulation type of an element type: fp32 for float and bf16 storage, fp64 for double
// (an fp64 input accumulated in fp32 would throw away what the caller asked fp64 for).
template <class T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <class T>
using acc_t = typename Acc<T>::type;

// Element <-> accumulation type: to_acc(x) widens once on load, from_acc<T>(a) rounds once on store.
__host__ __device__ __forceinline__ float to_acc(float v) { return v; }
__host__ __device__ __forceinline__ double to_acc(double v) { return v; }
__host__ __device__ __forceinline__ float to_acc(bf16 v) { return __bfloat162float(v); }
template <class T>
__host__ __device__ __forceinline__ T from_acc(acc_t<T> v);
template <>
__host__ __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__host__ __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <>
__host__ __device__ __forceinline__ bf16 from_acc<bf16>(float v) { return __float2bfloat16_rn(v); }

template <class T>
__host__ __device__ __forceinline__ float to_f32(T v);
template <>
__host__ __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__host__ __device__ __forceinline__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }

template <class T>
__host__ __device__ __forceinline__ T from_f32(float v);
template <>
__host__ __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__host__ __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

template <class T>
__host__ __device__ __forceinline__ T imin(T a, T b) { return a < b ? a : b; }
template <class T>
__host__ __device__ __forceinline__ T imax(T a, T b) { return a < b ? b : a; }

__host__ __device__ __forceinline__ int ilog2(unsigned int v) {  // floor(log2 v), v > 0
  int r = 0;
  while (v >>= 1) ++r;
  return r;
}

constexpr unsigned int kFullMask = 0xFFFFFFFFu;

// ------------------------------------------------------------------------------------------------
// The package's DropKey rule (ops/dropkey_rule.py), bit for bit, in 32-bit unsigned arithmetic.
// ------------------------------------------------------------------------------------------------
namespace dropkey {

__host__ __device__ __forceinline__ std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}


__host__ __device__ __forceinline__ std::uint32_t row_key(std::uint32_t key, std::uint32_t b, std::uint32_t h,
                                                          std::uint32_t i) {
  return mix32(mix32(mix32(key ^ b) ^ h) ^ i);
}
// keep <=> mix32(row ^ j) >= threshold (threshold 0 keeps everything)
__host__ __device__ __forceinline__ bool keep(std::uint32_t row, std::uint32_t j, std::uint32_t thr) {
  return mix32(row ^ j) >= thr;
}

}  // namespace dropkey

// ------------------------------------------------------------------------------------------------
// Reductions
// ------------------------------------------------------------------------------------------------
// A is float or double (the accumulation type; double shuffles are two 32-bit exchanges on the GPU).
template <class A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, y = z = 1). `scratch` holds 32 values of A in
// shared memory. Every thread gets the result. Contains two barriers, so all threads must call it.
template <class A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  A s = A(0);
  const int nwarps = blockDim.x >> 5;
  for (int w = 0; w < nwarps; ++w) s += scratch[w];  // same order in every thread: identical results
  __syncthreads();  // scratch may be reused right after
  return s;
}

// float2 through a warp shuffle: two 32-bit shuffles on the GPU, one exchange in the emulator.
__device__ __forceinline__ float2 shfl_xor2(float2 v, int lane_mask) {
#if MK_EMULATOR
  return __shfl_xor_sync(kFullMask, v, lane_mask);
#else
  return make_float2(__shfl_xor_sync(kFullMask, v.x, lane_mask), __shfl_xor_sync(kFullMask, v.y, lane_mask));
#endif
}

}  // namespace mk
