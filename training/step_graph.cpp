#include "training/step_graph.h"

#include <stdexcept>

namespace ctitan {

std::string cuda_graphs_refusal(const CudaGraphsJob& j) {
  const std::string head = "config error: training.cuda_graphs = true ";
  if (j.world_size > 1)
    return head + "runs one process on one GPU (the step's collectives are not captured); this job has " +
           std::to_string(j.world_size) + " ranks";
  if (j.optimizer != "AdamW")
    return head + "needs optimizer.name = \"AdamW\" (its update skips a non-finite step on the device); got \"" +
           j.optimizer + "\"";
  if (j.family_step_hooks)
    return head + "cannot capture model.name = \"" + j.family +
           "\": its step reads values on the host (Mixtral's routing copies each block's expert counts there)";
  if (j.preserve_rng_state)
    return head +
           "cannot capture activation_checkpoint.preserve_rng_state = true (the recompute sets the GPU's "
           "generator state on the host); set it to false";
  if (!j.gpu) return head + "needs a GPU; this run is on " + j.device;
  return "";
}

#ifndef CTITAN_WITH_CUDA
std::unique_ptr<StepGraph> make_step_graph(int /*device_index*/) {
  throw std::logic_error("training.cuda_graphs: this build has no CUDA");
}
#endif

}  // namespace ctitan
