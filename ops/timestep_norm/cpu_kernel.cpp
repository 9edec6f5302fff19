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
// it); the backward reads them back as T. Sums over a group's features run in 8 independent double
// lanes (pairwise-combined): a single serial accumulator made the forward's two reductions per
// step and group latency-bound, and the lanes' rounding error is no larger.
//
// Rows: with start == nullptr the rows are uniform, row r at step r * row_len with row_len steps
// (a batch), so an unpacked call passes no arrays for them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Sum of term(i) for i < n in 8 lanes (the compiler vectorises the lane loop), then pairwise.
template <typename F>
inline double lane_sum(int64_t n, F term) {
  double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) acc[u] += term(i + u);
  double tail = 0.0;
  for (; i < n; ++i) tail += term(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

std::vector<Task> tasks(int64_t rows, int64_t G) {
  std::vector<Task> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; g += kBlock) out.push_back({r, g, std::min(kBlock, G - g)});
  return out;
}

template <typename T>
void forward(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len, int64_t row_len,
             int64_t D, int64_t G, const double* scale, const double* bias, const int64_t* prev_count,
             const double* prev_mean, const double* prev_var, double eps, T* y, T* mu, T* rstd, T* gmu, T* shift,
             int64_t* count, T* mean_out, T* var_out) {
  const int64_t dg = D / G;
  const std::vector<Task> work = tasks(rows, G);
#pragma omp parallel
  {
    std::vector<double> buf, step_mean, step_var;  // per task: each step's group mean and variance
#pragma omp for schedule(dynamic, 1)
    for (size_t w = 0; w < work.size(); ++w) {
      const Task tk = work[w];
      const int64_t s0 = start ? start[tk.r] : tk.r * row_len, n_steps = start ? len[tk.r] : row_len;
      const int64_t ng = tk.ng, f0 = tk.g0 * dg;
      double K[kBlock], mean[kBlock], cm[kBlock], m2[kBlock], c2[kBlock], var0[kBlock];
      step_mean.resize(n_steps * ng);
      step_var.resize(n_steps * ng);
      // Pass 1: each step's group mean and population variance (two-pass inside the step), in
      // double; then K per group from the finite unpadded means.
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        if (pad[s]) continue;
        const T* xr = x + s * D + f0;
        for (int64_t j = 0; j < ng; ++j) {
          const T* xj = xr + j * dg;
          const double m = lane_sum(dg, [&](int64_t i) { return double(xj[i]); }) / double(dg);
          const double v = lane_sum(dg, [&](int64_t i) {
            const double d = double(xj[i]) - m;
            return d * d;
          });
          step_mean[t * ng + j] = m;
          step_var[t * ng + j] = v / double(dg);
        }
      }
      for (int64_t j = 0; j < ng; ++j) {
        buf.clear();
        for (int64_t t = 0; t < n_steps; ++t)
          if (!pad[s0 + t] && std::isfinite(step_mean[t * ng + j])) buf.push_back(step_mean[t * ng + j]);
        double k = 0.0;
        if (!buf.empty()) {
          auto mid = buf.begin() + (buf.size() - 1) / 2;
          std::nth_element(buf.begin(), mid, buf.end());
          k = *mid;
        }
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
      int64_t n = n0;
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        const T* xr = x + s * D + f0;
        T* yr = y + s * D + f0;
        T* mu_s = mu + s * G + tk.g0;
        T* rs_s = rstd + s * G + tk.g0;
        T* gm_s = gmu + s * G + tk.g0;
        if (pad[s]) {
          for (int64_t j = 0; j < ng; ++j) {
            mu_s[j] = T(mean[j] - cm[j]);
            const double var = n > 0 ? (m2[j] - c2[j]) / double(n) : var0[j];
            rs_s[j] = T(1.0 / std::sqrt(var + eps));
            gm_s[j] = T(0);
          }
          for (int64_t f = 0; f < ng * dg; ++f) yr[f] = T(0);
          continue;
        }
        ++n;
        const double inv_n = 1.0 / double(n), w_old = double(n - 1) * inv_n;
        for (int64_t j = 0; j < ng; ++j) {  // Chan's merge of (n - 1, mean, M2) with (1, gm, gv)
          const double gm = step_mean[t * ng + j] - K[j], gv = step_var[t * ng + j];
          const double d = gm - (mean[j] - cm[j]);
          kahan_add(mean[j], cm[j], d * inv_n);
          kahan_add(m2[j], c2[j], gv + d * d * w_old);
          const double mu_t = mean[j] - cm[j], a = 1.0 / std::sqrt((m2[j] - c2[j]) * inv_n + eps);
          mu_s[j] = T(mu_t);
          rs_s[j] = T(a);
          gm_s[j] = T(gm);
          const double c = K[j] + mu_t;  // y from the unrounded double statistics
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
              double* dscale, double* dbias, double* dprev_mean, double* dprev_var) {
  const int64_t dg = D / G;
  const std::vector<Task> work = tasks(rows, G);
#pragma omp parallel for schedule(dynamic, 1)
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
        double a = 0.0, b = 0.0;
        for (int64_t i = 0; i < dg; ++i) {
          const int64_t f = j * dg + i;
          const double xc = double(xr[f]) - c, d = double(dyr[f]);
          a += d * xc * sc[i];
          b += d * sc[i];
          dsc[f] += d * xc * rs;
          dbi[f] += d;
        }
        ds[j] = a;
        db[j] = b;
      }
      const double inv_n = 1.0 / double(n), seen_before = n > 1 ? 1.0 : 0.0;
      for (int64_t j = 0; j < ng; ++j) {
        const double rs = rs_s[j], gm = gm_s[j];
        kahan_add(V[j], cv[j], -0.5 * rs * rs * rs * ds[j] * inv_n);  // V_t
        const double v = V[j] - cv[j], u_next = U[j] - cu[j];
        kahan_add(U[j], cu[j], -(rs * db[j] * inv_n + seen_before * 2.0 * v * (gm - double(mu_prev[j])) * inv_n));  // U_t
        const double rest = (u_next + 2.0 * v * (gm - double(mu_s[j]))) / double(dg);
        const double two_v = 2.0 * v / double(dg), db_n = db[j] * inv_n / double(dg);
        const double* sc = scale + f0 + j * dg;
        for (int64_t i = 0; i < dg; ++i) {
          const int64_t f = j * dg + i;
          dxr[f] = T(rs * (double(dyr[f]) * sc[i] - db_n) + rest + two_v * (double(xr[f]) - K[j] - gm));
        }
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

}  // namespace

#define MK_TSN_EXPORT(T, tag)                                                                                     \
  extern "C" void mk_tsn_fwd_##tag(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start,         \
                                   const int64_t* len, int64_t row_len, int64_t D, int64_t G,                   \
                                   const double* scale, const double* bias, const int64_t* pc,                  \
                                   const double* pm, const double* pv, double eps, T* y, T* mu, T* rstd,        \
                                   T* gmu, T* shift, int64_t* count, T* mean, T* var) {                         \
    forward<T>(x, pad, rows, start, len, row_len, D, G, scale, bias, pc, pm, pv, eps, y, mu, rstd, gmu, shift,   \
               count, mean, var);                                                                                \
  }                                                                                                              \
  extern "C" void mk_tsn_bwd_##tag(const T* x, const T* dy, const uint8_t* pad, int64_t rows,                    \
                                   const int64_t* start, const int64_t* len, int64_t row_len, int64_t D,        \
                                   int64_t G, const double* scale, const T* mu, const T* rstd, const T* gmu,    \
                                   const T* mu0, const T* shift, const int64_t* pc, const T* dmean,             \
                                   const T* dvar, T* dx, double* dscale, double* dbias, double* dpm,            \
                                   double* dpv) {                                                               \
    backward<T>(x, dy, pad, rows, start, len, row_len, D, G, scale, mu, rstd, gmu, mu0, shift, pc, dmean, dvar,  \
                dx, dscale, dbias, dpm, dpv);                                                                    \
  }

MK_TSN_EXPORT(float, f32)
MK_TSN_EXPORT(double, f64)

// The caller's thread budget (torch.get_num_threads()), set before each call.
extern "C" void mk_tsn_set_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }
