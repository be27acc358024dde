// ctitan's own kernels (flash_attention, fused_ops, the fused AdamW in components/) are CPU
// loops over data_ptr(); a tensor on a GPU goes to ATen's op for the same formula instead
// (scaled_dot_product_attention, rms_norm, silu, cross_entropy, torch's fused AdamW).
// In the CPU build the test is the constant false: the ATen branches compile away and the CPU
// path is unchanged.
#pragma once
#include <atomic>
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace ctitan {

inline bool on_gpu(const at::Tensor& t) {
#ifdef CTITAN_WITH_CUDA
  return !t.device().is_cpu();
#else
  (void)t;
  return false;
#endif
}

// The one way the training step reads a result back to the host. For a tensor on a GPU the
// copy waits for the device's queued work: a host synchronisation, which leaves the GPU idle
// while the host catches up. The step calls this only where a value is needed on the host
// (log steps, before a checkpoint save, the end of the run) and tests count the calls
// (host_reads()), so a read added to every step shows up. Values of a CPU run go through the
// same calls: the CPU path is where the rule is tested.
inline std::atomic<int64_t>& host_read_counter() {
  static std::atomic<int64_t> n{0};
  return n;
}
inline int64_t host_reads() { return host_read_counter().load(); }
inline at::Tensor read_to_host(const at::Tensor& t) {
  host_read_counter().fetch_add(1);
  return t.cpu();
}

}  // namespace ctitan
