// Emulator controls and toy kernels that pin down the emulator's semantics in the tests:
// barriers, shuffles (every variant and width), votes, static and dynamic shared memory,
// multi-dimensional blocks, atomics over OS threads, bf16 rounding, and deliberately broken
// kernels (missing barrier, divergent shuffles, barrier after early return) that the emulator
// must catch. Compiled into the emulator extension only.
#include <cstring>
#include <stdexcept>

#include "../common.cuh"
#include "emu_api.h"

namespace mk::emu_api {

void set_reverse(int reverse) { mk_emu::set_reverse(reverse); }
void set_threads(int threads) { mk_emu::set_threads(threads); }
void set_smem_limit(std::int64_t bytes) { mk_emu::set_smem_limit(static_cast<long>(bytes)); }
unsigned long long switches() { return mk_emu::switch_count(); }
std::vector<std::string> launched_kernels() { return mk_emu::launched_kernels(); }

namespace {

// out[i] = in[n-1-i] within one block through shared memory, with the barrier.
__global__ void reverse_block(const float* in, float* out, int n) {
  __shared__ float buf[1024];
  const int t = threadIdx.x;
  if (t < n) buf[t] = in[t];
  __syncthreads();
  if (t < n) out[t] = buf[n - 1 - t];
}

// The same without the barrier: a race that only a particular fiber order hides.
__global__ void reverse_block_racy(const float* in, float* out, int n) {
  __shared__ float buf[1024];
  const int t = threadIdx.x;
  if (t < n) buf[t] = in[t];
  if (t < n) out[t] = buf[n - 1 - t];
}

// The same race with MK_STATIC_SMEM: poisoned per block, so stale values cannot hide it.
__global__ void reverse_block_racy_poisoned(const float* in, float* out, int n) {
  MK_STATIC_SMEM(float, buf, 1024);
  const int t = threadIdx.x;
  if (t < n) buf[t] = in[t];
  if (t < n) out[t] = buf[n - 1 - t];
}

// Every shuffle variant: out[9 * t + k] for k = 0..8.
__global__ void shuffles(const float* in, float* out, int n) {
  const int t = threadIdx.x + blockIdx.x * blockDim.x;
  const float v = t < n ? in[t] : 0.0f;
  const int lane = threadIdx.x & 31;
  float* o = out + 9 * t;
  o[0] = __shfl_sync(kFullMask, v, 31 - lane);
  o[1] = __shfl_sync(kFullMask, v, lane + 3, 8);
  o[2] = __shfl_up_sync(kFullMask, v, 3);
  o[3] = __shfl_up_sync(kFullMask, v, 2, 16);
  o[4] = __shfl_down_sync(kFullMask, v, 5);
  o[5] = __shfl_down_sync(kFullMask, v, 1, 4);
  o[6] = __shfl_xor_sync(kFullMask, v, 13);
  o[7] = __shfl_xor_sync(kFullMask, v, 6, 4);
  const unsigned int b = __ballot_sync(kFullMask, v > 0.0f);
  __syncwarp();
  o[8] = static_cast<float>(__popc(b)) + (__any_sync(kFullMask, v > 100.0f) ? 1000.0f : 0.0f) +
         (__all_sync(kFullMask, v > -100.0f) ? 10000.0f : 0.0f);
}

// double and 64-bit integer shuffles, half-warp masks (two disjoint groups at the same time).
__global__ void shuffles_wide(const float* in, float* out, int n) {
  const int t = threadIdx.x;
  const int lane = t & 31;
  const double d = static_cast<double>(in[t]) * 3.0;
  const long long q = static_cast<long long>(in[t]) + (1ll << 40);
  const double rd = __shfl_xor_sync(kFullMask, d, 1);
  const long long rq = __shfl_down_sync(kFullMask, q, 2);
  const unsigned int half = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
  const float rh = __shfl_xor_sync(half, in[t], 8);
  out[3 * t] = static_cast<float>(rd);
  out[3 * t + 1] = static_cast<float>(rq - (1ll << 40));
  out[3 * t + 2] = rh;
}

// 2-D blocks: linear thread id = x + y * bdx, lanes follow the linear id.
__global__ void block2d(const float* in, float* out, int n) {
  const int lin = threadIdx.x + threadIdx.y * blockDim.x;
  const int g = lin + blockIdx.x * blockDim.x * blockDim.y;
  const float v = __shfl_xor_sync(kFullMask, in[g], 1);
  out[g] = v + 1000.0f * threadIdx.y;
}

// Dynamic shared memory: block sum through a buffer of blockDim floats.
__global__ void dynamic_sum(const float* in, float* out, int n) {
  MK_DYNAMIC_SMEM(float, buf);
  const int t = threadIdx.x;
  buf[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) buf[t] += buf[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

__global__ void atomic_sum(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) atomicAdd(out, in[i]);
}

__global__ void to_bf16_bits(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const bf16 b = from_f32<bf16>(in[i]);
    out[i] = to_f32(b);
  }
}

__global__ void block_sum_kernel(const float* in, float* out, int n) {
  MK_STATIC_SMEM(float, scratch, 32);
  const float s = block_sum(static_cast<int>(threadIdx.x) < n ? in[threadIdx.x] : 0.0f, scratch);
  out[threadIdx.x] = s;
}

// Broken on purpose ------------------------------------------------------------------------------
// Lanes 0-15 shuffle with the full mask while lanes 16-31 go to __syncthreads: deadlock.
__global__ void divergent_shuffle_deadlock(const float* in, float* out, int n) {
  float v = in[threadIdx.x];
  if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(kFullMask, v, 1);
  __syncthreads();
  out[threadIdx.x] = v;
}
// Two halves of a warp in two different full-mask shuffles.
__global__ void divergent_shuffle_sites(const float* in, float* out, int n) {
  float v = in[threadIdx.x];
  if ((threadIdx.x & 31) < 16)
    v = __shfl_xor_sync(kFullMask, v, 1);
  else
    v = __shfl_xor_sync(kFullMask, v, 2);
  out[threadIdx.x] = v;
}
// Threads past n return, the rest meet a barrier (upstream Megalodon's TimestepNorm kernels do
// this when the feature or group count is not a multiple of 32: undefined behaviour in CUDA).
__global__ void barrier_after_return(const float* in, float* out, int n) {
  if (static_cast<int>(threadIdx.x) >= n) return;
  __shared__ float buf[1024];
  buf[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = buf[n - 1 - threadIdx.x];
}
// __syncthreads inside a branch taken by some threads only.
__global__ void divergent_barrier(const float* in, float* out, int n) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = in[threadIdx.x];
}
__global__ void partial_warp_shuffle(const float* in, float* out, int n) {
  out[threadIdx.x] = __shfl_xor_sync(kFullMask, in[threadIdx.x], 1);
}
__global__ void trap_kernel(const float* in, float* out, int n) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = in[threadIdx.x];
}

}  // namespace

void selftest(const std::string& name, void* in_, void* out_, std::int64_t n64, int grid, int block, std::int64_t smem) {
  const float* in = static_cast<const float*>(in_);
  float* out = static_cast<float*>(out_);
  const int n = static_cast<int>(n64);
  const std::size_t sm = static_cast<std::size_t>(smem);
  if (name == "reverse_block") {
    MK_LAUNCH(reverse_block, grid, block, sm, nullptr, in, out, n);
  } else if (name == "reverse_block_racy") {
    MK_LAUNCH(reverse_block_racy, grid, block, sm, nullptr, in, out, n);
  } else if (name == "reverse_block_racy_poisoned") {
    MK_LAUNCH(reverse_block_racy_poisoned, grid, block, sm, nullptr, in, out, n);
  } else if (name == "shuffles") {
    MK_LAUNCH(shuffles, grid, block, sm, nullptr, in, out, n);
  } else if (name == "shuffles_wide") {
    MK_LAUNCH(shuffles_wide, grid, block, sm, nullptr, in, out, n);
  } else if (name == "block2d") {
    MK_LAUNCH(block2d, grid, dim3(block / 4, 4), sm, nullptr, in, out, n);
  } else if (name == "dynamic_sum") {
    MK_LAUNCH(dynamic_sum, grid, block, sm, nullptr, in, out, n);
  } else if (name == "dynamic_sum_optin") {
    MK_SET_MAX_DYNAMIC_SMEM(dynamic_sum, sm);
    MK_LAUNCH(dynamic_sum, grid, block, sm, nullptr, in, out, n);
    MK_SET_MAX_DYNAMIC_SMEM(dynamic_sum, 48 * 1024);
  } else if (name == "atomic_sum") {
    MK_LAUNCH(atomic_sum, grid, block, sm, nullptr, in, out, n);
  } else if (name == "to_bf16") {
    MK_LAUNCH(to_bf16_bits, grid, block, sm, nullptr, in, out, n);
  } else if (name == "block_sum") {
    MK_LAUNCH(block_sum_kernel, grid, block, sm, nullptr, in, out, n);
  } else if (name == "divergent_shuffle_deadlock") {
    MK_LAUNCH(divergent_shuffle_deadlock, grid, block, sm, nullptr, in, out, n);
  } else if (name == "divergent_shuffle_sites") {
    MK_LAUNCH(divergent_shuffle_sites, grid, block, sm, nullptr, in, out, n);
  } else if (name == "barrier_after_return") {
    MK_LAUNCH(barrier_after_return, grid, block, sm, nullptr, in, out, n);
  } else if (name == "divergent_barrier") {
    MK_LAUNCH(divergent_barrier, grid, block, sm, nullptr, in, out, n);
  } else if (name == "partial_warp_shuffle") {
    MK_LAUNCH(partial_warp_shuffle, grid, block, sm, nullptr, in, out, n);
  } else if (name == "trap") {
    MK_LAUNCH(trap_kernel, grid, block, sm, nullptr, in, out, n);
  } else {
    throw std::invalid_argument("unknown selftest kernel " + name);
  }
}

}  // namespace mk::emu_api
