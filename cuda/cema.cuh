// CEMA Vandermonde sums (cema_kernel fwd/bwd, ema_hidden fwd/bwd): every output is a sum over
// n (synthesis) or over the sequence index j (analysis) of a coefficient times q[d,n]**e(j).
//
// Real type R. Every kernel is a template over R, the type of the coefficients (p, log_q, gamma,
// hx as interleaved (re, im) pairs), of the outputs and of all accumulation: float (fp32 p,
// complex64 parameters) or double (fp64 p, complex128). The analysis input x may be narrower
// than R (bf16 or fp32 x with double coefficients): it is widened once on load.
//
// Powers (ops/_vandermonde.py's rule). With the sequence split into rows of T positions,
// q**e(j) = Q2[row] * Q1[col], and each table entry is evaluated on its own in double:
// exp(e * log|q|), the phase in turns e * arg(q)/(2 pi) reduced mod 1 in double, sincospi in
// double. R = float: e * log|q| is exact (a 24-bit fp32 times an integer < 2**24) and the entry is
// rounded ONCE to fp32. R = double: the entry stays in double; arg(q)/(2 pi) is kept as a
// double-double and the rounding errors of e * log|q| and e * phi are recovered by FMAs, so each
// entry is a few ulps from exact at any e (qpow).
// No power is built by repeated multiplication and no phase j*arg(q) is formed in fp32, so a product
// Q2*Q1 is two roundings and one complex product from exact at any j (< 2**24).
//
// Layouts: forward e(j) = j + shift (rows from j = 0; `shift` = 1 is the bias's q**(t+1), put on
// Q2 so Q1 is shared), reverse e(j) = L-1-j (ema_hidden) with the sequence padded at the FRONT to
// M*T positions, so that position j' = row*T + col has e = (M-1-row)*T + (T-1-col): both factors
// have non-negative exponents (|factor| <= 1 for |q| <= 1, no overflow).
//
// Tiles. NP = N padded to 16, 32 or 64 (N <= 64) and T = 2048 / NP (128, 64, 32) for both real
// types, so a table [NP][T] of Q1 is always 2048 complex values (16 KiB fp32, 32 KiB fp64) and a
// block of 256 threads covers it.
//  * synthesis (k, b, dx): block (d, y) loops over tiles y, y + Y, ... of RT = rows * (256 / T) rows;
//    thread = (column, row group), `rows` rows each (syn_rows: 4, except fp64 at NP = 64: 1, so the
//    Q2 tile [RT][NP] stays within 512 complex128 and the block within the 48 KiB static limit);
//    Q1 [N][T] in shared memory built once per block, Q2 [RT][NP] once per tile (and once more with
//    the shift for b); per output row a coefficient c[n] (p gamma, gamma hx_b or p conj(dh_b)),
//    V = c Q1[n][col] once per n, then 2 FMAs per row.
//  * analysis (cema bwd, ema_hidden fwd): thread = (n, column group of 8), its 8 Q1 values in
//    registers; a tile = A rows x T of the input staged in shared memory (A = 32 fp32, 16 fp64:
//    the fp64 input tile and Q2 [A][NP] take the same bytes as fp32's), Q2 [A][NP] per tile:
//    P = sum_col w Q1, P1 = sum_col w E1 Q1 per row, then S += Q2 P, S1 += Q2 (E2 P + P1).
//    Per-thread sums -> fixed-order block reduction over column groups -> one partial per
//    (row, d, y, n) in a workspace; a finishing kernel (cema_kernel.cu, ema_hidden.cu: one thread
//    per coefficient) sums the Y partials in order and forms the gradients / h. Results are
//    deterministic: no atomics, the partition depends only on (D, N, L, R).
#pragma once

#include "common.cuh"
#if !MK_NVRTC  // NVRTC: libcu++'s, from emu/emu.cuh
#include <type_traits>
#endif

namespace mk {
namespace cema {

constexpr int kThreads = 256;
constexpr int kMaxN = 64;
constexpr int kTableSize = 2048;     // NP * T
constexpr int kMaxT = kTableSize / 16;
constexpr int kSynRowsMax = 4;       // rows per synthesis thread (registers acc[4])
constexpr int kAnaCols = 8;          // columns per analysis thread
constexpr int kFinishThreads = 128;

// Four reals of the analysis partial sums (S.re, S.im, S1.re, S1.im) in double. Not CUDA's double4
// (deprecated in CUDA 13 for its ambiguous alignment): 16-byte aligned, loaded as two 16-byte halves.
struct alignas(16) dsum4 {
  double x, y, z, w;
};

// Per real type: complex (c2) and 4-vector (c4) types, and the tile sizes that keep every kernel
// within the 48 KiB of static shared memory.
template <class R>
struct Real;
template <>
struct Real<float> {
  using c2 = float2;
  using c4 = float4;
  static constexpr int kAnaRows = 32;                // analysis rows per tile
  static constexpr int kSynQ2 = kMaxN * kMaxN / 2;   // Q2 tile entries: RT * NP <= NP * NP / 2
};
template <>
struct Real<double> {
  using c2 = double2;
  using c4 = dsum4;
  static constexpr int kAnaRows = 16;   // 16 KiB input + 16 KiB Q2 + 8 KiB reduction = 40 KiB
  static constexpr int kSynQ2 = 512;    // 32 KiB Q1 + 8 KiB Q2 + 1 KiB coefficients = 41 KiB
};
template <class R>
using c2_t = typename Real<R>::c2;
template <class R>
using c4_t = typename Real<R>::c4;

__host__ __device__ __forceinline__ int padded_n(int N) { return N <= 16 ? 16 : (N <= 32 ? 32 : 64); }

// Rows per synthesis thread: kSynRowsMax where the Q2 tile [(256 / T) * rows][NP] fits Real<R>::kSynQ2.
template <class R>
__host__ __device__ __forceinline__ int syn_rows(int NP) {
  if constexpr (std::is_same_v<R, float>) {
    return kSynRowsMax;  // (NP / 8) * 4 * NP = NP * NP / 2 = kSynQ2 at NP = 64
  } else {
    const int fit = Real<R>::kSynQ2 * kTableSize / (kThreads * NP * NP);  // fp64: 4, 4, 1
    return fit < kSynRowsMax ? fit : kSynRowsMax;
  }
}

// ------------------------------------------------------------------------------------------------
// Complex arithmetic on (re, im) pairs of either real type
// ------------------------------------------------------------------------------------------------
__host__ __device__ __forceinline__ float rfma(float a, float b, float c) { return fmaf(a, b, c); }
__host__ __device__ __forceinline__ double rfma(double a, double b, double c) { return fma(a, b, c); }

template <class R>
__host__ __device__ __forceinline__ c2_t<R> mkc(R x, R y) {
  if constexpr (std::is_same_v<R, float>) {
    return make_float2(x, y);
  } else {
    return make_double2(x, y);
  }
}
template <class R>
__host__ __device__ __forceinline__ c4_t<R> mkc4(R x, R y, R z, R w) {
  if constexpr (std::is_same_v<R, float>) {
    return make_float4(x, y, z, w);
  } else {
    dsum4 v;
    v.x = x;
    v.y = y;
    v.z = z;
    v.w = w;
    return v;
  }
}

__host__ __device__ __forceinline__ float2 cmul(float2 a, float2 b) {
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__host__ __device__ __forceinline__ double2 cmul(double2 a, double2 b) {
  return make_double2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
// acc + a * b in explicit FMAs: the same roundings whatever the compiler contracts around it (nvcc
// contracts a*b+c by default, and may do so differently in differently shaped code: the weighted and
// unweighted analysis kernels must give bitwise the same S).
__host__ __device__ __forceinline__ float2 cmac(float2 acc, float2 a, float2 b) {
  return make_float2(rfma(a.x, b.x, rfma(-a.y, b.y, acc.x)), rfma(a.x, b.y, rfma(a.y, b.x, acc.y)));
}
__host__ __device__ __forceinline__ double2 cmac(double2 acc, double2 a, double2 b) {
  return make_double2(rfma(a.x, b.x, rfma(-a.y, b.y, acc.x)), rfma(a.x, b.y, rfma(a.y, b.x, acc.y)));
}
__host__ __device__ __forceinline__ float2 cconj(float2 a) { return make_float2(a.x, -a.y); }
__host__ __device__ __forceinline__ double2 cconj(double2 a) { return make_double2(a.x, -a.y); }
__host__ __device__ __forceinline__ float2 cadd(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__host__ __device__ __forceinline__ double2 cadd(double2 a, double2 b) { return make_double2(a.x + b.x, a.y + b.y); }
// s + z * P of the analysis kernel: explicit FMAs for float (cmac); double keeps the contractible
// form (explicit FMAs there cost 4 bytes of spills in the unweighted fp64 kernel on sm_80).
__host__ __device__ __forceinline__ float2 acc_cmul(float2 s, float2 z, float2 p) { return cmac(s, z, p); }
__host__ __device__ __forceinline__ double2 acc_cmul(double2 s, double2 z, double2 p) { return cadd(s, cmul(z, p)); }
template <class V>
__host__ __device__ __forceinline__ V add4(V a, V b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
  return a;
}

template <class R>
__device__ __forceinline__ c2_t<R> load_c(const R* __restrict__ p, std::int64_t idx) {
  return mkc<R>(p[2 * idx], p[2 * idx + 1]);
}

// ------------------------------------------------------------------------------------------------
// Powers
// ------------------------------------------------------------------------------------------------
// log|q| and arg(q)/(2 pi) of coefficient idx (log_q interleaved re, im), in double; for R = double
// the turns carry a low part: phi + phi_lo = arg(q) / (2 pi) to ~2**-106 (a double-double product
// with 1/(2 pi) = kInv2PiHi + kInv2PiLo).
struct Root {
  double a, phi, phi_lo;
};

constexpr double kInv2PiHi = 0.15915494309189535;     // 1/(2 pi) rounded to double
constexpr double kInv2PiLo = -9.839338337591243e-18;  // 1/(2 pi) - kInv2PiHi

template <class R>
__device__ __forceinline__ Root load_root(const R* __restrict__ log_q, std::int64_t idx) {
  Root r;
  r.a = static_cast<double>(log_q[2 * idx]);
  const double theta = static_cast<double>(log_q[2 * idx + 1]);
  const double phi = theta * kInv2PiHi;
  r.phi = phi - rint(phi);  // exact; |phi| <= 1/2 keeps e * phi small
  // used by R = double only (dead code for float): the product's rounding error and the constant's tail
  r.phi_lo = fma(theta, kInv2PiHi, -phi) + theta * kInv2PiLo;
  return r;
}

// q**e for an integer exponent 0 <= e < 2**24, evaluated in double; R = float rounds it once.
// R = double: e * log|q| and e * (phi + phi_lo) are formed with their rounding errors recovered by
// FMAs, so the reduced phase and the magnitude are a few ulps from exact whatever e is: a power's
// error does not grow with e (the float64 reference's exp(e * log_q) grows ~e * 2**-53 * |arg q|).
template <class R>
__device__ __forceinline__ c2_t<R> qpow(Root q, std::int64_t e) {
  const double ed = static_cast<double>(e);
  const double m = ed * q.a;                 // fp32 log|q|: exact
  double mag = exp(m);
  double t = ed * q.phi;                     // turns, |t| < 2**23
  if constexpr (std::is_same_v<R, float>) {
    t -= rint(t);                            // rounding <= 2**-30 turns: far below fp32
  } else {
    mag = fma(mag, fma(ed, q.a, -m), mag);   // exp(m + dm) = exp(m) (1 + dm), |dm| <= ulp(m)
    const double lo = fma(ed, q.phi, -t) + ed * q.phi_lo;  // ed * (phi + phi_lo) = t + lo
    t = (t - rint(t)) + lo;                  // reduction exact, then the low part
  }
  double s, c;
  sincospi(2.0 * t, &s, &c);
  return mkc<R>(static_cast<R>(mag * c), static_cast<R>(mag * s));
}

// Exponent of row `row` (Q2) and column `col` (Q1) in either layout.
template <bool REVERSE>
__device__ __forceinline__ std::int64_t row_exponent(std::int64_t row, std::int64_t M, int T, int shift) {
  if (row >= M) return 0;  // rows past the end: finite powers, never stored / weighted by 0
  return REVERSE ? (M - 1 - row) * T : row * T + shift;
}
template <bool REVERSE>
__device__ __forceinline__ int col_exponent(int col, int T) {
  return REVERSE ? T - 1 - col : col;
}

// ------------------------------------------------------------------------------------------------
// Synthesis: out_o[d, j] = Re sum_n c_o[n] q**e(j) for output rows o
// ------------------------------------------------------------------------------------------------
enum SynthMode : int { kSynthCema = 0, kSynthHiddenDx = 1 };

// Coefficient of output o:
//  kSynthCema:     o = 0 (when has_k): p gamma -> k (shift 0); o >= has_k: gamma hx_b -> b (shift 1)
//  kSynthHiddenDx: o = b: p conj(dh_b) -> dx_b (reverse layout)
template <int MODE, class R>
__device__ __forceinline__ c2_t<R> synth_coef(int o, int n, int d, int D, int N, bool has_k, const R* __restrict__ p,
                                              const R* __restrict__ gamma, const R* __restrict__ rows) {
  const std::int64_t c = static_cast<std::int64_t>(d) * N + n;
  if (MODE == kSynthCema) {
    const c2_t<R> g = load_c(gamma, c);
    if (has_k && o == 0) return mkc<R>(p[c] * g.x, p[c] * g.y);
    const int b = o - (has_k ? 1 : 0);
    return cmul(g, load_c(rows, static_cast<std::int64_t>(b) * D * N + c));
  }
  const c2_t<R> h = load_c(rows, static_cast<std::int64_t>(o) * D * N + c);
  return mkc<R>(p[c] * h.x, -p[c] * h.y);
}

template <int MODE, class R>
__device__ __forceinline__ R* synth_out(int o, int d, int D, std::int64_t L, bool has_k, R* __restrict__ out0,
                                        R* __restrict__ outs) {
  if (MODE == kSynthCema) {
    if (has_k && o == 0) return out0 + static_cast<std::int64_t>(d) * L;
    return outs + (static_cast<std::int64_t>(o - (has_k ? 1 : 0)) * D + d) * L;
  }
  return outs + (static_cast<std::int64_t>(o) * D + d) * L;
}

// grid (D, Y), block kThreads. nout outputs: cema: has_k + B, dx: B.
// Blocks per multiprocessor the synthesis kernel is built for (__launch_bounds__' second argument;
// 0: ptxas chooses). fp64 before sm_90: 3, no more than its 41 KiB of static shared memory allows
// there anyway (A100: 3 blocks); without it ptxas spills 4 B on NVRTC's PTX, which addresses shared
// memory with 64-bit pointers where nvcc's uses 32-bit ones. fp32 and sm_90 keep ptxas' choice.
template <class R>
constexpr int synth_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return std::is_same_v<R, double> ? 3 : 0;
#else
  return 0;
#endif
}

template <int MODE, class R>
__global__ void __launch_bounds__(kThreads, synth_min_blocks<R>())
    cema_synth_kernel(const R* __restrict__ p, const R* __restrict__ log_q, const R* __restrict__ gamma,
                      const R* __restrict__ rows, R* __restrict__ out0, R* __restrict__ outs, int D, int N,
                      std::int64_t L, int nout, bool has_k) {
  using C = c2_t<R>;
  constexpr bool REVERSE = MODE == kSynthHiddenDx;
  MK_STATIC_SMEM(C, q1, kTableSize);          // [N][T]
  MK_STATIC_SMEM(C, q2, Real<R>::kSynQ2);     // [RT][NP]
  MK_STATIC_SMEM(C, cs, kMaxN);               // coefficients of the current output row
  const int d = blockIdx.x;
  const int tid = threadIdx.x;
  const int NP = padded_n(N);
  const int T = kTableSize / NP;
  const int G = kThreads / T;              // row groups
  const int rows_pt = syn_rows<R>(NP);     // rows per thread
  const int RT = G * rows_pt;              // rows per tile
  const std::int64_t M = (L + T - 1) / T;
  const std::int64_t pad = REVERSE ? M * T - L : 0;
  const std::int64_t tiles = (M + RT - 1) / RT;
  const int col = tid % T;
  const int grp = tid / T;
  const std::int64_t cbase = static_cast<std::int64_t>(d) * N;

  for (int i = tid; i < N * T; i += kThreads) {
    const int n = i / T;
    q1[i] = qpow<R>(load_root(log_q, cbase + n), col_exponent<REVERSE>(i % T, T));
  }
  for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const std::int64_t row0 = tile * RT;
    for (int o = 0; o < nout; ++o) {
      // Q2 for this tile: once for k / dx, once more with shift 1 at the first bias row.
      const bool build = o == 0 || (MODE == kSynthCema && has_k && o == 1);
      const int shift = (MODE == kSynthCema && !(has_k && o == 0)) ? 1 : 0;
      __syncthreads();  // the previous output's readers of q2 / cs are done
      if (build) {
        for (int i = tid; i < RT * N; i += kThreads) {
          const int m = i / N, n = i % N;
          q2[m * NP + n] = qpow<R>(load_root(log_q, cbase + n), row_exponent<REVERSE>(row0 + m, M, T, shift));
        }
      }
      if (tid < N) cs[tid] = synth_coef<MODE, R>(o, tid, d, D, N, has_k, p, gamma, rows);
      __syncthreads();
      R acc[kSynRowsMax];
#pragma unroll
      for (int i = 0; i < kSynRowsMax; ++i) acc[i] = R(0);
      for (int n = 0; n < N; ++n) {
        const C v = cmul(cs[n], q1[n * T + col]);
#pragma unroll
        for (int i = 0; i < kSynRowsMax; ++i) {
          if (i < rows_pt) {  // uniform; always true for fp32
            const C z = q2[(grp + G * i) * NP + n];
            acc[i] = rfma(v.x, z.x, rfma(-v.y, z.y, acc[i]));
          }
        }
      }
      R* out = synth_out<MODE, R>(o, d, D, L, has_k, out0, outs);
#pragma unroll
      for (int i = 0; i < kSynRowsMax; ++i) {
        const std::int64_t j = (row0 + grp + G * i) * T + col - pad;
        if (i < rows_pt && j >= 0 && j < L) out[j] = acc[i];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Analysis: S_o[n] = sum_j w_o[j] q**e(j), S1_o[n] = sum_j w_o[j] e(j) q**e(j) (WEIGHTED)
// ------------------------------------------------------------------------------------------------
enum AnalysisMode : int { kAnalysisCema = 0, kAnalysisHidden = 1 };

// Input row o: kAnalysisCema: o = 0 (when has_k) dk (shift 0), o >= has_k: db_b (shift 1);
// kAnalysisHidden: x_b (reverse layout).
template <int MODE, class XT>
__device__ __forceinline__ const XT* analysis_row(int o, int d, int D, std::int64_t L, bool has_k,
                                                  const XT* __restrict__ x0, const XT* __restrict__ xs) {
  if (MODE == kAnalysisCema && has_k && o == 0) return x0 + static_cast<std::int64_t>(d) * L;
  const int b = o - ((MODE == kAnalysisCema && has_k) ? 1 : 0);
  return xs + (static_cast<std::int64_t>(b) * D + d) * L;
}

// grid (D, Y), block kThreads. partial: c4 (S.re, S.im, S1.re, S1.im) [nrows][D][Y][N].
template <int MODE, class XT, class R, bool WEIGHTED>
__global__ void __launch_bounds__(kThreads)
    cema_analysis_kernel(const XT* __restrict__ x0, const XT* __restrict__ xs, const R* __restrict__ log_q,
                         c4_t<R>* __restrict__ partial, int D, int N, std::int64_t L, int nrows, bool has_k) {
  using C = c2_t<R>;
  using C4 = c4_t<R>;
  constexpr bool REVERSE = MODE == kAnalysisHidden;
  constexpr int A = Real<R>::kAnaRows;
  MK_STATIC_SMEM(C4, ws, A * kMaxT / 4);   // [A][T] inputs in R (T <= 128), as 4-vectors
  MK_STATIC_SMEM(C, q2, A * kMaxN);        // [A][NP]
  MK_STATIC_SMEM(C4, red, kThreads);       // per-thread (S, S1) for the block sum
  const int d = blockIdx.x;
  const int tid = threadIdx.x;
  const int NP = padded_n(N);
  const int T = kTableSize / NP;
  const int CG = kThreads / NP;  // column groups of kAnaCols: CG * kAnaCols = T
  const std::int64_t M = (L + T - 1) / T;
  const std::int64_t pad = REVERSE ? M * T - L : 0;
  const std::int64_t tiles = (M + A - 1) / A;
  const int n = tid % NP;
  const int cg = tid / NP;
  const bool active = n < N;
  const std::int64_t cbase = static_cast<std::int64_t>(d) * N;

  // This thread's 8 columns of Q1 and, for S1, E1 * Q1 (the inner exponent's weight).
  C q1[kAnaCols], q1e[kAnaCols];
  {
    const Root root = load_root(log_q, cbase + (active ? n : 0));
#pragma unroll
    for (int k = 0; k < kAnaCols; ++k) {
      const int e1 = col_exponent<REVERSE>(cg * kAnaCols + k, T);
      q1[k] = active ? qpow<R>(root, e1) : mkc<R>(R(0), R(0));
      q1e[k] = mkc<R>(q1[k].x * static_cast<R>(e1), q1[k].y * static_cast<R>(e1));
    }
  }
  for (int o = 0; o < nrows; ++o) {
    const int shift = (MODE == kAnalysisCema && !(has_k && o == 0)) ? 1 : 0;
    const XT* x = analysis_row<MODE, XT>(o, d, D, L, has_k, x0, xs);
    C s = mkc<R>(R(0), R(0)), s1 = mkc<R>(R(0), R(0));
    for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
      const std::int64_t row0 = tile * A;
      __syncthreads();  // the previous tile's readers of ws / q2 are done
      R* wsw = reinterpret_cast<R*>(ws);
      for (int i = tid; i < A * T; i += kThreads) {  // a tile is contiguous in the padded sequence
        const std::int64_t j = row0 * T + i - pad;
        wsw[i] = (j >= 0 && j < L) ? static_cast<R>(to_acc(x[j])) : R(0);  // widened once
      }
      for (int i = tid; i < A * N; i += kThreads) {
        const int m = i / N, nn = i % N;
        q2[m * NP + nn] = qpow<R>(load_root(log_q, cbase + nn), row_exponent<REVERSE>(row0 + m, M, T, shift));
      }
      __syncthreads();
      if (active) {
        for (int m = 0; m < A; ++m) {
          const C4 wa = ws[(m * T + cg * kAnaCols) / 4];
          const C4 wb = ws[(m * T + cg * kAnaCols) / 4 + 1];
          const R w[kAnaCols] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
          C P = mkc<R>(R(0), R(0)), P1 = mkc<R>(R(0), R(0));
#pragma unroll
          for (int k = 0; k < kAnaCols; ++k) {
            P.x = rfma(w[k], q1[k].x, P.x);
            P.y = rfma(w[k], q1[k].y, P.y);
            if (WEIGHTED) {
              P1.x = rfma(w[k], q1e[k].x, P1.x);
              P1.y = rfma(w[k], q1e[k].y, P1.y);
            }
          }
          const C z = q2[m * NP + n];
          s = acc_cmul(s, z, P);
          if (WEIGHTED) {
            const R e2 = static_cast<R>(row_exponent<REVERSE>(row0 + m, M, T, shift));  // exact: < 2**24
            s1 = acc_cmul(s1, z, mkc<R>(rfma(e2, P.x, P1.x), rfma(e2, P.y, P1.y)));
          }
        }
      }
    }
    // Fixed-order sum over the column groups: thread n adds cg = 0, 1, ... in turn.
    red[tid] = mkc4<R>(s.x, s.y, s1.x, s1.y);
    __syncthreads();
    if (tid < N) {
      C4 acc = red[tid];
      for (int g = 1; g < CG; ++g) acc = add4(acc, red[g * NP + tid]);
      partial[((static_cast<std::int64_t>(o) * D + d) * gridDim.y + blockIdx.y) * N + tid] = acc;
    }
    __syncthreads();  // red is rewritten by the next row
  }
}

// Sum of the Y partials of (row o, coefficient (d, n)), in order.
template <class C4>
__device__ __forceinline__ C4 sum_partials(const C4* __restrict__ partial, int o, std::int64_t d, std::int64_t n,
                                           int D, int N, int Y) {
  const C4* p = partial + ((static_cast<std::int64_t>(o) * D + d) * Y) * N + n;
  C4 acc = p[0];
#pragma unroll 1  // unrolled, the fp64 loads of the dsum4 partials made ptxas spill (sm_80)
  for (int y = 1; y < Y; ++y) acc = add4(acc, p[static_cast<std::int64_t>(y) * N]);
  return acc;
}

// ------------------------------------------------------------------------------------------------
// Per-coefficient finishing kernels (gradients and hidden states from the summed partials)
// ------------------------------------------------------------------------------------------------
// cema_kernel backward, one thread per coefficient (d, n): with S, S1 of dk and T, T1 of each db_b
//   dp = Re(S gamma), dgamma = conj(S p) + sum_b conj(T hx_b), dlog_q = conj(S1 p gamma) + sum_b conj(T1 gamma hx_b),
//   dhx_b = conj(T gamma)  (0 without db). Sums over b in order: deterministic.
template <class R>
__global__ void __launch_bounds__(kFinishThreads)
    cema_bwd_finish_kernel(const c4_t<R>* __restrict__ partial, const R* __restrict__ p, const R* __restrict__ gamma,
                           const R* __restrict__ hx, R* __restrict__ dp, R* __restrict__ dlog_q,
                           R* __restrict__ dgamma, R* __restrict__ dhx, int D, int N, int B, int Y, bool has_k,
                           bool has_b, bool weighted) {
  using C = c2_t<R>;
  using C4 = c4_t<R>;
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < DN;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t cd = c / N, cn = c % N;
    const R pc = p[c];
    const C g = load_c(gamma, c);
    R vdp = R(0);
    C vdg = mkc<R>(R(0), R(0)), vdl = mkc<R>(R(0), R(0));
    if (has_k) {
      const C4 a = sum_partials(partial, 0, cd, cn, D, N, Y);
      const C S = mkc<R>(a.x, a.y);
      vdp = S.x * g.x - S.y * g.y;
      vdg = mkc<R>(S.x * pc, -S.y * pc);
      if (weighted) vdl = cconj(cmul(mkc<R>(a.z, a.w), mkc<R>(pc * g.x, pc * g.y)));
    }
    for (int b = 0; b < B && !has_b; ++b) {
      const std::int64_t hc = static_cast<std::int64_t>(b) * DN + c;
      dhx[2 * hc] = R(0);
      dhx[2 * hc + 1] = R(0);
    }
    for (int b = 0; b < B && has_b; ++b) {
      const std::int64_t hc = static_cast<std::int64_t>(b) * DN + c;
      const C4 a = sum_partials(partial, b + (has_k ? 1 : 0), cd, cn, D, N, Y);
      const C Tb = mkc<R>(a.x, a.y);
      const C h = load_c(hx, hc);
      const C dh = cconj(cmul(Tb, g));
      dhx[2 * hc] = dh.x;
      dhx[2 * hc + 1] = dh.y;
      vdg = cadd(vdg, cconj(cmul(Tb, h)));
      if (weighted) vdl = cadd(vdl, cconj(cmul(mkc<R>(a.z, a.w), cmul(g, h))));
    }
    dp[c] = vdp;
    dgamma[2 * c] = vdg.x;
    dgamma[2 * c + 1] = vdg.y;
    dlog_q[2 * c] = vdl.x;
    dlog_q[2 * c + 1] = vdl.y;
  }
}

// ema_hidden forward, one thread per (b, d, n): V, W from the partials, h = p V + q**L hx.
template <class R>
__global__ void __launch_bounds__(kFinishThreads)
    ema_hidden_finish_kernel(const c4_t<R>* __restrict__ partial, const R* __restrict__ p,
                             const R* __restrict__ log_q, const R* __restrict__ hx, R* __restrict__ h,
                             R* __restrict__ v, R* __restrict__ w, int B, int D, int N, std::int64_t L, int Y) {
  using C = c2_t<R>;
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  const std::int64_t total = DN * B;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % DN;
    const int b = static_cast<int>(i / DN);
    const c4_t<R> a = sum_partials(partial, b, c / N, c % N, D, N, Y);
    C hv = mkc<R>(p[c] * a.x, p[c] * a.y);
    if (hx != nullptr) hv = cadd(hv, cmul(qpow<R>(load_root(log_q, c), L), load_c(hx, i)));
    h[2 * i] = hv.x;
    h[2 * i + 1] = hv.y;
    v[2 * i] = a.x;
    v[2 * i + 1] = a.y;
    if (w != nullptr) {
      w[2 * i] = a.z;
      w[2 * i + 1] = a.w;
    }
  }
}

// ema_hidden coefficient gradients from the saved sums V, W, one thread per (d, n), b in order:
//   dp = sum_b Re(conj(dh) V), dlog_q = sum_b dh conj(p W + L q**L hx), dhx = dh conj(q**L).
template <class R>
__global__ void __launch_bounds__(kFinishThreads)
    ema_hidden_coef_kernel(const R* __restrict__ dh, const R* __restrict__ p, const R* __restrict__ log_q,
                           const R* __restrict__ hx, const R* __restrict__ v, const R* __restrict__ w,
                           R* __restrict__ dp, R* __restrict__ dlog_q, R* __restrict__ dhx, int B, int D, int N,
                           std::int64_t L, bool need_p, bool need_lq) {
  using C = c2_t<R>;
  const std::int64_t DN = static_cast<std::int64_t>(D) * N;
  for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < DN;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const R pc = p[c];
    const C qL = hx != nullptr ? qpow<R>(load_root(log_q, c), L) : mkc<R>(R(0), R(0));
    const C lqL = mkc<R>(static_cast<R>(L) * qL.x, static_cast<R>(L) * qL.y);
    R vdp = R(0);
    C vdl = mkc<R>(R(0), R(0));
    for (int b = 0; b < B; ++b) {
      const std::int64_t i = static_cast<std::int64_t>(b) * DN + c;
      const C g = load_c(dh, i);
      if (need_p) {
        const C V = load_c(v, i);
        vdp += g.x * V.x + g.y * V.y;  // Re(conj(g) V)
      }
      if (need_lq) {
        const C W = load_c(w, i);
        C dq = mkc<R>(pc * W.x, pc * W.y);
        if (hx != nullptr) dq = cadd(dq, cmul(lqL, load_c(hx, i)));
        vdl = cadd(vdl, cmul(g, cconj(dq)));
      }
      if (hx != nullptr) {
        const C r = cmul(g, cconj(qL));
        dhx[2 * i] = r.x;
        dhx[2 * i + 1] = r.y;
      }
    }
    dp[c] = vdp;
    dlog_q[2 * c] = vdl.x;
    dlog_q[2 * c + 1] = vdl.y;
  }
}

}  // namespace cema
}  // namespace mk
