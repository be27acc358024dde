// Bookkeeping of the host staging buffer a save copies device tensors into
// (checkpoint.async_mode = "async_with_pinned_mem" in torchtitan): one page-locked buffer per
// rank, kept from save to save, so each save's device-to-host copies are DMA transfers into
// memory that is already pinned (pinning is slow: cudaHostAlloc costs far more than the copy).
//
// What it decides, without touching memory (the CUDA build allocates the buffer with
// at::empty(..., pinned_memory) when grow() says so, and checkpoint.cpp does the copies):
//   - layout: each tensor of a save at an offset aligned to kAlign bytes, in the order given,
//     no two overlapping; the buffer's size is the end of the last;
//   - reuse: a save whose layout fits the buffer reuses it (no allocation); a larger one
//     grows it to exactly what it needs (the old one is released; the count says how often);
//   - when the buffer may be reused: from begin() until finished() the save's background
//     writer reads the buffer, so a second begin() before finished() is refused — the caller
//     waits for the previous save first (CheckpointManager does, before staging the next).
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

namespace ctitan::ckpt {

class StagingBuffer {
 public:
  static constexpr int64_t kAlign = 512;  // cache lines and O_DIRECT-friendly offsets

  struct Slot {
    int64_t offset = 0;
    int64_t bytes = 0;
  };
  struct Layout {
    std::vector<Slot> slots;
    int64_t bytes = 0;  // what this save needs
    bool grow = false;  // the buffer must be (re)allocated with capacity() bytes first
  };

  // The layout of a save of tensors of these sizes (bytes; 0 allowed). Throws
  // std::logic_error when the previous save has not finished() (its writer may still read).
  Layout begin(const std::vector<int64_t>& tensor_bytes);
  // The previous save's writer is done with the buffer.
  void finished();

  bool in_use() const { return in_use_; }
  int64_t capacity() const { return capacity_; }
  int64_t allocations() const { return allocations_; }

 private:
  int64_t capacity_ = 0;
  int64_t allocations_ = 0;
  std::atomic<bool> in_use_{false};  // finished() runs on the writer thread
};

}  // namespace ctitan::ckpt
