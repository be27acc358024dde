// NCCL process groups for FSDP's tensor collectives on GPUs (all-gather into one tensor,
// reduce-scatter of one tensor, in the parameters' or the reduce dtype), Gloo kept for the
// CPU-side control (stop agreement, checkpoint coordination). CUDA build only
// (parallelisms/nccl_cuda.cpp); train reaches it through Distributed::new_nccl_group (comm.h).
#pragma once
#ifdef CTITAN_WITH_CUDA
#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ctitan {

// The NCCL group of `size` ranks meeting through `store` (a PrefixStore of the job's TCPStore),
// collectives timing out after `timeout`. Throws RuntimeFailure with one line when NCCL cannot
// make it, e.g. "NCCL group: no GPU visible to this process (ProcessGroupNCCL needs one per
// rank)".
c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout);

}  // namespace ctitan
#endif
