// The emulator's table of kernels launched by name expression (by_name.h).
#include "by_name.h"

#include <map>
#include <mutex>
#include <stdexcept>

namespace mk_emu {

namespace {
std::map<std::string, ByNameKernel>& table() {
  static std::map<std::string, ByNameKernel> t;
  return t;
}
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

void register_by_name(const std::string& name, ByNameKernel kernel) {
  std::lock_guard<std::mutex> g(table_mutex());
  table()[name] = std::move(kernel);
}

const ByNameKernel& find_by_name(const std::string& name) {
  std::lock_guard<std::mutex> g(table_mutex());
  auto it = table().find(name);
  if (it == table().end())
    throw std::invalid_argument("the emulator has no kernel " + name +
                                " (add it to the op's KERNELS list in ops/<op>/cuda_impl.py)");
  return it->second;
}

std::vector<std::string> launch_by_name(const std::string& name, dim3 grid, dim3 block, std::size_t smem,
                                        const std::vector<std::string>& args) {
  const ByNameKernel& k = find_by_name(name);
  if (args.size() != k.sizes.size())
    throw std::invalid_argument("launch of " + name + ": " + std::to_string(args.size()) + " arguments for " +
                                std::to_string(k.sizes.size()) + " parameters");
  for (std::size_t i = 0; i < args.size(); ++i)
    if (args[i].size() != k.sizes[i])
      throw std::invalid_argument("launch of " + name + ": argument " + std::to_string(i) + " has " +
                                  std::to_string(args[i].size()) + " bytes, the parameter (" + k.tags[i] + ") " +
                                  std::to_string(k.sizes[i]));
  if (smem > 48 * 1024) set_max_dynamic_smem(k.address, static_cast<long>(smem), name.c_str());
  k.launch(grid, block, smem, args);
  return k.tags;
}

}  // namespace mk_emu
