// A caching CPU allocator for LibTorch tensors.
//
// LibTorch's default CPU allocator hands every tensor to malloc and back. Blocks of 1 MiB
// and more are mmapped by glibc (the train executable fixes that threshold so that memory
// FSDP releases goes back to the system), so every activation, gradient and gathered
// parameter of every step costs an mmap, a munmap and one page fault per 4 KiB touched:
// about a million faults per step on the debug model, a fifth of the step's time.
//
// Training allocates the same sizes step after step, so large blocks are kept when freed
// and handed out again for a request of the same size (up to 1/8 larger), as the CUDA
// caching allocator does for device memory. Blocks under kMinCachedBytes go to malloc
// (glibc's heap already reuses them). The cache holds at most a configured number of bytes;
// a freed block that does not fit goes back to the system. release_cached_cpu_memory()
// empties it (FSDP calls it after sharding so the full model's storage really leaves).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ctitan {

struct CpuAllocatorStats {
  bool installed = false;
  int64_t cached_bytes = 0;  // held in the cache, not in any tensor
  int64_t cached_blocks = 0;
  int64_t live_bytes = 0;  // large blocks currently in tensors
  int64_t hits = 0;        // large requests served from the cache
  int64_t misses = 0;      // large requests that went to the system
  int64_t max_cached_bytes = 0;
};

constexpr size_t kMinCachedBytes = size_t{1} << 20;

// Makes the caching allocator LibTorch's CPU allocator (tensors allocated before keep their
// own deleter). Idempotent. Returns false, doing nothing, when CTITAN_CPU_ALLOCATOR=system
// or in a sanitizer build (AddressSanitizer must see every free).
bool install_caching_cpu_allocator();

// Upper bound of the cache (default: $CTITAN_CPU_CACHE_MAX_MIB, else a quarter of physical
// memory, at most 8 GiB). Shrinking it releases blocks until the cache fits.
void set_max_cached_cpu_bytes(int64_t bytes);

// Returns every cached block to the system.
void release_cached_cpu_memory();

CpuAllocatorStats cpu_allocator_stats();

}  // namespace ctitan
