// Host-side helpers shared by flash_attention_fwd.cu and flash_attention_bwd.cu: argument
// checks, the Params of a call, and the (dtype code, padded head dim) -> template dispatch.
#pragma once

#include <stdexcept>
#include <type_traits>

#include "flash_attention.cuh"

namespace mk {
namespace flash {

// Element type codes of the attention launchers: mk::DType plus float16.
// Emulator only: 3 = bf16 through the emulated mma.sync atom (checks the tensor-core layouts).
enum : int { kAttnFloat32 = 0, kAttnBFloat16 = 1, kAttnFloat16 = 2, kAttnBFloat16EmuSm80 = 3 };

inline Params make_params(std::int64_t B, std::int64_t L, std::int64_t S, std::int64_t H, std::int64_t ldv,
                          double scale, bool causal, std::int64_t chunk, bool block_causal, bool laplace, double p,
                          std::uint64_t seed, const std::int64_t* batch_index) {
  require(B >= 0 && L >= 0 && S >= 0 && H >= 1 && ldv >= 0, "flash_attention: negative sizes");
  require(L < (1ll << 30) && S < (1ll << 30), "flash_attention: L and S must be < 2^30");
  require(B * H < (1ll << 31) && B <= 0xFFFFFFFFll, "flash_attention: B * H must be < 2^31");
  require(chunk >= 0 && chunk < (1ll << 30), "flash_attention: chunk_size must be in [0, 2^30) (0: none)");
  require(!block_causal || chunk > 0, "flash_attention: block_causal needs chunk_size");
  require(p >= 0.0 && p < 1.0, "flash_attention: dropkey_p must be in [0, 1)");
  Params prm{};
  prm.B = static_cast<int>(B);
  prm.H = static_cast<int>(H);
  prm.L = static_cast<int>(L);
  prm.S = static_cast<int>(S);
  prm.ldv = static_cast<int>(ldv);
  prm.scale = static_cast<float>(scale);
  prm.causal = causal;
  prm.chunk = static_cast<int>(chunk);
  prm.block_causal = block_causal;
  prm.laplace = laplace;
  prm.thr = dropkey::threshold(p);
  prm.key = dropkey::seed_key(seed);
  prm.batch_index = batch_index;
  return prm;
}

// fn(E{}, std::integral_constant<int, D>{}) for the compiled (element type, head dim) pairs.
template <class F>
void dispatch(int dtype, std::int64_t D, F&& fn) {
  auto by_dim = [&](auto e) {
    switch (D) {
      case 64: fn(e, std::integral_constant<int, 64>{}); return;
      case 128: fn(e, std::integral_constant<int, 128>{}); return;
      case 256:
        if constexpr (sizeof(decltype(e)) <= 2) {  // fp32 tiles at D = 256 exceed the smem limit
          fn(e, std::integral_constant<int, 256>{});
          return;
        }
        [[fallthrough]];
      default:
        throw std::invalid_argument("flash_attention: no kernel for padded head dim " + std::to_string(D) +
                                    " with dtype code " + std::to_string(dtype));
    }
  };
  switch (dtype) {
#if MK_EMULATOR
    case kAttnFloat32: by_dim(float{}); return;
    case kAttnBFloat16EmuSm80:
      if (D != 64) throw std::invalid_argument("flash_attention: dtype code 3 (emulated mma.sync) has D = 64 only");
      fn(bf16_sm80emu{}, std::integral_constant<int, 64>{});
      return;
#endif
    case kAttnBFloat16: by_dim(cutlass::bfloat16_t{}); return;
    case kAttnFloat16: by_dim(cutlass::half_t{}); return;
    default: throw std::invalid_argument("flash_attention: unsupported dtype code " + std::to_string(dtype));
  }
}

}  // namespace flash
}  // namespace mk
