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

// --- dropkey_softmax (scores (Bf, Hf, L, S) contiguous) ----------------------------------------
void dropkey_softmax_fwd(int dtype, const void* x, void* y, std::int64_t Bf, std::int64_t Hf, std::int64_t L,
                         std::int64_t S, bool causal, double p, std::uint64_t seed, void* stream);
void dropkey_softmax_bwd(int dtype, const void* y, const void* dy, void* dx, std::int64_t Bf, std::int64_t Hf,
                         std::int64_t L, std::int64_t S, bool causal, void* stream);

// --- fftconv: x (B, D, L) contiguous, k (D, L) in x's arithmetic type (fp32; fp64 for double x) ---
// dtype: x's code (kFloat32, kBFloat16, kFloat64) for fwd / dx; the arithmetic type's code
// (kFloat32 or kFloat64) for the k spectrum and dk. Spectra (kf, prod, acc) are complex64 for
// fp32 arithmetic and complex128 for fp64 (interleaved re, im; bins permuted on the multi-pass path).
// L <= fftconv_one_block_max_length(dtype) (16384; 8192 in double): one block per row, ws unused
// (may be nullptr). Longer (up to fftconv_max_length(dtype) = 2^27; 2^25 in double): the
// multi-pass four-step FFT through ws, ws_rows rows of fftconv_workspace_row_floats(L, dtype)
// 4-byte floats (N complex values) each; rows go in chunks of ws_rows.
std::int64_t fftconv_fft_size(std::int64_t L);  // complex points N (real FFT length 2N)
std::int64_t fftconv_max_length(int dtype = 0);
std::int64_t fftconv_one_block_max_length(int dtype = 0);
std::int64_t fftconv_workspace_row_floats(std::int64_t L, int dtype = 0);  // 0 when L needs no workspace
// Spectrum of k: kf (D, N + 1) complex.
void fftconv_kernel_spectrum(int dtype, const void* k, void* kf, std::int64_t D, std::int64_t L, void* ws,
                             std::int64_t ws_rows, void* stream);
void fftconv_fwd(int dtype, const void* x, const void* kf, void* y, std::int64_t B, std::int64_t D, std::int64_t L,
                 void* ws, std::int64_t ws_rows, void* stream);
// dx (x's dtype) and the per-(b, d) product spectra prod (nb, D, N + 1) complex for b in
// [b0, b0 + nb); then fftconv_bwd_dk sums them into acc (D, N + 1) complex and, when
// `finalize`, writes dk (D, L) in the arithmetic type. Either output may be skipped (nullptr).
void fftconv_bwd_dx(int dtype, const void* dy, const void* x, const void* kf, void* dx, void* prod, std::int64_t B,
                    std::int64_t D, std::int64_t L, void* ws, std::int64_t ws_rows, void* stream);
void fftconv_bwd_dk(int dtype, const void* prod, void* acc, void* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                    bool accumulate, bool finalize, void* ws, std::int64_t ws_rows, void* stream);
// Test hook: out (n) complex of dtype's arithmetic type = e^{sign i pi a / 2^s} as the multi-pass
// twiddles compute it.
void fftconv_long_twiddle_probe(const std::uint32_t* a, void* out, std::int64_t n, int s, double sign, int dtype,
                                void* stream);
// Worst-case dynamic smem of the one-block fftconv kernels over float and double (resources.cu).
std::int64_t fftconv_one_block_max_smem_bytes();
// --- end fftconv ---


// --- attention (flash, cuda/flash_attention.cuh) -----------------------------------------------
// q (B, L, H, D), k (B, S, H, D), v (B, S, H, ldv), o / dout (B, L, H, ldv) contiguous with D the
// padded head dim (64, 128, 256) and ldv a multiple of flash_attention_dv_tile(dtype, D) (0: no
// kernel for that pair); lse / delta (B, H, L) fp32. dtype: 0 float32 (emulator only), 1 bf16, 2 fp16.
// chunk = 0: no chunk mask. The backward's delta is rowsum(dO * O) (softmax; unused by Laplace).
std::int64_t flash_attention_dv_tile(int dtype, std::int64_t D);
// Worst-case dynamic shared memory of the flash kernel families (for dynamic_smem_table).
std::vector<std::pair<std::string, std::int64_t>> flash_attention_smem();
void flash_attention_fwd(int dtype, const void* q, const void* k, const void* v, void* o, float* lse, std::int64_t B,
                         std::int64_t L, std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv,
                         double scale, bool causal, std::int64_t chunk, bool block_causal, bool laplace, double p,
                         std::uint64_t seed, void* stream);
void flash_attention_bwd(int dtype, const void* q, const void* k, const void* v, const void* dout, const float* lse,
                         const float* delta, void* dq, void* dk, void* dv, std::int64_t B, std::int64_t L,
                         std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv, double scale, bool causal,
                         std::int64_t chunk, bool block_causal, bool laplace, double p, std::uint64_t seed,
                         void* stream);
// --- end attention ---

// --- resources: worst-case dynamic shared memory per kernel family (for the nvcc resource test) --
std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table();

}  // namespace mk
