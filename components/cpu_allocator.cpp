#include "components/cpu_allocator.h"
#include "util/env.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace ctitan {
namespace {

constexpr size_t kAlignment = 64;  // c10's CPU alignment (AVX-512 loads)
constexpr size_t kGranule = 4096;  // large requests are rounded up to whole pages

// nullptr when the system has no memory to give.
void* try_system_alloc(size_t n) {
  void* p = nullptr;
  return posix_memalign(&p, kAlignment, std::max<size_t>(n, 1)) == 0 ? p : nullptr;
}

// What LibTorch's own CPU allocator would throw, with the size asked for in bytes (the
// training loop's failure line quotes it: "... N bytes").
[[noreturn]] void out_of_memory(size_t n, int64_t released) {
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "CPU allocator: out of memory: tried to allocate ", n, " bytes",
      released > 0 ? " after releasing " + std::to_string(released >> 20) + " MiB of cached blocks" : std::string());
}

void* system_alloc(size_t n) {
  void* p = try_system_alloc(n);
  if (!p) out_of_memory(n, 0);
  return p;
}

int64_t default_max_cached() {
  if (const auto mib = runtime_env().cpu_cache_max_mib) return *mib << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const int64_t quarter = pages > 0 && page > 0 ? int64_t{pages} * page / 4 : int64_t{1} << 30;
  return std::min<int64_t>(quarter, int64_t{8} << 30);
}

class CachingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = n < kMinCachedBytes ? system_alloc(n) : self().take((n + kGranule - 1) / kGranule * kGranule);
    return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};
  }
  // Context == data, so raw_allocate/raw_deallocate work (oneDNN's bf16 matmuls use them).
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static CachingCpuAllocator& self() {
    static auto* a = new CachingCpuAllocator();  // never destroyed: tensors may outlive main
    return *a;
  }

  void set_max(int64_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    max_cached_ = std::max<int64_t>(bytes, 0);
    trim_locked();
  }
  void release() {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [size, p] : free_) std::free(p);
    free_.clear();
    stats_.cached_bytes = stats_.cached_blocks = 0;
  }
  CpuAllocatorStats stats() {
    std::lock_guard<std::mutex> g(mu_);
    CpuAllocatorStats s = stats_;
    s.max_cached_bytes = max_cached_;
    return s;
  }
  void mark_installed() {
    std::lock_guard<std::mutex> g(mu_);
    stats_.installed = true;
  }

 private:
  CachingCpuAllocator() : max_cached_(default_max_cached()) {}

  static void free_block(void* p) { self().give_back(p); }

  // A cached block of at least `size` bytes and at most 1/8 more, else a new one.
  void* take(size_t size) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= size + size / 8) {
        void* p = it->second;
        const size_t got = it->first;
        free_.erase(it);
        stats_.cached_bytes -= static_cast<int64_t>(got);
        --stats_.cached_blocks;
        ++stats_.hits;
        live_[p] = got;
        stats_.live_bytes += static_cast<int64_t>(got);
        return p;
      }
    }
    // A miss: new memory from the system, outside the lock. Blocks of sizes no longer
    // requested stay cached until the bound pushes them out (see trim_locked / give_back).
    // When the system has none, the cache's blocks go back first and the request is tried
    // once more (as the CUDA caching allocator does before it reports out of memory).
    void* p = try_system_alloc(size);
    if (!p) {
      const int64_t released = stats().cached_bytes;
      release();
      p = try_system_alloc(size);
      if (!p) out_of_memory(size, released);
    }
    std::lock_guard<std::mutex> g(mu_);
    ++stats_.misses;
    live_[p] = size;
    stats_.live_bytes += static_cast<int64_t>(size);
    return p;
  }

  void give_back(void* p) {
    std::unique_lock<std::mutex> g(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {  // a small block: malloc's
      g.unlock();
      std::free(p);
      return;
    }
    const size_t size = it->second;
    live_.erase(it);
    stats_.live_bytes -= static_cast<int64_t>(size);
    if (stats_.cached_bytes + static_cast<int64_t>(size) > max_cached_) {
      g.unlock();
      std::free(p);  // the cache is full: back to the system
      return;
    }
    free_.emplace(size, p);
    stats_.cached_bytes += static_cast<int64_t>(size);
    ++stats_.cached_blocks;
  }

  // Frees the largest cached blocks until the cache fits its bound.
  void trim_locked() {
    while (stats_.cached_bytes > max_cached_ && !free_.empty()) {
      auto last = std::prev(free_.end());
      std::free(last->second);
      stats_.cached_bytes -= static_cast<int64_t>(last->first);
      --stats_.cached_blocks;
      free_.erase(last);
    }
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;       // size → block, cached
  std::unordered_map<void*, size_t> live_;  // block → size, in a tensor
  CpuAllocatorStats stats_;
  int64_t max_cached_;
};

}  // namespace

bool install_caching_cpu_allocator() {
#ifdef CTITAN_SANITIZE
  return false;
#else
  if (runtime_env().cpu_allocator == "system") return false;
  static std::once_flag once;
  std::call_once(once, [] {
    auto& a = CachingCpuAllocator::self();
    // Priority above the default allocator's registration (0), so no later default
    // registration can take the slot back.
    c10::SetCPUAllocator(&a, /*priority=*/1);
    a.mark_installed();
  });
  return true;
#endif
}

void set_max_cached_cpu_bytes(int64_t bytes) { CachingCpuAllocator::self().set_max(bytes); }
void release_cached_cpu_memory() { CachingCpuAllocator::self().release(); }
CpuAllocatorStats cpu_allocator_stats() { return CachingCpuAllocator::self().stats(); }

}  // namespace ctitan
