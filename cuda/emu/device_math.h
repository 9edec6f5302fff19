// Device math model of the emulator: the math functions and fast intrinsics the kernels call,
// each returning what the GPU may return rather than the host's libm result.
//
// The GPU's math library is not correctly rounded. The CUDA C++ Programming Guide, appendix
// "Mathematical Functions" (tables "Single-Precision Mathematical Standard Library Functions with
// Maximum ULP Error", the double-precision table and "Functions Affected by -use_fast_math" /
// the intrinsic functions table) states each function's maximum error as the distance in ulps
// between the correctly rounded result and the returned one. The model returns exactly that: the
// correctly rounded result (computed in double, or long double for double functions), moved by
// k ulps with k a deterministic pseudo-random integer in [-bound, bound] drawn from a hash of the
// argument bits and the function. So every call may be off by up to the documented bound, and a
// run is reproducible (same inputs, same outputs, both fiber orders).
//
// Bounds used (Programming Guide, Mathematical Functions appendix):
//   expf 2, logf 1, erfcf 4, rsqrtf 2, sinpif / cospif / sincospif 1 (all full range);
//   exp 1, sinpi / cospi / sincospi 1 (double);
//   __expf 2 + floor(|1.173 x|) ulp; __logf 3 ulp outside [0.5, 2], inside an absolute error
//   of 2^-21.41; __sinf / __cosf (__sincosf) absolute error 2^-21.41 on [-pi, pi] (larger outside:
//   modelled as 2^-21.41 * max(1, |x| / pi)); __fdividef(x, y) 2 ulp for 2^-126 <= |y| <= 2^126,
//   0 for 2^126 < |y| < 2^128 (documented: it returns zero there).
// Results the device returns exactly are kept exact: zero, infinite and NaN results, exp(0) = 1,
// log(1) = 0, and sin/cos of pi times a multiple of 1/2 (the exact values the twiddle factors
// of the FFTs rely on).
//
// Kernel code (namespace mk) calls expf / logf / erfcf / exp unqualified; the overloads at the end
// put this model in front of the host libm for every kernel. The CUDA-only names (__expf,
// sincospif, rsqrtf, ...) are defined here in the global namespace, as nvcc provides them.
// Define MK_EMU_EXACT_MATH to get the correctly rounded results instead (no perturbation).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace mk_emu {
namespace devmath {

enum Fn : std::uint64_t {
  kExpf = 1, kLogf, kErfcf, kRsqrtf, kSinpif, kCospif, kExp, kSinpi, kCospi, kExpfFast, kLogfFast,
  kSinfFast, kCosfFast, kFdividef, kRsqrt,
};

inline std::uint64_t mix(std::uint64_t z) {  // splitmix64 finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline std::uint64_t bits(float x) { std::uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline std::uint64_t bits(double x) { std::uint64_t u; std::memcpy(&u, &x, 8); return u; }

// k in [-bound, bound], uniform, from the key
inline long offset(std::uint64_t key, long bound) {
  if (bound <= 0) return 0;
  return static_cast<long>(mix(key) % static_cast<std::uint64_t>(2 * bound + 1)) - bound;
}

// r moved by k ulps (k steps to adjacent representable values), never across zero or to infinity
template <class T>
inline T step(T r, long k) {
#ifdef MK_EMU_EXACT_MATH
  (void)k;
  return r;
#else
  if (!std::isfinite(r) || r == T(0) || k == 0) return r;
  const T toward = k > 0 ? std::numeric_limits<T>::infinity() : -std::numeric_limits<T>::infinity();
  for (long i = 0, n = k > 0 ? k : -k; i < n; ++i) {
    const T next = std::nextafter(r, toward);
    if (!std::isfinite(next) || next == T(0) || std::signbit(next) != std::signbit(r)) break;
    r = next;
  }
  return r;
#endif
}

inline float ulp_model(Fn fn, std::uint64_t argbits, double exact, long bound) {
  const float r = static_cast<float>(exact);  // correctly rounded (double holds the exact value closely enough)
  return step(r, offset(mix(argbits) ^ (fn << 56), bound));
}
inline double ulp_model_d(Fn fn, std::uint64_t argbits, long double exact, long bound) {
  const double r = static_cast<double>(exact);
  return step(r, offset(mix(argbits) ^ (fn << 56), bound));
}
// exact + e with |e| <= abs_bound, e pseudo-random, then rounded to float
inline float abs_model(Fn fn, std::uint64_t argbits, double exact, double abs_bound) {
#ifdef MK_EMU_EXACT_MATH
  (void)fn; (void)argbits; (void)abs_bound;
  return static_cast<float>(exact);
#else
  const double u = static_cast<double>(mix(mix(argbits) ^ (fn << 56)) >> 11) * 0x1.0p-53;  // [0, 1)
  return static_cast<float>(exact + (2.0 * u - 1.0) * abs_bound);
#endif
}

// sin / cos of pi x in long double, correctly rounded to float / double in practice: x reduced
// exactly to r in [-1/4, 1/4] plus a quarter-turn count, so pi r is formed with a relative error
// ~2^-64 (no loss near the zeros); exact at the multiples of 1/2 (the FFT twiddles rely on them)
inline long double sincospi_exact(long double x, bool want_sin) {
  const long double h = std::nearbyint(2.0L * x);          // nearest quarter turn (units of 1/2)
  const long double r = x - h / 2.0L;                       // exact, |r| <= 1/4
  const long long q = static_cast<long long>(std::fmod(h, 4.0L) + 4.0L) % 4;
  constexpr long double kPi = 3.141592653589793238462643383279502884L;
  const long double s = r == 0.0L ? 0.0L : std::sin(kPi * r), c = r == 0.0L ? 1.0L : std::cos(kPi * r);
  // e^{i pi x} = i^q e^{i pi r}
  const long double sin_x = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
  const long double cos_x = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
  return want_sin ? sin_x : cos_x;
}
inline bool half_multiple(long double x) { return std::nearbyint(2.0L * x) == 2.0L * x; }
inline long double sinpi_exact(long double x) { return sincospi_exact(x, true); }
inline long double cospi_exact(long double x) { return sincospi_exact(x, false); }

}  // namespace devmath
}  // namespace mk_emu

// --- CUDA-only names (global, as nvcc provides them) -------------------------------------------
inline float __expf(float x) {
  namespace m = mk_emu::devmath;
  if (x == 0.0f) return 1.0f;
  return m::ulp_model(m::kExpfFast, m::bits(x), std::exp(static_cast<double>(x)),
                      2 + static_cast<long>(std::floor(std::fabs(1.173 * static_cast<double>(x)))));
}
inline float __logf(float x) {
  namespace m = mk_emu::devmath;
  if (x == 1.0f || !(x > 0.0f) || std::isinf(x)) return static_cast<float>(std::log(static_cast<double>(x)));
  const double e = std::log(static_cast<double>(x));
  if (x >= 0.5f && x <= 2.0f) return m::abs_model(m::kLogfFast, m::bits(x), e, std::exp2(-21.41));  // 2^-21.41
  return m::ulp_model(m::kLogfFast, m::bits(x), e, 3);
}
inline void __sincosf(float x, float* s, float* c) {
  namespace m = mk_emu::devmath;
  const double a = std::exp2(-21.41) * std::fmax(1.0, std::fabs(static_cast<double>(x)) / 3.141592653589793);
  if (!std::isfinite(x)) {
    *s = *c = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *s = m::abs_model(m::kSinfFast, m::bits(x), std::sin(static_cast<double>(x)), a);
  *c = m::abs_model(m::kCosfFast, m::bits(x), std::cos(static_cast<double>(x)), a);
}
inline float __sinf(float x) { float s, c; __sincosf(x, &s, &c); return s; }
inline float __cosf(float x) { float s, c; __sincosf(x, &s, &c); return c; }
inline float __fdividef(float a, float b) {
  namespace m = mk_emu::devmath;
  const float ab = std::fabs(b);
  if (ab > 0x1.0p126f && std::isfinite(b)) return std::isfinite(a) ? 0.0f * a * b : std::numeric_limits<float>::quiet_NaN();
  return m::ulp_model(m::kFdividef, m::bits(a) * 0x100000001ull ^ m::bits(b), static_cast<double>(a) / b, 2);
}
inline float __frcp_rn(float x) { return 1.0f / x; }       // IEEE round-to-nearest: exact model
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float rsqrtf(float x) {
  namespace m = mk_emu::devmath;
  return m::ulp_model(m::kRsqrtf, m::bits(x), 1.0 / std::sqrt(static_cast<double>(x)), 2);
}
inline double rsqrt(double x) {
  namespace m = mk_emu::devmath;
  return m::ulp_model_d(m::kRsqrt, m::bits(x), 1.0L / std::sqrt(static_cast<long double>(x)), 1);
}
// sin / cos results stay in [-1, 1] (a step up from a correctly rounded 1.0 would leave the range)
inline float sinpif(float x) {
  namespace m = mk_emu::devmath;
  const long double e = m::sinpi_exact(x);
  return m::half_multiple(x) ? static_cast<float>(e)
                             : std::fmin(1.0f, std::fmax(-1.0f, m::ulp_model(m::kSinpif, m::bits(x), static_cast<double>(e), 1)));
}
inline float cospif(float x) {
  namespace m = mk_emu::devmath;
  const long double e = m::cospi_exact(x);
  return m::half_multiple(x) ? static_cast<float>(e)
                             : std::fmin(1.0f, std::fmax(-1.0f, m::ulp_model(m::kCospif, m::bits(x), static_cast<double>(e), 1)));
}
inline void sincospif(float x, float* s, float* c) {
  *s = sinpif(x);
  *c = cospif(x);
}
inline void sincospi(double x, double* s, double* c) {
  namespace m = mk_emu::devmath;
  const long double es = m::sinpi_exact(x), ec = m::cospi_exact(x);
  const bool exact = m::half_multiple(x);
  *s = exact ? static_cast<double>(es) : std::fmin(1.0, std::fmax(-1.0, m::ulp_model_d(m::kSinpi, m::bits(x), es, 1)));
  *c = exact ? static_cast<double>(ec) : std::fmin(1.0, std::fmax(-1.0, m::ulp_model_d(m::kCospi, m::bits(x), ec, 1)));
}
inline void sincosf(float x, float* s, float* c) { __sincosf(x, s, c); }

// --- C library names the kernels call unqualified from namespace mk ------------------------------
// Declared in mk, they hide the host libm's ::expf etc. for every kernel (unqualified lookup finds
// the innermost declaration first; float/double arguments bring no other namespace by ADL).
namespace mk {
inline float expf(float x) {
  namespace m = mk_emu::devmath;
  if (x == 0.0f) return 1.0f;
  return m::ulp_model(m::kExpf, m::bits(x), std::exp(static_cast<double>(x)), 2);
}
inline float logf(float x) {
  namespace m = mk_emu::devmath;
  if (x == 1.0f) return 0.0f;
  return m::ulp_model(m::kLogf, m::bits(x), std::log(static_cast<double>(x)), 1);
}
inline float erfcf(float x) {
  namespace m = mk_emu::devmath;
  return m::ulp_model(m::kErfcf, m::bits(x), std::erfc(static_cast<double>(x)), 4);
}
inline double exp(double x) {
  namespace m = mk_emu::devmath;
  if (x == 0.0) return 1.0;
  return m::ulp_model_d(m::kExp, m::bits(x), std::exp(static_cast<long double>(x)), 1);
}
inline float exp(float x) { return expf(x); }  // CUDA's float overload of exp is expf
}  // namespace mk
