// Flash attention forward (cuda/flash_attention.cuh): instantiations for every element type and
// padded head dim, and the host launcher.
#include <stdexcept>

#include "launchers.h"

#if MK_HAVE_CUTE || defined(__CUDACC__)
#include "flash_attention.cuh"
#include "flash_attention_launch.h"

namespace mk {

namespace {
template <class C>
void launch_fwd(const flash::Params& p, void* stream) {
  using Lay = flash::FwdSmem<C>;
  const auto flash_fwd = &flash::flash_fwd_kernel<C>;
  if (Lay::bytes > 48 * 1024) MK_SET_MAX_DYNAMIC_SMEM(flash_fwd, Lay::bytes);
  const dim3 grid(static_cast<unsigned>((p.L + C::BM - 1) / C::BM), static_cast<unsigned>(p.B * p.H),
                  static_cast<unsigned>(p.ldv / C::DV));
  MK_LAUNCH(flash_fwd, grid, C::NT, Lay::bytes, stream, p);
}
}  // namespace

std::int64_t flash_attention_dv_tile(int dtype, std::int64_t D) {
  std::int64_t out = 0;  // 0: no kernel for (dtype, D)
  try {
    flash::dispatch(dtype, D, [&](auto e, auto d) { out = flash::FwdCfg<decltype(e), decltype(d)::value>::DV; });
  } catch (const std::invalid_argument&) {
  }
  return out;
}

std::vector<std::pair<std::string, std::int64_t>> flash_attention_smem() {
  std::int64_t fwd = 0, bwd = 0;  // worst case over the compiled (dtype, head dim) configurations
  for (int dtype : {flash::kAttnFloat32, flash::kAttnBFloat16, flash::kAttnFloat16})
    for (int D : {64, 128, 256}) {
      try {
        flash::dispatch(dtype, D, [&](auto e, auto d) {
          using E = decltype(e);
          constexpr int Dv = decltype(d)::value;
          fwd = imax<std::int64_t>(fwd, flash::FwdSmem<flash::FwdCfg<E, Dv>>::bytes);
          bwd = imax<std::int64_t>(bwd, flash::BwdSmem<flash::BwdCfg<E, Dv>>::bytes);
        });
      } catch (const std::invalid_argument&) {  // not compiled here (fp32 on nvcc, fp32 at D = 256)
      }
    }
  return {{"flash_fwd_kernel", fwd}, {"flash_bwd_kv_kernel", bwd}, {"flash_bwd_q_kernel", bwd}};
}

void flash_attention_fwd(int dtype, const void* q, const void* k, const void* v, void* o, float* lse, std::int64_t B,
                         std::int64_t L, std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv,
                         double scale, bool causal, std::int64_t chunk, bool block_causal, bool laplace, double p,
                         std::uint64_t seed, const std::int64_t* batch_index, void* stream) {
  flash::Params prm =
      flash::make_params(B, L, S, H, ldv, scale, causal, chunk, block_causal, laplace, p, seed, batch_index);
  prm.q = q;
  prm.k = k;
  prm.v = v;
  prm.out = o;
  prm.lse = lse;
  if (B * H * L == 0 || ldv == 0) return;
  flash::dispatch(dtype, D, [&](auto e, auto d) {
    using C = flash::FwdCfg<decltype(e), decltype(d)::value>;
    require(ldv % C::DV == 0, "flash_attention_fwd: ldv must be a multiple of flash_attention_dv_tile");
    launch_fwd<C>(prm, stream);
  });
}

}  // namespace mk

#else  // emulator build without the CuTe headers (nvidia-cutlass not installed)
namespace mk {
std::int64_t flash_attention_dv_tile(int, std::int64_t) { return 0; }
std::vector<std::pair<std::string, std::int64_t>> flash_attention_smem() { return {}; }
void flash_attention_fwd(int, const void*, const void*, const void*, void*, float*, std::int64_t, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t, std::int64_t, double, bool, std::int64_t, bool, bool,
                         double, std::uint64_t, const std::int64_t*, void*) {
  throw std::invalid_argument("flash attention was built without CuTe (pip install nvidia-cutlass)");
}
}  // namespace mk
#endif
