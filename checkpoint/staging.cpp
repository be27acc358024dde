#include "checkpoint/staging.h"

#include <stdexcept>
#include <string>

namespace ctitan::ckpt {

StagingBuffer::Layout StagingBuffer::begin(const std::vector<int64_t>& tensor_bytes) {
  if (in_use_) throw std::logic_error("[checkpoint] staging buffer still in use by the previous save's writer");
  Layout l;
  int64_t end = 0;
  for (int64_t b : tensor_bytes) {
    if (b < 0) throw std::invalid_argument("[checkpoint] staging: negative size " + std::to_string(b));
    const int64_t off = (end + kAlign - 1) / kAlign * kAlign;
    l.slots.push_back(Slot{off, b});
    end = off + b;
  }
  l.bytes = end;
  if (end > capacity_) {
    capacity_ = end;
    ++allocations_;
    l.grow = true;
  }
  in_use_ = true;
  return l;
}

void StagingBuffer::finished() { in_use_ = false; }

}  // namespace ctitan::ckpt
