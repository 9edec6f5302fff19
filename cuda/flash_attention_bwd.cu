// Flash attention backward (cuda/flash_attention.cuh): dv, dk and dq kernels for every element
// type and padded head dim, and the host launcher (three launches, no atomics).
#include <stdexcept>

#include "launchers.h"

#if MK_HAVE_CUTE || defined(__CUDACC__)
#include "flash_attention.cuh"
#include "flash_attention_launch.h"

namespace mk {

namespace {
template <class C, flash::Grad G>
void launch_kv(const flash::Params& p, unsigned z, void* stream) {
  constexpr int bytes = flash::BwdSmem<C>::bytes;
  const auto flash_bwd_kv = &flash::flash_bwd_kv_kernel<C, G>;
  if (bytes > 48 * 1024) MK_SET_MAX_DYNAMIC_SMEM(flash_bwd_kv, bytes);
  const dim3 grid(static_cast<unsigned>((p.S + C::BN - 1) / C::BN), static_cast<unsigned>(p.B * p.H), z);
  MK_LAUNCH(flash_bwd_kv, grid, C::NT, bytes, stream, p);
}
template <class C>
void launch_q(const flash::Params& p, void* stream) {
  constexpr int bytes = flash::BwdSmem<C>::bytes;
  const auto flash_bwd_q = &flash::flash_bwd_q_kernel<C>;
  if (bytes > 48 * 1024) MK_SET_MAX_DYNAMIC_SMEM(flash_bwd_q, bytes);
  const dim3 grid(static_cast<unsigned>((p.L + C::BM - 1) / C::BM), static_cast<unsigned>(p.B * p.H), 1);
  MK_LAUNCH(flash_bwd_q, grid, C::NT, bytes, stream, p);
}
}  // namespace

void flash_attention_bwd(int dtype, const void* q, const void* k, const void* v, const void* dout, const float* lse,
                         const float* delta, void* dq, void* dk, void* dv, std::int64_t B, std::int64_t L,
                         std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv, double scale, bool causal,
                         std::int64_t chunk, bool block_causal, bool laplace, double p, std::uint64_t seed,
                         const std::int64_t* batch_index, void* stream) {
  flash::Params prm =
      flash::make_params(B, L, S, H, ldv, scale, causal, chunk, block_causal, laplace, p, seed, batch_index);
  prm.q = q;
  prm.k = k;
  prm.v = v;
  prm.dout = dout;
  prm.lse = const_cast<float*>(lse);
  prm.delta = delta;
  flash::dispatch(dtype, D, [&](auto e, auto d) {
    using C = flash::BwdCfg<decltype(e), decltype(d)::value>;
    require(ldv % C::DV == 0, "flash_attention_bwd: ldv must be a multiple of flash_attention_dv_tile");
    prm.dv_chunks = static_cast<int>(ldv / C::DV);
    if (B * H == 0) return;
    if (S > 0) {
      prm.out = dv;
      if (ldv > 0) launch_kv<C, flash::Grad::kDV>(prm, static_cast<unsigned>(ldv / C::DV), stream);
      prm.out = dk;
      launch_kv<C, flash::Grad::kDK>(prm, 1, stream);
    }
    if (L > 0) {
      prm.out = dq;
      launch_q<C>(prm, stream);
    }
  });
}

}  // namespace mk

#else  // emulator build without the CuTe headers (nvidia-cutlass not installed)
namespace mk {
void flash_attention_bwd(int, const void*, const void*, const void*, const void*, const float*, const float*, void*,
                         void*, void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, double, bool, std::int64_t, bool, bool, double, std::uint64_t,
                         const std::int64_t*, void*) {
  throw std::invalid_argument("flash attention was built without CuTe (pip install nvidia-cutlass)");
}
}  // namespace mk
#endif
