// Which device a rank computes on, as torchtitan picks it: cuda:LOCAL_RANK when the LibTorch
// was built with CUDA (CTITAN_WITH_CUDA) and a GPU is visible, else the CPU. What is visible is
// CUDA's business (CUDA_VISIBLE_DEVICES): `CUDA_VISIBLE_DEVICES= ./train …` keeps a CUDA build
// on the CPU, which is how scripts/gpu_check.sh runs its CPU reference with the same binary.
//
// choose_device() is the decision alone, from plain facts, so that it is unit-tested on a
// machine without a GPU; visible_cuda_devices() asks the CUDA runtime (parallelisms/
// device_cuda.cpp, CUDA build only; 0 in the CPU build, which never links CUDA).
#pragma once
#include <cstdint>
#include <string>

namespace ctitan {

struct DeviceFacts {
  bool built_with_cuda = false;      // this binary links libtorch_cuda (CTITAN_WITH_CUDA)
  int64_t visible_gpus = 0;          // what the CUDA runtime counts (after CUDA_VISIBLE_DEVICES)
  int64_t local_rank = 0;            // LaunchEnv::local_rank (LOCAL_RANK)
  int64_t local_world_size = 1;      // LaunchEnv::local_world_size (LOCAL_WORLD_SIZE)
  std::string cuda_visible_devices;  // the variable's value, for messages ("" when unset)
  bool cuda_visible_devices_set = false;
};

struct DeviceChoice {
  bool cuda = false;
  int64_t index = -1;  // cuda:index when cuda, -1 for the CPU
  std::string why;     // the launch line's reason, e.g. "cuda:1 (LOCAL_RANK=1, 2 GPUs visible)"
  std::string name() const { return cuda ? "cuda:" + std::to_string(index) : "cpu"; }
};

// Throws UserError (exit 2) when GPUs are visible but fewer than the ranks on this node
// need: "device: LOCAL_RANK=2 but only 2 GPUs are visible (CUDA_VISIBLE_DEVICES=0,1); start
// at most 2 ranks per node (NPROC / --nproc-per-node) or make more GPUs visible".
DeviceChoice choose_device(const DeviceFacts& facts);

// The facts of this process: the build, the CUDA runtime's device count, LOCAL_RANK and
// LOCAL_WORLD_SIZE as given.
DeviceFacts device_facts(int64_t local_rank, int64_t local_world_size);

// The CUDA runtime's visible device count; 0 in the CPU build and on a machine without a GPU
// or a driver.
int64_t visible_cuda_devices();

// Makes the chosen GPU this process's current device (no-op for the CPU).
void use_device(const DeviceChoice& choice);
// CUDA's sync debug mode on this process (on: an operation that makes the host wait for the
// GPU throws, naming it); for the CTITAN_SYNC_CHECK test hook. A no-op in the CPU build.
void set_sync_errors(bool on);

// debug.deterministic, as torchtitan's set_determinism: ATen's deterministic algorithms (an op
// without one is an error), cuDNN deterministic and not benchmarking, and on a GPU cuBLAS's
// fixed workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the launcher set it; read when the
// first cuBLAS handle is made, so this runs before any matmul). Returns the line to log.
std::string use_deterministic_algorithms(const DeviceChoice& choice);

}  // namespace ctitan
