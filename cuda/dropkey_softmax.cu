// dropkey_softmax fwd/bwd for float, bf16 and double scores.
#include "dropkey_softmax.cuh"
#include "launchers.h"

namespace mk {

namespace {
int softmax_threads(std::int64_t S) {
  std::int64_t per = (S + kSoftmaxItems - 1) / kSoftmaxItems;
  int nt = 32;
  while (nt < per && nt < kSoftmaxMaxThreads) nt *= 2;
  return nt;
}
void check_rows(std::int64_t Bf, std::int64_t Hf, std::int64_t L, std::int64_t S) {
  require(Bf >= 0 && Hf >= 1 && L >= 0 && S >= 0, "dropkey_softmax: negative sizes");
  require(L < (1ll << 31) && S < (1ll << 31) && Hf < (1ll << 31), "dropkey_softmax: L, S and H must be < 2^31");
  require(Bf <= 0xFFFFFFFFll, "dropkey_softmax: the flat batch index must fit 32 bits (DropKey rule)");
}
}  // namespace

void dropkey_softmax_fwd(int dtype, const void* x, void* y, std::int64_t Bf, std::int64_t Hf, std::int64_t L,
                         std::int64_t S, bool causal, double p, std::uint64_t seed, const std::int64_t* batch_index,
                         void* stream) {
  check_rows(Bf, Hf, L, S);
  require(p >= 0.0 && p < 1.0, "dropkey_softmax: dropkey_p must be in [0, 1)");
  const std::int64_t rows = Bf * Hf * L;
  if (rows == 0 || S == 0) return;
  const std::uint32_t thr = dropkey::threshold(p);
  const std::uint32_t key = dropkey::seed_key(seed);
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    const auto dropkey_softmax_fwd = &dropkey_softmax_fwd_kernel<T, kSoftmaxItems>;
    MK_LAUNCH(dropkey_softmax_fwd, grid_1d(rows), softmax_threads(S), 0, stream, static_cast<const T*>(x),
              static_cast<T*>(y), rows, static_cast<int>(Hf), static_cast<int>(L), static_cast<int>(S), causal, key,
              thr, batch_index);
  });
}

void dropkey_softmax_bwd(int dtype, const void* y, const void* dy, void* dx, std::int64_t Bf, std::int64_t Hf,
                         std::int64_t L, std::int64_t S, bool causal, void* stream) {
  check_rows(Bf, Hf, L, S);
  const std::int64_t rows = Bf * Hf * L;
  if (rows == 0 || S == 0) return;
  MK_DISPATCH_FLOAT_BF16_DOUBLE(dtype, T, [&] {
    const auto dropkey_softmax_bwd = &dropkey_softmax_bwd_kernel<T, kSoftmaxItems>;
    MK_LAUNCH(dropkey_softmax_bwd, grid_1d(rows), softmax_threads(S), 0, stream, static_cast<const T*>(y),
              static_cast<const T*>(dy), static_cast<T*>(dx), rows, static_cast<int>(L), static_cast<int>(S), causal);
  });
}

}  // namespace mk
