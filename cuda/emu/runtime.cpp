// The SIMT emulator's runtime: fibers, the round-robin scheduler, barriers and warp-synchronous
// calls with their strict checks (see emu.cuh for the model). Compiled once into the emulator
// extension; kernels only see the declarations in emu.cuh.
#include "emu.cuh"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace mk_emu {

// --- fiber contexts ---------------------------------------------------------------------------
// ucontext's swapcontext makes a sigprocmask system call per switch (0.7 us on our VMs); on
// x86-64 a 12-instruction switch of the callee-saved registers does the same job (the ABI's
// callee-saved set plus the SSE/x87 control words) and ucontext remains the portable fallback
// (define MK_EMU_UCONTEXT to force it).
#if defined(__x86_64__) && !defined(MK_EMU_UCONTEXT)
#define MK_EMU_FAST_SWITCH 1
struct Context {
  void* sp = nullptr;
};
__attribute__((naked, noinline, used)) static void mk_emu_switch_(void** save_sp, void* to_sp) {
  __asm__ volatile(
      "pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "subq $8, %rsp\n\tstmxcsr (%rsp)\n\tfnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\tfldcw 4(%rsp)\n\taddq $8, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret\n");
}
inline void ctx_switch(Context& from, Context& to) { mk_emu_switch_(&from.sp, to.sp); }
inline void ctx_init(Context& c, char* stack, long size, void (*entry)()) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + size) & ~std::uintptr_t(15);
  auto* w = reinterpret_cast<std::uint64_t*>(top);
  w[-1] = 0;                                           // fake return address of entry (never used)
  w[-2] = reinterpret_cast<std::uint64_t>(entry);      // popped by the switch's ret
  for (int i = 3; i <= 8; ++i) w[-i] = 0;              // rbp rbx r12-r15
  w[-9] = 0x1F80ull | (0x037Full << 32);               // mxcsr, x87 control word defaults
  c.sp = &w[-9];
}
#else
#define MK_EMU_FAST_SWITCH 0
struct Context {
  ucontext_t uc;
};
inline void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void ctx_init(Context& c, char* stack, long size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Site {
  const char* what = "";
  const char* file = "";
  int line = 0;
  bool same(const Site& o) const { return line == o.line && what == o.what && std::strcmp(file, o.file) == 0; }
  std::string str() const {
    const char* base = std::strrchr(file, '/');
    return std::string(what) + " at " + (base ? base + 1 : file) + ":" + std::to_string(line);
  }
};

enum class Wait : unsigned char { Runnable, Block, Warp, Done };

struct Fiber {
  Context ctx;
  uint3 tid;
  Wait wait = Wait::Runnable;
  std::uint64_t wait_gen = 0;
  Site site;
  // warp-synchronous call in flight
  WarpOp op = WarpOp::Sync;
  unsigned int mask = 0;
  int param = 0;  // srcLane / delta / laneMask / predicate
  int width = 32;
  std::uint64_t value = 0, result = 0;
  std::uint64_t lane_gen = 0;
};

struct Config {
  int reverse = -1;        // -1: from MK_EMU_REVERSE
  int threads = -1;        // -1: from MK_EMU_THREADS (default 1)
  long stack_bytes = -1;   // -1: from MK_EMU_STACK_KB (default 64)
  long smem_limit = MK_DEFAULT_SMEM_OPTIN;
};
inline Config& config() {
  static Config c;
  return c;
}
inline long env_long(const char* name, long dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::strtol(v, nullptr, 10) : dflt;
}
inline bool reverse_order() { return config().reverse >= 0 ? config().reverse != 0 : env_long("MK_EMU_REVERSE", 0) != 0; }
inline int os_threads() { return static_cast<int>(config().threads > 0 ? config().threads : std::max(1L, env_long("MK_EMU_THREADS", 1))); }
inline long stack_bytes() { return config().stack_bytes > 0 ? config().stack_bytes : env_long("MK_EMU_STACK_KB", 64) * 1024; }
// API flags (the Python binding exposes them): order of fibers, OS threads over blocks.
void set_reverse(int r) { config().reverse = r; }
void set_threads(int n) { config().threads = n; }
void set_smem_limit(long bytes) { config().smem_limit = bytes; }

std::atomic<unsigned long long> g_switches{0};
std::mutex g_log_mutex;
std::vector<std::string> g_launched;  // distinct kernel names launched so far (tests check coverage)
unsigned long long switch_count() { return g_switches.load(); }

// Warp-synchronous calls in flight in one warp: groups of lanes (one per mask; disjoint masks
// may be in flight together, e.g. two half-warps) and the lanes that have returned.
struct WarpGroup {
  unsigned int mask = 0, arrived = 0;
  Site site;
  WarpOp op = WarpOp::Sync;
};
struct WarpState {
  static constexpr int kMaxGroups = 8;
  WarpGroup groups[kMaxGroups];
  int ngroups = 0;
  unsigned int exited = 0;
};

// One block being run by this OS thread.
struct BlockRun {
  const char* kernel = "";
  uint3 bid;
  int n = 0;
  Fiber* fibers = nullptr;
  int current = -1;
  Context sched;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  int bar_arrived = 0;
  std::uint64_t bar_gen = 0;
  Site bar_site;
  int exited = 0;
  bool abort = false;
  std::string error;
  unsigned long long switches = 0;
  std::vector<WarpState> warps;
  bool reverse = false;
  int done = 0;
  std::vector<std::pair<const void*, unsigned char*>> statics;  // MK_STATIC_SMEM of this block
  std::size_t static_used = 0;
  unsigned char* static_arena = nullptr;
};

thread_local BlockRun* tl_block = nullptr;

constexpr std::size_t kStaticSmemLimit = 48 * 1024;  // CUDA's static shared memory limit per block

// Per-OS-thread pool of fiber stacks (mmap'ed, one guard page below each) and fiber records.
struct Pool {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  long stack_size = 0;
  std::vector<unsigned char> smem;
  std::vector<unsigned char> static_arena = std::vector<unsigned char>(kStaticSmemLimit + 64);
  ~Pool() {
    for (char* s : stacks) munmap(s, stack_size + 4096);
  }
  void ensure(int n) {
    const long want = stack_bytes();
    if (want != stack_size) {
      for (char* s : stacks) munmap(s, stack_size + 4096);
      stacks.clear();
      stack_size = want;
    }
    if (static_cast<int>(fibers.size()) < n) fibers.resize(n);
    while (static_cast<int>(stacks.size()) < n) {
      void* p = mmap(nullptr, stack_size + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("mk_emu: cannot allocate fiber stacks");
      mprotect(p, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
      stacks.push_back(static_cast<char*>(p));
    }
  }
};
inline Pool& pool() {
  static thread_local Pool p;
  return p;
}

inline bool ready(const BlockRun& b, const Fiber& f) {
  return f.wait == Wait::Runnable || (f.wait == Wait::Block && f.wait_gen != b.bar_gen) ||
         (f.wait == Wait::Warp && f.wait_gen != f.lane_gen);
}

// The current fiber cannot go on: switch straight to the next ready fiber in scheduling order
// (round robin, forward or reversed), or back to the scheduler when no fiber is ready (all
// returned, or a deadlock). One context switch per wait instead of two through the scheduler.
inline void yield_to_scheduler() {
  BlockRun& b = *tl_block;
  Fiber& cur = b.fibers[b.current];
  ++b.switches;
  for (int k = 1; k < b.n; ++k) {
    const int i = b.reverse ? (b.current - k + b.n) % b.n : (b.current + k) % b.n;
    Fiber& f = b.fibers[i];
    if (ready(b, f)) {
      b.current = i;
      threadIdx = f.tid;
      ctx_switch(cur.ctx, f.ctx);
      return;
    }
  }
  ctx_switch(cur.ctx, b.sched);
}

[[noreturn]] inline void fail(const std::string& msg) {
  BlockRun& b = *tl_block;
  b.error = msg;
  b.abort = true;
  ctx_switch(b.fibers[b.current].ctx, b.sched);
  std::abort();  // never resumed
}

inline std::string mask_str(unsigned int m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", m);
  return buf;
}

inline std::string thread_name(const BlockRun& b, int i) {
  const uint3 t = b.fibers[i].tid;
  return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ")";
}

inline void fiber_main() {
  BlockRun& b = *tl_block;
  b.body(b.ctx);
  Fiber& f = b.fibers[b.current];
  f.wait = Wait::Done;
  ++b.exited;
  if (b.bar_arrived > 0)
    fail(thread_name(b, b.current) + " returned while " + std::to_string(b.bar_arrived) + " threads wait in " +
         b.bar_site.str() + " (barrier after early return)");
  // a lane of my warp waiting for me in a warp-synchronous call would never be released
  const int lane = b.current & 31;
  WarpState& w = b.warps[b.current >> 5];
  w.exited |= 1u << lane;
  for (int k = 0; k < w.ngroups; ++k)
    if (w.groups[k].mask >> lane & 1u)
      fail(thread_name(b, b.current) + " returned while lanes of its warp wait for it in " + w.groups[k].site.str() +
           " (mask " + mask_str(w.groups[k].mask) + ")");
  ++b.done;
  yield_to_scheduler();
  std::abort();  // a returned fiber is never resumed
}

// --- __syncthreads ----------------------------------------------------------------------------
void syncthreads(const char* file, int line) {
  BlockRun& b = *tl_block;
  const Site site{"__syncthreads", file, line};
  if (b.exited > 0)
    fail(site.str() + " reached by " + thread_name(b, b.current) + " after " + std::to_string(b.exited) +
         " threads of the block returned (barrier after early return)");
  if (b.bar_arrived == 0) {
    b.bar_site = site;
  } else if (!b.bar_site.same(site)) {
    fail("divergent __syncthreads: " + thread_name(b, b.current) + " at " + site.str() + ", other threads at " +
         b.bar_site.str());
  }
  if (++b.bar_arrived == b.n) {
    b.bar_arrived = 0;
    ++b.bar_gen;
    return;
  }
  Fiber& f = b.fibers[b.current];
  f.wait = Wait::Block;
  f.wait_gen = b.bar_gen;
  f.site = site;
  yield_to_scheduler();
  f.wait = Wait::Runnable;
}

// --- warp-synchronous calls -------------------------------------------------------------------

inline int shfl_source(WarpOp op, int lane, int param, int width) {
  const int seg = lane & ~(width - 1);
  switch (op) {
    case WarpOp::Shfl: return seg + (param & (width - 1));
    case WarpOp::ShflUp: return (lane - seg) >= param ? lane - param : lane;
    case WarpOp::ShflDown: return (lane - seg) + param < width ? lane + param : lane;
    case WarpOp::ShflXor: {
      const int s = lane ^ param;
      return (s & ~(width - 1)) == seg ? s : lane;
    }
    default: return lane;
  }
}

std::uint64_t warp_call(WarpOp op, unsigned int mask, std::uint64_t value, int param, int width, const char* what,
                        const char* file, int line) {
  BlockRun& b = *tl_block;
  const Site site{what, file, line};
  const int me = b.current;
  const int lane = me & 31;
  const int base = me - lane;
  const int present = std::min(32, b.n - base);
  const unsigned int present_mask = present == 32 ? 0xFFFFFFFFu : ((1u << present) - 1u);
  WarpState& w = b.warps[me >> 5];
  if (!(mask >> lane & 1u))
    fail(site.str() + ": calling lane " + std::to_string(lane) + " of " + thread_name(b, me) + " is not in mask " +
         mask_str(mask));
  if (mask & ~present_mask)
    fail(site.str() + ": mask " + mask_str(mask) + " names lanes that do not exist (block of " + std::to_string(b.n) +
         " threads)");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(site.str() + ": width " + std::to_string(width) + " is not a power of two in [1, 32]");
  if (mask & w.exited)
    fail(site.str() + ": mask " + mask_str(mask) + " names lanes that have returned (" + mask_str(mask & w.exited) + ")");
  // find the group this call joins; any overlap with a different call is a divergence
  int gi = -1;
  for (int k = 0; k < w.ngroups; ++k) {
    const WarpGroup& g = w.groups[k];
    if (!(g.mask & mask)) continue;
    if (g.mask != mask || g.op != op || !g.site.same(site))
      fail("divergent warp-synchronous calls in warp " + std::to_string(me >> 5) + ": lane " + std::to_string(lane) +
           " in " + site.str() + " (mask " + mask_str(mask) + "), lanes " + mask_str(g.arrived) + " in " + g.site.str() +
           " (mask " + mask_str(g.mask) + ")");
    gi = k;
  }
  if (gi < 0) {
    if (w.ngroups == WarpState::kMaxGroups) fail(site.str() + ": too many concurrent warp-synchronous groups");
    gi = w.ngroups++;
    w.groups[gi] = WarpGroup{mask, 0u, site, op};
  }
  WarpGroup& g = w.groups[gi];
  Fiber& f = b.fibers[me];
  f.value = value;
  f.param = param;
  f.width = width;
  f.mask = mask;
  f.site = site;
  g.arrived |= 1u << lane;
  if (g.arrived == mask) {
    unsigned int ballot = 0;
    if (op == WarpOp::Ballot || op == WarpOp::Any || op == WarpOp::All)
      for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && b.fibers[base + l].param) ballot |= 1u << l;
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& o = b.fibers[base + l];
      switch (op) {
        case WarpOp::Sync: o.result = 0; break;
        case WarpOp::Ballot: o.result = ballot; break;
        case WarpOp::Any: o.result = ballot != 0; break;
        case WarpOp::All: o.result = ballot == mask; break;
        default: {
          const int src = shfl_source(op, l, o.param, o.width);
          // an inactive source lane gives an undefined value in CUDA: poison it
          o.result = (mask >> src & 1u) ? b.fibers[base + src].value : 0xFFFFFFFFFFFFFFFFull;
        }
      }
      ++o.lane_gen;
    }
    w.groups[gi] = w.groups[--w.ngroups];  // retire the group
    return f.result;
  }
  f.wait = Wait::Warp;
  f.wait_gen = f.lane_gen;
  yield_to_scheduler();
  f.wait = Wait::Runnable;
  return f.result;
}

unsigned int activemask() {
  BlockRun& b = *tl_block;
  const int base = b.current & ~31;
  unsigned int m = 0;
  for (int l = 0; l < 32 && base + l < b.n; ++l)
    if (b.fibers[base + l].wait != Wait::Done) m |= 1u << l;
  return m;
}
[[noreturn]] void trap(const char* file, int line) { fail(Site{"__trap", file, line}.str()); }

// --- dynamic shared memory ----------------------------------------------------------------------
thread_local unsigned char* tl_dynamic_smem = nullptr;
unsigned char* dynamic_smem() { return tl_dynamic_smem; }

void* static_smem(const void* tag, std::size_t bytes, std::size_t align) {
  BlockRun& b = *tl_block;
  for (const auto& e : b.statics)
    if (e.first == tag) return e.second;
  std::size_t off = (b.static_used + align - 1) / align * align;
  if (off + bytes > kStaticSmemLimit)
    fail("static shared memory of the block exceeds " + std::to_string(kStaticSmemLimit) + " bytes");
  unsigned char* p = b.static_arena + off;
  std::memset(p, 0xFF, bytes);
  b.static_used = off + bytes;
  b.statics.emplace_back(tag, p);
  return p;
}

// --- scheduler ---------------------------------------------------------------------------------
inline std::string deadlock_report(const BlockRun& b) {
  std::string msg = "deadlock in kernel " + std::string(b.kernel) + " block (" + std::to_string(b.bid.x) + "," +
                    std::to_string(b.bid.y) + "," + std::to_string(b.bid.z) + "):";
  // group consecutive threads with the same wait site
  int i = 0;
  int groups = 0;
  while (i < b.n && groups < 12) {
    const Fiber& f = b.fibers[i];
    int j = i + 1;
    while (j < b.n && b.fibers[j].wait == f.wait && b.fibers[j].site.same(f.site) &&
           (f.wait != Wait::Warp || b.fibers[j].mask == f.mask))
      ++j;
    msg += "\n  threads " + std::to_string(i) + "-" + std::to_string(j - 1) + ": ";
    if (f.wait == Wait::Done) msg += "returned";
    else if (f.wait == Wait::Block) msg += "wait in " + f.site.str() + " (" + std::to_string(b.bar_arrived) + " of " + std::to_string(b.n) + " arrived)";
    else if (f.wait == Wait::Warp) msg += "wait in " + f.site.str() + " (mask " + mask_str(f.mask) + ")";
    else msg += "runnable";
    i = j;
    ++groups;
  }
  if (i < b.n) msg += "\n  ...";
  return msg;
}

inline void run_block(BlockRun& b) {
  Pool& p = pool();
  p.ensure(b.n);
  b.fibers = p.fibers.data();
  const dim3 bd = blockDim;
  for (int i = 0; i < b.n; ++i) {
    Fiber& f = b.fibers[i];
    f.tid.x = i % bd.x;
    f.tid.y = (i / bd.x) % bd.y;
    f.tid.z = i / (bd.x * bd.y);
    f.wait = Wait::Runnable;
    f.lane_gen = 0;
    f.site = Site{};
    ctx_init(f.ctx, p.stacks[i] + 4096, p.stack_size, fiber_main);
  }
  b.warps.assign((b.n + 31) / 32, WarpState{});
  b.statics.clear();
  b.static_used = 0;
  b.static_arena = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(p.static_arena.data()) + 63) & ~std::uintptr_t(63));
  BlockRun* saved = tl_block;
  tl_block = &b;
  b.reverse = reverse_order();
  b.done = 0;
  for (;;) {
    int first = -1;
    for (int k = 0; k < b.n && first < 0; ++k) {
      const int i = b.reverse ? b.n - 1 - k : k;
      if (ready(b, b.fibers[i])) first = i;
    }
    if (first < 0) {
      if (b.done == b.n) break;
      tl_block = saved;
      throw std::runtime_error(deadlock_report(b));
    }
    b.current = first;
    threadIdx = b.fibers[first].tid;
    ++b.switches;
    ctx_switch(b.sched, b.fibers[first].ctx);
    if (b.abort) {
      tl_block = saved;
      throw std::runtime_error("kernel " + std::string(b.kernel) + " block (" + std::to_string(b.bid.x) + "," +
                               std::to_string(b.bid.y) + "," + std::to_string(b.bid.z) + "): " + b.error);
    }
  }
  tl_block = saved;
  g_switches += b.switches;
}

inline std::string dim_str(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

struct SmemOptIn {
  std::mutex m;
  std::vector<std::pair<const void*, long>> entries;
};
inline SmemOptIn& smem_optin() {
  static SmemOptIn s;
  return s;
}
void set_max_dynamic_smem(const void* kernel, long bytes, const char* name) {
  if (bytes > config().smem_limit)
    throw std::runtime_error(std::string("MK_SET_MAX_DYNAMIC_SMEM(") + name + ", " + std::to_string(bytes) +
                             "): above the per-block limit " + std::to_string(config().smem_limit));
  std::lock_guard<std::mutex> g(smem_optin().m);
  for (auto& e : smem_optin().entries)
    if (e.first == kernel) {
      e.second = bytes;
      return;
    }
  smem_optin().entries.emplace_back(kernel, bytes);
}
long max_dynamic_smem(const void* kernel) {
  std::lock_guard<std::mutex> g(smem_optin().m);
  for (auto& e : smem_optin().entries)
    if (e.first == kernel) return e.second;
  return 48 * 1024;
}

void run_grid(const char* name, const void* kernel, dim3 grid, dim3 block, std::size_t smem, void (*body)(void*),
              void* ctx) {
  const std::string where = std::string("launch of ") + name + " grid " + dim_str(grid) + " block " + dim_str(block);
  const unsigned long long nt = 1ull * block.x * block.y * block.z;
  if (nt == 0 || nt > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    throw std::runtime_error(where + ": invalid block size (at most 1024 threads, z <= 64)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    throw std::runtime_error(where + ": invalid grid size (x < 2^31, y and z <= 65535, none 0)");
  const long limit = max_dynamic_smem(kernel);
  if (static_cast<long>(smem) > limit)
    throw std::runtime_error(where + ": " + std::to_string(smem) + " B dynamic shared memory above " +
                             std::to_string(limit) + " B (opt in with MK_SET_MAX_DYNAMIC_SMEM)");

  {
    std::lock_guard<std::mutex> g(g_log_mutex);
    if (std::find(g_launched.begin(), g_launched.end(), name) == g_launched.end()) g_launched.emplace_back(name);
  }
  const unsigned long long nblocks = 1ull * grid.x * grid.y * grid.z;
  const int nthreads_block = static_cast<int>(nt);
  const bool profile = env_long("MK_EMU_PROFILE", 0) != 0;
  const auto start = std::chrono::steady_clock::now();
  const unsigned long long switches0 = g_switches.load();
  const int nos = static_cast<int>(std::min<unsigned long long>(os_threads(), nblocks));
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex err_m;
  auto worker = [&]() {
    try {
      const dim3 saved_bd = blockDim, saved_gd = gridDim;
      const uint3 saved_bi = blockIdx, saved_ti = threadIdx;
      blockDim = block;
      gridDim = grid;
      Pool& p = pool();
      if (p.smem.size() < smem + 16) p.smem.resize(smem + 16);
      unsigned char* aligned = reinterpret_cast<unsigned char*>(
          (reinterpret_cast<std::uintptr_t>(p.smem.data()) + 15) & ~std::uintptr_t(15));
      unsigned char* saved_smem = tl_dynamic_smem;
      tl_dynamic_smem = aligned;
      BlockRun b;
      b.kernel = name;
      b.n = nthreads_block;
      b.body = body;
      b.ctx = ctx;
      while (!failed.load()) {
        const unsigned long long k = next++;
        if (k >= nblocks) break;
        blockIdx.x = static_cast<unsigned int>(k % grid.x);
        blockIdx.y = static_cast<unsigned int>((k / grid.x) % grid.y);
        blockIdx.z = static_cast<unsigned int>(k / (1ull * grid.x * grid.y));
        b.bid = blockIdx;
        b.bar_arrived = 0;
        b.bar_gen = 0;
        b.exited = 0;
        b.abort = false;
        b.switches = 0;
        std::memset(aligned, 0xFF, smem);  // uninitialised shared memory reads as NaN
        run_block(b);
      }
      blockDim = saved_bd;
      gridDim = saved_gd;
      blockIdx = saved_bi;
      threadIdx = saved_ti;
      tl_dynamic_smem = saved_smem;
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> g(err_m);
      if (!first_error) first_error = std::current_exception();
    }
  };
  if (nos <= 1) {
    worker();
  } else {
    std::vector<std::thread> ts;
    for (int i = 0; i < nos; ++i) ts.emplace_back(worker);
    for (auto& t : ts) t.join();
  }
  if (first_error) std::rethrow_exception(first_error);
  if (profile) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "[mk-emu] %-28s grid %-14s block %-12s smem %7zu B: %8.2f ms, %llu switches\n", name,
                 dim_str(grid).c_str(), dim_str(block).c_str(), smem, ms, g_switches.load() - switches0);
  }
}

std::vector<std::string> launched_kernels() {
  std::lock_guard<std::mutex> g(g_log_mutex);
  return g_launched;
}

}  // namespace mk_emu
