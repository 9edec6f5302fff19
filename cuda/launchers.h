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
// L <= fftconv_one_block_max_length() (16384): one block per row, ws unused (may be nullptr).
// Longer (up to fftconv_max_length() = 2^27): the multi-pass four-step FFT through ws, ws_rows
// rows of fftconv_workspace_row_floats(L) floats (N complex64) each; rows go in chunks of ws_rows.
std::int64_t fftconv_fft_size(std::int64_t L);  // complex points N (real FFT length 2N)
std::int64_t fftconv_max_length();
std::int64_t fftconv_one_block_max_length();
std::int64_t fftconv_workspace_row_floats(std::int64_t L);  // 0 when L needs no workspace
// Spectrum of k: kf (D, N + 1) complex64 (interleaved re, im; bins permuted for the multi-pass path).
void fftconv_kernel_spectrum(const float* k, float* kf, std::int64_t D, std::int64_t L, float* ws,
                             std::int64_t ws_rows, void* stream);
void fftconv_fwd(int dtype, const void* x, const float* kf, void* y, std::int64_t B, std::int64_t D, std::int64_t L,
                 float* ws, std::int64_t ws_rows, void* stream);
// dx (x's dtype) and the per-(b, d) product spectra prod (nb, D, N + 1) complex64 for b in
// [b0, b0 + nb); then fftconv_bwd_dk sums them into acc (D, N + 1) complex64 and, when
// `finalize`, writes dk (D, L) fp32. Either output may be skipped (nullptr).
void fftconv_bwd_dx(int dtype, const void* dy, const void* x, const float* kf, void* dx, float* prod, std::int64_t B,
                    std::int64_t D, std::int64_t L, float* ws, std::int64_t ws_rows, void* stream);
void fftconv_bwd_dk(const float* prod, float* acc, float* dk, std::int64_t nb, std::int64_t D, std::int64_t L,
                    bool accumulate, bool finalize, float* ws, std::int64_t ws_rows, void* stream);
// Test hook: out (n, 2) = e^{sign i pi a / 2^s} as the multi-pass twiddles compute it.
void fftconv_long_twiddle_probe(const std::uint32_t* a, float* out, std::int64_t n, int s, float sign, void* stream);

// --- cema_kernel / ema_hidden (cema.cuh): coefficients fp32, complex as interleaved (re, im) -----
// Workspace of the analysis partial sums: cema_workspace_floats(rows, D, N, L) floats, with
// rows = (dk given) + (db given) * B for cema_kernel_bwd and rows = B for ema_hidden_fwd.
std::int64_t cema_workspace_floats(std::int64_t rows, std::int64_t D, std::int64_t N, std::int64_t L);
// k (D, L) and, when hx (B, D, N) is given, b (B, D, L); p (D, N), log_q, gamma (D, N) complex.
void cema_kernel_fwd(const float* p, const float* log_q, const float* gamma, const float* hx, float* k, float* b,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, void* stream);
// dk (D, L), db (B, D, L) fp32 or nullptr -> dp (D, N), dlog_q, dgamma (D, N) and dhx (B, D, N) when hx
// is given (B = 0 without hx). weighted = false skips dlog_q (written as 0).
void cema_kernel_bwd(const float* dk, const float* db, const float* p, const float* log_q, const float* gamma,
                     const float* hx, float* dp, float* dlog_q, float* dgamma, float* dhx, float* workspace,
                     std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L, bool weighted, void* stream);
// x (B, D, L) float32/bf16 (dtype code) -> h, V and, when w != nullptr, W, all (B, D, N); hx may be nullptr.
void ema_hidden_fwd(int dtype, const void* x, const float* p, const float* log_q, const float* hx, float* h, float* v,
                    float* w, float* workspace, std::int64_t B, std::int64_t D, std::int64_t N, std::int64_t L,
                    void* stream);
// dh (B, D, N) -> dx (B, D, L) fp32 (nullptr: skipped), dp (D, N), dlog_q (D, N), dhx (B, D, N) when hx
// is given; V (need_p) and W (need_lq) are the forward's saved sums.
void ema_hidden_bwd(const float* dh, const float* p, const float* log_q, const float* hx, const float* v,
                    const float* w, float* dx, float* dp, float* dlog_q, float* dhx, std::int64_t B, std::int64_t D,
                    std::int64_t N, std::int64_t L, bool need_p, bool need_lq, void* stream);
// --- end cema_kernel / ema_hidden ----------------------------------------------------------------

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
