// rotary fwd (CONJ = false) and bwd (CONJ = true) for float, bf16 and double x.
#include "launchers.h"
#include "rotary.cuh"

namespace mk {

// cos/sin hold acc_t<T> values: float for float/bf16 x, double for double x (kernels._acc).
void rotary(int dtype, bool conjugate, const void* x, const void* cos, const void* sin, void* y, std::int64_t B,
            std::int64_t L, std::int64_t H, std::int64_t half, std::int64_t P, void* stream) {
  require(B >= 0 && L >= 0 && H >= 0 && half >= 0, "rotary: negative sizes");
  require(P == 1 || P == B, "rotary: the tables must have P = 1 or P = B rows");
  const std::int64_t pairs = B * L * H * half;
  if (pairs == 0) return;
  constexpr int kThreads = 256;
  const unsigned int grid = grid_1d((pairs + kThreads - 1) / kThreads, 65535);
  const bool per_batch = P == B && B > 1;
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    using A = acc_t<T>;
    const A* c = static_cast<const A*>(cos);
    const A* s = static_cast<const A*>(sin);
    if (conjugate) {
      const auto rotary_bwd = &rotary_kernel<T, true>;
      MK_LAUNCH(rotary_bwd, grid, kThreads, 0, stream, static_cast<const T*>(x), c, s, static_cast<T*>(y), pairs, L,
                H, half, per_batch);
    } else {
      const auto rotary_fwd = &rotary_kernel<T, false>;
      MK_LAUNCH(rotary_fwd, grid, kThreads, 0, stream, static_cast<const T*>(x), c, s, static_cast<T*>(y), pairs, L,
                H, half, per_batch);
    }
  });
}

}  // namespace mk
