#include "components/gpu_metrics.h"

#include <stdexcept>

namespace ctitan {

#ifndef CTITAN_WITH_CUDA
// CPU build: no GPU is ever chosen (parallelisms/device.h), so nothing reaches these.
GpuMemory gpu_memory(int64_t) { return {}; }
double gpu_matmul_peak_flops(const std::string&, int64_t) {
  throw std::logic_error("[metrics] gpu_matmul_peak_flops: this build has no CUDA");
}
void gpu_synchronize(int64_t) {}
GpuMemoryInfo gpu_memory_info(int64_t) { return {}; }
#endif

}  // namespace ctitan
