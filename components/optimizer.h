// Optimizer construction (AdamW / Adam with torchtitan's hyper-parameter names) and
// the small operations the training loop needs on it.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

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

// Sums a float64 tensor over a group of ranks, in place, where the tensor is (training/world.h's
// sum_over: on a GPU over NCCL without the host waiting). Empty: nothing to add.
using SumOverRanks = std::function<void(torch::Tensor&)>;

// Global L2 norm of the gradients of `params`, then scales them so the norm is at most
// max_norm (max_norm <= 0: measure only). Returns the norm before clipping, a float64 0-d
// tensor where the gradients are: on a GPU the norm and the clipping stay on the device, and
// nothing is read back. With sharded parameters, all_reduce_sum adds the local sums of squares
// of every shard's rank (a float64 tensor of one element on the gradients' device) so the norm
// is the global one.
torch::Tensor clip_grad_norm_tensor(const std::vector<torch::Tensor>& params, double max_norm,
                                    const SumOverRanks& all_reduce_sum = nullptr);
// The norm of clip_grad_norm_tensor, for an optimizer step that follows at once. The gradients
// are left as they are and the clip goes to step_unless, which applies it inside the fused
// AdamW's own pass over them: one read and write of every gradient fewer than clipping them
// first. GPU gradients: grad_scale (a float32 0-d tensor on their device: (norm + 1e-6) /
// max_norm when that is above 1 and the norm finite, else 1; undefined on the CPU or when
// max_norm <= 0) is what they are divided by. CPU gradients: cpu_grad_coef (max_norm / (norm +
// 1e-6) when that is below 1 and the norm finite, else 1) is what they are multiplied by, the
// factor clip_grad_norm multiplies them by, so the update has its bits.
struct GradNorm {
  torch::Tensor norm, grad_scale;
  double cpu_grad_coef = 1.0;
};
// counted_elsewhere: parameters among params whose gradients are clipped here but whose
// squares another rank adds to the sum (tensor parallelism's replicated norms: tp rank 0's).
GradNorm grad_norm_for_step(const std::vector<torch::Tensor>& params, double max_norm,
                            const SumOverRanks& all_reduce_sum = nullptr,
                            const std::vector<torch::Tensor>& counted_elsewhere = {});
// The same, the norm read to the host.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const SumOverRanks& all_reduce_sum = nullptr);

// opt.step(), skipped when `skip` (a bool 0-d tensor on the parameters' device; undefined:
// never) is true, without reading `skip` back from a GPU for the fused AdamW (torch's fused
// kernel skips on the device). Other optimizers read it (one read_to_host). grad_scale and
// cpu_grad_coef (grad_norm_for_step's; undefined / 1: none): the gradients divided by the one,
// CPU gradients multiplied by the other, before the update (by the fused AdamW as it reads
// them, leaving the gradient tensors as they are; other optimizers' gradients are changed).
void step_unless(torch::optim::Optimizer& opt, const torch::Tensor& skip, const torch::Tensor& grad_scale = {},
                 double cpu_grad_coef = 1.0);
// `n` steps that step_unless skipped, learnt by the caller later: the fused AdamW's host step
// counts of GPU parameters go back down by n (on the CPU a skip is exact at once).
void note_skipped_steps(torch::optim::Optimizer& opt, int64_t n);
// training.cuda_graphs (training/step_graph.h): the fused AdamW's GPU steps read the learning
// rate from `lr`, a float64 0-d tensor on the parameters' GPU that the caller fills before each
// step, with ctitan's AdamW kernel (kernels/fused_cuda.h; ATen's fused AdamW takes a float32
// rate there). False, and nothing changed, for another optimizer.
bool read_lr_from_device(torch::optim::Optimizer& opt, const torch::Tensor& lr);
// A replay of a captured step ran the fused AdamW's device step counts on by one: the host
// counts (what checkpoints store) follow, as the step's own host code raises them.
void note_replayed_step(torch::optim::Optimizer& opt);

}  // namespace ctitan
