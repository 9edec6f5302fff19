// pybind11 bindings of the host launchers. Pointers arrive as integers (tensor.data_ptr()) and
// streams as integers (torch.cuda.current_stream().cuda_stream, 0 in the emulator): this file
// includes neither torch nor CUDA headers, so the same bindings serve the real CUDA extension
// and the CPU emulator extension (MK_EMULATOR_BUILD adds the emulator controls and self-tests).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "launchers.h"
#ifdef MK_EMULATOR_BUILD
#include "emu/by_name.h"
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

  // --- attention ---
  m.def("flash_attention_dv_tile", &mk::flash_attention_dv_tile);
  m.def("flash_attention_fwd",
        [](int dtype, uptr q, uptr k, uptr v, uptr o, uptr lse, std::int64_t B, std::int64_t L, std::int64_t S,
           std::int64_t H, std::int64_t D, std::int64_t ldv, double scale, bool causal, std::int64_t chunk,
           bool block_causal, bool laplace, double p, std::uint64_t seed, uptr batch_index, uptr stream) {
          mk::flash_attention_fwd(dtype, P(q), P(k), P(v), P(o), P<float>(lse), B, L, S, H, D, ldv, scale, causal,
                                  chunk, block_causal, laplace, p, seed, P<const std::int64_t>(batch_index),
                                  P(stream));
        },
        nogil);
  m.def("flash_attention_bwd",
        [](int dtype, uptr q, uptr k, uptr v, uptr dout, uptr lse, uptr delta, uptr dq, uptr dk, uptr dv,
           std::int64_t B, std::int64_t L, std::int64_t S, std::int64_t H, std::int64_t D, std::int64_t ldv,
           double scale, bool causal, std::int64_t chunk, bool block_causal, bool laplace, double p,
           std::uint64_t seed, uptr batch_index, uptr stream) {
          mk::flash_attention_bwd(dtype, P(q), P(k), P(v), P(dout), P<const float>(lse), P<const float>(delta), P(dq),
                                  P(dk), P(dv), B, L, S, H, D, ldv, scale, causal, chunk, block_causal, laplace, p,
                                  seed, P<const std::int64_t>(batch_index), P(stream));
        },
        nogil);
  // --- end attention ---
  m.def("dynamic_smem_table", &mk::dynamic_smem_table);

#ifdef MK_EMULATOR_BUILD
  m.def("emulator_set_reverse", &mk::emu_api::set_reverse, "fiber order: 1 reversed, 0 natural, -1 from MK_EMU_REVERSE");
  m.def("emulator_set_threads", &mk::emu_api::set_threads, "OS threads over blocks (-1: MK_EMU_THREADS, default 1)");
  m.def("emulator_set_smem_limit", &mk::emu_api::set_smem_limit, "per-block shared memory limit in bytes");
  m.def("emulator_switches", &mk::emu_api::switches, "fiber switches so far");
  m.def("emulator_launched_kernels", &mk::emu_api::launched_kernels, "kernel names launched so far");
  // cuda/launch.py EmulatorLauncher: arguments as the bytes of their C types; returns their type tags
  m.def("launch_kernel",
        [](const std::string& name, std::tuple<unsigned, unsigned, unsigned> grid,
           std::tuple<unsigned, unsigned, unsigned> block, std::size_t smem, const std::vector<py::bytes>& args) {
          std::vector<std::string> raw(args.begin(), args.end());
          py::gil_scoped_release release;
          return ::mk_emu::launch_by_name(name, dim3(std::get<0>(grid), std::get<1>(grid), std::get<2>(grid)),
                                          dim3(std::get<0>(block), std::get<1>(block), std::get<2>(block)), smem,
                                          raw);
        });
  m.def("emulator_selftest",
        [](const std::string& name, uptr in, uptr out, std::int64_t n, int grid, int block, std::int64_t smem) {
          mk::emu_api::selftest(name, P(in), P(out), n, grid, block, smem);
        },
        nogil);
#endif
}
