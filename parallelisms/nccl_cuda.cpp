// CUDA build only (CMakeLists.txt compiles *_cuda.cpp files into it alone).
#include "parallelisms/nccl.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "config/errors.h"

namespace ctitan {

c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  if (c10::cuda::device_count() == 0)
    throw RuntimeFailure("NCCL group: no GPU visible to this process (ProcessGroupNCCL needs one per rank)");
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  try {
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw RuntimeFailure("NCCL group of " + std::to_string(size) + " ranks (rank " + std::to_string(rank) +
                         "): " + what.substr(0, what.find('\n')));
  }
}

}  // namespace ctitan
