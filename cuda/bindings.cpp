// pybind11 module of the CPU emulator (cuda/build.py): launch by name expression for the ops'
// launch descriptions (cuda/launch.py EmulatorLauncher), the emulator controls and its self-tests.
// Pointers arrive as integers (tensor.data_ptr()); no torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "emu/by_name.h"
#include "emu/emu_api.h"

#ifndef MK_EXT_NAME
#define MK_EXT_NAME _mk_cuda_emu
#endif

namespace py = pybind11;
using uptr = std::uintptr_t;

template <class T = void>
static T* P(uptr p) {
  return reinterpret_cast<T*>(p);
}

PYBIND11_MODULE(MK_EXT_NAME, m) {
  m.doc() = "megalodon_kernels CUDA emulator (kernels launched by name expression, see cuda/launch.py)";
  m.attr("EMULATOR") = true;
  auto nogil = py::call_guard<py::gil_scoped_release>();
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
}
