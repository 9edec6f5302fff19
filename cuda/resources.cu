// Worst-case dynamic shared memory of every kernel family that uses it (host code only), so
// the nvcc resource test checks static + dynamic shared memory against the per-block limits.
#include "fftconv.cuh"
#include "launchers.h"

namespace mk {

std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table() {
  const auto fft = fftconv_one_block_max_smem_bytes();  // --- fftconv: float N = 2^14 | double N = 2^13 ---
  std::vector<std::pair<std::string, std::int64_t>> table = {
      {"fftconv_spectrum_kernel", fft},
      {"fftconv_fwd_kernel", fft},
      {"fftconv_bwd_dx_kernel", fft},
      {"fftconv_bwd_dk_kernel", fft},
      // --- fftconv multi-pass (L > 16384, fftconv_long.cuh): worst case over N = 2^15 .. 2^27 ---
      {"fft4_col_fwd_kernel", fftconv_long_max_smem_bytes(false)},
      {"fft4_col_inv_kernel", fftconv_long_max_smem_bytes(false)},
      {"fft4_row_spectrum_kernel", fftconv_long_max_smem_bytes(true)},
      {"fft4_row_conv_kernel", fftconv_long_max_smem_bytes(true)},
      {"fft4_row_dk_kernel", fftconv_long_max_smem_bytes(true)},
  };
  // --- attention: flash kernels, worst case over the compiled (dtype, head dim) configurations ---
  for (auto& entry : flash_attention_smem()) table.push_back(entry);
  // --- end attention ---
  return table;
}

}  // namespace mk
