// SIMT emulation: the same kernel sources compile with nvcc (real CUDA) or with a host C++
// compiler, where this header supplies the CUDA built-ins and runs kernels on the CPU.
//
// Emulation model (host compiler, __CUDACC__ undefined):
//   * every CUDA thread of a block is a fiber with its own stack (64 KiB, guard page), switched
//     by a hand-written x86-64 register swap (ucontext's swapcontext makes a system call per
//     switch; it remains the fallback elsewhere or with -DMK_EMU_UCONTEXT); emu/runtime.cpp;
//   * one block at a time per OS thread (blocks may be spread over MK_EMU_THREADS OS threads),
//     so static __shared__ variables are `static thread_local` and dynamic shared memory is a
//     per-OS-thread buffer reached through MK_DYNAMIC_SMEM;
//   * a round-robin scheduler (direct fiber-to-fiber switches) resumes fibers that can make
//     progress; a fiber yields only at a __syncthreads or at a warp-synchronous call
//     (__shfl_*_sync, __syncwarp, votes) that has to wait for other lanes; a full pass in which
//     no fiber can run is a deadlock, reported with the kernel, the block and every wait site;
//   * shared memory (MK_DYNAMIC_SMEM, MK_STATIC_SMEM) is filled with 0xFF (NaN) per block;
//   * strict checks instead of undefined behaviour: divergent __syncthreads call sites, a
//     __syncthreads after some threads returned, warp-synchronous calls whose lanes disagree
//     on mask or call site, masks naming missing or exited lanes, bad launch configurations,
//     dynamic shared memory above 48 KiB without MK_SET_MAX_DYNAMIC_SMEM;
//   * the fiber order is reversible (MK_EMU_REVERSE=1 or mk_emu::set_reverse) so a missing
//     barrier shows up as a wrong result in one of the two orders.
//
// Kernels must use: __syncthreads(), the *_sync warp functions, MK_DYNAMIC_SMEM(type, name),
// MK_STATIC_SMEM(type, name, count) (or plain __shared__, which is not poisoned per block),
// MK_LAUNCH(kernel, grid, block, smem, stream, args...) and MK_SET_MAX_DYNAMIC_SMEM(kernel, bytes).
// `kernel` in the macros is a plain name (use a function-pointer variable for templates).
#pragma once

#define MK_DEFAULT_SMEM_OPTIN 166912  // A100 per-block limit; the emulator's launch check

#ifdef __CUDACC_RTC__
// ------------------------------------------------------------------------------------------------
// NVRTC (run-time compilation of the kernels alone, cuda/nvrtc.py): device code only, no host
// launchers and no C++ standard library; libcu++ (CCCL) stands in for the std headers used here.
// ------------------------------------------------------------------------------------------------
#include <cuda/std/cstddef>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
#include <cuda/std/type_traits>
#include <cuda/std/utility>
#include <cuda_bf16.h>

namespace std {
using namespace ::cuda::std;
}
#ifndef INFINITY
#define INFINITY (::cuda::std::numeric_limits<float>::infinity())
#endif

#define MK_EMULATOR 0
#define MK_NVRTC 1

#define MK_DYNAMIC_SMEM(type, name)                                  \
  extern __shared__ __align__(16) unsigned char mk_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(mk_dynamic_smem_)
#define MK_STATIC_SMEM(type, name, count) __shared__ type name[count]

#else
#define MK_NVRTC 0
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#endif

#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)
// ------------------------------------------------------------------------------------------------
// Real CUDA
// ------------------------------------------------------------------------------------------------
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define MK_EMULATOR 0

inline void mk_cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

#define MK_DYNAMIC_SMEM(type, name)                                  \
  extern __shared__ __align__(16) unsigned char mk_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(mk_dynamic_smem_)

// Static shared array `type name[count]`; in the emulator it is poisoned per block (plain
// `__shared__` also works there but keeps its values from block to block).
#define MK_STATIC_SMEM(type, name, count) __shared__ type name[count]

#define MK_LAUNCH(kernel, grid, block, smem, stream, ...)                                     \
  do {                                                                                       \
    kernel<<<(grid), (block), (smem), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__);   \
    ::mk_cuda_check(cudaGetLastError(), "launch of " #kernel);                              \
  } while (0)

#define MK_SET_MAX_DYNAMIC_SMEM(kernel, bytes)                                                      \
  ::mk_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes)), \
                  "cudaFuncSetAttribute(" #kernel ")")

#elif !defined(__CUDACC__)
// ------------------------------------------------------------------------------------------------
// Host emulation
// ------------------------------------------------------------------------------------------------
#include <atomic>
#include <cmath>
#include <type_traits>
#include <utility>

#define MK_EMULATOR 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static thread_local
#define __constant__ static const
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

// --- vector and index types -------------------------------------------------------------------
struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) double2 {
  double x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// --- bfloat16 ---------------------------------------------------------------------------------
struct __nv_bfloat16 {
  unsigned short __x;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    r.__x = static_cast<unsigned short>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
    r.__x = static_cast<unsigned short>(u >> 16);
  }
  return r;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  unsigned int u = static_cast<unsigned int>(b.__x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// --- math and bit intrinsics ------------------------------------------------------------------
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
// expf, logf, erfcf, exp, rsqrtf, sincospif, __expf, __fdividef, ...: the device math model
#include "device_math.h"
template <class T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// --- atomics (real atomics: blocks may run on several OS threads) ------------------------------
template <class T>
inline T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <class T>
inline T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
template <class T>
inline T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;
}
template <class T>
inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old > v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

namespace mk_emu {

// Implemented in emu/runtime.cpp (one copy per extension): the fiber scheduler and the
// synchronisation points. Kernels reach them through the macros at the end of this header.
enum class WarpOp : unsigned char { Sync, Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All };
void syncthreads(const char* file, int line);
std::uint64_t warp_call(WarpOp op, unsigned int mask, std::uint64_t value, int param, int width, const char* what,
                        const char* file, int line);
unsigned int activemask();
[[noreturn]] void trap(const char* file, int line);
unsigned char* dynamic_smem();
// Static shared memory of the running block for the declaration identified by `tag`: allocated
// on first use in each block and filled with 0xFF bytes (NaN), so a read before the block wrote
// it - a missing barrier - never sees the previous block's or launch's values.
void* static_smem(const void* tag, std::size_t bytes, std::size_t align);
void run_grid(const char* name, const void* kernel, dim3 grid, dim3 block, std::size_t smem, void (*body)(void*),
              void* ctx);
void set_max_dynamic_smem(const void* kernel, long bytes, const char* name);
// API flags (the Python binding exposes them): order of fibers, OS threads over blocks.
void set_reverse(int reverse);  // 1 reversed, 0 natural, -1 from MK_EMU_REVERSE
void set_threads(int threads);  // OS threads over blocks; -1 from MK_EMU_THREADS (default 1)
void set_smem_limit(long bytes);
unsigned long long switch_count();
}  // namespace mk_emu
#include <vector>
namespace mk_emu {
std::vector<std::string> launched_kernels();  // names given to MK_LAUNCH so far, first launch first

template <class T>
inline std::uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type wider than 64 bits");
  std::uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(std::uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}
template <class T>
inline T shfl(const char* file, int line, unsigned int mask, T v, int src, int width = 32) {
  return from_bits<T>(warp_call(WarpOp::Shfl, mask, to_bits(v), src, width, "__shfl_sync", file, line));
}
template <class T>
inline T shfl_up(const char* file, int line, unsigned int mask, T v, unsigned int d, int width = 32) {
  return from_bits<T>(warp_call(WarpOp::ShflUp, mask, to_bits(v), static_cast<int>(d), width, "__shfl_up_sync", file, line));
}
template <class T>
inline T shfl_down(const char* file, int line, unsigned int mask, T v, unsigned int d, int width = 32) {
  return from_bits<T>(warp_call(WarpOp::ShflDown, mask, to_bits(v), static_cast<int>(d), width, "__shfl_down_sync", file, line));
}
template <class T>
inline T shfl_xor(const char* file, int line, unsigned int mask, T v, int lm, int width = 32) {
  return from_bits<T>(warp_call(WarpOp::ShflXor, mask, to_bits(v), lm, width, "__shfl_xor_sync", file, line));
}
inline void syncwarp(const char* file, int line, unsigned int mask = 0xFFFFFFFFu) {
  warp_call(WarpOp::Sync, mask, 0, 0, 32, "__syncwarp", file, line);
}
inline unsigned int ballot(const char* file, int line, unsigned int mask, int pred) {
  return static_cast<unsigned int>(warp_call(WarpOp::Ballot, mask, 0, pred != 0, 32, "__ballot_sync", file, line));
}
inline int any(const char* file, int line, unsigned int mask, int pred) {
  return static_cast<int>(warp_call(WarpOp::Any, mask, 0, pred != 0, 32, "__any_sync", file, line));
}
inline int all(const char* file, int line, unsigned int mask, int pred) {
  return static_cast<int>(warp_call(WarpOp::All, mask, 0, pred != 0, 32, "__all_sync", file, line));
}

// kernel<<<grid, block, smem>>>(args...): the arguments are converted to the parameter types
// (as CUDA does) and copied once; every fiber of every block calls the kernel with them.
template <class... P, class... A>
inline void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  auto call = [kernel, ... params = static_cast<P>(std::forward<A>(args))]() { kernel(params...); };
  run_grid(name, reinterpret_cast<const void*>(kernel), grid, block, smem,
           [](void* c) { (*static_cast<decltype(call)*>(c))(); }, &call);
}

}  // namespace mk_emu

#define __syncthreads() ::mk_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::mk_emu::syncwarp(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(...) ::mk_emu::shfl(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::mk_emu::shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::mk_emu::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::mk_emu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) ::mk_emu::ballot(__FILE__, __LINE__, mask, pred)
#define __any_sync(mask, pred) ::mk_emu::any(__FILE__, __LINE__, mask, pred)
#define __all_sync(mask, pred) ::mk_emu::all(__FILE__, __LINE__, mask, pred)
#define __activemask() ::mk_emu::activemask()
#define __trap() ::mk_emu::trap(__FILE__, __LINE__)

#define MK_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::mk_emu::dynamic_smem())
#define MK_STATIC_SMEM(type, name, count)                 \
  static constexpr char mk_smem_tag_##name = 0;            \
  type* const name = static_cast<type*>(::mk_emu::static_smem(&mk_smem_tag_##name, sizeof(type) * (count), alignof(type)))
#define MK_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ((void)(stream), ::mk_emu::launch(#kernel, kernel, dim3(grid), dim3(block), (smem), __VA_ARGS__))
#define MK_SET_MAX_DYNAMIC_SMEM(kernel, bytes) \
  ::mk_emu::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<long>(bytes), #kernel)

#endif  // __CUDACC__
