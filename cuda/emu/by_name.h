// Launch by name expression in the emulator: the registry files that cuda/build.py generates from
// the ops' KERNELS lists register `mk::rotary_kernel<float, false>` etc. (the NVRTC name
// expressions, instantiated here by the host compiler from the same headers); the Python launch
// descriptions then launch them with the arguments as the bytes of their C types, as
// cuLaunchKernel receives them. The argument count and every size are checked against the C++
// signature; each parameter reports a type tag (cuda/launch.py ARG_TYPES) for the records.
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu.cuh"

namespace mk_emu {

struct ByNameKernel {
  const void* address;
  std::vector<std::string> tags;
  std::vector<std::size_t> sizes;
  std::function<void(dim3, dim3, std::size_t, const std::vector<std::string>&)> launch;
};

// name expression -> kernel (runtime.cpp holds the one table)
void register_by_name(const std::string& name, ByNameKernel kernel);
const ByNameKernel& find_by_name(const std::string& name);

template <class T>
std::string arg_tag() {
  if constexpr (std::is_pointer_v<T>) return "ptr";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_floating_point_v<T>) return sizeof(T) == 4 ? "f32" : "f64";
  else if constexpr (std::is_integral_v<T>) return (std::is_signed_v<T> ? "i" : "u") + std::to_string(8 * sizeof(T));
  else return "struct" + std::to_string(sizeof(T));
}

template <class... P, std::size_t... I>
void launch_from_bytes(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem,
                       const std::vector<std::string>& args, std::index_sequence<I...>) {
  std::tuple<std::remove_cv_t<P>...> values;
  ((std::memcpy(static_cast<void*>(&std::get<I>(values)), args[I].data(), sizeof(std::get<I>(values)))), ...);
  launch(name, kernel, grid, block, smem, std::get<I>(values)...);
}

template <class... P>
bool register_kernel(const char* name, void (*kernel)(P...)) {
  static_assert((std::is_trivially_copyable_v<std::remove_cv_t<P>> && ...), "kernel parameters must be trivially copyable");
  ByNameKernel k;
  k.address = reinterpret_cast<const void*>(kernel);
  k.tags = {arg_tag<std::remove_cv_t<P>>()...};
  k.sizes = {sizeof(std::remove_cv_t<P>)...};
  k.launch = [name, kernel](dim3 grid, dim3 block, std::size_t smem, const std::vector<std::string>& args) {
    launch_from_bytes(name, kernel, grid, block, smem, args, std::index_sequence_for<P...>{});
  };
  register_by_name(name, std::move(k));
  return true;
}

// Checks the arguments against the signature, opts in to `smem` bytes of dynamic shared memory
// when it exceeds the default 48 KiB (as the GPU runtime does), launches; returns the tags.
std::vector<std::string> launch_by_name(const std::string& name, dim3 grid, dim3 block, std::size_t smem,
                                        const std::vector<std::string>& args);

}  // namespace mk_emu

// MK_REGISTER_KERNEL(unique id, "name expression", name expression)
#define MK_REGISTER_KERNEL(id, name, ...) \
  static const bool mk_registered_##id = ::mk_emu::register_kernel(name, &__VA_ARGS__)
