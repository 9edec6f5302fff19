// Flash attention forward and backward written with CuTe, templated on the tiled MMA and the
// global -> shared copy op, so one source runs in the SIMT emulator (UniversalFMA, plain 16-byte
// copies; g++) and on sm_80 / sm_90 (mma.sync bf16/fp16 -> fp32, cp.async; nvcc).
//
// Semantics are those of ops/attention (bottom-right causal, chunk_size block-diagonal, LeX
// block_causal, the package's DropKey rule regenerated from (seed, b, h, i, j) in every pass,
// softmax or Laplace, scale). Layouts: q (B, L, H, D), k (B, S, H, D), v / o / do (B, L|S, H, ldv)
// with D the padded head dim (64, 128 or 256; the launcher pads), lse / delta (B, H, L) fp32.
//
// Tiling: a CTA owns BM query rows (forward, dq) or BN keys (dk, dv) and loops over the other
// side's blocks, visiting only the key / query range its rows can see at all (causal, chunk and
// block_causal bounds), so fully masked tiles are skipped. Scores, probabilities and their
// gradients use fp32 accumulators; P and dS are staged in shared memory in the input type
// as the A operand of the second GEMM (generic over the MMA atom's register layout).
//
// * forward, grid (L / BM, B * H, ldv / DV): online softmax with per-row (max, sum) in shared
//   memory; a row is reduced by two threads (a lane pair: one shuffle). dv is tiled (DV columns
//   per CTA); every dv tile recomputes q k^T (the 7B config's dv = 2048 does not fit on chip).
// * backward, deterministic, no atomics: dv per (key block, dv tile) looping over query blocks;
//   dk per key block looping over query blocks; dq per query block looping over key blocks;
//   dP = dO V^T sums over dv in DV-column chunks. delta = rowsum(dO * O) comes from the caller.
#pragma once

#include "common.cuh"

#if MK_EMULATOR
// CuTe on the host compiler: the CUDA headers it names are replaced by cute_host/ stand-ins
// (emu/emu.cuh already defines the CUDA types), and CCCL must not look for __half / fp8.
#define CCCL_DISABLE_FP16_SUPPORT
#define CCCL_DISABLE_BF16_SUPPORT
#define CCCL_DISABLE_NVFP8_SUPPORT
#pragma push_macro("__noinline__")
#undef __noinline__
#endif
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#if !MK_EMULATOR
#include <cute/arch/copy_sm80.hpp>
#endif
#if MK_EMULATOR
#pragma pop_macro("__noinline__")
#endif

namespace mk {
namespace flash {

using namespace cute;

constexpr float kLaplaceMu = 0.70710678118654752f;     // sqrt(1/2)
constexpr float kLaplaceInv = 2.5066282746310002f;     // 1 / (sigma sqrt 2) = sqrt(2 pi), sigma = sqrt(1 / (4 pi))
constexpr float kLaplacePdf = 1.4142135623730951f;     // 1 / (sigma sqrt(2 pi)) = sqrt 2
constexpr float kLaplaceHalfInvVar = 6.2831853071795865f;  // 1 / (2 sigma^2)

// Mask / DropKey parameters of one call (passed by value to every kernel).
struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* out;         // o (forward) or the gradient being produced (dq / dk / dv)
  float* lse;        // (B, H, L): written by the forward, read by the backward
  const float* delta;  // (B, H, L) rowsum(dO * O) (softmax backward)
  int B, H, L, S, ldv, dv_chunks;  // ldv: row length of v / o / do (padded dv)
  float scale;
  int causal, chunk, block_causal, laplace;
  std::uint32_t key, thr;  // DropKey stream key and threshold (thr = 0: off)
  // (B,) the batch index the DropKey rule hashes for each row, or null: the row's own index
  // (packed document rows pass their documents' indices).
  const std::int64_t* batch_index;
};

// ----------------------------------------------------------------------------------------------
// Global -> shared copies of 16 bytes: the copy op is a template parameter.
// ----------------------------------------------------------------------------------------------
struct CopyUniversal {  // emulator / any arch: a plain 16-byte copy, zeros when out of range
  template <class E>
  __device__ __forceinline__ static void copy16(const E* g, E* s, bool pred) {
    auto& dst = *reinterpret_cast<cute::uint128_t*>(s);
    if (pred) {
      UniversalCopy<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(g), dst);
    } else {
      dst = cute::uint128_t(std::uint64_t(0));
    }
  }
  __device__ __forceinline__ static void commit_and_wait() {}
};

#if !MK_EMULATOR
struct CopyCpAsync {  // sm_80+: cp.async.cg with zero fill for out-of-range rows
  template <class E>
  __device__ __forceinline__ static void copy16(const E* g, E* s, bool pred) {
    SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(g),
                                                           *reinterpret_cast<cute::uint128_t*>(s), pred);
  }
  __device__ __forceinline__ static void commit_and_wait() {
    cp_async_fence();
    cp_async_wait<0>();
  }
};
#endif

// ----------------------------------------------------------------------------------------------
// Configuration: element type, padded head dim, dv tile, block sizes, threads, MMA, copy op.
// ----------------------------------------------------------------------------------------------
template <class E_, int D_, int DV_, int BM_, int BN_, int NT_, class Mma_, class G2S_>
struct Cfg {
  using E = E_;
  using Mma = Mma_;
  using G2S = G2S_;
  static constexpr int D = D_, DV = DV_, BM = BM_, BN = BN_, NT = NT_;
  static constexpr int kPad = 16 / sizeof(E);  // row padding: keeps 16-byte rows, staggers banks
  static constexpr int kVec = 16 / sizeof(E);
};

template <int Rows, int Cols, class E>
__device__ __forceinline__ auto smem_tile(E* p) {  // (Rows, Cols) row-major, padded rows
  return make_tensor(make_smem_ptr(p), make_layout(make_shape(Int<Rows>{}, Int<Cols>{}),
                                                   make_stride(Int<Cols + 16 / int(sizeof(E))>{}, _1{})));
}
template <int Rows, int Cols, class E>
__device__ __forceinline__ auto smem_tile_t(E* p) {  // the same storage viewed as (Cols, Rows)
  return make_tensor(make_smem_ptr(p), make_layout(make_shape(Int<Cols>{}, Int<Rows>{}),
                                                   make_stride(_1{}, Int<Cols + 16 / int(sizeof(E))>{})));
}
template <int Rows, int Cols, class E>
constexpr int smem_elems() {
  return Rows * (Cols + 16 / int(sizeof(E)));
}

// Rows [r0, r0 + Rows) x columns [c0, c0 + Cols) of a (T, H, ld) row-major tensor (batch b,
// head h) into a padded shared tile; rows >= rmax are zero-filled. Cols * sizeof(E) % 16 == 0.
template <class C, int Rows, int Cols>
__device__ __forceinline__ void load_tile(const typename C::E* g, typename C::E* s, int b, int h, int r0, int rmax,
                                          int T, int H, int ld, int c0) {
  constexpr int per_row = Cols / C::kVec;
  constexpr int total = Rows * per_row;
  for (int t = threadIdx.x; t < total; t += C::NT) {
    const int r = t / per_row, cv = (t % per_row) * C::kVec;
    const int gr = r0 + r;
    const bool ok = gr < rmax && gr >= 0;
    const std::int64_t row = ok ? (static_cast<std::int64_t>(b) * T + gr) * H + h : 0;
    C::G2S::copy16(g + row * ld + c0 + cv, s + r * (Cols + C::kPad) + cv, ok);
  }
}

// acc (+)= A (M, K) * B (N, K)^T with A and B in shared memory (any layout): per k-block the
// operands are copied (converted to the atom's register type) into register fragments.
template <class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void block_gemm(TiledMma const& mma, TA const& sA, TB const& sB, TC& acc) {
  auto thr = mma.get_slice(threadIdx.x);
  auto tA = thr.partition_A(sA);  // (V, M', K')
  auto tB = thr.partition_B(sB);  // (V, N', K')
  using VA = typename TiledMma::ValTypeA;
  using VB = typename TiledMma::ValTypeB;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tA); ++kb) {
    auto a = tA(_, _, kb);
    auto bb = tB(_, _, kb);
    auto rA = make_tensor<VA>(make_layout(shape(a)));
    auto rB = make_tensor<VB>(make_layout(shape(bb)));
    CUTE_UNROLL
    for (int i = 0; i < size(rA); ++i) rA(i) = static_cast<VA>(a(i));
    CUTE_UNROLL
    for (int i = 0; i < size(rB); ++i) rB(i) = static_cast<VB>(bb(i));
    cute::gemm(mma, rA, rB, acc);
  }
}

// ----------------------------------------------------------------------------------------------
// Masks
// ----------------------------------------------------------------------------------------------
__device__ __forceinline__ int floor_div(int a, int c) { return a >= 0 ? a / c : -((-a + c - 1) / c); }

__device__ __forceinline__ bool visible(const Params& p, int i, int j) {
  const int pos = i + p.S - p.L;
  if (p.causal && j > pos) return false;
  if (p.chunk > 0) {
    const int cp = floor_div(pos, p.chunk), cj = j / p.chunk;
    return cj == cp || (p.block_causal && cj == cp - 1);
  }
  return true;
}

// Keys [lo, hi) that query rows [i0, i1) can see at all (as ops/attention/torch_impl._key_range).
__device__ __forceinline__ int2 key_range(const Params& p, int i0, int i1) {
  const int p0 = i0 + p.S - p.L, p1 = i1 - 1 + p.S - p.L;
  int lo = 0, hi = p.S;
  if (p.causal) hi = imin(hi, p1 + 1);
  if (p.chunk > 0) {
    const int c0 = floor_div(p0, p.chunk) - (p.block_causal ? 1 : 0);
    lo = imax(lo, c0 * p.chunk);
    hi = imin(hi, (floor_div(p1, p.chunk) + 1) * p.chunk);
  }
  return make_int2(lo, hi);
}

// Query rows [lo, hi) that can see any of the keys [j0, j1).
__device__ __forceinline__ int2 query_range(const Params& p, int j0, int j1) {
  const int shift = p.S - p.L;  // pos = i + shift
  int lo = 0, hi = p.L;
  if (p.causal) lo = imax(lo, j0 - shift);
  if (p.chunk > 0) {
    const int c0 = j0 / p.chunk, c1 = (j1 - 1) / p.chunk + (p.block_causal ? 1 : 0);
    lo = imax(lo, c0 * p.chunk - shift);
    hi = imin(hi, (c1 + 1) * p.chunk - shift);
  }
  return make_int2(lo, hi);
}

// The DropKey stream key of plane (b, h), computed once per CTA: mix32(mix32(key ^ b') ^ h) with
// b' = batch_index[b] for packed document rows, else b (dropkey::row_key without the row step).
__device__ __forceinline__ std::uint32_t head_key(const Params& p, int b, int h) {
  if (p.thr == 0u) return 0u;
  const std::int64_t rb = p.batch_index ? p.batch_index[b] : b;
  return dropkey::mix32(dropkey::mix32(p.key ^ static_cast<std::uint32_t>(rb)) ^ static_cast<std::uint32_t>(h));
}

// Scaled score of (i, j) or -inf when not visible / dropped / out of range; hk = head_key(p, b, h).
__device__ __forceinline__ float masked_score(const Params& p, std::uint32_t hk, int i, int j, float acc) {
  if (i >= p.L || j >= p.S || !visible(p, i, j)) return -INFINITY;
  if (p.thr != 0u) {
    const std::uint32_t rk = dropkey::mix32(hk ^ static_cast<std::uint32_t>(i));
    if (!dropkey::keep(rk, static_cast<std::uint32_t>(j), p.thr)) return -INFINITY;
  }
  return acc * p.scale;
}

__device__ __forceinline__ float laplace_fn(float s) { return 0.5f * erfcf((kLaplaceMu - s) * kLaplaceInv); }
__device__ __forceinline__ float laplace_grad(float s) {
  const float x = s - kLaplaceMu;
  return kLaplacePdf * expf(-x * x * kLaplaceHalfInvVar);
}

// ----------------------------------------------------------------------------------------------
// Forward
// ----------------------------------------------------------------------------------------------
template <class C>
struct FwdSmem {
  using E = typename C::E;
  static constexpr int q = 0;
  static constexpr int k = q + smem_elems<C::BM, C::D, E>() * sizeof(E);
  static constexpr int v = k + smem_elems<C::BN, C::D, E>() * sizeof(E);
  static constexpr int pm = v + smem_elems<C::BN, C::DV, E>() * sizeof(E);
  static constexpr int s = pm + smem_elems<C::BM, C::BN, E>() * sizeof(E);
  static constexpr int rows = s + C::BM * (C::BN + 4) * 4;  // m, l, alpha per row (fp32)
  static constexpr int bytes = rows + 3 * C::BM * 4;
};

template <class C>
__global__ void __launch_bounds__(C::NT) flash_fwd_kernel(Params p) {
  using E = typename C::E;
  using L = FwdSmem<C>;
  constexpr int BM = C::BM, BN = C::BN, D = C::D, DV = C::DV, SLD = C::BN + 4;
  static_assert(C::NT == 2 * BM, "the row pass gives each row a lane pair");
  MK_DYNAMIC_SMEM(unsigned char, smem);
  E* sQp = reinterpret_cast<E*>(smem + L::q);
  E* sKp = reinterpret_cast<E*>(smem + L::k);
  E* sVp = reinterpret_cast<E*>(smem + L::v);
  E* sPp = reinterpret_cast<E*>(smem + L::pm);
  float* sS = reinterpret_cast<float*>(smem + L::s);
  float* sM = reinterpret_cast<float*>(smem + L::rows);
  float* sL = sM + BM;
  float* sA = sL + BM;

  const int m0 = blockIdx.x * BM;
  const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const std::uint32_t hk = head_key(p, b, h);
  const int c0 = blockIdx.z * DV;
  const int tid = threadIdx.x;
  const int i_end = imin(p.L, m0 + BM);
  const int2 kr = key_range(p, m0, i_end);

  typename C::Mma mma;
  auto thr = mma.get_slice(tid);
  auto sQ = smem_tile<BM, D>(sQp);
  auto sK = smem_tile<BN, D>(sKp);
  auto sVt = smem_tile_t<BN, DV>(sVp);  // (DV, BN): v^T as the B operand of P v
  auto sP = smem_tile<BM, BN>(sPp);
  auto accO = partition_fragment_C(mma, Shape<Int<BM>, Int<DV>>{});
  clear(accO);
  auto cO = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<DV>>{}));
  auto cS = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));

  if (tid < BM) {
    sM[tid] = -INFINITY;
    sL[tid] = 0.0f;
  }
  load_tile<C, BM, D>(static_cast<const E*>(p.q), sQp, b, h, m0, p.L, p.L, p.H, D, 0);

  const int r = tid >> 1, half = tid & 1;  // row pass: lane pair (2r, 2r + 1) owns row r
  for (int n0 = kr.x; n0 < kr.y; n0 += BN) {
    __syncthreads();  // previous tile's sK / sV / sP / sS fully consumed
    load_tile<C, BN, D>(static_cast<const E*>(p.k), sKp, b, h, n0, kr.y, p.S, p.H, D, 0);
    load_tile<C, BN, DV>(static_cast<const E*>(p.v), sVp, b, h, n0, kr.y, p.S, p.H, p.ldv, c0);
    C::G2S::commit_and_wait();
    __syncthreads();

    auto accS = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    clear(accS);
    block_gemm(mma, sQ, sK, accS);
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) {
      const int rr = get<0>(cS(e)), cc = get<1>(cS(e));
      const int j = n0 + cc;
      sS[rr * SLD + cc] = j < kr.y ? masked_score(p, hk, m0 + rr, j, accS(e)) : -INFINITY;
    }
    __syncthreads();

    // row pass: online softmax (or Laplace), P in the input type, per-row rescale factor
    {
      const float* srow = sS + r * SLD + half * (BN / 2);
      E* prow = sPp + r * (BN + C::kPad) + half * (BN / 2);
      if (p.laplace) {
        for (int c = 0; c < BN / 2; ++c) {
          const float s = srow[c];
          prow[c] = static_cast<E>(s == -INFINITY ? 0.0f : laplace_fn(s));
        }
        if (half == 0) sA[r] = 1.0f;
      } else {
        float mx = -INFINITY;
        for (int c = 0; c < BN / 2; ++c) mx = fmaxf(mx, srow[c]);
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        const float m_old = sM[r];
        const float m_new = fmaxf(m_old, mx);
        const bool none = m_new == -INFINITY;
        float sum = 0.0f;
        for (int c = 0; c < BN / 2; ++c) {
          const float pv = none ? 0.0f : expf(srow[c] - m_new);
          prow[c] = static_cast<E>(pv);
          sum += pv;
        }
        sum += __shfl_xor_sync(kFullMask, sum, 1);
        if (half == 0) {
          const float alpha = none ? 1.0f : expf(m_old - m_new);
          sA[r] = alpha;
          sL[r] = sL[r] * alpha + sum;
          sM[r] = m_new;
        }
      }
    }
    __syncthreads();
    CUTE_UNROLL
    for (int e = 0; e < size(accO); ++e) accO(e) *= sA[get<0>(cO(e))];
    block_gemm(mma, sP, sVt, accO);
  }
  __syncthreads();

  // epilogue: o = acc / l (softmax; 0 for a row without keys), lse by the first dv tile
  E* o = static_cast<E*>(p.out);
  CUTE_UNROLL
  for (int e = 0; e < size(accO); ++e) {
    const int rr = get<0>(cO(e)), cc = get<1>(cO(e));
    const int i = m0 + rr;
    if (i < p.L) {
      float val = accO(e);
      if (!p.laplace) {
        const float l = sL[rr];
        val = l > 0.0f ? val / l : 0.0f;
      }
      o[((static_cast<std::int64_t>(b) * p.L + i) * p.H + h) * p.ldv + c0 + cc] = static_cast<E>(val);
    }
  }
  if (!p.laplace && blockIdx.z == 0 && tid < BM && m0 + tid < p.L) {
    const float l = sL[tid];
    p.lse[static_cast<std::int64_t>(bh) * p.L + m0 + tid] = l > 0.0f ? sM[tid] + logf(l) : -INFINITY;
  }
}

// ----------------------------------------------------------------------------------------------
// Backward
// ----------------------------------------------------------------------------------------------
template <class C>
struct BwdSmem {
  using E = typename C::E;
  static constexpr int q = 0;
  static constexpr int k = q + smem_elems<C::BM, C::D, E>() * sizeof(E);
  static constexpr int dout = k + smem_elems<C::BN, C::D, E>() * sizeof(E);
  static constexpr int v = dout + smem_elems<C::BM, C::DV, E>() * sizeof(E);
  static constexpr int ds = v + smem_elems<C::BN, C::DV, E>() * sizeof(E);
  static constexpr int rows = ds + smem_elems<C::BM, C::BN, E>() * sizeof(E);
  static constexpr int bytes = rows + 2 * C::BM * 4;  // lse, delta of the query block
};

// Which gradient a backward CTA produces.
enum class Grad { kDV, kDK, kDQ };

// One (query block m0, key block n0) step of the backward: scores, P, and (kDK / kDQ) dP and dS;
// leaves P (kDV) or dS (kDK / kDQ) in shared memory as the input type (BM x BN, row-major).
template <class C, Grad G>
__device__ __forceinline__ void bwd_tile(const Params& p, int b, int h, std::uint32_t hk, int m0, int n0, int n_end,
                                         int c0, unsigned char* smem) {
  using E = typename C::E;
  using Lay = BwdSmem<C>;
  constexpr int BM = C::BM, BN = C::BN, D = C::D, DV = C::DV;
  E* sQp = reinterpret_cast<E*>(smem + Lay::q);
  E* sKp = reinterpret_cast<E*>(smem + Lay::k);
  E* sOp = reinterpret_cast<E*>(smem + Lay::dout);
  E* sVp = reinterpret_cast<E*>(smem + Lay::v);
  E* sGp = reinterpret_cast<E*>(smem + Lay::ds);
  const float* sLse = reinterpret_cast<const float*>(smem + Lay::rows);
  const float* sDelta = sLse + BM;
  typename C::Mma mma;
  auto thr = mma.get_slice(threadIdx.x);
  auto cS = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  auto accS = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  clear(accS);
  block_gemm(mma, smem_tile<BM, D>(sQp), smem_tile<BN, D>(sKp), accS);
  // kDV: P (from the saved lse, or laplace(s)); kDK / kDQ: P or laplace'(s) (dS = dP laplace'(s)).
  CUTE_UNROLL
  for (int e = 0; e < size(accS); ++e) {
    const int rr = get<0>(cS(e)), cc = get<1>(cS(e));
    const int j = n0 + cc;
    const float s = j < n_end ? masked_score(p, hk, m0 + rr, j, accS(e)) : -INFINITY;
    float pv = 0.0f;
    if (s != -INFINITY) {
      if (p.laplace) pv = G == Grad::kDV ? laplace_fn(s) : laplace_grad(s);
      else pv = expf(s - sLse[rr]);
    }
    accS(e) = pv;
  }
  if constexpr (G == Grad::kDV) {
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) sGp[get<0>(cS(e)) * (BN + C::kPad) + get<1>(cS(e))] = static_cast<E>(accS(e));
  } else {
    // dP = dO V^T over dv in DV-column chunks
    auto accP = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    clear(accP);
    for (int ch = 0; ch < p.dv_chunks; ++ch) {
      __syncthreads();  // previous chunk consumed
      load_tile<C, BM, DV>(static_cast<const E*>(p.dout), sOp, b, h, m0, p.L, p.L, p.H, p.ldv, ch * DV);
      load_tile<C, BN, DV>(static_cast<const E*>(p.v), sVp, b, h, n0, n_end, p.S, p.H, p.ldv, ch * DV);
      C::G2S::commit_and_wait();
      __syncthreads();
      block_gemm(mma, smem_tile<BM, DV>(sOp), smem_tile<BN, DV>(sVp), accP);
    }
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) {
      const int rr = get<0>(cS(e)), cc = get<1>(cS(e));
      const float g = p.laplace ? accP(e) * accS(e) : accS(e) * (accP(e) - sDelta[rr]);
      sGp[rr * (BN + C::kPad) + cc] = static_cast<E>(g);
    }
  }
}

template <class C>
__device__ __forceinline__ void load_rows(const Params& p, int bh, int m0, unsigned char* smem) {
  float* sLse = reinterpret_cast<float*>(smem + BwdSmem<C>::rows);
  float* sDelta = sLse + C::BM;
  for (int t = threadIdx.x; t < C::BM; t += C::NT) {
    const int i = m0 + t;
    const bool ok = i < p.L && !p.laplace;
    sLse[t] = ok ? p.lse[static_cast<std::int64_t>(bh) * p.L + i] : 0.0f;
    sDelta[t] = ok ? p.delta[static_cast<std::int64_t>(bh) * p.L + i] : 0.0f;
  }
}

// dV (grid (S / BN, B * H, ldv / DV)) and dK (grid (S / BN, B * H, 1)) per key block.
template <class C, Grad G>
__global__ void __launch_bounds__(C::NT) flash_bwd_kv_kernel(Params p) {
  using E = typename C::E;
  using Lay = BwdSmem<C>;
  constexpr int BM = C::BM, BN = C::BN, D = C::D, DV = C::DV;
  constexpr int W = G == Grad::kDV ? DV : D;  // columns of the produced gradient
  MK_DYNAMIC_SMEM(unsigned char, smem);
  E* sQp = reinterpret_cast<E*>(smem + Lay::q);
  E* sKp = reinterpret_cast<E*>(smem + Lay::k);
  E* sOp = reinterpret_cast<E*>(smem + Lay::dout);
  E* sGp = reinterpret_cast<E*>(smem + Lay::ds);
  const int n0 = blockIdx.x * BN, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const std::uint32_t hk = head_key(p, b, h);
  const int c0 = blockIdx.z * DV;
  const int n_end = imin(p.S, n0 + BN);
  const int2 qr = query_range(p, n0, n_end);
  typename C::Mma mma;
  auto thr = mma.get_slice(threadIdx.x);
  auto acc = partition_fragment_C(mma, Shape<Int<BN>, Int<W>>{});
  clear(acc);
  auto cA = thr.partition_C(make_identity_tensor(Shape<Int<BN>, Int<W>>{}));
  load_tile<C, BN, D>(static_cast<const E*>(p.k), sKp, b, h, n0, n_end, p.S, p.H, D, 0);
  for (int m0 = qr.x; m0 < qr.y; m0 += BM) {
    __syncthreads();  // previous step's tiles consumed
    load_tile<C, BM, D>(static_cast<const E*>(p.q), sQp, b, h, m0, qr.y, p.L, p.H, D, 0);
    if constexpr (G == Grad::kDV)
      load_tile<C, BM, DV>(static_cast<const E*>(p.dout), sOp, b, h, m0, qr.y, p.L, p.H, p.ldv, c0);
    load_rows<C>(p, bh, m0, smem);
    C::G2S::commit_and_wait();
    __syncthreads();
    bwd_tile<C, G>(p, b, h, hk, m0, n0, n_end, c0, smem);
    __syncthreads();
    // rows >= qr.y are zero in sQ / sdO (zero-filled) and in P / dS (masked): they add nothing.
    if constexpr (G == Grad::kDV) {
      block_gemm(mma, smem_tile_t<BM, BN>(sGp), smem_tile_t<BM, DV>(sOp), acc);  // P^T dO
    } else {
      block_gemm(mma, smem_tile_t<BM, BN>(sGp), smem_tile_t<BM, D>(sQp), acc);  // dS^T Q
    }
  }
  E* out = static_cast<E*>(p.out);
  const int ld = G == Grad::kDV ? p.ldv : D;
  const float mul = G == Grad::kDV ? 1.0f : p.scale;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int rr = get<0>(cA(e)), cc = get<1>(cA(e));
    const int j = n0 + rr;
    if (j < p.S) out[((static_cast<std::int64_t>(b) * p.S + j) * p.H + h) * ld + c0 + cc] = static_cast<E>(acc(e) * mul);
  }
}

// dQ per query block (grid (L / BM, B * H)), looping over the visible key blocks.
template <class C>
__global__ void __launch_bounds__(C::NT) flash_bwd_q_kernel(Params p) {
  using E = typename C::E;
  using Lay = BwdSmem<C>;
  constexpr int BM = C::BM, BN = C::BN, D = C::D;
  MK_DYNAMIC_SMEM(unsigned char, smem);
  E* sQp = reinterpret_cast<E*>(smem + Lay::q);
  E* sKp = reinterpret_cast<E*>(smem + Lay::k);
  E* sGp = reinterpret_cast<E*>(smem + Lay::ds);
  const int m0 = blockIdx.x * BM, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const std::uint32_t hk = head_key(p, b, h);
  const int2 kr = key_range(p, m0, imin(p.L, m0 + BM));
  typename C::Mma mma;
  auto thr = mma.get_slice(threadIdx.x);
  auto acc = partition_fragment_C(mma, Shape<Int<BM>, Int<D>>{});
  clear(acc);
  auto cA = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
  load_tile<C, BM, D>(static_cast<const E*>(p.q), sQp, b, h, m0, p.L, p.L, p.H, D, 0);
  load_rows<C>(p, bh, m0, smem);
  for (int n0 = kr.x; n0 < kr.y; n0 += BN) {
    __syncthreads();
    load_tile<C, BN, D>(static_cast<const E*>(p.k), sKp, b, h, n0, kr.y, p.S, p.H, D, 0);
    C::G2S::commit_and_wait();
    __syncthreads();
    bwd_tile<C, Grad::kDQ>(p, b, h, hk, m0, n0, kr.y, 0, smem);
    __syncthreads();
    block_gemm(mma, smem_tile<BM, BN>(sGp), smem_tile_t<BN, D>(sKp), acc);  // dS K
  }
  E* out = static_cast<E*>(p.out);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int rr = get<0>(cA(e)), cc = get<1>(cA(e));
    const int i = m0 + rr;
    if (i < p.L) out[((static_cast<std::int64_t>(b) * p.L + i) * p.H + h) * D + cc] = static_cast<E>(acc(e) * p.scale);
  }
}

// ----------------------------------------------------------------------------------------------
// The instantiated configurations
// ----------------------------------------------------------------------------------------------
#if MK_EMULATOR
// FMA lanes as 16 x (NT / 16); register operands are fp32 (inputs converted on load).
template <class E, int NT>
struct MmaFor {
  using type = decltype(make_tiled_mma(UniversalFMA<float, float, float, float>{},
                                       Layout<Shape<_16, Int<NT / 16>, _1>>{}));
};
using G2S = CopyUniversal;

// Emulator check of the tensor-core path: an mma.sync m16n8k16 bf16 -> fp32 stand-in with
// SM80_16x8x16_F32BF16BF16F32_TN's register arrays and CuTe traits (thread-value layouts), whose
// fma gathers the warp's A / B fragments by shuffles following the PTX fragment layout
// (group g = lane / 4, t = lane % 4: A rows g, g + 8 / k pairs 2t, 2t + 8; B k pairs 2t, 2t + 8 /
// column g; C rows g, g + 8 / columns 2t, 2t + 1). The kernels run with the SM80 TiledMMA layout.
struct EmuSM80_16x8x16_F32BF16BF16F32_TN {
  using DRegisters = float[4];
  using ARegisters = uint32_t[4];
  using BRegisters = uint32_t[2];
  using CRegisters = float[4];
  static float lo(uint32_t v) { return __uint_as_float(v << 16); }
  static float hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }
  static void fma(float& d0, float& d1, float& d2, float& d3, uint32_t const& a0, uint32_t const& a1,
                  uint32_t const& a2, uint32_t const& a3, uint32_t const& b0, uint32_t const& b1, float const& c0,
                  float const& c1, float const& c2, float const& c3) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    float acc[2][2] = {{c0, c1}, {c2, c3}};  // [row half][column]
    float arow[2][16], bcol[2][16];
    for (int kp = 0; kp < 8; ++kp) {  // k pair (2 kp, 2 kp + 1): held by lane x * 4 + kp % 4
      const int kb = kp / 4;           // k >= 8: the second register of the pair
      for (int rh = 0; rh < 2; ++rh) {
        const uint32_t v = __shfl_sync(kFullMask, a[rh + 2 * kb], g * 4 + kp % 4);
        arow[rh][2 * kp] = lo(v);
        arow[rh][2 * kp + 1] = hi(v);
      }
      for (int cn = 0; cn < 2; ++cn) {
        const uint32_t v = __shfl_sync(kFullMask, b[kb], (2 * t + cn) * 4 + kp % 4);
        bcol[cn][2 * kp] = lo(v);
        bcol[cn][2 * kp + 1] = hi(v);
      }
    }
    for (int rh = 0; rh < 2; ++rh)
      for (int cn = 0; cn < 2; ++cn)
        for (int k = 0; k < 16; ++k) acc[rh][cn] += arow[rh][k] * bcol[cn][k];
    d0 = acc[0][0];
    d1 = acc[0][1];
    d2 = acc[1][0];
    d3 = acc[1][1];
  }
};
// bf16 storage that selects the emulated tensor-core configuration (D = 64; EMULATOR_KERNELS of
// ops/attention/cuda_impl.py).
struct bf16_sm80emu : cutlass::bfloat16_t {
  using cutlass::bfloat16_t::bfloat16_t;
  bf16_sm80emu() = default;
  explicit bf16_sm80emu(float x) : cutlass::bfloat16_t(x) {}
};
template <int NT>
struct MmaFor<bf16_sm80emu, NT> {
  using type = decltype(make_tiled_mma(EmuSM80_16x8x16_F32BF16BF16F32_TN{}, Layout<Shape<_4, Int<NT / 128>, _1>>{},
                                       Tile<_64, Int<16 * (NT / 128)>, _16>{}));
};
#else
template <class E>
struct MmaOp;
template <>
struct MmaOp<cutlass::bfloat16_t> {
  using type = SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct MmaOp<cutlass::half_t> {
  using type = SM80_16x8x16_F32F16F16F32_TN;
};
// 4 warps stacked along M (16 rows each) make a 64-row tile; 8 warps add a second column of warps.
template <class E, int NT>
struct MmaFor {
  using type = decltype(make_tiled_mma(typename MmaOp<E>::type{}, Layout<Shape<_4, Int<NT / 128>, _1>>{},
                                       Tile<_64, Int<16 * (NT / 128)>, _16>{}));
};
using G2S = CopyCpAsync;
#endif

// Forward: BM = BN = 64, 128 threads; the dv tile DV keeps the fp32 O accumulator at
// BM * DV / 128 registers per thread (64 at DV = 128).
template <class E, int D>
using FwdCfg = Cfg<E, D, (D >= 128 ? 128 : 64), 64, 64, 128, typename MmaFor<E, 128>::type, G2S>;
// Backward: the dk / dq accumulators are 64 x D fp32: 256 threads at D = 256 keep them at 64
// registers per thread (128 threads spilled under ptxas). The dv kernel recomputes q k^T per dv
// tile, so D = 256 (the 7B config, dv = 2048) takes DV = 128 (its accumulator: 32 registers).
template <class E, int D>
using BwdCfg = Cfg<E, D, (D >= 256 ? 128 : 64), 64, 64, (D >= 256 ? 256 : 128),
                   typename MmaFor<E, (D >= 256 ? 256 : 128)>::type, G2S>;

}  // namespace flash
}  // namespace mk

#if MK_EMULATOR
namespace cute {
template <>
struct MMA_Traits<mk::flash::EmuSM80_16x8x16_F32BF16BF16F32_TN> : MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN> {};
}  // namespace cute
#endif
