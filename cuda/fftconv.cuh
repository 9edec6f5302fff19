// fftconv (spec 3): y[t] = sum_{s <= t} k[t - s] x[s] per (b, d) row, by zero-padded real FFTs of
// length 2N (N = max(32, nextpow2(L)) complex points), one thread block per row, everything in
// shared memory (N complex64 = 8N bytes: 128 KiB at N = 16384, within the A100's 163 KiB).
//
//   * Real input -> half-length complex: z[m] = r[2m] + i r[2m+1] (m < N), stored at the
//     bit-reversed slot rev(m) straight from the (coalesced) global load.
//   * Radix-2 decimation-in-time FFT in place: stages of span 1..16 inside each warp on registers
//     (__shfl_xor_sync butterflies, lane = index mod 32), the other stages in shared memory with
//     one barrier per stage. Twiddles e^{-i pi r/m} come from sincospif(r/m): r/m is exact in
//     fp32 and sincospif is accurate to ~1 ulp for every span (no fast-math __sincosf).
//   * Spectrum pairs (k, N-k) are handled by one thread each, in place: the real-FFT split
//     X[k] = E + W^k O, the spectral product, and the inverse merge Z'[k] = E' + i O'; then an
//     in-place bit-reversal permutation feeds the inverse DIT FFT (scale 1/N).
// Arithmetic is fp32 whatever the input dtype; one rounding on store.
// Longer L (N > 16384, up to 2^27): the launchers route to the multi-pass four-step FFT of
// fftconv_long.cuh, which reuses fft_dit (batched) for its column and row transforms.
#pragma once

#include "common.cuh"

namespace mk {

constexpr int kFftMinLog2 = 5;        // the warp stages need N >= 32
constexpr int kFftMaxLog2 = 14;       // N <= 16384 complex points: L <= 16384
constexpr int kFftMaxThreads = 1024;
constexpr int kFft4MaxLog2 = 27;      // multi-pass path (fftconv_long.cuh): N1 <= 2^14, N2 <= 2^13

__host__ __device__ __forceinline__ int fft_threads(int log2n) {
  const int half = 1 << (log2n - 1);
  return half < 32 ? 32 : (half > kFftMaxThreads ? kFftMaxThreads : half);
}
__host__ __device__ __forceinline__ std::size_t fft_smem_bytes(int log2n) {
  return sizeof(float2) * (std::size_t(1) << log2n);
}

__device__ __forceinline__ float2 cadd(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ float2 csub(float2 a, float2 b) { return make_float2(a.x - b.x, a.y - b.y); }
__device__ __forceinline__ float2 cmul(float2 a, float2 b) {
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__device__ __forceinline__ float2 cconj(float2 a) { return make_float2(a.x, -a.y); }
// e^{i pi x} for x = r / m exactly representable
__device__ __forceinline__ float2 cispi(float x) {
  float s, c;
  sincospif(x, &s, &c);
  return make_float2(c, s);
}
__device__ __forceinline__ unsigned int bitrev(unsigned int m, int log2n) { return __brev(m) >> (32 - log2n); }

// a[rev(m)] = r[2m] + i r[2m+1], r = src zero-padded to 2N (FLIP: r[s] = src[L-1-s]).
template <class T, bool FLIP>
__device__ __forceinline__ void fft_load_real(float2* a, const T* __restrict__ src, int L, int log2n) {
  const int n = 1 << log2n;
  for (int m = threadIdx.x; m < n; m += blockDim.x) {
    const int s0 = 2 * m, s1 = 2 * m + 1;
    const float v0 = s0 < L ? to_f32(src[FLIP ? L - 1 - s0 : s0]) : 0.0f;
    const float v1 = s1 < L ? to_f32(src[FLIP ? L - 1 - s1 : s1]) : 0.0f;
    a[bitrev(m, log2n)] = make_float2(v0, v1);
  }
}

// In-place radix-2 DIT FFT of n = 2^log2n points held in bit-reversed order; natural order out.
// Forward uses e^{-i pi r/m}, INVERSE e^{+i pi r/m} (unnormalised). Barriers at entry and exit.
// 2^log2batch independent transforms stored back to back (a[j * n + i]) run together: every
// butterfly span m < n pairs elements inside one aligned 2m-block, so the stages over the whole
// concatenation are exactly the stages of each transform (the four-step passes in
// fftconv_long.cuh batch columns and row pairs this way).
template <bool INVERSE>
__device__ void fft_dit(float2* a, int log2n, int log2batch = 0) {
  const int n = 1 << (log2n + log2batch);  // elements over the batch
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const float sign = INVERSE ? 1.0f : -1.0f;
  // this lane's twiddle for the spans 1, 2, 4, 8, 16
  float2 tw[5];
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    const int m = 1 << s;
    tw[s] = cispi(sign * static_cast<float>(lane & (m - 1)) / static_cast<float>(m));
  }
  __syncthreads();
  for (int seg = tid >> 5; seg < (n >> 5); seg += blockDim.x >> 5) {
    float2 v = a[(seg << 5) + lane];
#pragma unroll
    for (int s = 0; s < 5; ++s) {
      const int m = 1 << s;
      const bool upper = lane & m;                  // the q = p + m element of the butterfly
      const float2 t = upper ? cmul(tw[s], v) : v;  // q premultiplies by its twiddle
      const float2 o = shfl_xor2(t, m);
      v = upper ? csub(o, t) : cadd(v, o);          // p + w q  |  p - w q
    }
    a[(seg << 5) + lane] = v;
  }
  for (int s = 5; s < log2n; ++s) {
    __syncthreads();
    const int m = 1 << s;
    const float inv_m = 1.0f / static_cast<float>(m);
    for (int j = tid; j < (n >> 1); j += blockDim.x) {
      const int r = j & (m - 1);
      const int p = ((j >> s) << (s + 1)) + r;
      const float2 w = cispi(sign * static_cast<float>(r) * inv_m);
      const float2 x = a[p];
      const float2 y = cmul(w, a[p + m]);
      a[p] = cadd(x, y);
      a[p + m] = csub(x, y);
    }
  }
  __syncthreads();
}

// For every pair k in [0, N/2] (one thread per pair), the real spectrum X of the 2N real
// samples packed in a (natural order after fft_dit<false>): f(k, X[k], X[N-k]) where for k = 0
// the second value is X[N]. f may overwrite a[k] and a[N-k] (and nothing else).
template <class F>
__device__ __forceinline__ void fft_real_pairs(float2* a, int log2n, F f) {
  const int n = 1 << log2n;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int k = threadIdx.x; k <= (n >> 1); k += blockDim.x) {
    float2 xk, xnk;
    if (k == 0) {
      const float2 z = a[0];
      xk = make_float2(z.x + z.y, 0.0f);
      xnk = make_float2(z.x - z.y, 0.0f);
    } else {
      const float2 zk = a[k], znk = a[n - k];
      const float2 e = make_float2(0.5f * (zk.x + znk.x), 0.5f * (zk.y - znk.y));   // (Z[k] + conj Z[N-k]) / 2
      const float2 o = make_float2(0.5f * (zk.y + znk.y), -0.5f * (zk.x - znk.x));  // -i (Z[k] - conj Z[N-k]) / 2
      const float2 wo = cmul(cispi(-static_cast<float>(k) * inv_n), o);
      xk = cadd(e, wo);
      xnk = cconj(csub(e, wo));
    }
    f(k, xk, xnk);
  }
}

// Inverse of the split: from Y[k], Y[N-k] (k = 0: Y[0], Y[N]) the half-length values Z'[k] and
// Z'[N-k] whose inverse N-point FFT / N gives (y[2m], y[2m+1]).
__device__ __forceinline__ void fft_merge_pair(float2* a, int log2n, int k, float2 yk, float2 ynk) {
  const int n = 1 << log2n;
  const float2 e = make_float2(0.5f * (yk.x + ynk.x), 0.5f * (yk.y - ynk.y));
  const float2 d = make_float2(0.5f * (yk.x - ynk.x), 0.5f * (yk.y + ynk.y));
  const float2 o = cmul(d, cispi(static_cast<float>(k) / static_cast<float>(n)));
  a[k] = make_float2(e.x - o.y, e.y + o.x);
  if (k != 0 && 2 * k != n) a[n - k] = make_float2(e.x + o.y, o.x - e.y);
}

// natural -> bit-reversed order, in place; barriers at entry and exit
__device__ __forceinline__ void fft_bitrev_permute(float2* a, int log2n) {
  const int n = 1 << log2n;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int j = static_cast<int>(bitrev(i, log2n));
    if (i < j) {
      const float2 t = a[i];
      a[i] = a[j];
      a[j] = t;
    }
  }
  __syncthreads();
}

// dst[s] = out[s] / N for s < L (FLIP: dst[L-1-s]), out[2m] = Re a[m], out[2m+1] = Im a[m].
template <class T, bool FLIP>
__device__ __forceinline__ void fft_store_real(T* __restrict__ dst, const float2* a, int L, int log2n) {
  const int n = 1 << log2n;
  const float scale = 1.0f / static_cast<float>(n);
  for (int m = threadIdx.x; m < n; m += blockDim.x) {
    const int s0 = 2 * m, s1 = 2 * m + 1;
    if (s0 >= L) continue;
    const float2 v = a[m];
    dst[FLIP ? L - 1 - s0 : s0] = from_f32<T>(v.x * scale);
    if (s1 < L) dst[FLIP ? L - 1 - s1 : s1] = from_f32<T>(v.y * scale);
  }
}

// ------------------------------------------------------------------------------------------------
// Kernels (one block per row, blockDim.x = fft_threads(log2n), dynamic smem = fft_smem_bytes)
// ------------------------------------------------------------------------------------------------

// kf[d] = rfft(k[d] zero-padded to 2N): N + 1 bins.
template <class TK>
__global__ void __launch_bounds__(kFftMaxThreads) fftconv_spectrum_kernel(const TK* __restrict__ k,
                                                                          float2* __restrict__ kf, int L, int log2n) {
  MK_DYNAMIC_SMEM(float2, a);
  const int n = 1 << log2n;
  const std::int64_t d = blockIdx.x;
  fft_load_real<TK, false>(a, k + d * L, L, log2n);
  fft_dit<false>(a, log2n);
  float2* out = kf + d * (n + 1);
  fft_real_pairs(a, log2n, [&](int i, float2 xk, float2 xnk) {
    out[i] = xk;
    out[n - i] = xnk;
  });
}

// y = irfft(rfft(x) * kf)[:L] per row b * D + d.
template <class T>
__global__ void __launch_bounds__(kFftMaxThreads) fftconv_fwd_kernel(const T* __restrict__ x, const float2* __restrict__ kf,
                                                                     T* __restrict__ y, int D, int L, int log2n) {
  MK_DYNAMIC_SMEM(float2, a);
  const int n = 1 << log2n;
  const std::int64_t row = blockIdx.x;
  const float2* kr = kf + (row % D) * (n + 1);
  fft_load_real<T, false>(a, x + row * L, L, log2n);
  fft_dit<false>(a, log2n);
  fft_real_pairs(a, log2n, [&](int i, float2 xk, float2 xnk) {
    fft_merge_pair(a, log2n, i, cmul(xk, kr[i]), cmul(xnk, kr[n - i]));
  });
  fft_bitrev_permute(a, log2n);
  fft_dit<true>(a, log2n);
  fft_store_real<T, false>(y + row * L, a, L, log2n);
}

// Per row b * D + d: G = rfft(flip dy); dx = flip(irfft(G * kf)) (if dx), prod = G * rfft(x)
// (if prod; row-major (nb, D, N + 1)). Row-local: prod[row] is written and re-read by the same
// thread, so no barrier is needed between the two spectra.
template <class T>
__global__ void __launch_bounds__(kFftMaxThreads) fftconv_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                        const float2* __restrict__ kf,
                                                                        T* __restrict__ dx, float2* __restrict__ prod,
                                                                        int D, int L, int log2n) {
  MK_DYNAMIC_SMEM(float2, a);
  const int n = 1 << log2n;
  const std::int64_t row = blockIdx.x;
  const float2* kr = kf + (row % D) * (n + 1);
  float2* pr = prod ? prod + row * (n + 1) : nullptr;
  if (pr) {
    fft_load_real<T, false>(a, x + row * L, L, log2n);
    fft_dit<false>(a, log2n);
    fft_real_pairs(a, log2n, [&](int i, float2 xk, float2 xnk) {
      pr[i] = xk;
      pr[n - i] = xnk;
    });
    __syncthreads();  // a[] is reloaded below
  }
  fft_load_real<T, true>(a, dy + row * L, L, log2n);
  fft_dit<false>(a, log2n);
  fft_real_pairs(a, log2n, [&](int i, float2 gk, float2 gnk) {
    if (pr) {
      pr[i] = cmul(gk, pr[i]);
      if (2 * i != n) pr[n - i] = cmul(gnk, pr[n - i]);  // the middle bin is its own partner
    }
    if (dx) fft_merge_pair(a, log2n, i, cmul(gk, kr[i]), cmul(gnk, kr[n - i]));
  });
  if (dx) {  // uniform over the block
    fft_bitrev_permute(a, log2n);
    fft_dit<true>(a, log2n);
    fft_store_real<T, true>(dx + row * L, a, L, log2n);
  }
}

// Per d: S = (acc[d] if accumulate) + sum_{b < nb} prod[b, d] in a fixed order; then either
// acc[d] = S, or (finalize) dk[d] = flip(irfft(S))[:L], rounded to TK.
template <class TK>
__global__ void __launch_bounds__(kFftMaxThreads) fftconv_bwd_dk_kernel(const float2* __restrict__ prod,
                                                                        float2* __restrict__ acc, TK* __restrict__ dk,
                                                                        int nb, int D, int L, int log2n, bool accumulate,
                                                                        bool finalize) {
  MK_DYNAMIC_SMEM(float2, a);
  const int n = 1 << log2n;
  const std::int64_t d = blockIdx.x;
  const std::int64_t bins = n + 1;
  auto total = [&](int i) {
    float2 s = accumulate ? acc[d * bins + i] : make_float2(0.0f, 0.0f);
    for (int b = 0; b < nb; ++b) s = cadd(s, prod[(static_cast<std::int64_t>(b) * D + d) * bins + i]);
    return s;
  };
  for (int i = threadIdx.x; i <= (n >> 1); i += blockDim.x) {
    const float2 sk = total(i);
    const float2 snk = total(n - i);
    if (finalize) {
      fft_merge_pair(a, log2n, i, sk, snk);
    } else {
      acc[d * bins + i] = sk;
      acc[d * bins + n - i] = snk;
    }
  }
  if (finalize) {
    fft_bitrev_permute(a, log2n);
    fft_dit<true>(a, log2n);
    fft_store_real<TK, true>(dk + d * L, a, L, log2n);
  }
}

// Host launchers (fftconv_long.cu), called by the public fftconv launchers for log2n > kFftMaxLog2;
// ws holds ws_rows rows of N complex64 (rows are processed in chunks of ws_rows).
void fftconv_long_kernel_spectrum(const float* k, float* kf, std::int64_t D, std::int64_t L, int log2n, float* ws,
                                  std::int64_t ws_rows, void* stream);
void fftconv_long_fwd(int dtype, const void* x, const float* kf, void* y, std::int64_t B, std::int64_t D,
                      std::int64_t L, int log2n, float* ws, std::int64_t ws_rows, void* stream);
void fftconv_long_bwd_dx(int dtype, const void* dy, const void* x, const float* kf, void* dx, float* prod,
                         std::int64_t B, std::int64_t D, std::int64_t L, int log2n, float* ws, std::int64_t ws_rows,
                         void* stream);
// Worst-case dynamic smem over every multi-pass plan: column-pass kernels (rows = false) or
// row-pass kernels (rows = true); for resources.cu.
std::int64_t fftconv_long_max_smem_bytes(bool rows);
void fftconv_long_bwd_dk(const float* prod, float* acc, float* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                         int log2n, bool accumulate, bool finalize, float* ws, std::int64_t ws_rows, void* stream);

}  // namespace mk
