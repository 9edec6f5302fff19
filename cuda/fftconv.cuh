// fftconv (docs/math.md, fftconv; the algorithm: docs/fft.md): y[t] = sum_{s <= t} k[t - s] x[s]
// per (b, d) row, by zero-padded real FFTs of
// length 2N (N = max(32, nextpow2(L)) complex points), one thread block per row, everything in
// shared memory.
//
//   * Real input -> half-length complex: z[m] = r[2m] + i r[2m+1] (m < N), stored at the
//     bit-reversed slot rev(m) straight from the (coalesced) global load.
//   * Radix-2 decimation-in-time FFT in place: stages of span 1..16 inside each warp on registers
//     (__shfl_xor_sync butterflies, lane = index mod 32), the other stages in shared memory, two
//     per barrier (fft_smem_stages). Twiddles e^{-i pi r/m} come from sincospi(f)(r/m): r/m is exact in
//     the arithmetic type and sincospi(f) is accurate to ~1 ulp for every span (no fast-math
//     __sincosf, no angle rounded through a narrower type).
//   * Spectrum pairs (k, N-k) are handled by one thread each, in place: the real-FFT split
//     X[k] = E + W^k O, the spectral product, and the inverse merge Z'[k] = E' + i O'; then an
//     in-place bit-reversal permutation feeds the inverse DIT FFT (scale 1/N).
//
// Arithmetic type R = acc_t<T>: fp32 for float and bf16 inputs, fp64 (double2 complex values,
// double twiddles) for double inputs; one rounding on store. Everything below is templated on
// the complex type C = cplx_t<R> (float2 | double2); FftCfg<R> holds the per-type sizes:
//   float : one block for N <= 2^14 (L <= 16384): 8N B = 128 KiB of shared memory;
//           multi-pass (fftconv_long.cuh) up to N = 2^27.
//   double: a complex value takes 16 B, so one block holds half the points: N <= 2^13
//           (L <= 8192), again 128 KiB (fits sm_80's 166912 B per block); the multi-pass plan
//           keeps every pass at <= 128 KiB too (rows <= 2^12 points, columns <= 2^13), so N <= 2^25
//           (L <= 33554432) in double.
// Longer L: the launchers route to the multi-pass four-step FFT of fftconv_long.cuh, which reuses
// fft_dit (batched) for its column and row transforms.
#pragma once

#include "common.cuh"
#if !MK_NVRTC  // NVRTC: libcu++'s, from emu/emu.cuh
#include <type_traits>
#endif

namespace mk {

template <class R>
struct FftCfg;
template <>
struct FftCfg<float> {
  using C = float2;
  static constexpr int kMaxLog2 = 14;       // one block: N <= 16384 (8N = 128 KiB smem)
  static constexpr int kMaxThreads = 1024;
  static constexpr int k4MaxLog2 = 27;      // multi-pass: N1 <= 2^14, N2 <= 2^13
  static constexpr int k4MaxRowLog2 = 13;   // row pass: 2 rows of N2 (2 * 8 * N2 <= 128 KiB)
  static constexpr int k4ColElems = 8192;   // column pass: C * N1 <= 8192 (64 KiB) unless N1 alone is larger
};
template <>
struct FftCfg<double> {
  using C = double2;
  static constexpr int kMaxLog2 = 13;       // one block: N <= 8192 (16N = 128 KiB smem)
  static constexpr int kMaxThreads = 1024;
  static constexpr int k4MaxLog2 = 25;      // multi-pass: N1 <= 2^13 (128 KiB), N2 <= 2^12
  static constexpr int k4MaxRowLog2 = 12;   // row pass: 2 rows of N2 (2 * 16 * N2 <= 128 KiB)
  static constexpr int k4ColElems = 4096;   // column pass: C * N1 <= 4096 (64 KiB) unless N1 alone is larger
};
template <class R>
using cplx_t = typename FftCfg<R>::C;
template <class C>
using real_t = std::remove_reference_t<decltype(C::x)>;

constexpr int kFftMinLog2 = 5;                             // the warp stages need N >= 32
constexpr int kFftMaxLog2 = FftCfg<float>::kMaxLog2;       // float / bf16 one-block limit
constexpr int kFftMaxThreads = 1024;
constexpr int kFft4MaxLog2 = FftCfg<float>::k4MaxLog2;     // float / bf16 multi-pass limit

template <class R>
__host__ __device__ __forceinline__ std::size_t fft_smem_bytes(int log2n) {
  return sizeof(cplx_t<R>) * (std::size_t(1) << log2n);
}

__device__ __forceinline__ float2 mkc(float x, float y) { return make_float2(x, y); }
__device__ __forceinline__ double2 mkc(double x, double y) { return make_double2(x, y); }
template <class C>
__device__ __forceinline__ C cadd(C a, C b) { return mkc(a.x + b.x, a.y + b.y); }
template <class C>
__device__ __forceinline__ C csub(C a, C b) { return mkc(a.x - b.x, a.y - b.y); }
template <class C>
__device__ __forceinline__ C cmul(C a, C b) { return mkc(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
template <class C>
__device__ __forceinline__ C cconj(C a) { return mkc(a.x, -a.y); }
// e^{i pi x} for x = r / m exactly representable (sincospif / sincospi: no argument reduction
// error, ~1 ulp in either type)
__device__ __forceinline__ float2 cispi(float x) {
  float s, c;
  sincospif(x, &s, &c);
  return make_float2(c, s);
}
__device__ __forceinline__ double2 cispi(double x) {
  double s, c;
  sincospi(x, &s, &c);
  return make_double2(c, s);
}
// double2 through a warp shuffle: each double is two 32-bit shuffles on the GPU; the emulator
// exchanges at most 64 bits per call, so two calls either way.
__device__ __forceinline__ double2 shfl_xor2(double2 v, int lane_mask) {
  return make_double2(__shfl_xor_sync(kFullMask, v.x, lane_mask), __shfl_xor_sync(kFullMask, v.y, lane_mask));
}
// 2^-s exactly (0 <= s < 127), in R
template <class R>
__device__ __forceinline__ R pow2_neg(int s) {
  return static_cast<R>(__int_as_float((127 - s) << 23));
}
__device__ __forceinline__ unsigned int bitrev(unsigned int m, int log2n) { return __brev(m) >> (32 - log2n); }

// a[rev(m)] = r[2m] + i r[2m+1], r = src zero-padded to 2N (FLIP: r[s] = src[L-1-s]).
template <class T, bool FLIP, class C>
__device__ __forceinline__ void fft_load_real(C* a, const T* __restrict__ src, int L, int log2n) {
  using R = real_t<C>;
  static_assert(std::is_same_v<R, acc_t<T>>, "complex type must match the accumulation type");
  const int n = 1 << log2n;
  for (int m = threadIdx.x; m < n; m += blockDim.x) {
    const int s0 = 2 * m, s1 = 2 * m + 1;
    const R v0 = s0 < L ? to_acc(src[FLIP ? L - 1 - s0 : s0]) : R(0);
    const R v1 = s1 < L ? to_acc(src[FLIP ? L - 1 - s1 : s1]) : R(0);
    a[bitrev(m, log2n)] = mkc(v0, v1);
  }
}

// In-place radix-2 DIT FFT of n = 2^log2n points held in bit-reversed order; natural order out.
// Forward uses e^{-i pi r/m}, INVERSE e^{+i pi r/m} (unnormalised). Barriers at entry and exit.
// 2^log2batch independent transforms stored back to back (a[j * n + i]) run together: every
// butterfly span m < n pairs elements inside one aligned 2m-block, so the stages over the whole
// concatenation are exactly the stages of each transform (the four-step passes in
// fftconv_long.cuh batch columns and row pairs this way).
// The twiddle table (optional, ``tw``): for every span m = 2^s, s = 5 .. kTwMaxLog2, the m values
// e^{-i pi r / m} (r < m) at tw[m - 32 + r], computed in double on the host and rounded once (0.5 ulp,
// against sincospi's ~1 ulp): a butterfly reads its twiddle instead of evaluating sincospi, the
// larger part of a shared-memory stage's instructions. nullptr: sincospi as before (the multi-pass
// kernels of fftconv_long.cuh). tw_at(m, r) is valid for 32 <= m <= 2^kTwMaxLog2, r < m.
template <bool INVERSE, class C>
__device__ __forceinline__ C tw_at(const C* __restrict__ tw, int m, int r) {
  const C w = tw[m - 32 + r];
  return INVERSE ? cconj(w) : w;
}

// e^{-i pi r / m} (INVERSE: e^{+i pi r / m}) for span m = 2^s, from the table or by sincospi
template <bool INVERSE, bool TABLE, class C>
__device__ __forceinline__ C twiddle(const C* __restrict__ tw, int s, int r) {
  using R = real_t<C>;
  if constexpr (TABLE) {
    return tw_at<INVERSE>(tw, 1 << s, r);
  } else {
    return cispi((INVERSE ? R(1) : R(-1)) * static_cast<R>(r) * pow2_neg<R>(s));
  }
}

// The shared-memory stages s = 5 .. log2n - 1 of fft_dit over n elements (barrier before each pass),
// two at a time where they can: stages s and s + 1 (spans m, 2m) of the four elements
// p + {0, m, 2m, 3m} (p = r < m within its aligned 4m-block) are the same four butterflies, with the
// same twiddles and operations, as two radix-2 passes (the same values up to where the compiler
// fuses a multiply-add), with the intermediate values in registers: half the barriers and
// shared-memory round trips, and 58 instructions per four elements and two stages instead of 96
// (sm_90, table twiddles). An odd count of stages starts with one radix-2 stage. TABLE is a
// template argument so each twiddle source gets its own loop. Double rows keep radix-2 stages:
// paired, their 1024-thread backward spills 32 B on sm_80 (64 registers per thread at most).
template <bool INVERSE, bool TABLE, class C>
__device__ __forceinline__ void fft_smem_stages(C* a, int log2n, int n, const C* __restrict__ tw) {
  constexpr bool kPaired = sizeof(real_t<C>) == 4;
  const int tid = threadIdx.x;
  int s = 5;
  for (; s < log2n && (!kPaired || ((log2n - s) & 1)); ++s) {
    __syncthreads();
    const int m = 1 << s;
    for (int j = tid; j < (n >> 1); j += blockDim.x) {
      const int r = j & (m - 1);
      const int p = ((j >> s) << (s + 1)) + r;
      const C x = a[p];
      const C y = cmul(twiddle<INVERSE, TABLE>(tw, s, r), a[p + m]);
      a[p] = cadd(x, y);
      a[p + m] = csub(x, y);
    }
  }
  if constexpr (kPaired) {
    for (; s < log2n; s += 2) {
      __syncthreads();
      const int m = 1 << s;
      for (int j = tid; j < (n >> 2); j += blockDim.x) {
        const int r = j & (m - 1);
        const int p = ((j >> s) << (s + 2)) + r;
        const C w1 = twiddle<INVERSE, TABLE>(tw, s, r);
        const C x0 = a[p], x2 = a[p + 2 * m];
        const C y1 = cmul(w1, a[p + m]), y3 = cmul(w1, a[p + 3 * m]);
        const C b0 = cadd(x0, y1), b1 = csub(x0, y1);   // stage s: (p, p + m) and (p + 2m, p + 3m)
        const C b2 = cadd(x2, y3), b3 = csub(x2, y3);
        const C z2 = cmul(twiddle<INVERSE, TABLE>(tw, s + 1, r), b2);       // stage s + 1: (p, p + 2m)
        const C z3 = cmul(twiddle<INVERSE, TABLE>(tw, s + 1, r + m), b3);   // and (p + m, p + 3m)
        a[p] = cadd(b0, z2);
        a[p + 2 * m] = csub(b0, z2);
        a[p + m] = cadd(b1, z3);
        a[p + 3 * m] = csub(b1, z3);
      }
    }
  }
}

template <bool INVERSE, class C>
__device__ __forceinline__ void fft_dit(C* a, int log2n, int log2batch = 0, const C* __restrict__ tw = nullptr) {
  using R = real_t<C>;
  const int n = 1 << (log2n + log2batch);  // elements over the batch
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const R sign = INVERSE ? R(1) : R(-1);
  // This lane's factor for the spans 1, 2, 4, 8, 16: the twiddle w on the butterfly's upper element
  // q = p + m, exactly 1 on its lower one p, and the sign of its own term: the lower lane makes
  // p + (w q) from its partner's product, the upper one p - w q. Every lane multiplies (by 1 exactly
  // on p), exchanges, and adds its signed term: in fp32 no select in the loop (50 instructions per
  // 32-element segment instead of 95 on sm_90); double rows keep the select (the sign array would
  // cost their kernels 4-8 registers, up to the 64-register cap).
  constexpr bool kSigned = sizeof(R) == 4;
  C lane_tw[5];
  R lane_sg[5];
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    const int m = 1 << s;
    const bool upper = lane & m;
    lane_tw[s] = upper ? cispi(sign * static_cast<R>(lane & (m - 1)) * pow2_neg<R>(s)) : mkc(R(1), R(0));
    lane_sg[s] = upper ? R(-1) : R(1);
  }
  __syncthreads();
  for (int seg = tid >> 5; seg < (n >> 5); seg += blockDim.x >> 5) {
    C v = a[(seg << 5) + lane];
#pragma unroll
    for (int s = 0; s < 5; ++s) {
      if constexpr (kSigned) {
        const C t = cmul(lane_tw[s], v);           // w q on the upper lane, p itself on the lower
        const C o = shfl_xor2(t, 1 << s);
        v = mkc(o.x + lane_sg[s] * t.x, o.y + lane_sg[s] * t.y);   // p + w q  |  p - w q
      } else {
        const bool upper = lane & (1 << s);        // the q = p + m element of the butterfly
        const C t = upper ? cmul(lane_tw[s], v) : v;
        const C o = shfl_xor2(t, 1 << s);
        v = upper ? csub(o, t) : cadd(v, o);
      }
    }
    a[(seg << 5) + lane] = v;
  }
  if (tw) {
    fft_smem_stages<INVERSE, true>(a, log2n, n, tw);
  } else {
    fft_smem_stages<INVERSE, false>(a, log2n, n, tw);
  }
  __syncthreads();
}

// For every pair k in [0, N/2] (one thread per pair), the real spectrum X of the 2N real
// samples packed in a (natural order after fft_dit<false>): f(k, X[k], X[N-k]) where for k = 0
// the second value is X[N]. f may overwrite a[k] and a[N-k] (and nothing else).
template <class C, class F>
__device__ __forceinline__ void fft_real_pairs(C* a, int log2n, F f, const C* __restrict__ tw = nullptr) {
  using R = real_t<C>;
  const int n = 1 << log2n;
  const R inv_n = pow2_neg<R>(log2n);
  const R h = R(0.5);
  for (int k = threadIdx.x; k <= (n >> 1); k += blockDim.x) {
    C xk, xnk;
    if (k == 0) {
      const C z = a[0];
      xk = mkc(z.x + z.y, R(0));
      xnk = mkc(z.x - z.y, R(0));
    } else {
      const C zk = a[k], znk = a[n - k];
      const C e = mkc(h * (zk.x + znk.x), h * (zk.y - znk.y));   // (Z[k] + conj Z[N-k]) / 2
      const C o = mkc(h * (zk.y + znk.y), -h * (zk.x - znk.x));  // -i (Z[k] - conj Z[N-k]) / 2
      const C wo = cmul(tw ? tw_at<false>(tw, n, k) : cispi(-static_cast<R>(k) * inv_n), o);
      xk = cadd(e, wo);
      xnk = cconj(csub(e, wo));
    }
    f(k, xk, xnk);
  }
}

// Inverse of the split: from Y[k], Y[N-k] (k = 0: Y[0], Y[N]) the half-length values Z'[k] and
// Z'[N-k] whose inverse N-point FFT / N gives (y[2m], y[2m+1]).
template <class C>
__device__ __forceinline__ void fft_merge_pair(C* a, int log2n, int k, C yk, C ynk, const C* __restrict__ tw = nullptr) {
  using R = real_t<C>;
  const int n = 1 << log2n;
  const R h = R(0.5);
  const C e = mkc(h * (yk.x + ynk.x), h * (yk.y - ynk.y));
  const C d = mkc(h * (yk.x - ynk.x), h * (yk.y + ynk.y));
  const C o = cmul(d, tw ? tw_at<true>(tw, n, k) : cispi(static_cast<R>(k) * pow2_neg<R>(log2n)));
  a[k] = mkc(e.x - o.y, e.y + o.x);
  if (k != 0 && 2 * k != n) a[n - k] = mkc(e.x + o.y, o.x - e.y);
}

// natural -> bit-reversed order, in place; barriers at entry and exit
template <class C>
__device__ __forceinline__ void fft_bitrev_permute(C* a, int log2n) {
  const int n = 1 << log2n;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int j = static_cast<int>(bitrev(i, log2n));
    if (i < j) {
      const C t = a[i];
      a[i] = a[j];
      a[j] = t;
    }
  }
  __syncthreads();
}

// dst[s] = out[s] / N for s < L (FLIP: dst[L-1-s]), out[2m] = Re a[m], out[2m+1] = Im a[m].
template <class T, bool FLIP, class C>
__device__ __forceinline__ void fft_store_real(T* __restrict__ dst, const C* a, int L, int log2n) {
  using R = real_t<C>;
  static_assert(std::is_same_v<R, acc_t<T>>, "complex type must match the accumulation type");
  const int n = 1 << log2n;
  const R scale = pow2_neg<R>(log2n);
  for (int m = threadIdx.x; m < n; m += blockDim.x) {
    const int s0 = 2 * m, s1 = 2 * m + 1;
    if (s0 >= L) continue;
    const C v = a[m];
    dst[FLIP ? L - 1 - s0 : s0] = from_acc<T>(v.x * scale);
    if (s1 < L) dst[FLIP ? L - 1 - s1 : s1] = from_acc<T>(v.y * scale);
  }
}

// ------------------------------------------------------------------------------------------------
// Kernels (one block per row, dynamic smem = fft_smem_bytes<R>; blockDim.x any multiple of 32 up to
// kMaxThreads, since every stage strides over its butterflies: the launcher gives N / 16 threads, so
// several rows' blocks share an SM; tw: the twiddle table above, covering spans up to N, or nullptr).
// T is the element type of x / y (float, bf16, double); TK the type k / dk / the spectra are
// computed in (float or double = acc_t<T>: the Python side converts k to it).
// ------------------------------------------------------------------------------------------------

// kf[d] = rfft(k[d] zero-padded to 2N): N + 1 bins.
template <class TK>
__global__ void __launch_bounds__(FftCfg<TK>::kMaxThreads)
    fftconv_spectrum_kernel(const TK* __restrict__ k, cplx_t<TK>* __restrict__ kf, int L, int log2n,
                            const cplx_t<TK>* __restrict__ tw) {
  using C = cplx_t<TK>;
  MK_DYNAMIC_SMEM(C, a);
  const int n = 1 << log2n;
  const std::int64_t d = blockIdx.x;
  fft_load_real<TK, false>(a, k + d * L, L, log2n);
  fft_dit<false>(a, log2n, 0, tw);
  C* out = kf + d * (n + 1);
  fft_real_pairs(a, log2n, [&](int i, C xk, C xnk) {
    out[i] = xk;
    out[n - i] = xnk;
  }, tw);
}

// y = irfft(rfft(x) * kf)[:L] per row b * D + d. (minBlocks 1 in the launch bounds: without it ptxas
// holds the float kernels at 32 registers for two 1024-thread blocks per SM and spills 16-52 B;
// this and the bwd_dx kernel stay spill-free at 37-46 registers.)
template <class T>
__global__ void __launch_bounds__(FftCfg<acc_t<T>>::kMaxThreads, 1)
    fftconv_fwd_kernel(const T* __restrict__ x, const cplx_t<acc_t<T>>* __restrict__ kf, T* __restrict__ y, int D,
                       int L, int log2n, const cplx_t<acc_t<T>>* __restrict__ tw) {
  using C = cplx_t<acc_t<T>>;
  MK_DYNAMIC_SMEM(C, a);
  const int n = 1 << log2n;
  const std::int64_t row = blockIdx.x;
  const C* kr = kf + (row % D) * (n + 1);
  fft_load_real<T, false>(a, x + row * L, L, log2n);
  fft_dit<false>(a, log2n, 0, tw);
  fft_real_pairs(a, log2n, [=](int i, C xk, C xnk) {
    fft_merge_pair(a, log2n, i, cmul(xk, kr[i]), cmul(xnk, kr[n - i]), tw);
  }, tw);
  fft_bitrev_permute(a, log2n);
  fft_dit<true>(a, log2n, 0, tw);
  fft_store_real<T, false>(y + row * L, a, L, log2n);
}

// Per row b * D + d: G = rfft(flip dy); dx = flip(irfft(G * kf)) (if dx), prod = G * rfft(x)
// (if prod; row-major (nb, D, N + 1)). Row-local: prod[row] is written and re-read by the same
// thread, so no barrier is needed between the two spectra.
template <class T>
__global__ void __launch_bounds__(FftCfg<acc_t<T>>::kMaxThreads, 1)
    fftconv_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const cplx_t<acc_t<T>>* __restrict__ kf,
                          T* __restrict__ dx, cplx_t<acc_t<T>>* __restrict__ prod, int D, int L, int log2n,
                          const cplx_t<acc_t<T>>* __restrict__ tw) {
  using C = cplx_t<acc_t<T>>;
  MK_DYNAMIC_SMEM(C, a);
  const int n = 1 << log2n;
  const std::int64_t row = blockIdx.x;
  const C* kr = kf + (row % D) * (n + 1);
  C* pr = prod ? prod + row * (n + 1) : nullptr;
  if (pr) {
    fft_load_real<T, false>(a, x + row * L, L, log2n);
    fft_dit<false>(a, log2n, 0, tw);
    fft_real_pairs(a, log2n, [&](int i, C xk, C xnk) {
      pr[i] = xk;
      pr[n - i] = xnk;
    }, tw);
    __syncthreads();  // a[] is reloaded below
  }
  fft_load_real<T, true>(a, dy + row * L, L, log2n);
  fft_dit<false>(a, log2n, 0, tw);
  fft_real_pairs(a, log2n, [=](int i, C gk, C gnk) {
    if (pr) {
      pr[i] = cmul(gk, pr[i]);
      if (2 * i != n) pr[n - i] = cmul(gnk, pr[n - i]);  // the middle bin is its own partner
    }
    if (dx) fft_merge_pair(a, log2n, i, cmul(gk, kr[i]), cmul(gnk, kr[n - i]), tw);
  }, tw);
  if (dx) {  // uniform over the block
    fft_bitrev_permute(a, log2n);
    fft_dit<true>(a, log2n, 0, tw);
    fft_store_real<T, true>(dx + row * L, a, L, log2n);
  }
}

// Per d: S = (acc[d] if accumulate) + sum_{b < nb} prod[b, d] in a fixed order; then either
// acc[d] = S, or (finalize) dk[d] = flip(irfft(S))[:L].
template <class TK>
__global__ void __launch_bounds__(FftCfg<TK>::kMaxThreads)
    fftconv_bwd_dk_kernel(const cplx_t<TK>* __restrict__ prod, cplx_t<TK>* __restrict__ acc, TK* __restrict__ dk,
                          int nb, int D, int L, int log2n, bool accumulate, bool finalize,
                          const cplx_t<TK>* __restrict__ tw) {
  using C = cplx_t<TK>;
  MK_DYNAMIC_SMEM(C, a);
  const int n = 1 << log2n;
  const std::int64_t d = blockIdx.x;
  const std::int64_t bins = n + 1;
  auto total = [&](int i) {
    C s = accumulate ? acc[d * bins + i] : mkc(TK(0), TK(0));
    for (int b = 0; b < nb; ++b) s = cadd(s, prod[(static_cast<std::int64_t>(b) * D + d) * bins + i]);
    return s;
  };
  for (int i = threadIdx.x; i <= (n >> 1); i += blockDim.x) {
    const C sk = total(i);
    const C snk = total(n - i);
    if (finalize) {
      fft_merge_pair(a, log2n, i, sk, snk, tw);
    } else {
      acc[d * bins + i] = sk;
      acc[d * bins + n - i] = snk;
    }
  }
  if (finalize) {
    fft_bitrev_permute(a, log2n);
    fft_dit<true>(a, log2n, 0, tw);
    fft_store_real<TK, true>(dk + d * L, a, L, log2n);
  }
}

}  // namespace mk
