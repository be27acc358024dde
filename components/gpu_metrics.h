// The GPU's side of the metrics (issue 17): CUDA memory peaks (torchtitan logs
// memory/max_reserved(GiB) and max_active), and the bf16 / fp32 matmul peak measured on the
// GPU at start-up, the MFU reference. components/gpu_metrics_cuda.cpp in the CUDA build; the
// CPU build has only the stubs below, which nothing calls (the device is never a GPU there).
#pragma once
#include <cstdint>
#include <string>

namespace ctitan {

struct GpuMemory {
  double peak_allocated_gib = 0;  // tensors (CUDA caching allocator's allocated bytes, peak)
  double peak_reserved_gib = 0;   // what the allocator holds from the driver (peak)
};
GpuMemory gpu_memory(int64_t device);

// Best FLOP/s of n×n×n matmuls in `dtype` ("bfloat16" or "float32", TF32 as the process has
// it) on cuda:device over >= 0.3 s, each timed between device synchronisations.
double gpu_matmul_peak_flops(const std::string& dtype, int64_t device);

// The device's free and total memory in bytes, as the driver reports them (cudaMemGetInfo).
struct GpuMemoryInfo {
  double free_bytes = 0, total_bytes = 0;
};
GpuMemoryInfo gpu_memory_info(int64_t device);

// Waits for the device's queued work (step times with device synchronisation).
void gpu_synchronize(int64_t device);

}  // namespace ctitan
