// Rotary (RoPE / xPos) on adjacent feature pairs: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c) with
// the tables (cos, sin) already holding the xPos scale; CONJ = true applies the transpose
// (the backward). Elementwise, grid-stride over pairs, arithmetic and tables in acc_t<T> (fp32
// for float/bf16 x, fp64 for double x), one rounding on store.
#pragma once

#include "common.cuh"

namespace mk {

template <class T, bool CONJ>
__global__ void __launch_bounds__(256) rotary_kernel(const T* __restrict__ x, const acc_t<T>* __restrict__ cos_t,
                                                     const acc_t<T>* __restrict__ sin_t, T* __restrict__ y,
                                                     std::int64_t pairs, std::int64_t L, std::int64_t H,
                                                     std::int64_t half, bool per_batch) {
  using A = acc_t<T>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t q = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < pairs; q += stride) {
    const std::int64_t j = q % half;
    const std::int64_t blh = q / half;       // (b * L + l) * H + h
    const std::int64_t bl = blh / H;         // b * L + l
    const std::int64_t t = per_batch ? bl : bl % L;
    const A c = cos_t[t * half + j];
    const A s = CONJ ? -sin_t[t * half + j] : sin_t[t * half + j];
    const A x0 = to_acc(x[2 * q]);
    const A x1 = to_acc(x[2 * q + 1]);
    y[2 * q] = from_acc<T>(x0 * c - x1 * s);
    y[2 * q + 1] = from_acc<T>(x0 * s + x1 * c);
  }
}

}  // namespace mk
