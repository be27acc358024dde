#include "parallelisms/device.h"

#include <ATen/Context.h>

#include <cstdlib>

#include "config/errors.h"

namespace ctitan {

DeviceChoice choose_device(const DeviceFacts& f) {
  DeviceChoice c;
  if (!f.built_with_cuda) {
    c.why = "this build has no CUDA";
    return c;
  }
  if (f.visible_gpus <= 0) {
    c.why = f.cuda_visible_devices_set && f.cuda_visible_devices.empty()
                ? "no GPU visible (CUDA_VISIBLE_DEVICES is empty)"
                : "no GPU visible";
    return c;
  }
  const std::string seen = std::to_string(f.visible_gpus) + (f.visible_gpus == 1 ? " GPU" : " GPUs") + " visible" +
                           (f.cuda_visible_devices_set ? " (CUDA_VISIBLE_DEVICES=" + f.cuda_visible_devices + ")" : "");
  if (f.local_rank < 0 || f.local_rank >= f.visible_gpus || f.local_world_size > f.visible_gpus) {
    throw UserError("device: LOCAL_RANK=" + std::to_string(f.local_rank) +
                    " of LOCAL_WORLD_SIZE=" + std::to_string(f.local_world_size) + " but only " + seen +
                    "; start at most " + std::to_string(f.visible_gpus) +
                    " ranks per node (NPROC / --nproc-per-node) or make more GPUs visible");
  }
  c.cuda = true;
  c.index = f.local_rank;
  c.why = "LOCAL_RANK=" + std::to_string(f.local_rank) + ", " + seen;
  return c;
}

DeviceFacts device_facts(int64_t local_rank, int64_t local_world_size) {
  DeviceFacts f;
#ifdef CTITAN_WITH_CUDA
  f.built_with_cuda = true;
#endif
  f.visible_gpus = visible_cuda_devices();
  f.local_rank = local_rank;
  f.local_world_size = local_world_size;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    f.cuda_visible_devices_set = true;
    f.cuda_visible_devices = v;
  }
  return f;
}

std::string use_deterministic_algorithms(const DeviceChoice& choice) {
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
  std::string line = "debug.deterministic: deterministic algorithms";
  if (choice.cuda) {
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    line += ", cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG=" + std::string(std::getenv("CUBLAS_WORKSPACE_CONFIG"));
  }
  return line;
}

#ifndef CTITAN_WITH_CUDA
int64_t visible_cuda_devices() { return 0; }
void use_device(const DeviceChoice&) {}
void set_sync_errors(bool) {}
#endif

}  // namespace ctitan
