// Worst-case dynamic shared memory of every kernel family that uses it (host code only), so
// the nvcc resource test checks static + dynamic shared memory against the per-block limits.
// (The launch descriptions' kernels, e.g. fftconv's, are checked on the NVRTC build instead:
// tests/test_cuda_nvrtc.py with the sizes their cuda_impl.py computes.)
#include "launchers.h"

namespace mk {

std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table() {
  std::vector<std::pair<std::string, std::int64_t>> table;
  // --- attention: flash kernels, worst case over the compiled (dtype, head dim) configurations ---
  for (auto& entry : flash_attention_smem()) table.push_back(entry);
  // --- end attention ---
  return table;
}

}  // namespace mk
