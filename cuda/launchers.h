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

// --- rotary: x (B, L, H, 2*half) contiguous, cos/sin (P, L, half) fp32 with P in {1, B} ---------
void rotary(int dtype, bool conjugate, const void* x, const float* cos, const float* sin, void* y, std::int64_t B,
            std::int64_t L, std::int64_t H, std::int64_t half, std::int64_t P, void* stream);

// --- timestep_norm (x (B, L, D) contiguous; G groups of D/G features) ----------------------------
// Workspace: timestep_norm_workspace_floats(B, L, G) floats.
std::int64_t timestep_norm_workspace_floats(std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G);
void timestep_norm_fwd(int dtype, const void* x, const float* scale, const float* bias, const std::int64_t* prev_count,
                       const float* prev_mean, const float* prev_var, const bool* padding_mask, void* y,
                       std::int64_t* count, float* mean, float* var, float* cummean, float* cumrstd, float* workspace,
                       std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G, double eps, void* stream);
void timestep_norm_bwd(int dtype, const void* dy, const float* dmean, const float* dvar, const void* x,
                       const float* scale, const std::int64_t* prev_count, const float* prev_mean,
                       const bool* padding_mask, const float* cummean, const float* cumrstd, void* dx, float* dscale,
                       float* dbias, float* dprev_mean, float* dprev_var, float* workspace, std::int64_t B,
                       std::int64_t L, std::int64_t D, std::int64_t G, void* stream);

// --- fftconv: x (B, D, L) contiguous, k (D, L) fp32 ---------------------------------------------
std::int64_t fftconv_fft_size(std::int64_t L);  // complex points N (real FFT length 2N)
std::int64_t fftconv_max_length();
// Spectrum of k: kf (D, N + 1) complex64 (interleaved re, im).
void fftconv_kernel_spectrum(const float* k, float* kf, std::int64_t D, std::int64_t L, void* stream);
void fftconv_fwd(int dtype, const void* x, const float* kf, void* y, std::int64_t B, std::int64_t D, std::int64_t L,
                 void* stream);
// dx (x's dtype) and the per-(b, d) product spectra prod (nb, D, N + 1) complex64 for b in
// [b0, b0 + nb); then fftconv_bwd_dk sums them into acc (D, N + 1) complex64 and, when
// `finalize`, writes dk (D, L) fp32. Either output may be skipped (nullptr).
void fftconv_bwd_dx(int dtype, const void* dy, const void* x, const float* kf, void* dx, float* prod, std::int64_t B,
                    std::int64_t D, std::int64_t L, void* stream);
void fftconv_bwd_dk(const float* prod, float* acc, float* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                    bool accumulate, bool finalize, void* stream);

// --- resources: worst-case dynamic shared memory per kernel family (for the nvcc resource test) --
std::vector<std::pair<std::string, std::int64_t>> dynamic_smem_table();

}  // namespace mk
