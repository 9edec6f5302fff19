// pybind11 bindings of the host launchers. Pointers arrive as integers (tensor.data_ptr()) and
// streams as integers (torch.cuda.current_stream().cuda_stream, 0 in the emulator): this file
// includes neither torch nor CUDA headers, so the same bindings serve the real CUDA extension
// and the CPU emulator extension (MK_EMULATOR_BUILD adds the emulator controls and self-tests).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "launchers.h"
#ifdef MK_EMULATOR_BUILD
#include "emu/emu_api.h"
#endif

#ifndef MK_EXT_NAME
#define MK_EXT_NAME _C
#endif

namespace py = pybind11;
using uptr = std::uintptr_t;

template <class T = void>
static T* P(uptr p) {
  return reinterpret_cast<T*>(p);
}

PYBIND11_MODULE(MK_EXT_NAME, m) {
  m.doc() = "megalodon_kernels CUDA kernels (raw-pointer launchers; see cuda/kernels.py for the tensor API)";
#ifdef MK_EMULATOR_BUILD
  m.attr("EMULATOR") = true;
#else
  m.attr("EMULATOR") = false;
#endif
  auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("dropkey_softmax_fwd",
        [](int dtype, uptr x, uptr y, std::int64_t Bf, std::int64_t Hf, std::int64_t L, std::int64_t S, bool causal,
           double p, std::uint64_t seed, uptr stream) {
          mk::dropkey_softmax_fwd(dtype, P(x), P(y), Bf, Hf, L, S, causal, p, seed, P(stream));
        },
        nogil);
  m.def("dropkey_softmax_bwd",
        [](int dtype, uptr y, uptr dy, uptr dx, std::int64_t Bf, std::int64_t Hf, std::int64_t L, std::int64_t S,
           bool causal, uptr stream) {
          mk::dropkey_softmax_bwd(dtype, P(y), P(dy), P(dx), Bf, Hf, L, S, causal, P(stream));
        },
        nogil);
  m.def("rotary",
        [](int dtype, bool conjugate, uptr x, uptr cos, uptr sin, uptr y, std::int64_t B, std::int64_t L,
           std::int64_t H, std::int64_t half, std::int64_t Pn, uptr stream) {
          mk::rotary(dtype, conjugate, P(x), P<const float>(cos), P<const float>(sin), P(y), B, L, H, half, Pn,
                     P(stream));
        },
        nogil);
  m.def("timestep_norm_workspace_floats", &mk::timestep_norm_workspace_floats);
  m.def("timestep_norm_fwd",
        [](int dtype, uptr x, uptr scale, uptr bias, uptr prev_count, uptr prev_mean, uptr prev_var, uptr mask, uptr y,
           uptr count, uptr mean, uptr var, uptr cummean, uptr cumrstd, uptr ws, std::int64_t B, std::int64_t L,
           std::int64_t D, std::int64_t G, double eps, uptr stream) {
          mk::timestep_norm_fwd(dtype, P(x), P<const float>(scale), P<const float>(bias),
                                P<const std::int64_t>(prev_count), P<const float>(prev_mean),
                                P<const float>(prev_var), P<const bool>(mask), P(y), P<std::int64_t>(count),
                                P<float>(mean), P<float>(var), P<float>(cummean), P<float>(cumrstd), P<float>(ws), B,
                                L, D, G, eps, P(stream));
        },
        nogil);
  m.def("timestep_norm_bwd",
        [](int dtype, uptr dy, uptr dmean, uptr dvar, uptr x, uptr scale, uptr prev_count, uptr prev_mean, uptr mask,
           uptr cummean, uptr cumrstd, uptr dx, uptr dscale, uptr dbias, uptr dprev_mean, uptr dprev_var, uptr ws,
           std::int64_t B, std::int64_t L, std::int64_t D, std::int64_t G, uptr stream) {
          mk::timestep_norm_bwd(dtype, P(dy), P<const float>(dmean), P<const float>(dvar), P(x),
                                P<const float>(scale), P<const std::int64_t>(prev_count), P<const float>(prev_mean),
                                P<const bool>(mask), P<const float>(cummean), P<const float>(cumrstd), P(dx),
                                P<float>(dscale), P<float>(dbias), P<float>(dprev_mean), P<float>(dprev_var),
                                P<float>(ws), B, L, D, G, P(stream));
        },
        nogil);
  m.def("fftconv_fft_size", &mk::fftconv_fft_size);
  m.def("fftconv_max_length", &mk::fftconv_max_length);
  m.def("fftconv_kernel_spectrum",
        [](uptr k, uptr kf, std::int64_t D, std::int64_t L, uptr stream) {
          mk::fftconv_kernel_spectrum(P<const float>(k), P<float>(kf), D, L, P(stream));
        },
        nogil);
  m.def("fftconv_fwd",
        [](int dtype, uptr x, uptr kf, uptr y, std::int64_t B, std::int64_t D, std::int64_t L, uptr stream) {
          mk::fftconv_fwd(dtype, P(x), P<const float>(kf), P(y), B, D, L, P(stream));
        },
        nogil);
  m.def("fftconv_bwd_dx",
        [](int dtype, uptr dy, uptr x, uptr kf, uptr dx, uptr prod, std::int64_t B, std::int64_t D, std::int64_t L,
           uptr stream) {
          mk::fftconv_bwd_dx(dtype, P(dy), P(x), P<const float>(kf), P(dx), P<float>(prod), B, D, L, P(stream));
        },
        nogil);
  m.def("fftconv_bwd_dk",
        [](uptr prod, uptr acc, uptr dk, std::int64_t nb, std::int64_t D, std::int64_t L, bool accumulate,
           bool finalize, uptr stream) {
          mk::fftconv_bwd_dk(P<const float>(prod), P<float>(acc), P<float>(dk), nb, D, L, accumulate, finalize,
                             P(stream));
        },
        nogil);
  m.def("dynamic_smem_table", &mk::dynamic_smem_table);

#ifdef MK_EMULATOR_BUILD
  m.def("emulator_set_reverse", &mk::emu_api::set_reverse, "fiber order: 1 reversed, 0 natural, -1 from MK_EMU_REVERSE");
  m.def("emulator_set_threads", &mk::emu_api::set_threads, "OS threads over blocks (-1: MK_EMU_THREADS, default 1)");
  m.def("emulator_set_smem_limit", &mk::emu_api::set_smem_limit, "per-block shared memory limit in bytes");
  m.def("emulator_switches", &mk::emu_api::switches, "fiber switches so far");
  m.def("emulator_launched_kernels", &mk::emu_api::launched_kernels, "kernel names launched so far");
  m.def("emulator_selftest",
        [](const std::string& name, uptr in, uptr out, std::int64_t n, int grid, int block, std::int64_t smem) {
          mk::emu_api::selftest(name, P(in), P(out), n, grid, block, smem);
        },
        nogil);
#endif
}
