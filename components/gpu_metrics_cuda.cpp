// CUDA build only (CMakeLists.txt compiles *_cuda.cpp files into it alone).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <chrono>

#include "components/gpu_metrics.h"

namespace ctitan {

GpuMemory gpu_memory(int64_t device) {
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  GpuMemory m;
  m.peak_allocated_gib = static_cast<double>(s.allocated_bytes[agg].peak) / double(1 << 30);
  m.peak_reserved_gib = static_cast<double>(s.reserved_bytes[agg].peak) / double(1 << 30);
  return m;
}

GpuMemoryInfo gpu_memory_info(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {static_cast<double>(free), static_cast<double>(total)};
}

void gpu_synchronize(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  c10::cuda::device_synchronize();
}

double gpu_matmul_peak_flops(const std::string& dtype, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  at::NoGradGuard no_grad;
  const auto st = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const int64_t n = 8192;  // large enough to reach the tensor cores' rate on an H100
  const auto opts = at::TensorOptions().dtype(st).device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  // Random operands, as training's are varied: on constant ones the tensor cores draw less power
  // and run faster than on real data (an H200 gave 851-888 TFLOP/s in bf16 on ones, and 833-876
  // on a periodic pattern, against ~790 on random data), so the MFU reference came out too high.
  // Drawn from a generator of its own: the run's seeded generators are left as they were.
  auto gen = at::cuda::detail::createCUDAGenerator(static_cast<c10::DeviceIndex>(device));
  gen.set_current_seed(20261128);
  auto a = at::empty({n, n}, opts).normal_(0.0, 1.0, gen), b = at::empty({n, n}, opts).normal_(0.0, 1.0, gen);
  auto c = at::mm(a, b);  // warm-up: cuBLAS handle, kernel selection
  c10::cuda::device_synchronize();
  double best = 0.0, spent = 0.0;
  for (int rep = 0; rep < 5 || (spent < 0.3 && rep < 200); ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    c = at::mm(a, b);
    c10::cuda::device_synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spent += s;
    best = std::max(best, 2.0 * n * n * n / s);
  }
  return best;
}

}  // namespace ctitan
