// The CUDA build's StepGraph (training/step_graph.h) over ATen's CUDAGraph.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "training/step_graph.h"

namespace ctitan {
namespace {

class CudaStepGraph final : public StepGraph {
 public:
  explicit CudaStepGraph(int device) : device_(static_cast<c10::DeviceIndex>(device)) {}

  void capture(const std::function<void()>& body) override {
    const c10::cuda::CUDAGuard on_device(device_);
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    // A capture needs a stream other than the default one; the backward's autograd threads
    // queue on the stream its forward used, so they are captured too. Thread-local mode: the
    // batch reader's thread may allocate pinned memory meanwhile (a global capture would make
    // that an error in that thread).
    const c10::cuda::CUDAStreamGuard on_side(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_));
    graph_.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      body();
    } catch (...) {
      try {
        graph_.capture_end();  // leaves the stream out of capture mode; the run ends with body's error
      } catch (...) {
      }
      throw;
    }
    graph_.capture_end();
  }

  void replay() override {
    const c10::cuda::CUDAGuard on_device(device_);
    graph_.replay();
  }

 private:
  c10::DeviceIndex device_;
  at::cuda::CUDAGraph graph_;
};

}  // namespace

std::unique_ptr<StepGraph> make_step_graph(int device_index) { return std::make_unique<CudaStepGraph>(device_index); }

}  // namespace ctitan
