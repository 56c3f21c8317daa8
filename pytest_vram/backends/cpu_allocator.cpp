// Counts the bytes that PyTorch's CPU allocator hands out on one thread, with their peak.
//
// pytest-vram compiles this file once per torch build (see cpu_allocator.py) and loads it with
// ctypes: no Python headers are needed, only torch's own C++ headers and libc10.
//
// The counting allocator wraps the CPU allocator that was installed before it. Blocks allocated
// on a thread that a counter watches are counted: their sizes are added to the counter and kept
// in a table by data pointer, and freeing one (on any thread) takes its size off again. Other
// blocks are the wrapped allocator's, untouched.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

constexpr int kSlots = 4;  // counters that may watch at the same time

// Python reads current and peak straight from memory (ctypes.c_int64.from_address): a read
// costs no call. An aligned, lock-free 64-bit atomic is a plain 64-bit integer in memory.
struct Counter {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<const void*> thread{nullptr};  // the watched thread's marker, or none
};
static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "current and peak are read as int64");
static_assert(std::atomic<int64_t>::is_always_lock_free, "current and peak are read as int64");

// Counters are never freed: a block may outlive the Python object that made its counter.
std::atomic<Counter*> g_watching[kSlots];
thread_local char t_marker;

// A counted block: its size, the counters that counted it, and the wrapped allocation's own
// context and deleter, which free it.
struct Block {
  size_t nbytes;
  void* context;
  c10::DeleterFnPtr deleter;
  Counter* counters[kSlots];
};

// Counted blocks by data pointer, in shards so that threads freeing blocks rarely contend.
constexpr size_t kShards = 16;
struct Shard {
  std::mutex mutex;
  std::unordered_map<void*, Block> blocks;
};
// Never destroyed, like the allocator below: blocks may still be freed while the process exits,
// after this library's static objects would have been destroyed.
Shard* const g_shards = new Shard[kShards];

Shard& shard_of(void* data) {
  return g_shards[(reinterpret_cast<uintptr_t>(data) >> 6) % kShards];
}

void add(Counter* counter, int64_t nbytes) {
  int64_t now = counter->current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t peak = counter->peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !counter->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Uncounts and frees a counted block; false when data is not one.
bool release(void* data) {
  Block block;
  {
    Shard& shard = shard_of(data);
    std::lock_guard<std::mutex> guard(shard.mutex);
    auto found = shard.blocks.find(data);
    if (found == shard.blocks.end()) {
      return false;
    }
    block = found->second;
    shard.blocks.erase(found);
  }
  for (Counter* counter : block.counters) {
    if (counter != nullptr) {
      counter->current.fetch_sub(static_cast<int64_t>(block.nbytes), std::memory_order_relaxed);
    }
  }
  if (block.deleter != nullptr) {
    block.deleter(block.context);
  }
  return true;
}

void counted_delete(void* data) { release(data); }

void raw_delete(void* data);  // after the allocator, which it falls back on

struct CountingAllocator final : c10::Allocator {
  c10::Allocator* wrapped = nullptr;

  // A block no counter watches is the wrapped allocator's, untouched. A counted one keeps the
  // wrapped allocation's memory and its data pointer as context, as PyTorch expects of a plain
  // CPU allocation (copy-on-write clones and the raw interface depend on it).
  c10::DataPtr allocate(size_t nbytes) override {
    Block block{nbytes, nullptr, nullptr, {nullptr, nullptr, nullptr, nullptr}};
    bool counted = false;
    if (nbytes > 0) {
      const void* me = &t_marker;
      for (int i = 0; i < kSlots; ++i) {
        Counter* counter = g_watching[i].load(std::memory_order_acquire);
        if (counter != nullptr && counter->thread.load(std::memory_order_relaxed) == me) {
          block.counters[i] = counter;
          counted = true;
        }
      }
    }
    c10::DataPtr allocation = wrapped->allocate(nbytes);
    void* data = allocation.get();
    if (!counted || data == nullptr) {
      return allocation;
    }
    c10::Device device = allocation.device();
    block.deleter = allocation.get_deleter();
    block.context = allocation.release_context();
    {
      Shard& shard = shard_of(data);
      std::lock_guard<std::mutex> guard(shard.mutex);
      shard.blocks[data] = block;
    }
    for (Counter* counter : block.counters) {
      if (counter != nullptr) {
        add(counter, static_cast<int64_t>(nbytes));
      }
    }
    return c10::DataPtr(data, data, &counted_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

CountingAllocator& g_allocator = *new CountingAllocator();

// Kernels that allocate through the raw interface free through this; blocks that were not
// counted (or were allocated before this allocator was installed) go to the wrapped one.
void raw_delete(void* data) {
  if (data == nullptr || release(data)) {
    return;
  }
  c10::DeleterFnPtr fallback = g_allocator.wrapped->raw_deleter();
  if (fallback != nullptr) {
    fallback(data);
  }
}

}  // namespace

extern "C" {

// 0: the counting allocator is the CPU allocator. 1: one of higher priority keeps its place.
int pytest_vram_install(void) {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &g_allocator) {
    return 0;
  }
  g_allocator.wrapped = current;
  c10::SetCPUAllocator(&g_allocator, 0);
  return c10::GetCPUAllocator() == &g_allocator ? 0 : 1;
}

int pytest_vram_installed(void) { return c10::GetCPUAllocator() == &g_allocator ? 1 : 0; }

void* pytest_vram_new_counter(void) { return new Counter(); }

// Start counting the calling thread's allocations. 0: watching. 1: kSlots counters already are.
int pytest_vram_watch(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  counter->thread.store(&t_marker, std::memory_order_relaxed);
  for (int i = 0; i < kSlots; ++i) {
    if (g_watching[i].load(std::memory_order_acquire) == counter) {
      return 0;
    }
  }
  for (int i = 0; i < kSlots; ++i) {
    Counter* empty = nullptr;
    if (g_watching[i].compare_exchange_strong(empty, counter, std::memory_order_acq_rel)) {
      return 0;
    }
  }
  counter->thread.store(nullptr, std::memory_order_relaxed);
  return 1;
}

// Stop counting new allocations; frees of the blocks counted so far still count.
void pytest_vram_unwatch(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  for (int i = 0; i < kSlots; ++i) {
    Counter* expected = counter;
    g_watching[i].compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
  }
  counter->thread.store(nullptr, std::memory_order_relaxed);
}

// Where Python reads the counter's figures: current at offset 0, peak at offset 8.
int pytest_vram_counter_layout(void) {
  return offsetof(Counter, current) == 0 && offsetof(Counter, peak) == 8 ? 0 : 1;
}

void pytest_vram_reset_peak(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  counter->peak.store(counter->current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // extern "C"
