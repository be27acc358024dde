// training.cuda_graphs: the training step captured once as a CUDA graph and replayed from then
// on, so that the host's launch work (some 1,200 kernels a step on the 150M model) no longer
// sits between the GPU's kernels. For one process on one GPU, with the fused AdamW:
//   - the first two steps of a run train eagerly (lazy set-up: the optimizer's state, cuBLAS's
//     and cuDNN's plans, the allocator's blocks);
//   - the third (the next one if that one is profiled) copies its batches into buffers the graph
//     reads, and captures the step's work on a side stream: zeroing the gradients, every
//     micro-batch's forward and backward, the norm and the clip factor, the fused AdamW, the
//     non-finite flag, all on the device (the step reads nothing back: the rule that
//     scripts/gpu_check.sh part (f) checks). Capturing runs nothing, so that step then replays;
//   - later steps copy their batches into those buffers, write the step's learning rate into the
//     float64 the AdamW kernel reads (components/optimizer.h, read_lr_from_device), replay, and
//     raise the optimizer's host step counts as the step's host code would have.
// What the host does between steps (logging, checkpoints, validation, the stop agreement) runs
// eagerly as before. cuda_graphs_refusal names what the capture cannot take (several ranks,
// the Adam optimizer, a family with per-step host work, the RNG replay of recomputation).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace ctitan {

class StepGraph {
 public:
  virtual ~StepGraph() = default;
  // Records the GPU work that body queues (on a side stream) without running it; body's host
  // code runs once. The device is synchronised and the allocator's cached blocks released first,
  // so that the graph's memory pool does not sit beside the eager steps' cache.
  virtual void capture(const std::function<void()>& body) = 0;
  // Queues the captured work on the device's current stream; the host code of body does not run.
  virtual void replay() = 0;
};

// A graph on the GPU `device_index`: the CUDA build's; elsewhere an error.
std::unique_ptr<StepGraph> make_step_graph(int device_index);

// The eager steps before the capture.
constexpr int64_t kEagerStepsBeforeCapture = 2;

// What decides whether training.cuda_graphs can run a job.
struct CudaGraphsJob {
  bool gpu = false;                 // the run's device is a GPU
  std::string device;               // its name for the message ("cpu (no GPU visible)")
  int64_t world_size = 1;           // ranks
  std::string optimizer;            // optimizer.name
  std::string family;               // model.name
  bool family_step_hooks = false;   // the family adds host work to each step (Mixtral's routing)
  bool preserve_rng_state = false;  // activation_checkpoint.preserve_rng_state
};
// "" when it can; else the one-line config error, naming the key that rules it out.
std::string cuda_graphs_refusal(const CudaGraphsJob& j);

}  // namespace ctitan
