// CUDA build only (CMakeLists.txt compiles *_cuda.cpp files into it alone).
#include <c10/cuda/CUDAFunctions.h>

#include "parallelisms/device.h"

namespace ctitan {

// c10's count is 0, not an error, without a driver or a device.
int64_t visible_cuda_devices() { return static_cast<int64_t>(c10::cuda::device_count()); }

void use_device(const DeviceChoice& choice) {
  if (choice.cuda) c10::cuda::set_device(static_cast<c10::DeviceIndex>(choice.index));
}

void set_sync_errors(bool on) {
  c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                    : c10::cuda::SyncDebugMode::L_DISABLED);
}

}  // namespace ctitan
