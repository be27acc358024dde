// ctitan's own kernels (flash_attention, fused_ops, the fused AdamW in components/) are CPU
// loops over data_ptr(); a tensor on a GPU goes to ATen's op for the same formula instead
// (scaled_dot_product_attention, rms_norm, silu, cross_entropy, torch's fused AdamW).
// In the CPU build the test is the constant false: the ATen branches compile away and the CPU
// path is unchanged.
#pragma once
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

}  // namespace ctitan
