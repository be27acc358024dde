// Optimizer construction (AdamW / Adam with torchtitan's hyper-parameter names) and
// the small operations the training loop needs on it.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

namespace ctitan {

struct OptimizerSpec {
  std::string name = "AdamW";  // AdamW | Adam
  double lr = 8e-4;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled for AdamW, L2 for Adam (as torch.optim)
};

// params: the tensors this rank updates (with FSDP: its local shards only).
std::unique_ptr<torch::optim::Optimizer> build_optimizer(std::vector<torch::Tensor> params, const OptimizerSpec& spec);

void set_learning_rate(torch::optim::Optimizer& opt, double lr);

// Bytes this rank holds for training state: the optimizer's parameters (with FSDP the
// local shards), their gradients, and the optimizer state (Adam's two moments).
struct TrainingStateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};
TrainingStateBytes training_state_bytes(torch::optim::Optimizer& opt);

// Global L2 norm of the gradients of `params`, then scales them so the norm is at most
// max_norm (max_norm <= 0: measure only). Returns the norm before clipping. With sharded
// parameters, all_reduce_sum adds the local sums of squares of every shard's rank so the
// norm is the global one.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const std::function<double(double)>& all_reduce_sum = nullptr);

}  // namespace ctitan
