// Causal FFT convolution on the CPU, forward and backward, one pass over memory per tensor.
//
// The torch backend makes five to six passes over spectrum-sized buffers in main memory (the
// zero-padded copy of x, its spectrum, the product, the inverse, the slice's copy). Here every
// transform runs on a scratch buffer that stays in the core's cache: x is read once, y written
// once, and the zero padding is never stored.
//
// Vectorisation runs ACROSS ROWS: a vector register holds the same time step (or frequency) of W
// rows, so every butterfly is plain full-width vector arithmetic with a broadcast twiddle, whatever
// the transform size. A "row block" is W consecutive channels d of one batch row b.
//
// Two real row blocks share one complex transform of size n = 2 * nextpow2(L) (n >= 2L - 1, so the
// circular product never wraps into the first L outputs): block a in the real part, block b in
// the imaginary part. Their spectra are separated at each pair of frequencies (f, n - f):
//     A = Z(f) + conj Z(n-f) = 2 Xa(f),    Bv = Z(f) - conj Z(n-f) = 2i Xb(f),
// and a product with real-signal spectra Ka, Kb recombines as one spectrum whose inverse has
// block a's result in the real part and block b's in the imaginary part:
//     W(f) = (A Ka + Bv Kb) / 2,    W(n-f) = conj(A Ka - Bv Kb) / 2.
// The kernel spectra are stored already scaled by 1 / (2n) (the halving and the inverse's 1/n).
//
// The forward transform is a decimation-in-frequency FFT (natural order in, bit-reversed out), the
// inverse a decimation-in-time FFT (bit-reversed in, natural out): no permutation pass; the
// spectral step finds f and n - f through the bit-reversal table. Both run radix-4 passes (two
// stages per load and store of the buffer) and recurse depth-first, so a sub-transform that fits
// the L1 cache is finished there before the next one starts. The first forward stage knows the
// upper half of its input is zero padding, the last inverse stage computes only the first L
// outputs. Loads and stores transpose W x W tiles in registers (time steps <-> channel lanes).
//
// Twiddles are cos/sin in double, rounded once to T, per transform size (a plan, built once and
// kept). Arithmetic is in T (float for float work, double for double): the accuracy of a
// Cooley-Tukey FFT in T, as the torch backend's library FFT (bench/accuracy_fp32.py).
//
// Work split: a task owns a pair of channel blocks (j0, j1) and runs the batch rows through them,
// pairing (b, j0) with (b, j1); the kernel spectra of its two blocks are computed once, and in the
// backward the k-gradient's spectrum sums over b in the task's own accumulators (no reduction
// between threads). The forward splits a task's batch rows further when there are fewer tasks than
// threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace {

// One vector register of lanes (GCC / Clang vector extensions: the same source builds for AVX-512,
// AVX2 or SSE2).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

template <class T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
  static constexpr int64_t W = kVecBytes / sizeof(T);
};

template <class T>
struct Cx {  // W complex values, one per lane
  typename Vec<T>::type re, im;
};

template <class T>
inline Cx<T> operator+(Cx<T> a, Cx<T> b) { return {a.re + b.re, a.im + b.im}; }
template <class T>
inline Cx<T> operator-(Cx<T> a, Cx<T> b) { return {a.re - b.re, a.im - b.im}; }
template <class T>
inline Cx<T> mul(Cx<T> a, Cx<T> b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }
template <class T>
inline Cx<T> mul_conj(Cx<T> a, Cx<T> b) { return {a.re * b.re + a.im * b.im, a.im * b.re - a.re * b.im}; }  // a conj(b)
template <class T>
inline Cx<T> conj(Cx<T> a) { return {a.re, -a.im}; }
template <class T>
inline Cx<T> mul_tw(Cx<T> a, T c, T s) { return {a.re * c - a.im * s, a.re * s + a.im * c}; }  // a (c + is)

// Sub-transforms of at most this many points run stage by stage (they fit the L1 cache: 256
// points of 16 float lanes are 32 KiB); larger ones recurse.
constexpr int64_t kLeaf = 256;

constexpr double kPi = 3.141592653589793238462643383279502884;

template <class T>
struct Plan {
  int64_t n;
  std::vector<T> c, s;            // w^m = exp(-2 pi i m / n) = c[m] + i s[m], m < n (radix-4 reads up to 3n/4)
  std::vector<int64_t> rev;       // bit reversal of [0, n)
  int64_t pos(int64_t f) const { return rev[f]; }                 // where frequency f lands
  int64_t mirror(int64_t f) const { return rev[(n - f) & (n - 1)]; }  // where n - f lands (f = 0: 0)
  explicit Plan(int64_t n_) : n(n_), c(n_), s(n_), rev(n_) {
    for (int64_t m = 0; m < n; ++m) {
      const double a = 2.0 * kPi * (double(m) / double(n));
      c[m] = T(std::cos(a));
      s[m] = T(-std::sin(a));
    }
    int bits = 0;
    while ((int64_t(1) << bits) < n) ++bits;
    for (int64_t i = 0; i < n; ++i) {
      int64_t r = 0;
      for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
      rev[i] = r;
    }
  }
};

template <class T>
const Plan<T>& plan(int64_t n) {
  static std::mutex lock;
  static std::map<int64_t, std::unique_ptr<Plan<T>>> plans;
  std::lock_guard<std::mutex> guard(lock);
  auto& p = plans[n];
  if (!p) p.reset(new Plan<T>(n));
  return *p;
}

// Radix-4 butterflies: two radix-2 stages (spans 2q and q) in one pass over z[0, 4q), so each
// pass loads and stores every element once for two stages. Twiddle m' of the sub-transform of
// size 4q is the plan's twiddle m' * st. The outputs land where two radix-2 stages would put
// them, so the bit-reversed order of the spectrum is unchanged.
template <class T>
inline Cx<T> mul_minus_i(Cx<T> a) { return {a.im, -a.re}; }  // a (-i)

template <class T>
inline void dif4(Cx<T>* z, int64_t q, const Plan<T>& p, int64_t st) {
  for (int64_t k = 0; k < q; ++k) {
    const Cx<T> a0 = z[k], a1 = z[k + q], a2 = z[k + 2 * q], a3 = z[k + 3 * q];
    const Cx<T> t0 = a0 + a2, t1 = a1 + a3, t2 = a0 - a2, t3 = mul_minus_i(a1 - a3);
    const int64_t i1 = k * st, i2 = 2 * i1, i3 = 3 * i1;
    z[k] = t0 + t1;
    z[k + q] = mul_tw(t0 - t1, p.c[i2], p.s[i2]);
    z[k + 2 * q] = mul_tw(t2 + t3, p.c[i1], p.s[i1]);
    z[k + 3 * q] = mul_tw(t2 - t3, p.c[i3], p.s[i3]);
  }
}

template <class T>
inline void dit4(Cx<T>* z, int64_t q, const Plan<T>& p, int64_t st) {
  for (int64_t k = 0; k < q; ++k) {
    const int64_t i1 = k * st, i2 = 2 * i1;
    const Cx<T> a0 = z[k], a1 = mul_tw(z[k + q], p.c[i2], -p.s[i2]);
    const Cx<T> a2 = z[k + 2 * q], a3 = mul_tw(z[k + 3 * q], p.c[i2], -p.s[i2]);
    const Cx<T> e0 = a0 + a1, e1 = a0 - a1;
    const Cx<T> f0 = mul_tw(a2 + a3, p.c[i1], -p.s[i1]), f1 = mul_minus_i(mul_tw(a2 - a3, p.c[i1], -p.s[i1]));
    z[k] = e0 + f0;
    z[k + 2 * q] = e0 - f0;
    z[k + q] = e1 - f1;  // e1 + i (f1 / -i): the conjugate twiddle w^-q = i
    z[k + 3 * q] = e1 + f1;
  }
}

// Forward DIF of z[0, m), a sub-transform of the plan's size (twiddle m' of size m is the plan's
// twiddle m' * step, step = n / m): radix-4 passes, one radix-2 pass of span 1 last when log2(m)
// is odd.
template <class T>
void dif(Cx<T>* z, int64_t m, const Plan<T>& p, int64_t step) {
  if (m > kLeaf) {
    dif4(z, m / 4, p, step);
    for (int j = 0; j < 4; ++j) dif(z + j * (m / 4), m / 4, p, 4 * step);
    return;
  }
  int64_t q = m / 4;
  for (; q >= 1; q /= 4) {
    for (int64_t j = 0; j < m; j += 4 * q) dif4(z + j, q, p, step * (m / (4 * q)));
  }
  if (m >= 2 && (m & 0x5555555555555555LL) == 0) {  // log2(m) odd: a last radix-2 pass of span 1
    for (int64_t j = 0; j < m; j += 2) {
      const Cx<T> a = z[j], b = z[j + 1];
      z[j] = a + b;
      z[j + 1] = a - b;
    }
  }
}

// Inverse DIT of z[0, m) (bit-reversed in, natural out, unscaled), conjugate twiddles: the
// radix-2 pass of span 1 first when log2(m) is odd, then radix-4 passes.
template <class T>
void dit(Cx<T>* z, int64_t m, const Plan<T>& p, int64_t step) {
  if (m > kLeaf) {
    for (int j = 0; j < 4; ++j) dit(z + j * (m / 4), m / 4, p, 4 * step);
    dit4(z, m / 4, p, step);
    return;
  }
  int64_t q = 1;
  if (m >= 2 && (m & 0x5555555555555555LL) == 0) {  // log2(m) odd
    for (int64_t j = 0; j < m; j += 2) {
      const Cx<T> a = z[j], b = z[j + 1];
      z[j] = a + b;
      z[j + 1] = a - b;
    }
    q = 2;
  }
  for (; 4 * q <= m; q *= 4) {
    for (int64_t j = 0; j < m; j += 4 * q) dit4(z + j, q, p, step * (m / (4 * q)));
  }
}

// The full forward transform of a zero-padded signal: z[0, L) holds it, L <= n / 2; z[L, n) is
// not read (the first stage writes its upper half from the lower one alone).
template <class T>
void forward(Cx<T>* z, int64_t L, const Plan<T>& p) {
  const int64_t n = p.n, h = n / 2;
  if (n == 1) return;
  for (int64_t k = L; k < h; ++k) z[k] = Cx<T>{};
  for (int64_t k = 0; k < h; ++k) z[k + h] = mul_tw(z[k], p.c[k], p.s[k]);
  dif(z, h, p, 2);
  dif(z + h, h, p, 2);
}

// The full inverse transform, of which only z[0, L) is wanted (L <= n / 2): the upper half of the
// last stage is not computed and z[L, n) is left as scratch.
template <class T>
void inverse(Cx<T>* z, int64_t L, const Plan<T>& p) {
  const int64_t n = p.n, h = n / 2;
  if (n == 1) return;
  dit(z, h, p, 2);
  dit(z + h, h, p, 2);
  for (int64_t k = 0; k < L; ++k) z[k] = z[k] + mul_tw(z[k + h], p.c[k], -p.s[k]);
}

// The transpose of a W x W tile held in W vector registers (v[r][c] -> v[c][r]), by swapping the
// off-diagonal blocks of every scale s = W/2, ..., 1 between rows r and r + s: log2(W) rounds of W
// two-register shuffles, instead of W * W scalar moves through memory.
template <class V, int64_t W, int64_t S, size_t... t>
inline __attribute__((always_inline)) void swap_blocks(V& a, V& b, std::index_sequence<t...>) {
  const V lo = __builtin_shufflevector(a, b, ((t & S) ? W + t - S : t)...);
  const V hi = __builtin_shufflevector(a, b, ((t & S) ? W + t : t + S)...);
  a = lo;
  b = hi;
}

template <class V, int64_t W, int64_t S>
inline __attribute__((always_inline)) void transpose_round(V* v) {
  if constexpr (S >= 1) {
    for (int64_t r = 0; r < W; ++r) {
      if (!(r & S)) swap_blocks<V, W, S>(v[r], v[r + S], std::make_index_sequence<W>{});
    }
    transpose_round<V, W, S / 2>(v);
  }
}

template <class T>
inline __attribute__((always_inline)) void transpose(typename Vec<T>::type* v) {
  transpose_round<typename Vec<T>::type, Vec<T>::W, Vec<T>::W / 2>(v);
}

// A row block: lanes are channels d0 .. d0 + lanes - 1 of one batch row (rows of L contiguous
// values starting at `src`, consecutive channels L apart). part 0: real, 1: imag. Whole tiles of
// W steps go through registers; the last partial tile through a zero-filled stack tile.
template <class T>
void load(Cx<T>* z, int part, const T* src, int64_t lanes, int64_t L) {
  typedef typename Vec<T>::type V;
  constexpr int64_t W = Vec<T>::W;
  V v[W];
  for (int64_t t0 = 0; t0 < L; t0 += W) {
    const int64_t tn = std::min(W, L - t0);
    for (int64_t l = 0; l < W; ++l) {
      if (l >= lanes) {
        v[l] = V{};
      } else if (tn == W) {
        __builtin_memcpy(&v[l], src + l * L + t0, sizeof(V));  // one unaligned vector load
      } else {
        v[l] = V{};
        __builtin_memcpy(&v[l], src + l * L + t0, tn * sizeof(T));
      }
    }
    transpose<T>(v);
    for (int64_t i = 0; i < tn; ++i) (part ? z[t0 + i].im : z[t0 + i].re) = v[i];
  }
}

template <class T>
void zero_part(Cx<T>* z, int part, int64_t L) {
  for (int64_t t = 0; t < L; ++t) (part ? z[t].im : z[t].re) = typename Vec<T>::type{};
}

template <class T>
void store(const Cx<T>* z, int part, T* dst, int64_t lanes, int64_t L) {
  typedef typename Vec<T>::type V;
  constexpr int64_t W = Vec<T>::W;
  V v[W];
  for (int64_t t0 = 0; t0 < L; t0 += W) {
    const int64_t tn = std::min(W, L - t0);
    for (int64_t i = 0; i < W; ++i) v[i] = i < tn ? (part ? z[t0 + i].im : z[t0 + i].re) : V{};
    transpose<T>(v);
    if (tn == W) {
      for (int64_t l = 0; l < lanes; ++l) __builtin_memcpy(dst + l * L + t0, &v[l], sizeof(V));
    } else {
      for (int64_t l = 0; l < lanes; ++l) __builtin_memcpy(dst + l * L + t0, &v[l], tn * sizeof(T));
    }
  }
}

template <class T>
using Buf = std::vector<Cx<T>>;  // Cx<T> is over-aligned; C++17's allocator honours it

struct Geometry {
  int64_t B, D, L, W, blocks, tasks;
  int64_t lanes(int64_t j) const { return std::min(W, D - j * W); }
  bool has(int64_t j) const { return j < blocks; }
};

// Blocks j0 (real part) and j0 + 1 (imaginary part; zero when there is no such block) of the
// (D, L) rows starting at `rows` (one batch row of x, or k).
template <class T>
void load_pair(Cx<T>* z, const T* rows, const Geometry& g, int64_t j0) {
  load(z, 0, rows + j0 * g.W * g.L, g.lanes(j0), g.L);
  if (g.has(j0 + 1)) load(z, 1, rows + (j0 + 1) * g.W * g.L, g.lanes(j0 + 1), g.L);
  else zero_part(z, 1, g.L);
}

template <class T>
void store_pair(const Cx<T>* z, T* rows, const Geometry& g, int64_t j0) {
  store(z, 0, rows + j0 * g.W * g.L, g.lanes(j0), g.L);
  if (g.has(j0 + 1)) store(z, 1, rows + (j0 + 1) * g.W * g.L, g.lanes(j0 + 1), g.L);
}

// Kernel spectra of blocks j0, j1 (natural order, f in [0, n/2]), scaled by 1 / (2n); conjugated
// for the adjoint (a correlation).
template <class T>
void kernel_spectra(const T* k, const Geometry& g, int64_t j0, const Plan<T>& p, bool conjugate, Cx<T>* z,
                    Cx<T>* Ka, Cx<T>* Kb) {
  const int64_t n = p.n;
  load_pair(z, k, g, j0);
  forward(z, g.L, p);
  const T scale = T(1) / T(4 * n), sign = conjugate ? T(-1) : T(1);
  for (int64_t f = 0; f <= n / 2; ++f) {
    const Cx<T> Zf = z[p.pos(f)], Zg = conj(z[p.mirror(f)]);
    const Cx<T> A = Zf + Zg, Bv = Zf - Zg;  // 2 Ka(f), 2i Kb(f)
    Ka[f] = {A.re * scale, A.im * (sign * scale)};
    Kb[f] = {Bv.im * scale, -Bv.re * (sign * scale)};  // Bv / 2i = (Bv.im - i Bv.re) / 2
  }
}

// z (the transform of blocks a + i b) times the blocks' kernel spectra, in place (see the top).
template <class T>
void apply(Cx<T>* z, const Cx<T>* Ka, const Cx<T>* Kb, const Plan<T>& p) {
  const int64_t n = p.n;
  for (int64_t f = 0; f <= n / 2; ++f) {
    const int64_t pf = p.pos(f), pg = p.mirror(f);
    const Cx<T> Zf = z[pf], Zg = conj(z[pg]);
    const Cx<T> P = mul(Zf + Zg, Ka[f]), Q = mul(Zf - Zg, Kb[f]);
    z[pg] = conj(P - Q);  // before z[pf]: at f = 0 and n/2, pf == pg and P + Q is the value
    z[pf] = P + Q;
  }
}

int team(int threads, int64_t tasks) {
  return int(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
}

template <class T>
Geometry geometry(int64_t B, int64_t D, int64_t L) {
  Geometry g{B, D, L, Vec<T>::W, 0, 0};
  g.blocks = (D + g.W - 1) / g.W;
  g.tasks = (g.blocks + 1) / 2;
  return g;
}

int64_t fft_size(int64_t L) {
  int64_t m = 1;
  while (m < L) m *= 2;
  return 2 * m;
}

// y r(B D L) = causal convolution of x r(B D L) with k r(D L); all contiguous.
template <class T>
void forward_call(const T* x, const T* k, T* y, int64_t B, int64_t D, int64_t L, int threads) {
  const Geometry g = geometry<T>(B, D, L);
  const Plan<T>& p = plan<T>(fft_size(L));
  const int64_t n = p.n;
  // batch rows per work item: the whole batch, unless that leaves threads idle
  const int64_t per = std::max<int64_t>(1, B / std::max<int64_t>(1, (threads + g.tasks - 1) / g.tasks));
  const int64_t chunks = (B + per - 1) / per, items = g.tasks * chunks;
#pragma omp parallel num_threads(team(threads, items))
  {
    Buf<T> z(n), Ka(n / 2 + 1), Kb(n / 2 + 1);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t j0 = 2 * (it / chunks), b0 = (it % chunks) * per;
      kernel_spectra(k, g, j0, p, false, z.data(), Ka.data(), Kb.data());
      for (int64_t b = b0; b < std::min(B, b0 + per); ++b) {
        load_pair(z.data(), x + b * D * L, g, j0);
        forward(z.data(), L, p);
        apply(z.data(), Ka.data(), Kb.data(), p);
        inverse(z.data(), L, p);
        store_pair(z.data(), y + b * D * L, g, j0);
      }
    }
  }
}

// dx r(B D L) = causal correlation of dy with k (nullptr: not wanted), dk r(D L) = sum over b of
// the correlation of dy with x (nullptr: not wanted).
template <class T>
void backward_call(const T* dy, const T* x, const T* k, T* dx, T* dk, int64_t B, int64_t D, int64_t L,
                   int threads) {
  const Geometry g = geometry<T>(B, D, L);
  const Plan<T>& p = plan<T>(fft_size(L));
  const int64_t n = p.n, h = n / 2;
#pragma omp parallel num_threads(team(threads, g.tasks))
  {
    Buf<T> z(n), zx(dk ? n : 0), Ka(dx ? h + 1 : 0), Kb(dx ? h + 1 : 0), Sa(dk ? h + 1 : 0), Sb(dk ? h + 1 : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < g.tasks; ++task) {
      const int64_t j0 = 2 * task;
      if (dx) kernel_spectra(k, g, j0, p, true, z.data(), Ka.data(), Kb.data());
      if (dk) std::fill(Sa.begin(), Sa.end(), Cx<T>{}), std::fill(Sb.begin(), Sb.end(), Cx<T>{});
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = b * D * L;
        load_pair(z.data(), dy + row, g, j0);
        forward(z.data(), L, p);
        if (dk) {  // S += DY conj(X) per block: (2 DYa)(conj 2 Xa) and (2i DYb)(conj 2i Xb)
          load_pair(zx.data(), x + row, g, j0);
          forward(zx.data(), L, p);
          for (int64_t f = 0; f <= h; ++f) {
            const int64_t pf = p.pos(f), pg = p.mirror(f);
            const Cx<T> Yf = z[pf], Yg = conj(z[pg]), Xf = zx[pf], Xg = conj(zx[pg]);
            Sa[f] = Sa[f] + mul_conj(Yf + Yg, Xf + Xg);
            Sb[f] = Sb[f] + mul_conj(Yf - Yg, Xf - Xg);
          }
        }
        if (dx) {
          apply(z.data(), Ka.data(), Kb.data(), p);
          inverse(z.data(), L, p);
          store_pair(z.data(), dx + row, g, j0);
        }
      }
      if (dk) {  // the two blocks' dk as one inverse: dk_a + i dk_b, each S / 4 over n
        const T scale = T(1) / T(4 * n);
        for (int64_t f = 0; f <= h; ++f) {
          const Cx<T> a = Sa[f], bb = Sb[f];
          const Cx<T> w = {(a.re - bb.im) * scale, (a.im + bb.re) * scale};      // a + i b
          const Cx<T> v = {(a.re + bb.im) * scale, (bb.re - a.im) * scale};      // conj(a) + i conj(b)
          z[p.mirror(f)] = v;
          z[p.pos(f)] = w;
        }
        inverse(z.data(), L, p);
        store_pair(z.data(), dk, g, j0);
      }
    }
  }
}

}  // namespace

#define MK_FFTCONV_EXPORT(T, tag)                                                                              \
  extern "C" void mk_fftconv_fwd_##tag(const T* x, const T* k, T* y, int64_t B, int64_t D, int64_t L,          \
                                       int threads) {                                                         \
    forward_call<T>(x, k, y, B, D, L, threads);                                                                \
  }                                                                                                            \
  extern "C" void mk_fftconv_bwd_##tag(const T* dy, const T* x, const T* k, T* dx, T* dk, int64_t B,           \
                                       int64_t D, int64_t L, int threads) {                                   \
    backward_call<T>(dy, x, k, dx, dk, B, D, L, threads);                                                      \
  }

MK_FFTCONV_EXPORT(float, f32)
MK_FFTCONV_EXPORT(double, f64)
