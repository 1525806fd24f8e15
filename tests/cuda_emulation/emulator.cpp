// The CUDA emulation's runtime (see NOTE: [CUDA emulation] in cuda_emulation.h): fibers per block,
// barriers, launch rules, and torch.ops.nanfast_emu.* wrapping the kernels of stats_cuda.cu.
#include "cuda_emulation.h"

#include <sys/mman.h>
#include <setjmp.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef CUDA_EMU_TSAN
// ThreadSanitizer's fiber interface (sanitizer/tsan_interface.h, declared here: GCC ships no header).
extern "C" {
void* __tsan_get_current_fiber();
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
char __tsan_atomic8_load(const volatile char* a, int mo);
char __tsan_atomic8_fetch_add(volatile char* a, char v, int mo);
short __tsan_atomic16_load(const volatile short* a, int mo);
short __tsan_atomic16_fetch_add(volatile short* a, short v, int mo);
int __tsan_atomic32_load(const volatile int* a, int mo);
int __tsan_atomic32_fetch_add(volatile int* a, int v, int mo);
long __tsan_atomic64_load(const volatile long* a, int mo);
long __tsan_atomic64_fetch_add(volatile long* a, long v, int mo);

// NOTE: [Volatile accesses under ThreadSanitizer]
// In CUDA's memory model a volatile access acts as a relaxed atomic one. Built with
// --param=tsan-distinguish-volatile=1, the compiler reports each volatile access here, and ThreadSanitizer
// records it as a relaxed atomic access of the same bytes (the access itself follows, as compiled): two
// volatile accesses do not race, a volatile and a plain one do.
void __tsan_volatile_read1(void* a) { __tsan_atomic8_load(static_cast<volatile char*>(a), 0); }
void __tsan_volatile_read2(void* a) { __tsan_atomic16_load(static_cast<volatile short*>(a), 0); }
void __tsan_volatile_read4(void* a) { __tsan_atomic32_load(static_cast<volatile int*>(a), 0); }
void __tsan_volatile_read8(void* a) { __tsan_atomic64_load(static_cast<volatile long*>(a), 0); }
void __tsan_volatile_write1(void* a) { __tsan_atomic8_fetch_add(static_cast<volatile char*>(a), 0, 0); }
void __tsan_volatile_write2(void* a) { __tsan_atomic16_fetch_add(static_cast<volatile short*>(a), 0, 0); }
void __tsan_volatile_write4(void* a) { __tsan_atomic32_fetch_add(static_cast<volatile int*>(a), 0, 0); }
void __tsan_volatile_write8(void* a) { __tsan_atomic64_fetch_add(static_cast<volatile long*>(a), 0, 0); }
}
#endif

namespace cuda_emu {
namespace {

// NOTE: [CUDA emulation under ThreadSanitizer]
// Built with CUDA_EMU_TSAN (tools/cuda_tsan), each fiber is a ThreadSanitizer fiber and switches
// synchronize, so the threads of a block are ordered as by their barriers and more; but the blocks of
// a grid run in waves of kTsanWave, each block of a wave on a worker thread of its own, with nothing
// ordering the blocks of a wave: a race between blocks on global memory is reported, as it would be a race on a GPU.
#ifdef CUDA_EMU_TSAN
constexpr size_t kTsanWave = 8;
void* tsan_current_fiber() {
  return __tsan_get_current_fiber();
}
void* tsan_create_fiber() {
  return __tsan_create_fiber(0);
}
void tsan_destroy_fiber(void* fiber) {
  __tsan_destroy_fiber(fiber);
}
void tsan_switch_to(void* fiber) {
  __tsan_switch_to_fiber(fiber, 0);
}
#else
void* tsan_current_fiber() {
  return nullptr;
}
void* tsan_create_fiber() {
  return nullptr;
}
void tsan_destroy_fiber(void* /*fiber*/) {}
void tsan_switch_to(void* /*fiber*/) {}
#endif

// A kernel thread's stack; the page below each is a guard page, so an overflow faults.
constexpr size_t kStackBytes = 64 << 10;

enum class Order { kForward, kReverse, kShuffled };

Order parse_order(const std::string& name) {
  if (name == "forward") {
    return Order::kForward;
  }
  if (name == "reverse") {
    return Order::kReverse;
  }
  TORCH_CHECK(name == "shuffled", "nanfast_emu.configure: order must be forward, reverse or shuffled, not '", name, "'");
  return Order::kShuffled;
}

struct Config {
  Order order = Order::kForward;
  uint64_t seed = 0;
};

std::mutex config_mutex;

Config& config() {
  static Config value = [] {
    Config c;
    if (const char* order = std::getenv("NANFAST_CUDA_EMU_ORDER")) {
      c.order = parse_order(order);
    }
    if (const char* seed = std::getenv("NANFAST_CUDA_EMU_SEED")) {
      c.seed = std::strtoull(seed, nullptr, 10);
    }
    return c;
  }();
  return value;
}

// Host-side state of the emulated op running on this OS thread.
struct Host {
  int guards = 0;
  Site unchecked{nullptr, 0, nullptr};  // the last launch, until its launch check
  int64_t launches = 0;
  int64_t blocks = 0;
  std::mt19937_64 rng;
};

thread_local Host host;
CUstream_st* const kCurrentStream = reinterpret_cast<CUstream_st*>(uintptr_t{0x1000});
CUstream_st* const kUnguardedStream = reinterpret_cast<CUstream_st*>(uintptr_t{0x2000});

// NOTE: [Fibers]
// A kernel thread runs on a fiber: its own stack (a guard page below it), made once per OS thread
// with makecontext and then parked at the top of fiber_main. Switches use _setjmp/_longjmp, which
// unlike swapcontext make no system call (the signal mask is left alone): several times faster,
// which keeps the emulated tests short. A started fiber jumps back to the scheduler at each barrier
// and when its thread returns; the next block restarts it from its parking point, also when the
// previous block was abandoned after an error.
enum class State { kNew, kRunnable, kAtBarrier, kDone };

struct Fiber {
  jmp_buf resume;
  State state;
  Site barrier;
  dim3 index;
};

struct Block {
  jmp_buf scheduler;
  void* scheduler_fiber = nullptr;  // ThreadSanitizer's
  std::vector<Fiber> fibers;
  size_t current = 0;
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;
};

struct Slot {
  jmp_buf parked;
  ucontext_t context;
  void* stack = nullptr;  // the mapping, guard page included
  void* tsan_fiber = nullptr;
  ~Slot() {
    if (tsan_fiber != nullptr) {
      tsan_destroy_fiber(tsan_fiber);
    }
    munmap(stack, kStackBytes + static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  }
};

thread_local Block* running = nullptr;
thread_local dim3 this_thread, this_block, this_block_dim, this_grid_dim;
thread_local std::vector<std::pair<void*, size_t>> shared_arrays;
thread_local std::vector<std::unique_ptr<Slot>> slots;
thread_local ucontext_t creator;
thread_local void* creator_fiber = nullptr;
thread_local Slot* starting = nullptr;

[[noreturn]] void run_thread() {
  Block& block = *running;
  try {
    (*block.body)();
  } catch (...) {
    if (!block.error) {
      block.error = std::current_exception();
    }
  }
  block.fibers[block.current].state = State::kDone;
  tsan_switch_to(block.scheduler_fiber);
  _longjmp(block.scheduler, 1);
}

void fiber_main() {
  Slot* const slot = starting;
  if (_setjmp(slot->parked) == 0) {
    tsan_switch_to(creator_fiber);
    setcontext(&creator);  // parked; a later _longjmp(parked) starts a thread
  }
  run_thread();
}

// Out of line: getcontext() and _setjmp() return twice, which must not clobber a caller's locals.
[[gnu::noinline]] void create_slot() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* memory = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(memory != MAP_FAILED, "CUDA emulation: cannot map a thread's stack");
  TORCH_CHECK(mprotect(memory, page, PROT_NONE) == 0, "CUDA emulation: cannot protect a stack's guard page");
  auto slot = std::make_unique<Slot>();
  slot->stack = memory;
  getcontext(&slot->context);
  slot->context.uc_stack.ss_sp = static_cast<char*>(memory) + page;
  slot->context.uc_stack.ss_size = kStackBytes;
  slot->context.uc_link = nullptr;
  makecontext(&slot->context, fiber_main, 0);
  starting = slot.get();
  slot->tsan_fiber = tsan_create_fiber();
  creator_fiber = tsan_current_fiber();
  tsan_switch_to(slot->tsan_fiber);
  swapcontext(&creator, &slot->context);
  slots.push_back(std::move(slot));
}

[[gnu::noinline]] void switch_to(jmp_buf save, jmp_buf target, void* target_fiber) {
  if (_setjmp(save) == 0) {
    tsan_switch_to(target_fiber);
    _longjmp(target, 1);
  }
}

void arrange(std::vector<size_t>& order, Order kind) {
  std::iota(order.begin(), order.end(), size_t{0});
  if (kind == Order::kReverse) {
    std::reverse(order.begin(), order.end());
  } else if (kind == Order::kShuffled) {
    std::shuffle(order.begin(), order.end(), host.rng);
  }
}

std::string where(const Site& site) {
  std::ostringstream out;
  out << site.file << ":" << site.line;
  return out.str();
}

std::string thread_name(const Fiber& fiber) {
  std::ostringstream out;
  out << "thread (" << fiber.index.x << ", " << fiber.index.y << ", " << fiber.index.z << ")";
  return out.str();
}

// Runs every thread of the current block to its end, a barrier phase at a time.
void run_block(Block& block, const dim3& dims, Order kind, const std::string& launch) {
  const size_t n = block.fibers.size();
  while (slots.size() < n) {
    create_slot();
  }
  block.scheduler_fiber = tsan_current_fiber();
  for (size_t t = 0; t < n; ++t) {
    block.fibers[t].state = State::kNew;
    block.fibers[t].index = dim3(t % dims.x, t / dims.x % dims.y, t / (dims.x * dims.y));
  }
  std::vector<size_t> order(n);
  while (true) {
    arrange(order, kind);
    for (size_t t : order) {
      Fiber& fiber = block.fibers[t];
      if (fiber.state == State::kAtBarrier || fiber.state == State::kDone) {
        continue;
      }
      block.current = t;
      this_thread = fiber.index;
      const bool start = fiber.state == State::kNew;
      fiber.state = State::kRunnable;
      switch_to(block.scheduler, start ? slots[t]->parked : fiber.resume, slots[t]->tsan_fiber);
      if (block.error) {
        std::rethrow_exception(block.error);
      }
    }
    const auto waiting = std::find_if(
        block.fibers.begin(), block.fibers.end(), [](const Fiber& f) { return f.state == State::kAtBarrier; });
    if (waiting == block.fibers.end()) {
      return;  // every thread has finished
    }
    for (Fiber& fiber : block.fibers) {
      TORCH_CHECK(
          fiber.state != State::kDone, "CUDA emulation: ", launch, ": ", thread_name(*waiting),
          " waits at __syncthreads() at ", where(waiting->barrier), " but ", thread_name(fiber),
          " has returned (a barrier that not every thread of the block reaches)");
      TORCH_CHECK(
          fiber.barrier.file == waiting->barrier.file && fiber.barrier.line == waiting->barrier.line,
          "CUDA emulation: ", launch, ": ", thread_name(*waiting), " waits at __syncthreads() at ",
          where(waiting->barrier), " but ", thread_name(fiber), " at ", where(fiber.barrier),
          " (threads of a block must reach the same barrier)");
    }
    for (Fiber& fiber : block.fibers) {
      fiber.state = State::kRunnable;
    }
  }
}

#ifdef CUDA_EMU_TSAN
// kTsanWave worker threads, kept for the whole process with their fibers (ThreadSanitizer never quite
// frees a finished thread: a thread per block runs out of memory). Only the launching thread, through
// the mutex, orders one wave's workers after the last wave's.
class Wave {
 public:
  static Wave& instance() {
    static Wave* wave = new Wave;  // never destroyed: the workers wait until the process ends
    return *wave;
  }

  // Runs job(i) on worker i for i < count, and waits for them.
  void run(size_t count, const std::function<void(size_t)>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = &job;
    count_ = count;
    pending_ = count;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  Wave() {
    for (size_t i = 0; i < kTsanWave; ++i) {
      std::thread([this, i] { work(i); }).detach();
    }
  }

  void work(size_t i) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      start_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (i >= count_) {
        continue;
      }
      const std::function<void(size_t)>& job = *job_;
      lock.unlock();
      job(i);
      lock.lock();
      if (--pending_ == 0) {
        done_.notify_one();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t count_ = 0;
  size_t pending_ = 0;
  uint64_t generation_ = 0;
};
#endif

void poison(const std::pair<void*, size_t>& array) {
  std::memset(array.first, 0xFF, array.second);  // NaN in every float, -1 in every integer
}

}  // namespace

const dim3& thread_idx() {
  return this_thread;
}
const dim3& block_idx() {
  return this_block;
}
const dim3& block_dim() {
  return this_block_dim;
}
const dim3& grid_dim() {
  return this_grid_dim;
}

void syncthreads(const char* file, int line) {
  TORCH_CHECK(running != nullptr, "CUDA emulation: __syncthreads() at ", file, ":", line, " outside a kernel");
  Fiber& fiber = running->fibers[running->current];
  fiber.state = State::kAtBarrier;
  fiber.barrier = Site{file, line, nullptr};
  switch_to(fiber.resume, running->scheduler, running->scheduler_fiber);
}

void shared_declared(void* data, size_t bytes) {
  for (const auto& array : shared_arrays) {
    if (array.first == data) {
      return;
    }
  }
  // Seen for the first time: no thread of this block has written it yet (the call follows the
  // declaration), so it is poisoned now and before every later block.
  shared_arrays.emplace_back(data, bytes);
  poison(shared_arrays.back());
}

void launch_check(const char* /*file*/, int /*line*/) {
  host.unchecked = Site{nullptr, 0, nullptr};
}

void guard_entered() {
  ++host.guards;
}

void guard_exited() {
  --host.guards;
}

cudaStream_t current_stream() {
  return host.guards > 0 ? kCurrentStream : kUnguardedStream;
}

void run_grid(const Site& site, dim3 grid, dim3 block_dims, size_t shared_bytes, cudaStream_t stream,
              const std::function<void()>& thread_body) {
  const std::string launch = std::string(site.what) + " launched at " + where(site);
  TORCH_CHECK(running == nullptr, "CUDA emulation: ", launch, " from inside a kernel");
  TORCH_CHECK(
      host.unchecked.file == nullptr, "CUDA emulation: the launch at ", where(host.unchecked),
      " has no C10_CUDA_KERNEL_LAUNCH_CHECK() before the next launch (", launch, ")");
  TORCH_CHECK(host.guards > 0, "CUDA emulation: ", launch, " without a CUDAGuard held (it would run on the current device)");
  TORCH_CHECK(stream != nullptr, "CUDA emulation: ", launch, " on the default stream, not the current stream");
  TORCH_CHECK(
      stream == kCurrentStream, "CUDA emulation: ", launch,
      " on a stream that is not the current stream under the CUDAGuard");
  TORCH_CHECK(
      grid.x >= 1 && grid.x <= 2147483647u && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 && grid.z <= 65535,
      "CUDA emulation: ", launch, " with grid (", grid.x, ", ", grid.y, ", ", grid.z,
      "): each dimension must be at least 1, x at most 2^31 - 1, y and z at most 65535");
  const size_t threads = size_t{block_dims.x} * block_dims.y * block_dims.z;
  TORCH_CHECK(
      threads >= 1 && threads <= 1024 && block_dims.z <= 64, "CUDA emulation: ", launch, " with blocks of (",
      block_dims.x, ", ", block_dims.y, ", ", block_dims.z, ") threads: 1 to 1024 threads, z at most 64");
  TORCH_CHECK(shared_bytes <= 48 * 1024, "CUDA emulation: ", launch, " with ", shared_bytes, " bytes of dynamic shared memory");
  host.unchecked = site;
  ++host.launches;

  Config settings;
  {
    const std::lock_guard<std::mutex> lock(config_mutex);
    settings = config();
  }
  const size_t num_blocks = size_t{grid.x} * grid.y * grid.z;
  std::vector<size_t> block_order(num_blocks);
  arrange(block_order, settings.order);
  host.blocks += static_cast<int64_t>(num_blocks);
  // Runs block_order[first, last) on this OS thread.
  const auto run_blocks = [&](size_t first, size_t last) {
    Block block;
    block.fibers.resize(threads);
    block.body = &thread_body;
    this_grid_dim = grid;
    this_block_dim = block_dims;
    struct Running {  // running is reset however the blocks end
      explicit Running(Block* b) {
        running = b;
      }
      ~Running() {
        running = nullptr;
      }
    } guard(&block);
    for (size_t i = first; i < last; ++i) {
      const size_t b = block_order[i];
      this_block = dim3(b % grid.x, b / grid.x % grid.y, b / (size_t{grid.x} * grid.y));
      for (const auto& array : shared_arrays) {
        poison(array);
      }
      run_block(block, block_dims, settings.order, launch);
    }
  };
#ifdef CUDA_EMU_TSAN
  for (size_t first = 0; first < num_blocks; first += kTsanWave) {
    const size_t count = std::min(num_blocks - first, kTsanWave);
    std::vector<std::exception_ptr> errors(count);
    Wave::instance().run(count, [&](size_t i) {
      try {
        run_blocks(first + i, first + i + 1);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
    for (const std::exception_ptr& error : errors) {
      if (error) {
        std::rethrow_exception(error);
      }
    }
  }
#else
  run_blocks(0, num_blocks);
#endif
}

void KernelTable::impl(const char* name, StatsKernel kernel) {
  TORCH_INTERNAL_ASSERT(std::string(name) == "stats", "CUDA emulation: unexpected kernel ", name);
  stats = kernel;
}

void KernelTable::impl(const char* name, FlagKernel kernel) {
  TORCH_INTERNAL_ASSERT(std::string(name) == "any_nonfinite", "CUDA emulation: unexpected kernel ", name);
  any_nonfinite = kernel;
}

void KernelTable::impl(const char* name, SummaryKernel kernel) {
  TORCH_INTERNAL_ASSERT(std::string(name) == "step_summary", "CUDA emulation: unexpected kernel ", name);
  step_summary = kernel;
}

KernelTable& kernels() {
  static KernelTable table;
  return table;
}

namespace {

// Runs one op of the .cu file: fresh host state, and no launch left unchecked at its end.
template <typename Kernel, typename... Args>
auto run_op(const char* op, Kernel kernel, Args&&... args) {
  TORCH_INTERNAL_ASSERT(kernel != nullptr, "CUDA emulation: stats_cuda.cu registered no ", op, " kernel");
  {
    const std::lock_guard<std::mutex> lock(config_mutex);
    host = Host{};
    host.rng.seed(config().seed);
  }
  auto result = kernel(std::forward<Args>(args)...);
  TORCH_CHECK(
      host.unchecked.file == nullptr, "CUDA emulation: ", op, ": the launch at ", where(host.unchecked),
      " has no C10_CUDA_KERNEL_LAUNCH_CHECK()");
  TORCH_INTERNAL_ASSERT(host.guards == 0, "CUDA emulation: ", op, " left ", host.guards, " CUDAGuard(s) held");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats(at::TensorList tensors) {
  return run_op("nanfast_emu.stats", kernels().stats, tensors);
}

at::Tensor any_nonfinite(at::TensorList tensors) {
  return run_op("nanfast_emu.any_nonfinite", kernels().any_nonfinite, tensors);
}

at::Tensor step_summary(at::TensorList recorded, OptionalTensor recorded_counted, OptionalTensor counts,
                        OptionalTensor norm, OptionalTensor absmax, int64_t n_params, OptionalTensor counted,
                        bool nan_only, OptionalTensor found_inf, OptionalTensor grad_scale, at::TensorList losses,
                        at::IntArrayRef loss_calls, OptionalTensor scale, OptionalTensor groups, int64_t n_groups) {
  return run_op("nanfast_emu.step_summary", kernels().step_summary, recorded, recorded_counted, counts, norm, absmax,
                n_params, counted, nan_only, found_inf, grad_scale, losses, loss_calls, scale, groups, n_groups);
}

void configure(std::string order, int64_t seed) {
  const std::lock_guard<std::mutex> lock(config_mutex);
  config() = Config{parse_order(order), static_cast<uint64_t>(seed)};
}

// [launches, blocks] of the last op run on this thread.
std::vector<int64_t> last_launches() {
  return {host.launches, host.blocks};
}

}  // namespace
}  // namespace cuda_emu

TORCH_LIBRARY(nanfast_emu, m) {
  m.def("stats(Tensor[] tensors) -> (Tensor counts, Tensor norm, Tensor absmax)");
  m.def("any_nonfinite(Tensor[] tensors) -> Tensor");
  m.def(
      "step_summary(Tensor[] recorded, Tensor? recorded_counted, Tensor? counts, Tensor? norm, Tensor? absmax, "
      "int n_params, Tensor? counted, bool nan_only, Tensor? found_inf, Tensor? grad_scale, Tensor[] losses, "
      "int[] loss_calls, Tensor? scale, Tensor? groups, int n_groups) -> Tensor");
  m.def("configure(str order, int seed=0) -> ()", &cuda_emu::configure);
  m.def("last_launches() -> int[]", &cuda_emu::last_launches);
}

TORCH_LIBRARY_IMPL(nanfast_emu, CPU, m) {
  m.impl("stats", &cuda_emu::stats);
  m.impl("any_nonfinite", &cuda_emu::any_nonfinite);
  m.impl("step_summary", &cuda_emu::step_summary);
}

// As for torch.ops.nanfast: statistics are not differentiated, and negative views are read in place.
TORCH_LIBRARY_IMPL(nanfast_emu, Autograd, m) {
  m.impl("stats", torch::CppFunction::makeFallthrough());
  m.impl("any_nonfinite", torch::CppFunction::makeFallthrough());
  m.impl("step_summary", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(nanfast_emu, Negative, m) {
  m.impl("stats", torch::CppFunction::makeFallthrough());
  m.impl("any_nonfinite", torch::CppFunction::makeFallthrough());
}
