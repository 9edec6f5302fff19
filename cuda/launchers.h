// Host launchers of every CUDA kernel: plain C++ over raw device pointers and sizes, so the
// pybind11 bindings (bindings.cpp) need neither torch nor CUDA headers. Each launcher checks its
// sizes (std::invalid_argument -> ValueError), picks grid/block/shared memory and launches on
// `stream` (a cudaStream_t; ignored by the emulator). Element types are mk::DType codes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mk {

// --- attention (flash, cuda/flash_attention.cuh) -----------------------------------------------
// q (B, L, H, D), k (B, S, H, D), v (B, S, H, ldv), o / dout (B, L, H, ldv) contiguous with D the
// padded head dim (64, 128, 256) and ldv a multiple of flash_attention_dv_tile(dtype, D) (0: no
// kernel for that pair); lse / delta (B, H, L) fp32. dtype: 0 float32 (emulator only), 1 bf16, 2 fp16.
// chunk = 0: no chunk mask. The backward's delta is rowsum(dO * O) (softmax; unused by Laplace).
// batch_index: (B,) int64, the batch index the DropKey rule hashes for each row, or null (the row).
std::int64_t flash_attention_dv_tile(int dtype, std::int64_t D);
// Worst-case dynamic shared memory of the flash kernel families (for dynamic_smem_table).
std::vector<std::pair<std::string, std::int64_t>> flash_attention_smem();
void flash_attention_fwd(int dtype, const void* q, const void* k, const void* v, void* o, float* lse, std::int64_t B,
                         std::int64_t L, std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv,
                         double scale, bool causal, std::int64_t chunk, bool block_causal, bool laplace, double p,
                         std::uint64_t seed, const std::int64_t* batch_index, void* stream);
void flash_attention_bwd(int dtype, const void* q, const void* k, const void* v, const void* dout, const float* lse,
                         const float* delta, void* dq, void* dk, void* dv, std::int64_t B, std::int64_t L,
                         std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv, double scale, bool causal,
                         std::int64_t chunk, bool block_causal, bool laplace, double p, std::uint64_t seed,
                         const std::int64_t* batch_index, void* stream);
// --- end attention ---

// --- resources: worst-case dynamic shared memory per kernel family (for the nvcc resource test) --
std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table();

}  // namespace mk
