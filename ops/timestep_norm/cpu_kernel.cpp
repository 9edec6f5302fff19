// TimestepNorm on the CPU: one sequential pass over time per (row, block of groups), OpenMP over
// those tasks.
//
// A row is a batch row, or a document of a packed row: it starts at step `start[r]` of the
// (steps, D) array and has `len[r]` steps. Statistics are kept in double relative to a shift K per
// (row, group) (the lower median of the finite unpadded step means, as the torch backend's), so
// x - mu keeps the precision of the data's spread when the mean is large. The running sums are
// Kahan-compensated. The math is docs/math.md, TimestepNorm; the backward is the torch backend's
// scaled-carry reverse scan (ops/timestep_norm/torch_impl.py), one step at a time.
//
// Layout of the work: a task owns up to kBlock consecutive groups of one row, so each step reads
// a contiguous run of features, and the per-group updates are loops over the block's groups that
// the compiler vectorises; the step count is shared by the groups of a row, so each step costs one
// division, not one per group.
//
// Per-step statistics (mu relative to K, rstd, gmu relative to K; G per step) and the per-row
// results are written in T, the op's accumulation dtype (float for float work, double for double),
// each rounded once from the double it was computed in (as a cast of a double array would round
// it); the backward reads them back as T. Sums over a group's features run in vector lanes (see
// kW below).
//
// Forward, per task: (1) each step's group mean and variance, in one pass over x; (2) K, the
// lower median of those means; (3) the merge over time, a serial chain of Kahan updates that keeps
// little else; (4) rstd for all steps at once; (5) y, in a second pass over x (the task's x, L x
// its features, is usually still in L2).
//
// Rows: with start == nullptr the rows are uniform, row r at step r * row_len with row_len steps
// (a batch), so an unpacked call passes no arrays for them.
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // groups per task

// Kahan summation on arrays of the block's groups: the sum is s - c.
inline void kahan_add(double& s, double& c, double v) {
  const double y = v - c;
  const double t = s + y;
  c = (t - s) - y;
  s = t;
}

struct Task {
  int64_t r, g0, ng;  // row, first group, number of groups
};

// Sums over a group's features run in kW double lanes, one vector register (GCC / Clang vector
// extensions, so the same source builds for AVX-512, AVX2 or SSE2), combined pairwise at the end.
// A serial accumulator made every sum latency-bound (one dependent add per feature); the compiler
// does not vectorise such a reduction by itself (it may not reassociate), and with `omp simd` it
// combined the lanes serially through memory. The lanes' rounding error is no larger.
#if defined(__AVX512F__)
constexpr int kW = 8;
#elif defined(__AVX__)
constexpr int kW = 4;
#else
constexpr int kW = 2;
#endif
typedef double vd __attribute__((vector_size(kW * sizeof(double))));
typedef float vf __attribute__((vector_size(kW * sizeof(float))));

inline vd vload(const double* p) {
  vd v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vd vload(const float* p) {
#if defined(__AVX512F__)
  return _mm512_cvtps_pd(_mm256_loadu_ps(p));  // one instruction (GCC splits the generic conversion)
#else
  vf v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, vd);
#endif
}
inline void vstore(double* p, vd v) { std::memcpy(p, &v, sizeof v); }

// The lane sums of a and b, each ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) for 8 lanes.
inline void hsum2(vd a, vd b, double& sa, double& sb) {
#if defined(__AVX512F__)  // the same additions on both at once: 3 shuffles, 3 additions
  const __m512d h = _mm512_shuffle_f64x2(a, b, 0x44) + _mm512_shuffle_f64x2(a, b, 0xEE);  // a_i + a_i+4 | b ...
  const __m512d q = h + _mm512_permutex_pd(h, 0x4E);  // + lane i + 2
  const __m512d r = q + _mm512_permute_pd(q, 0x55);   // + lane i + 1
  sa = _mm512_cvtsd_f64(r);
  sb = _mm_cvtsd_f64(_mm512_extractf64x2_pd(r, 2));
#else
  if constexpr (kW == 8) {
    sa = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    sb = ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]));
  } else if constexpr (kW == 4) {
    sa = (a[0] + a[2]) + (a[1] + a[3]);
    sb = (b[0] + b[2]) + (b[1] + b[3]);
  } else {
    sa = a[0] + a[1];
    sb = b[0] + b[1];
  }
#endif
}

// The k-th smallest of a[0, m) (k < m; no NaN), by quickselect with branch-free partitions into
// the other buffer: the values are data, so a partition's compare branches mispredict about half
// the time, and std::nth_element spent as long on the K of a row as the rest of its forward.
// a and tmp (m values each) are both overwritten.
double select(double* a, double* tmp, int64_t m, int64_t k) {
  for (int rounds = 0; m > 32; ++rounds) {
    if (rounds == 64) {  // a pathological pivot sequence: the library's guaranteed-linear selection
      std::nth_element(a, a + k, a + m);
      return a[k];
    }
    const double p0 = a[0], p1 = a[m / 2], p2 = a[m - 1];  // the median of three as the pivot
    const double p = std::max(std::min(p0, p1), std::min(std::max(p0, p1), p2));
    // < p to the front of tmp, > p to the back; tmp[lo, hi) is free (the values equal to p, at
    // least one, are not copied), so the write of v to the side it does not belong to is harmless
    int64_t lo = 0, hi = m;
    for (int64_t i = 0; i < m; ++i) {
      const double v = a[i];
      tmp[lo] = v;
      tmp[hi - 1] = v;
      lo += v < p;
      hi -= v > p;
    }
    double* next = tmp;
    if (k < lo) {
      m = lo;
    } else if (k >= hi) {
      next += hi;
      m -= hi;
      k -= hi;
    } else {
      return p;
    }
    tmp = a;
    a = next;
  }
  std::nth_element(a, a + k, a + m);
  return a[k];
}

std::vector<Task> tasks(int64_t rows, int64_t G) {
  std::vector<Task> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; g += kBlock) out.push_back({r, g, std::min(kBlock, G - g)});
  return out;
}

// The caller's thread budget (torch.get_num_threads()), no more threads than tasks.
int team(int threads, size_t tasks) { return int(std::max<int64_t>(1, std::min<int64_t>(threads, int64_t(tasks)))); }

template <typename T>
void forward(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len, int64_t row_len,
             int64_t D, int64_t G, const double* scale, const double* bias, const int64_t* prev_count,
             const double* prev_mean, const double* prev_var, double eps, T* y, T* mu, T* rstd, T* gmu, T* shift,
             int64_t* count, T* mean_out, T* var_out, int threads) {
  const int64_t dg = D / G;
  const double inv_dg = 1.0 / double(dg);
  const std::vector<Task> work = tasks(rows, G);
#pragma omp parallel num_threads(team(threads, work.size()))
  {
    std::vector<double> buf, scratch, step_mean, step_var;  // per task: each step's group mean and variance
#pragma omp for schedule(dynamic, 1)
    for (size_t w = 0; w < work.size(); ++w) {
      const Task tk = work[w];
      const int64_t s0 = start ? start[tk.r] : tk.r * row_len, n_steps = start ? len[tk.r] : row_len;
      const int64_t ng = tk.ng, f0 = tk.g0 * dg;
      double K[kBlock], mean[kBlock], cm[kBlock], m2[kBlock], c2[kBlock], var0[kBlock];
      step_mean.resize(n_steps * ng);
      step_var.resize(n_steps * ng);
      // Pass 1: each step's group mean and population variance in double, in one pass over the
      // features (half the reads and conversions of a mean pass then a variance pass): sums of
      // d = x - x0 and d^2, x0 the group's first feature at this step. The d are O(spread), so
      // there is no cancellation of a large mean: S2 / n - (S1 / n)^2 loses at most about
      // log2(2 Dg) bits, as (S1 / n)^2 = (mean - x0)^2 <= Dg var. For float data d and d^2 are
      // exact in double. Then K per group from the finite unpadded means.
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        if (pad[s]) continue;
        const T* xr = x + s * D + f0;
        for (int64_t j = 0; j < ng; ++j) {
          const T* xj = xr + j * dg;
          const double x0 = double(xj[0]);
          vd a1 = {}, a2 = {}, b1 = {}, b2 = {};  // two sets of lanes: two dependency chains
          int64_t i = 0;
          for (; i + 2 * kW <= dg; i += 2 * kW) {
            const vd d = vload(xj + i) - x0, e = vload(xj + i + kW) - x0;
            a1 += d;
            a2 += d * d;
            b1 += e;
            b2 += e * e;
          }
          if (i + kW <= dg) {
            const vd d = vload(xj + i) - x0;
            a1 += d;
            a2 += d * d;
            i += kW;
          }
          a1 += b1;
          a2 += b2;
          double s1 = 0.0, s2 = 0.0;
          for (; i < dg; ++i) {
            const double d = double(xj[i]) - x0;
            s1 += d;
            s2 += d * d;
          }
          double h1, h2;
          hsum2(a1, a2, h1, h2);
          s1 += h1;
          s2 += h2;
          const double d1 = s1 * inv_dg, v = s2 * inv_dg - d1 * d1;
          step_mean[t * ng + j] = x0 + d1;
          step_var[t * ng + j] = v < 0.0 ? 0.0 : v;  // rounding below 0; NaN stays NaN
        }
      }
      buf.resize(n_steps);
      scratch.resize(n_steps);
      for (int64_t j = 0; j < ng; ++j) {
        int64_t m = 0;
        for (int64_t t = 0; t < n_steps; ++t) {
          const double v = step_mean[t * ng + j];
          buf[m] = v;
          m += !pad[s0 + t] && std::isfinite(v);
        }
        const double k = m > 0 ? select(buf.data(), scratch.data(), m, (m - 1) / 2) : 0.0;
        // K as the op's residual holds it (T = the accumulation type), so the backward subtracts
        // the same value
        K[j] = double(T(k));
      }
      // Pass 2: the running merge, y. An unseen prior (n0 = 0) is the empty summary.
      const int64_t n0 = prev_count[tk.r];
      for (int64_t j = 0; j < ng; ++j) {
        const int64_t rg = tk.r * G + tk.g0 + j;
        var0[j] = prev_var[rg];
        mean[j] = n0 > 0 ? prev_mean[rg] - K[j] : 0.0;
        m2[j] = n0 > 0 ? var0[j] * double(n0) : 0.0;
        cm[j] = c2[j] = 0.0;
      }
      // The merge overwrites step_mean / step_var of step t with the running mean (relative to K)
      // and variance after it; a padded step carries them unchanged.
      int64_t n = n0;
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        T* mu_s = mu + s * G + tk.g0;
        T* gm_s = gmu + s * G + tk.g0;
        double* m_t = step_mean.data() + t * ng;
        double* v_t = step_var.data() + t * ng;
        if (pad[s]) {
          for (int64_t j = 0; j < ng; ++j) {
            m_t[j] = mean[j] - cm[j];
            v_t[j] = n > 0 ? (m2[j] - c2[j]) / double(n) : var0[j];
            mu_s[j] = T(m_t[j]);
            gm_s[j] = T(0);
          }
          continue;
        }
        ++n;
        const double inv_n = 1.0 / double(n), w_old = double(n - 1) * inv_n;
        for (int64_t j = 0; j < ng; ++j) {  // Chan's merge of (n - 1, mean, M2) with (1, gm, gv)
          const double gm = m_t[j] - K[j], gv = v_t[j];
          const double d = gm - (mean[j] - cm[j]);
          kahan_add(mean[j], cm[j], d * inv_n);
          kahan_add(m2[j], c2[j], gv + d * d * w_old);
          m_t[j] = mean[j] - cm[j];
          v_t[j] = (m2[j] - c2[j]) * inv_n;
          mu_s[j] = T(m_t[j]);
          gm_s[j] = T(gm);
        }
      }
      // rstd of every step at once: vector square roots and divisions, off the merge's latency chain
      const int64_t nv = n_steps * ng;
      double* a_all = step_var.data();
#pragma omp simd
      for (int64_t k = 0; k < nv; ++k) a_all[k] = 1.0 / std::sqrt(a_all[k] + eps);
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        T* rs_s = rstd + s * G + tk.g0;
        for (int64_t j = 0; j < ng; ++j) rs_s[j] = T(a_all[t * ng + j]);
        T* yr = y + s * D + f0;
        if (pad[s]) {
          for (int64_t f = 0; f < ng * dg; ++f) yr[f] = T(0);
          continue;
        }
        const T* xr = x + s * D + f0;
        for (int64_t j = 0; j < ng; ++j) {
          const double c = K[j] + step_mean[t * ng + j], a = a_all[t * ng + j];  // the unrounded statistics
          const double* sc = scale + f0 + j * dg;
          const double* bi = bias + f0 + j * dg;
          const T* xj = xr + j * dg;
          T* yj = yr + j * dg;
          for (int64_t i = 0; i < dg; ++i) yj[i] = T((double(xj[i]) - c) * a * sc[i] + bi[i]);
        }
      }
      const bool observed = n > n0;
      if (tk.g0 == 0) count[tk.r] = n;
      for (int64_t j = 0; j < ng; ++j) {
        const int64_t rg = tk.r * G + tk.g0 + j;
        shift[rg] = T(K[j]);
        mean_out[rg] = T(observed ? mean[j] - cm[j] + K[j] : prev_mean[rg]);
        var_out[rg] = T(observed ? (m2[j] - c2[j]) / double(n) : var0[j]);
      }
    }
  }
}

// Reverse scan in the scaled-carry form (ops/timestep_norm/torch_impl.py):
//   V_t = dvar / n_L - sum_{s >= t} w_s 0.5 r_s^3 ds_s / n_s
//   U_t = dmean / n_L - sum_{s >= t} w_s [r_s db_s + 2 V_s (gmu_s - mu_{s-1})] / n_s
//   dx = r (dy scale - db / (n Dg)) + [U_{t+1} + 2 V (gmu - mu)] / Dg + 2 V (x - gmu) / Dg
// dscale / dbias: one partial row of D per row (its tasks own disjoint features), summed by the caller.
template <typename T>
void backward(const T* x, const T* dy, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len,
              int64_t row_len, int64_t D, int64_t G, const double* scale, const T* mu, const T* rstd, const T* gmu,
              const T* mu0, const T* shift, const int64_t* prev_count, const T* dmean, const T* dvar, T* dx,
              double* dscale, double* dbias, double* dprev_mean, double* dprev_var, int threads) {
  const int64_t dg = D / G;
  const double inv_dg = 1.0 / double(dg);
  const std::vector<Task> work = tasks(rows, G);
#pragma omp parallel for schedule(dynamic, 1) num_threads(team(threads, work.size()))
  for (size_t w = 0; w < work.size(); ++w) {
    const Task tk = work[w];
    const int64_t s0 = start ? start[tk.r] : tk.r * row_len, n_steps = start ? len[tk.r] : row_len;
    const int64_t ng = tk.ng, f0 = tk.g0 * dg;
    double* dsc = dscale + tk.r * D + f0;
    double* dbi = dbias + tk.r * D + f0;
    for (int64_t f = 0; f < ng * dg; ++f) dsc[f] = dbi[f] = 0.0;
    const int64_t n0 = prev_count[tk.r];
    int64_t live = 0;
    for (int64_t t = 0; t < n_steps; ++t) live += !pad[s0 + t];
    const int64_t n_end = n0 + live;
    const double inv_end = 1.0 / double(std::max<int64_t>(n_end, 1));
    double K[kBlock], U[kBlock], cu[kBlock], V[kBlock], cv[kBlock], ds[kBlock], db[kBlock];
    for (int64_t j = 0; j < ng; ++j) {  // U_{t+1}, V_{t+1} while step t is processed
      const int64_t rg = tk.r * G + tk.g0 + j;
      K[j] = shift[rg];
      U[j] = dmean[rg] * inv_end;
      V[j] = dvar[rg] * inv_end;
      cu[j] = cv[j] = 0.0;
    }
    int64_t n = n_end;  // count after the step being processed
    for (int64_t t = n_steps - 1; t >= 0; --t) {
      const int64_t s = s0 + t;
      const T* xr = x + s * D + f0;
      const T* dyr = dy + s * D + f0;
      T* dxr = dx + s * D + f0;
      if (pad[s]) {
        for (int64_t f = 0; f < ng * dg; ++f) dxr[f] = T(0);
        continue;
      }
      const T* mu_s = mu + s * G + tk.g0;
      const T* rs_s = rstd + s * G + tk.g0;
      const T* gm_s = gmu + s * G + tk.g0;
      // mu_{t-1}: the carried mean entering step t (a padded step carries it unchanged; the row's
      // first step sees the prior's); the cross term exists only after an observation
      const T* mu_prev = t > 0 ? mu + (s - 1) * G + tk.g0 : mu0 + tk.r * G + tk.g0;
      for (int64_t j = 0; j < ng; ++j) {
        const double c = K[j] + double(mu_s[j]), rs = rs_s[j];
        const double* sc = scale + f0 + j * dg;
        const T* xj = xr + j * dg;
        const T* dyj = dyr + j * dg;
        double* dscj = dsc + j * dg;
        double* dbij = dbi + j * dg;
        vd va = {}, vb = {};
        int64_t i = 0;
        for (; i + kW <= dg; i += kW) {
          const vd xc = vload(xj + i) - c, d = vload(dyj + i), sci = vload(sc + i);
          va += d * xc * sci;
          vb += d * sci;
          vstore(dscj + i, vload(dscj + i) + d * xc * rs);
          vstore(dbij + i, vload(dbij + i) + d);
        }
        double a = 0.0, b = 0.0;
        for (; i < dg; ++i) {
          const double xc = double(xj[i]) - c, d = double(dyj[i]);
          a += d * xc * sc[i];
          b += d * sc[i];
          dscj[i] += d * xc * rs;
          dbij[i] += d;
        }
        double ha, hb;
        hsum2(va, vb, ha, hb);
        a += ha;
        b += hb;
        ds[j] = a;
        db[j] = b;
      }
      const double inv_n = 1.0 / double(n), seen_before = n > 1 ? 1.0 : 0.0;
      for (int64_t j = 0; j < ng; ++j) {
        const double rs = rs_s[j], gm = gm_s[j];
        kahan_add(V[j], cv[j], -0.5 * rs * rs * rs * ds[j] * inv_n);  // V_t
        const double v = V[j] - cv[j], u_next = U[j] - cu[j];
        kahan_add(U[j], cu[j], -(rs * db[j] * inv_n + seen_before * 2.0 * v * (gm - double(mu_prev[j])) * inv_n));  // U_t
        const double rest = (u_next + 2.0 * v * (gm - double(mu_s[j]))) * inv_dg;
        const double two_v = 2.0 * v * inv_dg, db_n = db[j] * inv_n * inv_dg, k = K[j];
        const double* sc = scale + f0 + j * dg;
        const T* xj = xr + j * dg;
        const T* dyj = dyr + j * dg;
        T* dxj = dxr + j * dg;
        for (int64_t i = 0; i < dg; ++i)
          dxj[i] = T(rs * (double(dyj[i]) * sc[i] - db_n) + rest + two_v * (double(xj[i]) - k - gm));
      }
      --n;
    }
    for (int64_t j = 0; j < ng; ++j) {
      const int64_t rg = tk.r * G + tk.g0 + j;
      if (live == 0) {  // nothing observed: mean / var ARE the prior's, gradients pass straight through
        dprev_mean[rg] = dmean[rg];
        dprev_var[rg] = dvar[rg];
      } else if (n0 > 0) {
        dprev_mean[rg] = double(n0) * (U[j] - cu[j]);
        dprev_var[rg] = double(n0) * (V[j] - cv[j]);
      } else {
        dprev_mean[rg] = dprev_var[rg] = 0.0;
      }
    }
  }
}

// The side inputs (scale, bias, prev_mean, prev_var) as double, from float or double (bit i of
// `f64` set: the i-th is double): converting them here costs less than a torch conversion per
// tensor per call in the caller.
std::vector<double> as_double(const void* p, int64_t n, bool f64) {
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = f64 ? static_cast<const double*>(p)[i] : static_cast<const float*>(p)[i];
  return out;
}

// mu0 = prev_mean - K as the op's residual (in T, as torch's prev_mean.to(T) - K would round it).
template <typename T>
void forward_call(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len,
                  int64_t row_len, int64_t D, int64_t G, const void* scale, const void* bias, const int64_t* pc,
                  const void* pm, const void* pv, int f64, double eps, T* y, T* mu, T* rstd, T* gmu, T* shift,
                  int64_t* count, T* mean, T* var, T* mu0, int threads) {
  const std::vector<double> sc = as_double(scale, D, f64 & 1), bi = as_double(bias, D, f64 & 2),
                            m0 = as_double(pm, rows * G, f64 & 4), v0 = as_double(pv, rows * G, f64 & 8);
  forward<T>(x, pad, rows, start, len, row_len, D, G, sc.data(), bi.data(), pc, m0.data(), v0.data(), eps, y, mu,
             rstd, gmu, shift, count, mean, var, threads);
  for (int64_t i = 0; i < rows * G; ++i) mu0[i] = T(m0[i]) - shift[i];
}

// dscale / dbias (D each) summed over the kernel's per-row partials, in row order.
template <typename T>
void backward_call(const T* x, const T* dy, const uint8_t* pad, int64_t rows, const int64_t* start,
                   const int64_t* len, int64_t row_len, int64_t D, int64_t G, const void* scale, int f64,
                   const T* mu, const T* rstd, const T* gmu, const T* mu0, const T* shift, const int64_t* pc,
                   const T* dmean, const T* dvar, T* dx, double* dscale, double* dbias, double* dpm, double* dpv,
                   int threads) {
  const std::vector<double> sc = as_double(scale, D, f64 & 1);
  std::vector<double> dsc(rows * D), dbi(rows * D);
  backward<T>(x, dy, pad, rows, start, len, row_len, D, G, sc.data(), mu, rstd, gmu, mu0, shift, pc, dmean, dvar, dx,
              dsc.data(), dbi.data(), dpm, dpv, threads);
  for (int64_t f = 0; f < D; ++f) dscale[f] = dbias[f] = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < D; ++f) {
      dscale[f] += dsc[r * D + f];
      dbias[f] += dbi[r * D + f];
    }
}

}  // namespace

#define MK_TSN_EXPORT(T, tag)                                                                                     \
  extern "C" void mk_tsn_fwd_##tag(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start,         \
                                   const int64_t* len, int64_t row_len, int64_t D, int64_t G, const void* scale, \
                                   const void* bias, const int64_t* pc, const void* pm, const void* pv, int f64, \
                                   double eps, T* y, T* mu, T* rstd, T* gmu, T* shift, int64_t* count, T* mean,  \
                                   T* var, T* mu0, int threads) {                                               \
    forward_call<T>(x, pad, rows, start, len, row_len, D, G, scale, bias, pc, pm, pv, f64, eps, y, mu, rstd, gmu, \
                    shift, count, mean, var, mu0, threads);                                                      \
  }                                                                                                              \
  extern "C" void mk_tsn_bwd_##tag(const T* x, const T* dy, const uint8_t* pad, int64_t rows,                    \
                                   const int64_t* start, const int64_t* len, int64_t row_len, int64_t D,        \
                                   int64_t G, const void* scale, int f64, const T* mu, const T* rstd,           \
                                   const T* gmu, const T* mu0, const T* shift, const int64_t* pc,               \
                                   const T* dmean, const T* dvar, T* dx, double* dscale, double* dbias,         \
                                   double* dpm, double* dpv, int threads) {                                     \
    backward_call<T>(x, dy, pad, rows, start, len, row_len, D, G, scale, f64, mu, rstd, gmu, mu0, shift, pc,     \
                     dmean, dvar, dx, dscale, dbias, dpm, dpv, threads);                                         \
  }

MK_TSN_EXPORT(float, f32)
MK_TSN_EXPORT(double, f64)
