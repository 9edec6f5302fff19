// Controls of the SIMT emulator and its self-test kernels (emulator extension only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mk::emu_api {

void set_reverse(int reverse);   // 1: fibers in reverse order, 0: natural, -1: from MK_EMU_REVERSE
void set_threads(int threads);   // OS threads over blocks; -1: from MK_EMU_THREADS (default 1)
void set_smem_limit(std::int64_t bytes);
unsigned long long switches();
std::vector<std::string> launched_kernels();
// Runs the toy kernel `name` (see emu_api.cu) on float buffers in/out of n elements.
void selftest(const std::string& name, void* in, void* out, std::int64_t n, int grid, int block, std::int64_t smem);

}  // namespace mk::emu_api
