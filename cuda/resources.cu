// Worst-case dynamic shared memory of every kernel family that uses it (host code only), so
// the nvcc resource test checks static + dynamic shared memory against the per-block limits.
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table() {
  const auto fft = static_cast<std::int64_t>(fft_smem_bytes(kFftMaxLog2));
  return {
      {"fftconv_spectrum_kernel", fft},
      {"fftconv_fwd_kernel", fft},
      {"fftconv_bwd_dx_kernel", fft},
      {"fftconv_bwd_dk_kernel", fft},
  };
}

}  // namespace mk
