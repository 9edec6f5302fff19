// fftconv for L > 16384: the same zero-padded real FFT of length 2N (N = nextpow2(L) complex
// points, half-length complex trick of fftconv.cuh) with the N-point complex FFT done in passes
// through a global fp32-complex workspace (four-step / Bailey), N = N1 * N2:
//
//   z[n] = r[2n] + i r[2n+1],  n = N2 * n1 + n2,  k = k1 + N1 * k2:
//   Z[k1 + N1 k2] = sum_n2 W_N2^(n2 k2) * W_N^(n2 k1) * (sum_n1 W_N1^(n1 k1) z[N2 n1 + n2])
//
//   pass 1 (column, fft4_col_fwd_kernel): for each n2 the N1-point FFT over n1 (stride N2 in z),
//     C adjacent columns per block so the strided loads/stores are C-element contiguous runs;
//     A[k1][n2] written to ws[k1 * N2 + n2].
//   pass 2 (row, fft4_row_*_kernel): row k1 of ws (contiguous, N2 points) times the twiddle
//     W_N^(n2 k1), N2-point FFT -> Z in the transposed layout P: ws[k1 * N2 + k2] = Z[k1 + N1 k2].
//     The real-FFT split pairs Z[k] with Z[N - k], i.e. row k1 with row N1 - k1 (k2 -> N2-1-k2;
//     rows 0 and N1/2 pair with themselves), so each block owns such a row pair and does, in
//     shared memory: split -> spectral product (kernel spectrum kf, stored in layout P too) ->
//     merge -> inverse N2-point FFT -> conjugate twiddle W_N^(-n2 k1) -> ws.
//   pass 3 (column, fft4_col_inv_kernel): inverse N1-point FFT of each column, scale 1/N,
//     z' -> real output (rounded once to the output dtype).
// Spectra (kf, the dk product spectra) are (rows, N + 1) complex64 like the one-block path but
// permuted: X[k] at pos(k) = (k mod N1) * N2 + k / N1 for k < N, X[N] at N.
//
// Twiddles are never formed from a rounded angle: the exponent n2 * k1 is reduced mod N in
// integers, and e^{i pi a / 2^s} is sincospif of an exactly representable fraction (a < 2^24);
// larger a (only for N >= 2^25) is split as a = a_hi + a_lo, both exact, and the two unit factors
// multiplied (one extra rounding). No fast-math __sincosf anywhere.
//
// Sizes: log2 N2 = min(13, ceil(log2 N / 2)), log2 N1 = log2 N - log2 N2 (5 <= both; N1 <= 2^14),
// so 2^15 <= N <= 2^27: L up to 2^27. C = max(1, min(16, 8192 / N1)) columns per column block.
//   shared memory per block: column passes C * N1 * 8 B <= 64 KiB (128 KiB only at N1 = 2^14,
//   i.e. N = 2^27); row passes 2 * N2 * 8 B (4 KiB at N = 2^15, 16 KiB at 2^20, <= 128 KiB).
//   global traffic per (b, d) row (8N = one row of ws or of a spectrum), forward: x read
//   (L * sizeof(T)), ws written 8N | ws read 8N, kf read 8N, ws written 8N | ws read 8N, y written
//   L * sizeof(T): 40N + 2L * sizeof(T) bytes (the one-block kernel: 8N + 2L * sizeof(T)).
//   Backward dx + product spectra: x's spectrum (L * sizeof(T) + 8N + 8N + 8N to prod), then
//   flip(dy) through the three passes with prod read-modify-written in pass 2: 80N + 3L * sizeof(T).
//   dk per d: nb product rows read (nb * 8N), ws 8N + 8N, dk written 4L. k's spectrum per d: 24N + 4L.
// Workspace: ws_rows rows of N complex64; the launchers walk the rows in chunks of ws_rows.
#pragma once

#include "fftconv.cuh"

namespace mk {

constexpr int kFft4MaxRowLog2 = 13;  // N1 = N / N2 <= 2^14 follows from N <= 2^kFft4MaxLog2
constexpr int kFft4ColElems = 8192;    // C * N1 <= 8192 (64 KiB) unless N1 alone is larger

struct Fft4Plan {
  int log2n, log2n1, log2n2, log2c;
};

__host__ __device__ __forceinline__ Fft4Plan fft4_plan(int log2n) {
  Fft4Plan p;
  p.log2n = log2n;
  p.log2n2 = imin(kFft4MaxRowLog2, (log2n + 1) / 2);
  p.log2n1 = log2n - p.log2n2;
  p.log2c = imax(0, imin(4, ilog2(kFft4ColElems) - p.log2n1));
  return p;
}
__host__ __device__ __forceinline__ int fft4_col_threads(const Fft4Plan& p) { return fft_threads(p.log2n1 + p.log2c); }
__host__ __device__ __forceinline__ int fft4_row_threads(const Fft4Plan& p) { return fft_threads(p.log2n2 + 1); }
__host__ __device__ __forceinline__ std::size_t fft4_col_smem_bytes(const Fft4Plan& p) {
  return fft_smem_bytes(p.log2n1 + p.log2c);
}
__host__ __device__ __forceinline__ std::size_t fft4_row_smem_bytes(const Fft4Plan& p) {
  return fft_smem_bytes(p.log2n2 + 1);
}

// e^{sign i pi a / 2^s} for an integer a >= 0: a / 2^s is exact in fp32 for a < 2^24; above, the
// low 12 bits go into a second exact factor.
__device__ __forceinline__ float2 cispi_frac(unsigned int a, int s, float sign) {
  const float scale = __int_as_float((127 - s) << 23);  // 2^-s exactly
  if (a < (1u << 24)) return cispi(sign * static_cast<float>(a) * scale);
  const unsigned int lo = a & 0xFFFu;
  return cmul(cispi(sign * static_cast<float>(a - lo) * scale), cispi(sign * static_cast<float>(lo) * scale));
}
// W_N^(e) with e reduced mod N = 2^log2n: e^{sign 2 pi i e / N} = e^{sign i pi e / 2^(log2n - 1)}
__device__ __forceinline__ float2 fft4_twiddle(unsigned int e, int log2n, float sign) {
  return cispi_frac(e & ((1u << log2n) - 1u), log2n - 1, sign);
}

// position of spectrum bin k (0 <= k <= N) in the pass-2 layout
__device__ __forceinline__ std::int64_t fft4_pos(int k, const Fft4Plan& p) {
  if (k == (1 << p.log2n)) return k;
  return (static_cast<std::int64_t>(k & ((1 << p.log2n1) - 1)) << p.log2n2) + (k >> p.log2n1);
}

// ------------------------------------------------------------------------------------------------
// Column passes. grid = (rows, N2 / C); blockDim = fft4_col_threads; smem fft4_col_smem_bytes.
// a[c * N1 + i] holds column col0 + c; thread i -> (c = i mod C, n1 = i / C) so consecutive threads
// touch consecutive columns (contiguous in global memory).
// ------------------------------------------------------------------------------------------------

// ws[row][k1 * N2 + n2] = sum_n1 W_N1^(n1 k1) z[N2 n1 + n2], z from src row zero-padded to 2N
// (FLIP: r[s] = src[L - 1 - s]).
template <class T, bool FLIP>
__global__ void __launch_bounds__(kFftMaxThreads) fft4_col_fwd_kernel(const T* __restrict__ src,
                                                                      float2* __restrict__ ws, int L, Fft4Plan p) {
  MK_DYNAMIC_SMEM(float2, a);
  const int c_mask = (1 << p.log2c) - 1;
  const int count = 1 << (p.log2n1 + p.log2c);
  const int col0 = blockIdx.y << p.log2c;
  const std::int64_t row = blockIdx.x;
  const T* s = src + row * L;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int c = i & c_mask, n1 = i >> p.log2c;
    const int m = (n1 << p.log2n2) + col0 + c;
    const int s0 = 2 * m, s1 = 2 * m + 1;
    const float v0 = s0 < L ? to_f32(s[FLIP ? L - 1 - s0 : s0]) : 0.0f;
    const float v1 = s1 < L ? to_f32(s[FLIP ? L - 1 - s1 : s1]) : 0.0f;
    a[(c << p.log2n1) + bitrev(n1, p.log2n1)] = make_float2(v0, v1);
  }
  fft_dit<false>(a, p.log2n1, p.log2c);
  float2* out = ws + (row << p.log2n);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int c = i & c_mask, k1 = i >> p.log2c;
    out[(k1 << p.log2n2) + col0 + c] = a[(c << p.log2n1) + k1];
  }
}

// dst row (length L, FLIP: reversed) = the real samples of (1/N) * inverse N1-point FFTs of the
// columns of ws (pass 2 already applied the inverse row FFTs and conjugate twiddles).
template <class T, bool FLIP>
__global__ void __launch_bounds__(kFftMaxThreads) fft4_col_inv_kernel(const float2* __restrict__ ws,
                                                                      T* __restrict__ dst, int L, Fft4Plan p) {
  MK_DYNAMIC_SMEM(float2, a);
  const int c_mask = (1 << p.log2c) - 1;
  const int count = 1 << (p.log2n1 + p.log2c);
  const int col0 = blockIdx.y << p.log2c;
  const std::int64_t row = blockIdx.x;
  const float2* in = ws + (row << p.log2n);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int c = i & c_mask, k1 = i >> p.log2c;
    a[(c << p.log2n1) + bitrev(k1, p.log2n1)] = in[(k1 << p.log2n2) + col0 + c];
  }
  fft_dit<true>(a, p.log2n1, p.log2c);
  const float scale = __int_as_float((127 - p.log2n) << 23);  // 1/N exactly
  T* d = dst + row * L;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int c = i & c_mask, n1 = i >> p.log2c;
    const int m = (n1 << p.log2n2) + col0 + c;
    const int s0 = 2 * m, s1 = 2 * m + 1;
    if (s0 >= L) continue;
    const float2 v = a[(c << p.log2n1) + n1];
    d[FLIP ? L - 1 - s0 : s0] = from_f32<T>(v.x * scale);
    if (s1 < L) d[FLIP ? L - 1 - s1 : s1] = from_f32<T>(v.y * scale);
  }
}

// ------------------------------------------------------------------------------------------------
// Row passes. grid = (rows, N1 / 2 + 1); block j owns rows j and N1 - j (j = 0 and N1 / 2: one
// row); a[0, N2) = row j, a[N2, 2 N2) = row N1 - j. blockDim = fft4_row_threads, smem
// fft4_row_smem_bytes.
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ int fft4_row_count(const Fft4Plan& p) {  // 1 or 2 rows in this block
  const int j = blockIdx.y;
  return (j == 0 || 2 * j == (1 << p.log2n1)) ? 1 : 2;
}

// a[slot * N2 + rev(n2)] = ws[r][n2] * W_N^(n2 r) for the block's rows r; then the forward row FFTs.
__device__ __forceinline__ void fft4_row_forward(float2* a, const float2* __restrict__ ws_row, const Fft4Plan& p) {
  const int j = blockIdx.y;
  const int n1 = 1 << p.log2n1, n2 = 1 << p.log2n2;
  const int rows = fft4_row_count(p);
  for (int i = threadIdx.x; i < rows * n2; i += blockDim.x) {
    const int slot = i >> p.log2n2, c = i & (n2 - 1);
    const int r = slot ? n1 - j : j;
    const float2 v = ws_row[(static_cast<std::int64_t>(r) << p.log2n2) + c];
    const float2 w = fft4_twiddle(static_cast<unsigned int>(c) * static_cast<unsigned int>(r), p.log2n, -1.0f);
    a[(slot << p.log2n2) + bitrev(c, p.log2n2)] = cmul(v, w);
  }
  fft_dit<false>(a, p.log2n2, rows - 1);
}

// For every spectrum pair (k, N - k) with k in the block's rows (one thread per pair):
// f(k, ia, ib) with ia, ib the smem slots of Z[k], Z[N - k] (k = 0: ia = ib = 0 stands for the
// pair X[0], X[N]). No barrier.
template <class F>
__device__ __forceinline__ void fft4_row_pairs(const Fft4Plan& p, F f) {
  const int j = blockIdx.y;
  const int n1 = 1 << p.log2n1, n2 = 1 << p.log2n2;
  const int pairs = j == 0 ? n2 / 2 + 1 : (2 * j == n1 ? n2 / 2 : n2);
  for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
    const int k = j + (t << p.log2n1);
    int ib;
    if (j == 0) ib = (n2 - t) & (n2 - 1);  // k = N1 t: N - k = N1 (N2 - t)
    else if (2 * j == n1) ib = n2 - 1 - t;  // same row
    else ib = n2 + (n2 - 1 - t);            // row N1 - j, k2 = N2 - 1 - t
    f(k, t, ib);
  }
}

// The real-FFT split of fft_real_pairs for one pair: X[k], X[N-k] (k = 0: X[0], X[N]) from the
// complex spectrum values zk = Z[k], znk = Z[N-k].
__device__ __forceinline__ void fft4_split(int k, float2 zk, float2 znk, int log2n, float2& xk, float2& xnk) {
  if (k == 0) {
    xk = make_float2(zk.x + zk.y, 0.0f);
    xnk = make_float2(zk.x - zk.y, 0.0f);
    return;
  }
  const float2 e = make_float2(0.5f * (zk.x + znk.x), 0.5f * (zk.y - znk.y));
  const float2 o = make_float2(0.5f * (zk.y + znk.y), -0.5f * (zk.x - znk.x));
  const float2 wo = cmul(cispi_frac(static_cast<unsigned int>(k), log2n, -1.0f), o);
  xk = cadd(e, wo);
  xnk = cconj(csub(e, wo));
}

// fft_merge_pair for one pair, into smem slots ia, ib (ia == ib: k = 0 or the self pair N/2).
__device__ __forceinline__ void fft4_merge(float2* a, int k, int ia, int ib, float2 yk, float2 ynk, int log2n) {
  const float2 e = make_float2(0.5f * (yk.x + ynk.x), 0.5f * (yk.y - ynk.y));
  const float2 d = make_float2(0.5f * (yk.x - ynk.x), 0.5f * (yk.y + ynk.y));
  const float2 o = cmul(d, cispi_frac(static_cast<unsigned int>(k), log2n, 1.0f));
  a[ia] = make_float2(e.x - o.y, e.y + o.x);
  if (ib != ia) a[ib] = make_float2(e.x + o.y, o.x - e.y);
}

// After the merges (barrier inside): bit-reverse each row, inverse row FFTs, conjugate twiddles,
// ws[r][n2] = result.
__device__ __forceinline__ void fft4_row_inverse(float2* a, float2* __restrict__ ws_row, const Fft4Plan& p) {
  const int j = blockIdx.y;
  const int n1 = 1 << p.log2n1, n2 = 1 << p.log2n2;
  const int rows = fft4_row_count(p);
  __syncthreads();
  for (int i = threadIdx.x; i < rows * n2; i += blockDim.x) {
    const int slot = i >> p.log2n2, c = i & (n2 - 1);
    const int rc = static_cast<int>(bitrev(c, p.log2n2));
    if (c < rc) {
      float2* row = a + (slot << p.log2n2);
      const float2 t = row[c];
      row[c] = row[rc];
      row[rc] = t;
    }
  }
  fft_dit<true>(a, p.log2n2, rows - 1);
  for (int i = threadIdx.x; i < rows * n2; i += blockDim.x) {
    const int slot = i >> p.log2n2, c = i & (n2 - 1);
    const int r = slot ? n1 - j : j;
    const float2 w = fft4_twiddle(static_cast<unsigned int>(c) * static_cast<unsigned int>(r), p.log2n, 1.0f);
    ws_row[(static_cast<std::int64_t>(r) << p.log2n2) + c] = cmul(a[(slot << p.log2n2) + c], w);
  }
}

// spec[row] (N + 1 bins, layout pos) = the real spectrum of the pass-1 output ws[row].
__global__ void __launch_bounds__(kFftMaxThreads) fft4_row_spectrum_kernel(const float2* __restrict__ ws,
                                                                           float2* __restrict__ spec, Fft4Plan p) {
  MK_DYNAMIC_SMEM(float2, a);
  const std::int64_t row = blockIdx.x;
  fft4_row_forward(a, ws + (row << p.log2n), p);
  float2* out = spec + row * ((std::int64_t(1) << p.log2n) + 1);
  fft4_row_pairs(p, [&](int k, int ia, int ib) {
    float2 xk, xnk;
    fft4_split(k, a[ia], a[ib], p.log2n, xk, xnk);
    out[fft4_pos(k, p)] = xk;
    out[fft4_pos((1 << p.log2n) - k, p)] = xnk;  // k = 0: X[N] at N
  });
}

// Row r = row0 + blockIdx.x (d = r mod D): X = spectrum of ws[blockIdx.x]; if prod:
// prod[blockIdx.x] *= X (bins in layout pos); if out: ws[blockIdx.x] <- pass 2 of irfft(X * kf[d]).
// Each pair's slots are read and written by one thread only, so the merge needs no barrier.
__global__ void __launch_bounds__(kFftMaxThreads) fft4_row_conv_kernel(float2* __restrict__ ws,
                                                                       const float2* __restrict__ kf,
                                                                       float2* __restrict__ prod, int D,
                                                                       std::int64_t row0, bool out, Fft4Plan p) {
  MK_DYNAMIC_SMEM(float2, a);
  const std::int64_t bins = (std::int64_t(1) << p.log2n) + 1;
  const std::int64_t row = blockIdx.x;
  float2* wr = ws + (row << p.log2n);
  const float2* kr = kf + ((row0 + row) % D) * bins;
  float2* pr = prod ? prod + row * bins : nullptr;
  fft4_row_forward(a, wr, p);
  fft4_row_pairs(p, [&](int k, int ia, int ib) {
    float2 xk, xnk;
    fft4_split(k, a[ia], a[ib], p.log2n, xk, xnk);
    const std::int64_t pk = fft4_pos(k, p), pnk = fft4_pos((1 << p.log2n) - k, p);
    if (pr) {
      pr[pk] = cmul(xk, pr[pk]);
      if (pnk != pk) pr[pnk] = cmul(xnk, pr[pnk]);  // the middle bin N/2 is its own partner
    }
    if (out) fft4_merge(a, k, ia, ib, cmul(xk, kr[pk]), cmul(xnk, kr[pnk]), p.log2n);
  });
  if (out) fft4_row_inverse(a, wr, p);  // uniform over the grid
}

// Per d = d0 + blockIdx.x: S = (acc[d] if accumulate) + sum_{b < nb} prod[b, d] (fixed order, so
// deterministic); then acc[d] = S, or (finalize) ws[blockIdx.x] <- pass 2 of irfft(S).
__global__ void __launch_bounds__(kFftMaxThreads) fft4_row_dk_kernel(const float2* __restrict__ prod,
                                                                     float2* __restrict__ acc, float2* __restrict__ ws,
                                                                     int nb, int D, std::int64_t d0, bool accumulate,
                                                                     bool finalize, Fft4Plan p) {
  MK_DYNAMIC_SMEM(float2, a);
  const std::int64_t bins = (std::int64_t(1) << p.log2n) + 1;
  const std::int64_t d = d0 + blockIdx.x;
  auto total = [&](std::int64_t pos) {
    float2 s = accumulate ? acc[d * bins + pos] : make_float2(0.0f, 0.0f);
    for (int b = 0; b < nb; ++b) s = cadd(s, prod[(static_cast<std::int64_t>(b) * D + d) * bins + pos]);
    return s;
  };
  fft4_row_pairs(p, [&](int k, int ia, int ib) {
    const std::int64_t pk = fft4_pos(k, p), pnk = fft4_pos((1 << p.log2n) - k, p);
    const float2 sk = total(pk), snk = total(pnk);
    if (finalize) {
      fft4_merge(a, k, ia, ib, sk, snk, p.log2n);
    } else {
      acc[d * bins + pk] = sk;
      acc[d * bins + pnk] = snk;
    }
  });
  if (finalize) fft4_row_inverse(a, ws + (static_cast<std::int64_t>(blockIdx.x) << p.log2n), p);
}

// Test hook: out[i] = e^{sign i pi a[i] / 2^s} as the passes compute it (cispi_frac), so the
// split branch for a >= 2^24 (only reached at N >= 2^25, too long for the emulator) is checked.
__global__ void __launch_bounds__(256) fft4_twiddle_probe_kernel(const unsigned int* __restrict__ a,
                                                                  float2* __restrict__ out, int n, int s, float sign) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cispi_frac(a[i], s, sign);
}

}  // namespace mk
