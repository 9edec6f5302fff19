// CEMA Vandermonde sums (cema_kernel fwd/bwd, ema_hidden fwd/bwd): every output is a sum over
// n (synthesis) or over the sequence index j (analysis) of a coefficient times q[d,n]**e(j).
//
// Powers (ops/_vandermonde.py's rule). With the sequence split into rows of T positions,
// q**e(j) = Q2[row] * Q1[col], and each table entry is evaluated on its own in double:
// exp(e * log|q|) (e * log|q| exact: a 24-bit fp32 times an integer < 2**24), the phase in turns
// e * arg(q)/(2 pi) reduced mod 1 in double, sincospi in double, rounded ONCE to fp32. No power
// is built by repeated multiplication and no phase j*arg(q) is formed in fp32, so a product
// Q2*Q1 is two roundings and one complex product from exact at any j (< 2**24).
//
// Layouts: forward e(j) = j + shift (rows from j = 0; `shift` = 1 is the bias's q**(t+1), put on
// Q2 so Q1 is shared), reverse e(j) = L-1-j (ema_hidden) with the sequence padded at the FRONT to
// M*T positions, so that position j' = row*T + col has e = (M-1-row)*T + (T-1-col): both factors
// have non-negative exponents (|factor| <= 1 for |q| <= 1, no overflow).
//
// Tiles. NP = N padded to 16, 32 or 64 (N <= 64) and T = 2048 / NP (128, 64, 32), so a table
// [NP][T] of Q1 is always 2048 complex values (16 KiB) and a block of 256 threads covers it.
//  * synthesis (k, b, dx): block (d, y) loops over tiles y, y + Y, ... of R = 4 * (256 / T) rows;
//    thread = (column, row group), 4 rows each; Q1 [N][T] in shared memory built once per block,
//    Q2 [R][NP] once per tile (and once more with the shift for b); per output row a coefficient
//    c[n] (p gamma, gamma hx_b or p conj(dh_b)), V = c Q1[n][col] once per n, then 2 FMAs per row.
//  * analysis (cema bwd, ema_hidden fwd): thread = (n, column group of 8), its 8 Q1 values in
//    registers; a tile = 32 rows x T of the input staged in shared memory, Q2 [32][NP] per tile:
//    P = sum_col w Q1, P1 = sum_col w E1 Q1 per row, then S += Q2 P, S1 += Q2 (E2 P + P1).
//    Per-thread sums -> fixed-order block reduction over column groups -> one partial per
//    (row, d, y, n) in a workspace; a finishing kernel (cema_kernel.cu, ema_hidden.cu: one thread
//    per coefficient) sums the Y partials in order and forms the gradients / h. Results are
//    deterministic: no atomics, the partition depends only on (D, N, L).
#pragma once

#include "common.cuh"

namespace mk {
namespace cema {

constexpr int kThreads = 256;
constexpr int kMaxN = 64;
constexpr int kTableSize = 2048;     // NP * T
constexpr int kSynRowsPerThread = 4;
constexpr int kAnaCols = 8;          // columns per analysis thread
constexpr int kAnaRows = 32;         // rows per analysis tile
constexpr int kFinishThreads = 128;

struct Layout {
  int NP, T;
  std::int64_t M;  // rows of T positions covering L
};

__host__ __device__ __forceinline__ int padded_n(int N) { return N <= 16 ? 16 : (N <= 32 ? 32 : 64); }

inline Layout layout(int N, std::int64_t L) {
  Layout l;
  l.NP = padded_n(N);
  l.T = kTableSize / l.NP;
  l.M = (L + l.T - 1) / l.T;
  return l;
}

// log|q| and arg(q)/(2 pi) of coefficient idx (log_q interleaved re, im), in double.
struct Root {
  double a, phi;
};

__device__ __forceinline__ Root load_root(const float* __restrict__ log_q, std::int64_t idx) {
  Root r;
  r.a = static_cast<double>(log_q[2 * idx]);
  const double phi = static_cast<double>(log_q[2 * idx + 1]) * 0.15915494309189533577;  // 1 / (2 pi)
  r.phi = phi - rint(phi);  // exact; |phi| <= 1/2 keeps e * phi small
  return r;
}

// q**e for an integer exponent 0 <= e < 2**24, rounded once from a double evaluation.
__device__ __forceinline__ float2 qpow(Root q, std::int64_t e) {
  const double ed = static_cast<double>(e);
  const double mag = exp(ed * q.a);          // ed * q.a is exact
  double t = ed * q.phi;                     // turns, |t| < 2**23: rounding <= 2**-30 turns
  t -= rint(t);                              // exact reduction mod 1
  double s, c;
  sincospi(2.0 * t, &s, &c);
  return make_float2(static_cast<float>(mag * c), static_cast<float>(mag * s));
}

__host__ __device__ __forceinline__ float2 cmul(float2 a, float2 b) {
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__host__ __device__ __forceinline__ float2 cconj(float2 a) { return make_float2(a.x, -a.y); }
__host__ __device__ __forceinline__ float2 cadd(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

__device__ __forceinline__ float2 load_c(const float* __restrict__ p, std::int64_t idx) {
  return make_float2(p[2 * idx], p[2 * idx + 1]);
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
template <int MODE>
__device__ __forceinline__ float2 synth_coef(int o, int n, int d, int D, int N, bool has_k, const float* __restrict__ p,
                                             const float* __restrict__ gamma, const float* __restrict__ rows) {
  const std::int64_t c = static_cast<std::int64_t>(d) * N + n;
  if (MODE == kSynthCema) {
    const float2 g = load_c(gamma, c);
    if (has_k && o == 0) return make_float2(p[c] * g.x, p[c] * g.y);
    const int b = o - (has_k ? 1 : 0);
    return cmul(g, load_c(rows, static_cast<std::int64_t>(b) * D * N + c));
  }
  const float2 h = load_c(rows, static_cast<std::int64_t>(o) * D * N + c);
  return make_float2(p[c] * h.x, -p[c] * h.y);
}

template <int MODE>
__device__ __forceinline__ float* synth_out(int o, int d, int D, std::int64_t L, bool has_k, float* __restrict__ out0,
                                            float* __restrict__ outs) {
  if (MODE == kSynthCema) {
    if (has_k && o == 0) return out0 + static_cast<std::int64_t>(d) * L;
    return outs + (static_cast<std::int64_t>(o - (has_k ? 1 : 0)) * D + d) * L;
  }
  return outs + (static_cast<std::int64_t>(o) * D + d) * L;
}

// grid (D, Y), block kThreads. nout outputs: cema: has_k + B, dx: B.
template <int MODE>
__global__ void __launch_bounds__(kThreads)
    cema_synth_kernel(const float* __restrict__ p, const float* __restrict__ log_q, const float* __restrict__ gamma,
                      const float* __restrict__ rows, float* __restrict__ out0, float* __restrict__ outs, int D, int N,
                      std::int64_t L, int nout, bool has_k) {
  constexpr bool REVERSE = MODE == kSynthHiddenDx;
  MK_STATIC_SMEM(float2, q1, kTableSize);          // [N][T]
  MK_STATIC_SMEM(float2, q2, kMaxN * kMaxN / 2);   // [R][NP]: R * NP = NP * NP / 2
  MK_STATIC_SMEM(float2, cs, kMaxN);               // coefficients of the current output row
  const int d = blockIdx.x;
  const int tid = threadIdx.x;
  const int NP = padded_n(N);
  const int T = kTableSize / NP;
  const int G = kThreads / T;              // row groups
  const int R = G * kSynRowsPerThread;     // rows per tile
  const std::int64_t M = (L + T - 1) / T;
  const std::int64_t pad = REVERSE ? M * T - L : 0;
  const std::int64_t tiles = (M + R - 1) / R;
  const int col = tid % T;
  const int grp = tid / T;
  const std::int64_t cbase = static_cast<std::int64_t>(d) * N;

  for (int i = tid; i < N * T; i += kThreads) {
    const int n = i / T;
    q1[i] = qpow(load_root(log_q, cbase + n), col_exponent<REVERSE>(i % T, T));
  }
  for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const std::int64_t row0 = tile * R;
    for (int o = 0; o < nout; ++o) {
      // Q2 for this tile: once for k / dx, once more with shift 1 at the first bias row.
      const bool build = o == 0 || (MODE == kSynthCema && has_k && o == 1);
      const int shift = (MODE == kSynthCema && !(has_k && o == 0)) ? 1 : 0;
      __syncthreads();  // the previous output's readers of q2 / cs are done
      if (build) {
        for (int i = tid; i < R * N; i += kThreads) {
          const int m = i / N, n = i % N;
          q2[m * NP + n] = qpow(load_root(log_q, cbase + n), row_exponent<REVERSE>(row0 + m, M, T, shift));
        }
      }
      if (tid < N) cs[tid] = synth_coef<MODE>(o, tid, d, D, N, has_k, p, gamma, rows);
      __syncthreads();
      float acc[kSynRowsPerThread];
#pragma unroll
      for (int i = 0; i < kSynRowsPerThread; ++i) acc[i] = 0.0f;
      for (int n = 0; n < N; ++n) {
        const float2 v = cmul(cs[n], q1[n * T + col]);
#pragma unroll
        for (int i = 0; i < kSynRowsPerThread; ++i) {
          const float2 z = q2[(grp + G * i) * NP + n];
          acc[i] = fmaf(v.x, z.x, fmaf(-v.y, z.y, acc[i]));
        }
      }
      float* out = synth_out<MODE>(o, d, D, L, has_k, out0, outs);
#pragma unroll
      for (int i = 0; i < kSynRowsPerThread; ++i) {
        const std::int64_t j = (row0 + grp + G * i) * T + col - pad;
        if (j >= 0 && j < L) out[j] = acc[i];
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

// grid (D, Y), block kThreads. partial: float4 (S.re, S.im, S1.re, S1.im) [nrows][D][Y][N].
template <int MODE, class XT, bool WEIGHTED>
__global__ void __launch_bounds__(kThreads)
    cema_analysis_kernel(const XT* __restrict__ x0, const XT* __restrict__ xs, const float* __restrict__ log_q,
                         float4* __restrict__ partial, int D, int N, std::int64_t L, int nrows, bool has_k) {
  constexpr bool REVERSE = MODE == kAnalysisHidden;
  MK_STATIC_SMEM(float4, ws, kAnaRows * kTableSize / 16 / 4);  // [R][T] inputs (T <= 128), as float4
  MK_STATIC_SMEM(float2, q2, kAnaRows * kMaxN);               // [R][NP]
  MK_STATIC_SMEM(float4, red, kThreads);                      // per-thread (S, S1) for the block sum
  const int d = blockIdx.x;
  const int tid = threadIdx.x;
  const int NP = padded_n(N);
  const int T = kTableSize / NP;
  const int CG = kThreads / NP;  // column groups of kAnaCols: CG * kAnaCols = T
  const std::int64_t M = (L + T - 1) / T;
  const std::int64_t pad = REVERSE ? M * T - L : 0;
  const std::int64_t tiles = (M + kAnaRows - 1) / kAnaRows;
  const int n = tid % NP;
  const int cg = tid / NP;
  const bool active = n < N;
  const std::int64_t cbase = static_cast<std::int64_t>(d) * N;

  // This thread's 8 columns of Q1 and, for S1, E1 * Q1 (the inner exponent's weight).
  float2 q1[kAnaCols], q1e[kAnaCols];
  {
    const Root root = load_root(log_q, cbase + (active ? n : 0));
#pragma unroll
    for (int k = 0; k < kAnaCols; ++k) {
      const int e1 = col_exponent<REVERSE>(cg * kAnaCols + k, T);
      q1[k] = active ? qpow(root, e1) : make_float2(0.0f, 0.0f);
      q1e[k] = make_float2(q1[k].x * static_cast<float>(e1), q1[k].y * static_cast<float>(e1));
    }
  }
  for (int o = 0; o < nrows; ++o) {
    const int shift = (MODE == kAnalysisCema && !(has_k && o == 0)) ? 1 : 0;
    const XT* x = analysis_row<MODE, XT>(o, d, D, L, has_k, x0, xs);
    float2 s = make_float2(0.0f, 0.0f), s1 = make_float2(0.0f, 0.0f);
    for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
      const std::int64_t row0 = tile * kAnaRows;
      __syncthreads();  // the previous tile's readers of ws / q2 are done
      float* wsw = reinterpret_cast<float*>(ws);
      for (int i = tid; i < kAnaRows * T; i += kThreads) {  // a tile is contiguous in the padded sequence
        const std::int64_t j = row0 * T + i - pad;
        wsw[i] = (j >= 0 && j < L) ? to_f32(x[j]) : 0.0f;
      }
      for (int i = tid; i < kAnaRows * N; i += kThreads) {
        const int m = i / N, nn = i % N;
        q2[m * NP + nn] = qpow(load_root(log_q, cbase + nn), row_exponent<REVERSE>(row0 + m, M, T, shift));
      }
      __syncthreads();
      if (active) {
        for (int m = 0; m < kAnaRows; ++m) {
          const float4 wa = ws[(m * T + cg * kAnaCols) / 4];
          const float4 wb = ws[(m * T + cg * kAnaCols) / 4 + 1];
          const float w[kAnaCols] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
          float2 P = make_float2(0.0f, 0.0f), P1 = make_float2(0.0f, 0.0f);
#pragma unroll
          for (int k = 0; k < kAnaCols; ++k) {
            P.x = fmaf(w[k], q1[k].x, P.x);
            P.y = fmaf(w[k], q1[k].y, P.y);
            if (WEIGHTED) {
              P1.x = fmaf(w[k], q1e[k].x, P1.x);
              P1.y = fmaf(w[k], q1e[k].y, P1.y);
            }
          }
          const float2 z = q2[m * NP + n];
          s = cadd(s, cmul(z, P));
          if (WEIGHTED) {
            const float e2 = static_cast<float>(row_exponent<REVERSE>(row0 + m, M, T, shift));  // exact: < 2**24
            s1 = cadd(s1, cmul(z, make_float2(fmaf(e2, P.x, P1.x), fmaf(e2, P.y, P1.y))));
          }
        }
      }
    }
    // Fixed-order sum over the column groups: thread n adds cg = 0, 1, ... in turn.
    red[tid] = make_float4(s.x, s.y, s1.x, s1.y);
    __syncthreads();
    if (tid < N) {
      float4 acc = red[tid];
      for (int g = 1; g < CG; ++g) {
        const float4 v = red[g * NP + tid];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      partial[((static_cast<std::int64_t>(o) * D + d) * gridDim.y + blockIdx.y) * N + tid] = acc;
    }
    __syncthreads();  // red is rewritten by the next row
  }
}

// Sum of the Y partials of (row o, coefficient c = d * N + n), in order.
__device__ __forceinline__ float4 sum_partials(const float4* __restrict__ partial, int o, std::int64_t c, int D, int N,
                                               int Y) {
  const std::int64_t d = c / N, n = c % N;
  const float4* p = partial + ((static_cast<std::int64_t>(o) * D + d) * Y) * N + n;
  float4 acc = p[0];
  for (int y = 1; y < Y; ++y) {
    const float4 v = p[static_cast<std::int64_t>(y) * N];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  return acc;
}

// ------------------------------------------------------------------------------------------------
// Host helpers shared by the launchers
// ------------------------------------------------------------------------------------------------
constexpr std::int64_t kTargetBlocks = 1024;  // enough (d, y) blocks for several waves on 108-132 SMs

// Blocks along the sequence per feature: all tiles of a row in one block when D alone fills the
// GPU (the per-block Q1 table is then built once per d), more when D is small.
inline int blocks_along(std::int64_t tiles, std::int64_t D) {
  const std::int64_t want = (kTargetBlocks + D - 1) / D;
  std::int64_t y = want < tiles ? want : tiles;
  if (y > 65535) y = 65535;
  return static_cast<int>(y < 1 ? 1 : y);
}
inline std::int64_t synth_tiles(const Layout& l) {
  const std::int64_t R = static_cast<std::int64_t>(kThreads / l.T) * kSynRowsPerThread;
  return (l.M + R - 1) / R;
}
inline std::int64_t analysis_tiles(const Layout& l) { return (l.M + kAnaRows - 1) / kAnaRows; }

inline void check_sizes(const char* op, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L) {
  require(B >= 0 && D >= 0 && N >= 0, std::string(op) + ": negative sizes");
  require(N <= kMaxN, std::string(op) + ": N = " + std::to_string(N) + " > " + std::to_string(kMaxN));
  require(L >= 1 && L + 1 < (1ll << 24),
          std::string(op) + ": need 1 <= L and L + 1 < 2^24 (exact fp32 exponents), got L = " + std::to_string(L));
  require(D < (1ll << 31) && B < (1ll << 31), std::string(op) + ": B and D must be < 2^31");
}
inline unsigned int finish_grid(std::int64_t items) {
  return grid_1d((items + kFinishThreads - 1) / kFinishThreads, 1 << 16);
}

}  // namespace cema
}  // namespace mk
