// TimestepNorm on the CPU: one sequential pass per (row, group), OpenMP over the (row, group) pairs.
//
// A row is a batch row, or a document of a packed row: it starts at step `start[r]` of the
// (steps, D) array and has `len[r]` steps. Statistics are kept in double relative to a shift K per
// (row, group) (the lower median of the finite unpadded step means, as the torch backend's), so
// x - mu keeps the precision of the data's spread when the mean is large. Every running sum is
// Kahan-compensated. The math is docs/math.md, TimestepNorm; the backward is the torch backend's
// scaled-carry reverse scan (ops/timestep_norm/torch_impl.py), one step at a time.
//
// Per-step statistics (mu relative to K, rstd, gmu relative to K) are written as double (rows of G
// per step); the caller rounds them to the op's accumulation dtype.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

struct Kahan {  // s - c is the running sum (c: the rounding error of the last additions)
  double s = 0.0, c = 0.0;
  double value() const { return s - c; }
  void add(double v) {
    double y = v - c;
    double t = s + y;
    c = (t - s) - y;
    s = t;
  }
};

template <typename T>
double group_mean(const T* xr, int64_t dg, double K) {
  double m = 0.0;
  for (int64_t i = 0; i < dg; ++i) m += double(xr[i]) - K;
  return m / double(dg);
}

template <typename T>
double group_var(const T* xr, int64_t dg, double K, double gm) {  // two-pass: deviations from gm
  double v = 0.0;
  for (int64_t i = 0; i < dg; ++i) {
    double d = double(xr[i]) - K - gm;
    v += d * d;
  }
  return v / double(dg);
}

// The lower median of the finite unpadded step means of (row, group), 0 when there is none.
template <typename T>
double shift_of(const T* x, const uint8_t* pad, int64_t start, int64_t len, int64_t D, int64_t g, int64_t dg,
                std::vector<double>& buf) {
  buf.clear();
  for (int64_t t = 0; t < len; ++t) {
    int64_t s = start + t;
    if (pad[s]) continue;
    double m = group_mean(x + s * D + g * dg, dg, 0.0);
    if (std::isfinite(m)) buf.push_back(m);
  }
  if (buf.empty()) return 0.0;
  auto mid = buf.begin() + (buf.size() - 1) / 2;
  std::nth_element(buf.begin(), mid, buf.end());
  return *mid;
}

template <typename T>
void forward(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len, int64_t D,
             int64_t G, const double* scale, const double* bias, const int64_t* prev_count, const double* prev_mean,
             const double* prev_var, double eps, T* y, double* mu, double* rstd, double* gmu, double* shift,
             int64_t* count, double* mean_out, double* var_out) {
  const int64_t dg = D / G;
#pragma omp parallel
  {
    std::vector<double> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t rg = 0; rg < rows * G; ++rg) {
      const int64_t r = rg / G, g = rg % G;
      const int64_t s0 = start[r], n_steps = len[r];
      // K as the op's residual holds it (T: x's compute type = the accumulation dtype), so that the
      // backward subtracts the same value
      const double K = double(T(shift_of(x, pad, s0, n_steps, D, g, dg, buf)));
      const int64_t n0 = prev_count[r];
      const double var0 = prev_var[rg];
      // An unseen prior (n0 = 0) is the empty summary; its mean and variance are ignored.
      int64_t n = n0;
      Kahan mean, m2;
      if (n0 > 0) {
        mean.s = prev_mean[rg] - K;
        m2.s = var0 * double(n0);
      }
      const double* sc = scale + g * dg;
      const double* bi = bias + g * dg;
      for (int64_t t = 0; t < n_steps; ++t) {
        const int64_t s = s0 + t;
        const T* xr = x + s * D + g * dg;
        T* yr = y + s * D + g * dg;
        double gm = 0.0;
        if (!pad[s]) {
          gm = group_mean(xr, dg, K);
          const double gv = group_var(xr, dg, K, gm);
          const double d = gm - mean.value();
          ++n;
          mean.add(d / double(n));           // Chan's merge of (n - 1, mean, M2) with (1, gm, gv)
          m2.add(gv + d * d * double(n - 1) / double(n));
        }
        const double m = mean.value();
        const double var = n > 0 ? m2.value() / double(n) : var0;  // before any observation: the prior
        const double rs = 1.0 / std::sqrt(var + eps);
        mu[s * G + g] = m;
        rstd[s * G + g] = rs;
        gmu[s * G + g] = gm;
        if (pad[s]) {
          for (int64_t i = 0; i < dg; ++i) yr[i] = T(0);
        } else {
          for (int64_t i = 0; i < dg; ++i) yr[i] = T((double(xr[i]) - K - m) * rs * sc[i] + bi[i]);
        }
      }
      const bool observed = n > n0;
      shift[rg] = K;
      if (g == 0) count[r] = n;
      mean_out[rg] = observed ? mean.value() + K : prev_mean[rg];
      var_out[rg] = observed ? m2.value() / double(n) : var0;
    }
  }
}

// Reverse scan of (row, group) in the scaled-carry form (ops/timestep_norm/torch_impl.py):
//   V_t = dvar / n_L - sum_{s >= t} w_s 0.5 r_s^3 ds_s / n_s
//   U_t = dmean / n_L - sum_{s >= t} w_s [r_s db_s + 2 V_s (gmu_s - mu_{s-1})] / n_s
//   dx = r (dy scale - db / (n Dg)) + [U_{t+1} + 2 V (gmu - mu)] / Dg + 2 V (x - gmu) / Dg
// dscale / dbias: one partial row of D per row (its groups own disjoint features), summed by the caller.
template <typename T>
void backward(const T* x, const T* dy, const uint8_t* pad, int64_t rows, const int64_t* start, const int64_t* len,
              int64_t D, int64_t G, const double* scale, const double* mu, const double* rstd, const double* gmu,
              const double* mu0, const double* shift, const int64_t* prev_count, const double* dmean,
              const double* dvar, T* dx, double* dscale, double* dbias, double* dprev_mean, double* dprev_var) {
  const int64_t dg = D / G;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t rg = 0; rg < rows * G; ++rg) {
    const int64_t r = rg / G, g = rg % G;
    const int64_t s0 = start[r], n_steps = len[r];
    const double K = shift[rg];
    const double* sc = scale + g * dg;
    double* dsc = dscale + r * D + g * dg;
    double* dbi = dbias + r * D + g * dg;
    for (int64_t i = 0; i < dg; ++i) dsc[i] = dbi[i] = 0.0;
    const int64_t n0 = prev_count[r];
    int64_t live = 0;
    for (int64_t t = 0; t < n_steps; ++t) live += !pad[s0 + t];
    const int64_t n_end = n0 + live;
    const double inv_end = 1.0 / double(std::max<int64_t>(n_end, 1));
    Kahan U, V;  // U_{t+1}, V_{t+1} while step t is processed
    U.s = dmean[rg] * inv_end;
    V.s = dvar[rg] * inv_end;
    int64_t n = n_end;  // count after the step being processed
    for (int64_t t = n_steps - 1; t >= 0; --t) {
      const int64_t s = s0 + t;
      const T* xr = x + s * D + g * dg;
      const T* dyr = dy + s * D + g * dg;
      T* dxr = dx + s * D + g * dg;
      if (pad[s]) {
        for (int64_t i = 0; i < dg; ++i) dxr[i] = T(0);
        continue;
      }
      const double m = mu[s * G + g], rs = rstd[s * G + g], gm = gmu[s * G + g];
      double ds = 0.0, db = 0.0;
      for (int64_t i = 0; i < dg; ++i) {
        const double xc = double(xr[i]) - K - m, d = double(dyr[i]);
        ds += d * xc * sc[i];
        db += d * sc[i];
        dsc[i] += d * xc * rs;
        dbi[i] += d;
      }
      const double inv_n = 1.0 / double(n);
      V.add(-0.5 * rs * rs * rs * ds * inv_n);  // V_t
      const double v = V.value(), u_next = U.value();
      // mu_{t-1}: the carried mean entering step t (a padded step carries the mean unchanged;
      // the row's first step sees the prior's); the term exists only after an observation
      const double m_prev = t > 0 ? mu[(s - 1) * G + g] : mu0[rg];
      const double cross = n - 1 > 0 ? 2.0 * v * (gm - m_prev) * inv_n : 0.0;
      U.add(-(rs * db * inv_n + cross));  // U_t
      const double rest = (u_next + 2.0 * v * (gm - m)) / double(dg);
      const double two_v = 2.0 * v / double(dg), db_n = db * inv_n / double(dg);
      for (int64_t i = 0; i < dg; ++i) {
        const double xv = double(xr[i]) - K;
        dxr[i] = T(rs * (double(dyr[i]) * sc[i] - db_n) + rest + two_v * (xv - gm));
      }
      --n;
    }
    // Nothing observed: mean / var ARE the prior's, gradients pass straight through.
    if (live == 0) {
      dprev_mean[rg] = dmean[rg];
      dprev_var[rg] = dvar[rg];
    } else if (n0 > 0) {
      dprev_mean[rg] = double(n0) * U.value();
      dprev_var[rg] = double(n0) * V.value();
    } else {
      dprev_mean[rg] = dprev_var[rg] = 0.0;
    }
  }
}

}  // namespace

#define MK_TSN_EXPORT(T, tag)                                                                                     \
  extern "C" void mk_tsn_fwd_##tag(const T* x, const uint8_t* pad, int64_t rows, const int64_t* start,         \
                                   const int64_t* len, int64_t D, int64_t G, const double* scale,                \
                                   const double* bias, const int64_t* pc, const double* pm, const double* pv,  \
                                   double eps, T* y, double* mu, double* rstd, double* gmu, double* shift,     \
                                   int64_t* count, double* mean, double* var) {                                \
    forward<T>(x, pad, rows, start, len, D, G, scale, bias, pc, pm, pv, eps, y, mu, rstd, gmu, shift, count,     \
               mean, var);                                                                                       \
  }                                                                                                              \
  extern "C" void mk_tsn_bwd_##tag(const T* x, const T* dy, const uint8_t* pad, int64_t rows,                    \
                                   const int64_t* start, const int64_t* len, int64_t D, int64_t G,               \
                                   const double* scale, const double* mu, const double* rstd, const double* gmu, \
                                   const double* mu0, const double* shift, const int64_t* pc,                   \
                                   const double* dmean, const double* dvar, T* dx, double* dscale,              \
                                   double* dbias, double* dpm, double* dpv) {                                   \
    backward<T>(x, dy, pad, rows, start, len, D, G, scale, mu, rstd, gmu, mu0, shift, pc, dmean, dvar, dx,      \
                dscale, dbias, dpm, dpv);                                                                        \
  }

MK_TSN_EXPORT(float, f32)
MK_TSN_EXPORT(double, f64)

// The caller's thread budget (torch.get_num_threads()), set before each call.
extern "C" void mk_tsn_set_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }
