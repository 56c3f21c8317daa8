// Counts the bytes that PyTorch's CPU allocator hands out on one thread, with their peak.
//
// pytest-vram compiles this file once per torch build (see allocator.py) and loads it with
// ctypes: no Python headers are needed, only torch's own C++ headers, libc10 and libtorch_cpu.
//
// The counting allocator wraps the CPU allocator that was installed before it. Blocks allocated
// on a thread that a counter watches are counted: their sizes are added to the counter and kept
// in a table by data pointer, and freeing one (on any thread) takes its size off again. Other
// blocks are the wrapped allocator's, untouched.
//
// While a test's peak is broken down by category, a counter also logs each block it counts and
// each free, with a code Python keeps up to date for where the watched thread is (in a module's
// forward, in an optimizer step, ...). It tags each block for Python, replays the log to its
// peak when asked, and keeps the bytes alive at the peak by where code as the log grows, which
// Python reads in place: pytest_vram/backends/cpu/allocatorlog.py is its Python side.
//
// An op counter (the simulated device, computing on the CPU) counts what ops return rather
// than every block: a block allocated while an op runs is counted when the outermost op that
// reaches a kernel returns, if it is still alive then, so that what a kernel allocates for
// itself and frees again is never counted. That is what a TorchDispatchMode sees of each op's
// outputs, at the cost of a RecordFunction callback per op instead of two Python calls; what is
// allocated outside any op is not counted, as a dispatch mode never sees it. Its
// sizes are rounded as the CUDA caching allocator rounds them, and each counted block and free
// is replayed, in order, on a model of the caching allocator's segments (the one in
// pytest_vram/backends/segments.py, without a capacity), for reserved memory. While a breakdown
// listens, an op counter logs what it counts (its rounded blocks, its cuBLAS workspaces) on a
// counter's log that no thread watches, which Python reads as it reads the allocator counter's.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int kSlots = 4;  // counters that may watch at the same time
constexpr int kPlaces = 16;  // where codes whose bytes at the peak are kept as the log grows

// A lock for the few instructions of a map or segment update, taken for nearly every allocation
// and free and almost never contended (frees on other threads are rare): cheaper there than
// std::mutex. Nothing that can block runs while it is held.
class SpinLock {
 public:
  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) {
      }
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};
using Guard = std::lock_guard<SpinLock>;

// Python reads current and peak straight from memory (ctypes.c_int64.from_address): a read
// costs no call. An aligned, lock-free 64-bit atomic is a plain 64-bit integer in memory.
// A counted allocation (bytes > 0) or free (bytes < 0) in a counter's log, with the code of where
// the watched thread was when it allocated (what Python last wrote into Counter::where).
struct LogEvent {
  const void* data;
  int64_t bytes;
  int64_t where;
  // An allocation's: the index + 1 of the event that freed it, 0 while alive, so that replaying
  // the log to a point needs no lookup.
  int64_t freed;
};
// A block counted before the log began, that Python met and asked the tag of.
struct Adopted {
  int64_t bytes;
  int64_t tag;
  int64_t freed;  // as LogEvent's
};

struct Counter {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<const void*> thread{nullptr};  // the watched thread's marker, or none
  // Written and read by Python in place, as current and peak are: where the watched thread is
  // (offset 24), and how many events the log holds (offset 32).
  std::atomic<int64_t> where{0};
  std::atomic<int64_t> logged{0};
  // While a breakdown watches (non-zero, offset 40), every counted allocation and free, in
  // order. Python starts and stops a log in place: kLogStarting asks for an empty log, which the
  // next event or read makes (settle_log), and 0 stops it, its memory kept for the next start.
  std::atomic<int64_t> logging{0};
  // Read by Python in place (offset 48): the bytes alive at the log's peak by where code, for the
  // codes below kPlaces, of the blocks allocated in the log. Python reads it in place while no
  // block the log counts matters to it by itself: a test's peak by category with no Python call.
  int64_t peak_by_where[kPlaces] = {};
  // Kept up to date as the log grows: its running total, the peak of it from event peak_from
  // on, and the bytes alive by where code now.
  int64_t running = 0;
  int64_t best = 0;
  int64_t peak_from = 0;
  int64_t live_by_where[kPlaces] = {};
  // Where pytest_vram_log_peak writes the blocks alive at the peak, and how many fit.
  int64_t* peak_blocks = nullptr;
  int64_t peak_capacity = 0;
  SpinLock log_mutex;
  std::vector<LogEvent> log;
  // While logging: the tag of the block at each data pointer that the log knows alive. A block
  // allocated in the log is tagged with its event's index + 1; a block counted before the log
  // began is tagged -1, -2, ... (its index in adopted, negated, - 1) when Python first asks.
  std::unordered_map<const void*, int64_t> tags;
  std::vector<Adopted> adopted;
};
constexpr int64_t kLogStarting = 2;
static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "current and peak are read as int64");
static_assert(std::atomic<int64_t>::is_always_lock_free, "current and peak are read as int64");

// Counters are never freed: a block may outlive the Python object that made its counter.
std::atomic<Counter*> g_watching[kSlots];
thread_local char t_marker;

// The CUDA caching allocator's segments, as CachingAllocatorModel in segments.py models them
// (without a capacity, so that no request fails): tests/test_op_counter.py checks that both
// give the same figures for the same requests.
constexpr int64_t kMinBlock = 512;
constexpr int64_t kSmallRequest = int64_t(1) << 20;
constexpr int64_t kSmallSegment = int64_t(2) << 20;
constexpr int64_t kMinLargeAlloc = int64_t(10) << 20;
constexpr int64_t kLargeSegment = int64_t(20) << 20;
constexpr int64_t kRoundLarge = int64_t(2) << 20;

struct SegmentBlock {
  int64_t addr;
  int64_t size;
  bool small;
  bool allocated = false;
  SegmentBlock* prev = nullptr;
  SegmentBlock* next = nullptr;
};

// Free blocks by (size, address), for the best fit. A block's size and address do not change
// while it is in a pool.
struct BySizeThenAddress {
  bool operator()(const SegmentBlock* a, const SegmentBlock* b) const {
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  }
};

struct SegmentPool {
  std::set<SegmentBlock*, BySizeThenAddress> blocks;

  void add(SegmentBlock* block) { blocks.insert(block); }
  void remove(SegmentBlock* block) { blocks.erase(block); }
  SegmentBlock* best_fit(int64_t size) {
    SegmentBlock smallest{INT64_MIN, size, false};
    auto found = blocks.lower_bound(&smallest);
    return found == blocks.end() ? nullptr : *found;
  }
};

struct SegmentModel {
  SegmentPool small_pool, large_pool;
  int64_t next_addr = int64_t(1) << 32;
  int64_t reserved = 0, peak_reserved = 0, allocated = 0, peak_allocated = 0;
  int64_t segments = 0, num_device_alloc = 0, num_device_free = 0;

  SegmentBlock* malloc(int64_t nbytes) {
    int64_t size = nbytes < kMinBlock ? kMinBlock : (nbytes + kMinBlock - 1) / kMinBlock * kMinBlock;
    bool small = size <= kSmallRequest;
    SegmentPool& pool = small ? small_pool : large_pool;
    SegmentBlock* block = pool.best_fit(size);
    if (block != nullptr) {
      pool.remove(block);
    } else {
      int64_t segment = small ? kSmallSegment
                        : size < kMinLargeAlloc
                            ? kLargeSegment
                            : (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
      block = new SegmentBlock{next_addr, segment, small};
      next_addr += segment;
      reserved += segment;
      peak_reserved = std::max(peak_reserved, reserved);
      ++segments;
      ++num_device_alloc;
    }
    int64_t remaining = block->size - size;
    if (small ? remaining >= kMinBlock : remaining > kSmallRequest) {
      auto* rest = new SegmentBlock{block->addr + size, remaining, small};
      rest->prev = block;
      rest->next = block->next;
      if (block->next != nullptr) {
        block->next->prev = rest;
      }
      block->next = rest;
      block->size = size;
      pool.add(rest);
    }
    block->allocated = true;
    allocated += block->size;
    peak_allocated = std::max(peak_allocated, allocated);
    return block;
  }

  void free(SegmentBlock* block) {
    if (block == nullptr || !block->allocated) {
      return;
    }
    block->allocated = false;
    allocated -= block->size;
    SegmentPool& pool = block->small ? small_pool : large_pool;
    if (SegmentBlock* prev = block->prev; prev != nullptr && !prev->allocated) {
      pool.remove(prev);
      block->addr = prev->addr;
      block->size += prev->size;
      block->prev = prev->prev;
      if (prev->prev != nullptr) {
        prev->prev->next = block;
      }
      delete prev;
    }
    if (SegmentBlock* next = block->next; next != nullptr && !next->allocated) {
      pool.remove(next);
      block->size += next->size;
      block->next = next->next;
      if (next->next != nullptr) {
        next->next->prev = block;
      }
      delete next;
    }
    pool.add(block);
  }

  int64_t empty_cache() {
    int64_t released = 0;
    for (SegmentPool* pool : {&small_pool, &large_pool}) {
      std::vector<SegmentBlock*> whole;
      for (SegmentBlock* block : pool->blocks) {
        if (block->prev == nullptr && block->next == nullptr) {
          whole.push_back(block);
        }
      }
      for (SegmentBlock* block : whole) {
        pool->remove(block);
        released += block->size;
        --segments;
        ++num_device_free;
        delete block;
      }
    }
    reserved -= released;
    return released;
  }

  // Deletes every block of the model, which is not used again (relayout): the segments of
  // the free blocks in its pools and of the allocated blocks in used.
  void discard(const std::vector<SegmentBlock*>& used) {
    std::set<SegmentBlock*> heads;
    for (SegmentBlock* block : used) {
      while (block != nullptr && block->prev != nullptr) {
        block = block->prev;
      }
      if (block != nullptr) {
        heads.insert(block);
      }
    }
    for (SegmentPool* pool : {&small_pool, &large_pool}) {
      for (SegmentBlock* block : pool->blocks) {
        while (block->prev != nullptr) {
          block = block->prev;
        }
        heads.insert(block);
      }
      pool->blocks.clear();
    }
    for (SegmentBlock* block : heads) {
      while (block != nullptr) {
        SegmentBlock* next = block->next;
        delete block;
        block = next;
      }
    }
  }

  int64_t inactive_split_bytes() const {
    int64_t total = 0;
    for (const SegmentPool* pool : {&small_pool, &large_pool}) {
      for (const SegmentBlock* block : pool->blocks) {
        if (block->prev != nullptr || block->next != nullptr) {
          total += block->size;
        }
      }
    }
    return total;
  }
};

// An op counter. current and peak come first, where Python reads them, as for Counter.
struct OpCounter {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  SpinLock mutex;  // guards what follows
  SegmentModel segments;
  // Where the blocks live that a test found counted and its fixtures do not hold (memory a
  // test left behind, that the running test never touched): in the device's figures, not in
  // the running test's own (pytest_vram_op_start_own).
  SegmentModel background;
  // Allocations that would take current past limit fail (-1: no limit), with this message
  // around the size that would have been live.
  int64_t limit = -1;
  std::string limit_head;
  std::string limit_tail;
  // cuBLAS workspaces (0: none): the first matrix multiply of a thread, or of the autograd
  // engine's backward, allocates one of this size after its outputs, held until cleared.
  int64_t workspace_size = 0;
  // and the bytes handed out for each
  std::unordered_map<const void*, std::pair<SegmentBlock*, int64_t>> workspaces;
  // The counter whose log hears of each block counted and freed (none: no log), and the where
  // code it logs a workspace with.
  std::atomic<Counter*> log{nullptr};
  int64_t workspace_where = 0;
  // How many blocks it counts now (workspaces aside).
  std::atomic<int64_t> blocks{0};
};
static_assert(offsetof(OpCounter, current) == 0, "current is read at offset 0");

// What a workspace made inside backward is keyed by: the autograd engine's thread for the device.
char g_autograd_thread;

// The op counter that watches this thread, and where it is in the ops that run.
struct OpThread {
  OpCounter* counter = nullptr;
  int depth = 0;  // nesting of the ops below the outermost one that reached a kernel
  int uncounted = 0;  // inside host_memory(): allocations are the host's, not the device's
  std::vector<void*> pending;  // allocated while the outermost op runs
  int64_t pending_bytes = 0;
  // Counted blocks the outermost op freed: it resized their storage (an out= result), which
  // allocates the new block before it frees the old one, as the segment model hears of it.
  std::vector<SegmentBlock*> resized;
  at::CallbackHandle callback = 0;
  bool matmul = false;  // the outermost op is a matrix multiply, which needs a workspace
  int backward = 0;  // nesting of autograd nodes, where get_current_graph_task_id is missing
};
thread_local OpThread t_op;

// A counted block: its size, the counters that counted it, and the wrapped allocation's own
// context and deleter, which free it; for an op counter, the bytes it counts (its rounded
// request while it waits for its op to return, then the block handed out), its block in the
// segment model and whether it still waits.
struct Block {
  size_t nbytes;
  void* context;
  c10::DeleterFnPtr deleter;
  Counter* counters[kSlots];
  OpCounter* op_counter;
  int64_t op_size;
  SegmentBlock* segment_block;
  bool pending;
  int64_t op_request;  // the rounded request, which a relayout asks for again
  bool background;  // its segment block is in the op counter's background model
};

// Counted blocks by data pointer, in shards so that threads freeing blocks rarely contend.
constexpr size_t kShards = 16;
struct Shard {
  SpinLock mutex;
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

// Empties the log that Python started in place; the caller holds the log's lock.
void settle_log(Counter* counter) {
  if (counter->logging.load(std::memory_order_relaxed) != kLogStarting) {
    return;
  }
  counter->log.clear();
  counter->tags.clear();
  counter->adopted.clear();
  counter->running = counter->best = counter->peak_from = 0;
  std::fill(std::begin(counter->live_by_where), std::end(counter->live_by_where), 0);
  std::fill(std::begin(counter->peak_by_where), std::end(counter->peak_by_where), 0);
  counter->logged.store(0, std::memory_order_release);
  counter->logging.store(1, std::memory_order_relaxed);
}

void add_where(Counter* counter, int64_t where, int64_t bytes) {
  if (where >= 0 && where < kPlaces) {
    counter->live_by_where[where] += bytes;
  }
}

// Frees come from any thread, so the log takes a lock; it is only taken while logging. An
// allocation is logged where the watched thread is, unless where_code says where (>= 0).
void log_event(Counter* counter, const void* data, int64_t bytes, int64_t where_code = -1) {
  if (!counter->logging.load(std::memory_order_relaxed)) {
    return;
  }
  Guard guard(counter->log_mutex);
  if (!counter->logging.load(std::memory_order_relaxed)) {
    return;
  }
  settle_log(counter);
  int64_t index = static_cast<int64_t>(counter->log.size());
  int64_t where = 0;
  if (bytes > 0) {
    where = where_code >= 0 ? where_code : counter->where.load(std::memory_order_relaxed);
    counter->tags[data] = index + 1;
    add_where(counter, where, bytes);
  } else {
    auto found = counter->tags.find(data);
    if (found != counter->tags.end()) {
      int64_t tag = found->second;
      if (tag > 0) {
        LogEvent& allocated = counter->log[static_cast<size_t>(tag - 1)];
        allocated.freed = index + 1;
        add_where(counter, allocated.where, bytes);
      } else {
        counter->adopted[static_cast<size_t>(-tag - 1)].freed = index + 1;
      }
      counter->tags.erase(found);
    }
  }
  counter->log.push_back({data, bytes, where, 0});
  counter->running += bytes;
  if (counter->running > counter->best) {
    counter->best = counter->running;
    std::copy(std::begin(counter->live_by_where), std::end(counter->live_by_where),
              std::begin(counter->peak_by_where));
  }
  counter->logged.store(static_cast<int64_t>(counter->log.size()), std::memory_order_release);
}

void add(OpCounter* counter, int64_t nbytes) {
  int64_t now = counter->current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t peak = counter->peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !counter->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// The block size the CUDA caching allocator hands out for a request: a multiple of 512 bytes.
int64_t round_like_cuda(size_t nbytes) {
  constexpr int64_t kMinBlock = 512;
  int64_t n = static_cast<int64_t>(nbytes);
  return n < kMinBlock ? kMinBlock : (n + kMinBlock - 1) / kMinBlock * kMinBlock;
}

// Logs a block an op counter counts (bytes > 0) or stops counting, when its log is on.
void log_op(OpCounter* counter, const void* data, int64_t bytes, int64_t where_code = -1) {
  if (Counter* log = counter->log.load(std::memory_order_acquire)) {
    log_event(log, data, bytes, where_code);
  }
}

// Counts the block of an op counter at data; the caller holds its shard lock. It counts the
// block handed out, as CUDA counts allocated bytes: a remainder too small to split off with it.
void commit(Block& block, const void* data) {
  OpCounter* counter = block.op_counter;
  block.pending = false;
  {
    Guard guard(counter->mutex);
    block.segment_block = counter->segments.malloc(block.op_size);
    block.op_size = block.segment_block->size;
  }
  add(counter, block.op_size);
  counter->blocks.fetch_add(1, std::memory_order_relaxed);
  log_op(counter, data, block.op_size);
}

// Uncounts and frees a counted block; false when data is not one.
bool release(void* data) {
  Block block;
  bool segment_freed = false;
  {
    Shard& shard = shard_of(data);
    Guard guard(shard.mutex);
    auto found = shard.blocks.find(data);
    if (found == shard.blocks.end()) {
      return false;
    }
    block = found->second;
    shard.blocks.erase(found);
    OpCounter* counter = block.op_counter;
    if (counter != nullptr && !block.pending &&
        (block.background || !(t_op.counter == counter && t_op.depth > 0))) {
      // Under the shard's lock, so that relayout() never leaves this block's segment stale.
      Guard segments_guard(counter->mutex);
      (block.background ? counter->background : counter->segments).free(block.segment_block);
      segment_freed = true;
    }
  }
  for (Counter* counter : block.counters) {
    if (counter != nullptr) {
      counter->current.fetch_sub(static_cast<int64_t>(block.nbytes), std::memory_order_relaxed);
      log_event(counter, data, -static_cast<int64_t>(block.nbytes));
    }
  }
  if (OpCounter* counter = block.op_counter) {
    if (block.pending) {
      // A kernel's own temporary, never counted.
      if (t_op.counter == counter) {
        t_op.pending_bytes -= block.op_size;
      }
    } else {
      counter->current.fetch_sub(block.op_size, std::memory_order_relaxed);
      counter->blocks.fetch_sub(1, std::memory_order_relaxed);
      log_op(counter, data, -block.op_size);
      if (!segment_freed) {
        t_op.resized.push_back(block.segment_block);
      }
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
    Block block{nbytes, nullptr, nullptr, {nullptr, nullptr, nullptr, nullptr}, nullptr, 0,
                nullptr, false, 0};
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
      // Outside any op nothing is an op's output: the wrapped number that Python's x * 2
      // makes of its 2, for one, which a dispatch mode never sees.
      OpThread& thread = t_op;
      if (thread.counter != nullptr && thread.uncounted == 0 && thread.depth > 0) {
        block.op_counter = thread.counter;
        block.op_size = block.op_request = round_like_cuda(nbytes);
        check_limit(thread, block.op_size);
        counted = true;
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
      Guard guard(shard.mutex);
      Block& stored = shard.blocks[data] = block;
      if (block.op_counter != nullptr) {
        OpThread& thread = t_op;
        stored.pending = true;
        thread.pending.push_back(data);
        thread.pending_bytes += block.op_size;
      }
    }
    for (Counter* counter : block.counters) {
      if (counter != nullptr) {
        add(counter, static_cast<int64_t>(nbytes));
        log_event(counter, data, static_cast<int64_t>(nbytes));
      }
    }
    return c10::DataPtr(data, data, &counted_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }

  // Refuses an allocation that would take the counter past its limit, before it is made.
  static void check_limit(const OpThread& thread, int64_t size) {
    OpCounter* counter = thread.counter;
    int64_t limit = counter->limit;
    if (limit < 0) {
      return;
    }
    int64_t needed =
        counter->current.load(std::memory_order_relaxed) + thread.pending_bytes + size;
    if (needed <= limit) {
      return;
    }
    std::string message;
    {
      Guard guard(counter->mutex);
      message = counter->limit_head + format_size(needed) + counter->limit_tail;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  }

  // As pytest_vram.units.format_size: "1.50 GiB", below 1 KiB "512 B".
  static std::string format_size(int64_t n) {
    char text[64];
    if (n < 1024) {
      std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(n));
      return text;
    }
    const char* units[] = {"TiB", "GiB", "MiB"};
    const double factors[] = {1099511627776.0, 1073741824.0, 1048576.0};
    for (int i = 0; i < 3; ++i) {
      if (static_cast<double>(n) >= factors[i]) {
        std::snprintf(text, sizeof text, "%.2f %s", static_cast<double>(n) / factors[i], units[i]);
        return text;
      }
    }
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(n) / 1024.0);
    return text;
  }

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

// What the op counter needs to know of the op a RecordFunction stands for:
// - whether it decomposes into other ops before any kernel runs (CompositeImplicitAutograd): a
//   dispatch mode sees the ops it decomposes into, not it; records that name no operator (the
//   autograd engine's, one per node it evaluates, each with a name of its own) are treated
//   alike, and not cached;
// - whether it runs on cuBLAS on a GPU (workspaces.py's matmul_ops), and so needs a workspace.
// Cached by the name's address, which each operator's schema keeps for as long as the operator
// is registered, in a small table indexed by that address (a hit is a load and a name compare);
// the name is compared as well, in case an operator was removed and another took its place.
struct OpFacts {
  std::string name;
  bool decomposes;
  bool multiplies_matrices;
};

constexpr size_t kFactSlots = 1024;
struct FactSlot {
  const char* key = nullptr;
  const OpFacts* facts = nullptr;
};

const OpFacts kNoOperator{"", true, false};

const OpFacts& facts_of(const at::RecordFunction& fn) {
  static const std::set<std::string> matmuls = {
      "aten::mm",   "aten::addmm", "aten::_addmm_activation", "aten::bmm",     "aten::baddbmm",
      "aten::addbmm", "aten::mv",  "aten::addmv",             "aten::dot",     "aten::vdot",
      "aten::_int_mm", "aten::_scaled_mm"};
  thread_local FactSlot slots[kFactSlots];
  // Every OpFacts a thread made, by the name's address (the overloads of an operator share
  // its name's text, not its address, and may differ), for as long as the thread lives:
  // slots point into it.
  thread_local std::unordered_map<const char*, OpFacts> made;
  const char* name = fn.name();
  FactSlot& slot = slots[(reinterpret_cast<uintptr_t>(name) >> 3) % kFactSlots];
  if (slot.key == name && slot.facts->name == name) {
    return *slot.facts;
  }
  auto op_name = fn.operator_name();
  if (!op_name) {
    return kNoOperator;
  }
  auto found = made.find(name);
  if (found == made.end() || found->second.name != name) {
    auto handle = c10::Dispatcher::singleton().findOp(*op_name);
    bool decomposes =
        handle.has_value() &&
        handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    found = made.insert_or_assign(name, OpFacts{name, decomposes, matmuls.count(name) > 0})
                .first;
  }
  slot.key = name;
  slot.facts = &found->second;
  return found->second;
}

// Whether the calling thread runs backward: torch::autograd::get_current_graph_task_id() (the
// graph task whose nodes it evaluates, -1 outside backward), found at run time. Where a torch
// build lacks it, the op counter hears of each node through its BACKWARD_FUNCTION record
// instead (OpThread::backward), at the cost of a record per node.
using GraphTaskId = int (*)();
GraphTaskId graph_task_id_function() {
  static const GraphTaskId found = [] {
    void* library = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* symbol = library != nullptr
                       ? dlsym(library, "_ZN5torch8autograd25get_current_graph_task_idEv")
                       : nullptr;
    return reinterpret_cast<GraphTaskId>(symbol);
  }();
  return found;
}

bool in_backward(const OpThread& thread) {
  GraphTaskId graph_task_id = graph_task_id_function();
  return graph_task_id != nullptr ? graph_task_id() != -1 : thread.backward > 0;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  OpThread& thread = t_op;
  if (thread.counter == nullptr) {
    return nullptr;
  }
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    ++thread.backward;
  } else if (thread.depth > 0) {
    ++thread.depth;
  } else {
    const OpFacts& facts = facts_of(fn);
    if (!facts.decomposes) {
      thread.depth = 1;
      thread.matmul = facts.multiplies_matrices && thread.counter->workspace_size > 0;
    }
  }
  return nullptr;
}

// What the outermost op allocated and still holds when it returns are its outputs (or what it
// keeps, as a cache): counted now.
void free_resized(OpThread& thread) {
  if (thread.resized.empty()) {
    return;
  }
  Guard guard(thread.counter->mutex);
  for (SegmentBlock* block : thread.resized) {
    thread.counter->segments.free(block);
  }
  thread.resized.clear();
}

// The calling thread's workspace (the autograd engine's inside backward), allocated if it has
// none: as the tracker's CublasWorkspaces does after a matrix multiply's outputs are counted.
void take_workspace(OpThread& thread) {
  OpCounter* counter = thread.counter;
  const void* key = in_backward(thread) ? static_cast<const void*>(&g_autograd_thread)
                                        : static_cast<const void*>(&t_marker);
  int64_t size = counter->workspace_size;
  {
    Guard guard(counter->mutex);
    if (size <= 0 || counter->workspaces.count(key) > 0) {
      return;
    }
  }
  CountingAllocator::check_limit(thread, size);
  SegmentBlock* block;
  int64_t where;
  {
    Guard guard(counter->mutex);
    block = counter->segments.malloc(size);
    counter->workspaces[key] = {block, block->size};
    where = counter->workspace_where;
  }
  add(counter, block->size);
  log_op(counter, key, block->size, where);
}

void leave_op(OpThread& thread) {
  if (thread.depth == 0 || --thread.depth > 0) {
    return;
  }
  for (void* data : thread.pending) {
    Shard& shard = shard_of(data);
    Guard guard(shard.mutex);
    auto found = shard.blocks.find(data);
    if (found != shard.blocks.end() && found->second.pending &&
        found->second.op_counter == thread.counter) {
      commit(found->second, data);
    }
  }
  thread.pending.clear();
  thread.pending_bytes = 0;
  free_resized(thread);
  if (thread.matmul) {
    thread.matmul = false;
    take_workspace(thread);
  }
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  OpThread& thread = t_op;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (thread.backward > 0) {
      --thread.backward;
    }
    return;
  }
  leave_op(thread);
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

// Where Python reads the counter's figures: current at offset 0, peak at offset 8, and where it
// writes where the thread is at offset 24, reads the log's length at offset 32 and stops the
// log at offset 40.
int pytest_vram_counter_layout(void) {
  return offsetof(Counter, current) == 0 && offsetof(Counter, peak) == 8 &&
                 offsetof(Counter, where) == 24 && offsetof(Counter, logged) == 32 &&
                 offsetof(Counter, logging) == 40 && offsetof(Counter, peak_by_where) == 48
             ? 0
             : 1;
}

// Stops the log and releases its memory (Python stops a short one in place instead).
void pytest_vram_log_release(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  Guard guard(counter->log_mutex);
  counter->logging.store(0, std::memory_order_relaxed);
  std::vector<LogEvent>().swap(counter->log);
  std::unordered_map<const void*, int64_t>().swap(counter->tags);
  std::vector<Adopted>().swap(counter->adopted);
  counter->logged.store(0, std::memory_order_release);
}

// The peak is looked for from the next event on (what came before was a fixture's).
void pytest_vram_log_peak_from_here(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  Guard guard(counter->log_mutex);
  settle_log(counter);
  counter->peak_from = static_cast<int64_t>(counter->log.size());
  counter->best = counter->running;
  std::copy(std::begin(counter->live_by_where), std::end(counter->live_by_where),
            std::begin(counter->peak_by_where));
}

// How many events the log holds.
int64_t pytest_vram_log_length(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  Guard guard(counter->log_mutex);
  settle_log(counter);
  return static_cast<int64_t>(counter->log.size());
}

int64_t pytest_vram_counted_bytes(void* handle, void* data);

// The tag of the counted block at data (0: the counter counts none there). A block counted
// before the log began is adopted: alive from the log's start until the log frees it.
int64_t pytest_vram_log_tag(void* handle, void* data) {
  auto* counter = static_cast<Counter*>(handle);
  {
    Guard guard(counter->log_mutex);
    settle_log(counter);
    auto found = counter->tags.find(data);
    if (found != counter->tags.end()) {
      return found->second;
    }
  }
  // Not under the log's lock: an allocation takes a shard's lock, then the log's.
  int64_t bytes = pytest_vram_counted_bytes(handle, data);
  if (bytes == 0) {
    return 0;
  }
  Guard guard(counter->log_mutex);
  settle_log(counter);
  auto found = counter->tags.find(data);
  if (found != counter->tags.end()) {
    return found->second;
  }
  int64_t tag = -static_cast<int64_t>(counter->adopted.size()) - 1;
  counter->adopted.push_back({bytes, tag, 0});
  counter->tags[data] = tag;
  return tag;
}

// Where pytest_vram_log_peak writes: capacity (tag, bytes, where) triples at out.
void pytest_vram_log_peak_blocks(void* handle, int64_t* out, int64_t capacity) {
  auto* counter = static_cast<Counter*>(handle);
  Guard guard(counter->log_mutex);
  counter->peak_blocks = out;
  counter->peak_capacity = capacity;
}

// Replays the log to its peak, the highest running total at or after event index peak_from (the
// first such event; before peak_from when none is higher: the peak peak_by_where is of), and
// writes the blocks alive then as
// (tag, bytes, where) triples where pytest_vram_log_peak_blocks said, as many as fit; an adopted
// block's where is 0, as for one allocated where nothing was noted. Returns how many blocks were alive, which may be more than it wrote.
// One argument, no more: what a call from Python costs is mostly converting its arguments.
int64_t pytest_vram_log_peak(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  Guard guard(counter->log_mutex);
  settle_log(counter);
  int64_t* out = counter->peak_blocks;
  int64_t capacity = counter->peak_capacity;
  const std::vector<LogEvent>& log = counter->log;
  int64_t size = static_cast<int64_t>(log.size());
  int64_t first = std::max<int64_t>(0, std::min(counter->peak_from, size));
  int64_t running = 0;
  for (int64_t i = 0; i < first; ++i) {
    running += log[static_cast<size_t>(i)].bytes;
  }
  int64_t best = running;
  int64_t end = first;  // events before end make the peak
  for (int64_t i = first; i < size; ++i) {
    running += log[static_cast<size_t>(i)].bytes;
    if (running > best) {
      best = running;
      end = i + 1;
    }
  }
  // A block is alive at the peak when allocated before end and not freed before it: freed (the
  // index + 1 of its free) is 0 or past end.
  int64_t count = 0;
  auto write = [&](int64_t tag, int64_t bytes, int64_t where) {
    if (count < capacity) {
      out[3 * count] = tag;
      out[3 * count + 1] = bytes;
      out[3 * count + 2] = where;
    }
    ++count;
  };
  for (const Adopted& block : counter->adopted) {
    if (block.freed == 0 || block.freed > end) {
      write(block.tag, block.bytes, 0);
    }
  }
  for (int64_t i = 0; i < end; ++i) {
    const LogEvent& event = log[static_cast<size_t>(i)];
    if (event.bytes > 0 && (event.freed == 0 || event.freed > end)) {
      write(i + 1, event.bytes, event.where);
    }
  }
  return count;
}

// The bytes the counter counts for the block at data (0: it counts none there).
int64_t pytest_vram_counted_bytes(void* handle, void* data) {
  Shard& shard = shard_of(data);
  Guard guard(shard.mutex);
  auto found = shard.blocks.find(data);
  if (found == shard.blocks.end()) {
    return 0;
  }
  const Block& block = found->second;
  for (Counter* counter : block.counters) {
    if (counter == handle) {
      return static_cast<int64_t>(block.nbytes);
    }
  }
  // A block an op counter counts, when the counter's log is that op counter's.
  if (block.op_counter != nullptr && !block.pending &&
      block.op_counter->log.load(std::memory_order_acquire) == handle) {
    return block.op_size;
  }
  return 0;
}

void pytest_vram_reset_peak(void* handle) {
  auto* counter = static_cast<Counter*>(handle);
  counter->peak.store(counter->current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

// Op counters. Like counters they are never freed: a block may outlive its Python object.
void* pytest_vram_new_op_counter(void) { return new OpCounter(); }

// Start counting op outputs on the calling thread. 0: watching. 1: another op counter is.
int pytest_vram_op_watch(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  OpThread& thread = t_op;
  if (thread.counter == counter) {
    return 0;
  }
  if (thread.counter != nullptr) {
    return 1;
  }
  thread.counter = counter;
  thread.depth = 0;
  thread.matmul = false;
  thread.backward = 0;
  thread.pending.clear();
  thread.pending_bytes = 0;
  auto callback = at::RecordFunctionCallback(on_op_start, on_op_end);
  if (graph_task_id_function() != nullptr) {
    callback.scopes({at::RecordScope::FUNCTION});
  } else {
    callback.scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION});
  }
  thread.callback = at::addThreadLocalCallback(std::move(callback));
  return 0;
}

// Stop counting new allocations on the calling thread; frees of counted blocks still count.
void pytest_vram_op_unwatch(void* handle) {
  OpThread& thread = t_op;
  if (thread.counter != static_cast<OpCounter*>(handle)) {
    return;
  }
  at::removeCallback(thread.callback);
  thread.callback = 0;
  free_resized(thread);
  thread.counter = nullptr;
  thread.depth = 0;
  thread.pending.clear();
  thread.pending_bytes = 0;
}

// The size of the cuBLAS workspaces that matrix multiplies allocate from now on (0: none).
void pytest_vram_op_workspace_size(void* handle, int64_t size) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  counter->workspace_size = size;
}

}  // extern "C"

namespace {

// Lays the counter's live blocks out on a fresh segment model, largest first, as
// OwnSegments.start() and restart() in segments.py do: those at the data pointers in keep (with
// keep null, all but the background's) and the workspaces. Any other live block joins the
// background model, where it stays until it is freed. What the old model cached is forgotten.
// Called between ops.
void relayout(OpCounter* counter, const std::set<const void*>* keep) {
  std::vector<std::unique_lock<SpinLock>> shard_locks;
  for (size_t i = 0; i < kShards; ++i) {
    shard_locks.emplace_back(g_shards[i].mutex);
  }
  Guard guard(counter->mutex);
  std::vector<std::pair<int64_t, SegmentBlock**>> live;
  std::vector<std::pair<int64_t, Block*>> leaving;
  for (size_t i = 0; i < kShards; ++i) {
    for (auto& [data, block] : g_shards[i].blocks) {
      if (block.op_counter != counter || block.pending || block.background) {
        continue;
      }
      if (keep == nullptr || keep->count(data) > 0) {
        live.emplace_back(block.op_request, &block.segment_block);
      } else {
        leaving.emplace_back(block.op_request, &block);
      }
    }
  }
  for (auto& [key, workspace] : counter->workspaces) {
    live.emplace_back(counter->workspace_size, &workspace.first);
  }
  auto largest_first = [](const auto& a, const auto& b) { return a.first > b.first; };
  std::stable_sort(live.begin(), live.end(), largest_first);
  std::stable_sort(leaving.begin(), leaving.end(), largest_first);
  std::vector<SegmentBlock*> used;
  for (auto& [size, block] : leaving) {
    used.push_back(block->segment_block);
    block->segment_block = counter->background.malloc(size);
    block->background = true;
  }
  SegmentModel fresh;
  fresh.next_addr = counter->segments.next_addr;  // addresses stay unique
  for (auto& [size, slot] : live) {
    used.push_back(*slot);
    *slot = fresh.malloc(size);
  }
  counter->segments.discard(used);
  counter->segments = std::move(fresh);
}

}  // namespace

extern "C" {

// Lays the counter's live blocks out anew, as a broader-scoped fixture made in a test's set-up
// leaves them: what making it cost, cached blocks included, is forgotten, as a later test never
// sees it.
void pytest_vram_op_relayout(void* handle) { relayout(static_cast<OpCounter*>(handle), nullptr); }

// Before a test that counts here: its own segments hold the blocks at the count data pointers
// in held (what its fixtures hold), laid out anew; what else is counted moves to the
// background model.
void pytest_vram_op_start_own(void* handle, void** held, int64_t count) {
  std::set<const void*> keep(held, held + count);
  relayout(static_cast<OpCounter*>(handle), &keep);
}

// Lets every workspace go, as torch._C._cuda_clearCublasWorkspaces() does; how many there were.
int pytest_vram_op_clear_workspaces(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  int64_t released = 0;
  int count = 0;
  {
    Guard guard(counter->mutex);
    for (auto& [key, workspace] : counter->workspaces) {
      counter->segments.free(workspace.first);
      released += workspace.second;
      ++count;
      log_op(counter, key, -workspace.second);
    }
    counter->workspaces.clear();
  }
  counter->current.fetch_sub(released, std::memory_order_relaxed);
  return count;
}

void pytest_vram_op_reset_peak(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  counter->peak.store(counter->current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

// Between enter and leave, the calling thread's allocations count as one op's outputs would.
void pytest_vram_op_enter(void) {
  OpThread& thread = t_op;
  if (thread.counter != nullptr) {
    ++thread.depth;
  }
}

void pytest_vram_op_leave(void) { leave_op(t_op); }

// Inside host_memory() (depth > 0) the calling thread's allocations are not the device's.
void pytest_vram_op_uncounted(int delta) { t_op.uncounted += delta; }

// Sets the limit (-1: none) and the message of an allocation it refuses.
void pytest_vram_op_limit(void* handle, int64_t limit, const char* head, const char* tail) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  counter->limit = limit;
  counter->limit_head = head != nullptr ? head : "";
  counter->limit_tail = tail != nullptr ? tail : "";
}

// The segment model's figures, as SegmentFigures orders them: reserved, its peak, allocated,
// its peak, segments, segments asked of the driver and segments given back.
// With background non-zero, the background model's.
void pytest_vram_op_segments(void* handle, int64_t* out, int background) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  const SegmentModel& model = background != 0 ? counter->background : counter->segments;
  out[0] = model.reserved;
  out[1] = model.peak_reserved;
  out[2] = model.allocated;
  out[3] = model.peak_allocated;
  out[4] = model.segments;
  out[5] = model.num_device_alloc;
  out[6] = model.num_device_free;
}

// The free bytes of partly used segments, which empty_cache cannot give back.
int64_t pytest_vram_op_inactive_split_bytes(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  return counter->segments.inactive_split_bytes() + counter->background.inactive_split_bytes();
}

// torch.cuda.empty_cache(): the entirely free segments go back; the bytes released.
int64_t pytest_vram_op_empty_cache(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  return counter->segments.empty_cache() + counter->background.empty_cache();
}

void pytest_vram_op_reset_segment_peaks(void* handle) {
  auto* counter = static_cast<OpCounter*>(handle);
  Guard guard(counter->mutex);
  for (SegmentModel* model : {&counter->segments, &counter->background}) {
    model->peak_reserved = model->reserved;
    model->peak_allocated = model->allocated;
  }
}

// Whether the block at data is one the op counter counts: counted now, or made by the op
// that runs (Python code that an op calls, an autograd hook, meets its outputs before the op
// returns and they are counted).
int pytest_vram_op_counts(void* handle, void* data) {
  Shard& shard = shard_of(data);
  Guard guard(shard.mutex);
  auto found = shard.blocks.find(data);
  return found != shard.blocks.end() && found->second.op_counter == handle ? 1 : 0;
}

// Stops counting the block at data: its bytes are counted elsewhere now (the simulated
// device's copy of a host tensor, which takes over the original's count). Its free, later,
// takes nothing off. 1: it was counted; 0: not by this op counter, or still pending.
int pytest_vram_op_forget(void* handle, void* data) {
  auto* counter = static_cast<OpCounter*>(handle);
  Shard& shard = shard_of(data);
  Guard guard(shard.mutex);
  auto found = shard.blocks.find(data);
  if (found == shard.blocks.end() || found->second.op_counter != counter ||
      found->second.pending) {
    return 0;
  }
  Block& block = found->second;
  {
    Guard segments_guard(counter->mutex);
    (block.background ? counter->background : counter->segments).free(block.segment_block);
  }
  block.background = false;
  counter->current.fetch_sub(block.op_size, std::memory_order_relaxed);
  counter->blocks.fetch_sub(1, std::memory_order_relaxed);
  log_op(counter, data, -block.op_size);
  block.op_counter = nullptr;
  block.segment_block = nullptr;
  return 1;
}

// How many blocks the op counter counts now, its workspaces aside.
int64_t pytest_vram_op_blocks(void* handle) {
  return static_cast<OpCounter*>(handle)->blocks.load(std::memory_order_relaxed);
}

// Whether the op counter holds a workspace for the calling thread (backward: for the autograd
// engine's): a test that moved to the tracker must not make a second one.
int pytest_vram_op_has_workspace(void* handle, int backward) {
  auto* counter = static_cast<OpCounter*>(handle);
  const void* key = backward != 0 ? static_cast<const void*>(&g_autograd_thread)
                                  : static_cast<const void*>(&t_marker);
  Guard guard(counter->mutex);
  return counter->workspaces.count(key) > 0 ? 1 : 0;
}

// From now on the op counter logs what it counts and frees on the log of the counter log (which
// no thread should watch; null: no log), a workspace with where code workspace_where.
void pytest_vram_op_log(void* handle, void* log, int64_t workspace_where) {
  auto* counter = static_cast<OpCounter*>(handle);
  {
    Guard guard(counter->mutex);
    counter->workspace_where = workspace_where;
  }
  counter->log.store(static_cast<Counter*>(log), std::memory_order_release);
}

// Logs an allocation (bytes > 0) or free counted elsewhere, at key, which no block's data
// pointer may be: what the simulated device's tracker counts once a test counts there.
void pytest_vram_log_event(void* handle, void* key, int64_t bytes) {
  log_event(static_cast<Counter*>(handle), key, bytes);
}

// A build of PyTorch without CUDA has no device guard for CUDA devices, and code that sets the
// device of a tensor it makes (torch.tensor(..., device="cuda")) stops there. While the
// simulated device computes, a guard that does nothing stands in; it never replaces a real one.
// 0: done. 1: a real CUDA guard is registered, left in place.
int pytest_vram_cuda_guard(int on) {
  static const c10::impl::DeviceGuardImplInterface* const fake =
      new c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>();
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  const c10::impl::DeviceGuardImplInterface* current = slot.load();
  if (current != nullptr && current != fake) {
    return 1;
  }
  slot.store(on ? fake : nullptr);
  if (!on) {
    // Making a CUDA tensor asked torch.cuda._lazy_init, which the simulated device answered;
    // PyTorch remembers that it did. Forget it, so that the next one asks again, and the build
    // says again that it has no CUDA.
    using SetRequiresInit = void (*)(c10::DeviceType, bool);
    static auto set_requires_init = []() -> SetRequiresInit {
      // torch._C loaded libtorch_python for itself (RTLD_LOCAL): ask that copy.
      void* library = dlopen("libtorch_python.so", RTLD_LAZY | RTLD_NOLOAD);
      void* symbol = library != nullptr
          ? dlsym(library, "_ZN5torch5utils24set_requires_device_initEN3c1010DeviceTypeEb")
          : nullptr;
      return reinterpret_cast<SetRequiresInit>(symbol);
    }();
    if (set_requires_init != nullptr) {
      set_requires_init(c10::DeviceType::CUDA, true);
    }
  }
  return 0;
}

}  // extern "C"
