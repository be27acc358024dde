// Tensor parallelism with sequence parallelism and loss parallelism (torchtitan's apply_tp:
// Megatron's layer split plus sequence-sharded norms), applied from outside through the
// model's plan (models/tp_plan.h), over a tp group of Comm collectives (Gloo on the CPU,
// NCCL on GPUs).
//
// Each tp rank keeps its share of every split parameter as the parameter itself (set_data: the
// model, FSDP and the optimizer keep referring to the same tensors, now of the local shape),
// and the layers' hooks run the collectives, each an autograd function with its transpose in
// backward:
//   gather over the sequence   fwd all-gather dim 1          bwd reduce-scatter (sum) dim 1
//   scatter over the sequence  fwd reduce-scatter (sum) dim 1 bwd all-gather dim 1
//   gather over the vocabulary fwd all-gather last dim        bwd this rank's columns
// Between blocks a rank holds [B, T/tp, D]; the norms and the residual additions run there.
// With loss parallelism the logits stay [B, T, V/tp] and the cross-entropy combines the shares
// with three small collectives (row maxima, sums of exponentials, target logits): no rank ever
// holds [B, T, V].
//
// With FSDP the tp-local parameters are what FSDP shards over dp_shard (torchtitan's 2-D
// [dp_shard, tp] mesh), so a rank holds 1/(tp · dp_shard) of each split parameter.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include "models/tp_plan.h"
#include "models/unit_runner.h"
#include "parallelisms/comm.h"

namespace ctitan {

struct TPOptions {
  bool loss_parallel = true;  // parallelism.disable_loss_parallel = false
};

class TensorParallel {
 public:
  TensorParallel(std::shared_ptr<Comm> group, TPOptions options);

  int64_t degree() const { return group_->size(); }
  int64_t rank() const { return group_->rank(); }
  const TPOptions& options() const { return opt_; }
  const std::shared_ptr<Comm>& group() const { return group_; }

  // The dimension a style splits its parameters on (0 or 1), or -1: kept whole.
  static int64_t split_dim(TPStyle style);
  // This rank's share of a whole tensor under `style` (a view; the tensor itself when the style
  // keeps it whole): what shard_parameter keeps and what a checkpoint load cuts out of whole rows.
  at::Tensor share_of(TPStyle style, const at::Tensor& whole) const;
  // Cuts `t` to this rank's share under `style` in place (set_data). A parameter without
  // storage (built deferred, nothing to draw into it) becomes zeros of the local shape.
  void shard_parameter(TPStyle style, const at::Tensor& t) const;
  // Applies tensor parallelism to a model: every parameter of `units` (each must be in the
  // plan) cut to this rank's share, the plan's layer hooks filled with the collectives their
  // style needs, the Replicated parameters' names recorded. A unit whose parameters have no
  // storage (built deferred) is first given full-size storage and filled by init_unit(i), one
  // unit at a time in order, drawing what a one-process init draws; without init_unit its
  // shares start as zeros (a checkpoint fills them). Afterwards every parameter has values.
  void apply(const std::vector<ModelUnit>& units, const TPPlan& plan, const std::function<void(size_t)>& init_unit);
  // The whole parameter from every tp rank's share (a collective over the tp group), for tests
  // and exports; a Replicated one is returned as it is.
  at::Tensor full_parameter(TPStyle style, const at::Tensor& local) const;
  // The FQNs of the parameters every tp rank holds whole (norms).
  const std::set<std::string>& replicated() const { return replicated_; }
  // The style apply() cut a parameter by (Replicated for one it does not know).
  TPStyle style(const std::string& fqn) const;

  // Σ_rows (logsumexp(row) − row[label]) · scale over logits split by the vocabulary: logits
  // [N, V/tp] are this rank's columns [rank·V/tp, (rank+1)·V/tp), labels [N] global ids in
  // [0, V). Row statistics in float32, the sum in float64, returned float32 (fused_cross_entropy's
  // numbers); every tp rank returns the same value. Backward: softmax − one-hot of this rank's
  // columns, no collective.
  at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& labels, double scale) const;

  // In place: each tensor's gradient summed over the tp group (the Replicated parameters',
  // partial over the sequence), in one collective.
  void sum_gradients(const std::vector<at::Tensor>& params) const;

  // The autograd collectives (public for tests). x [B, T/tp, ...] → [B, T, ...] and back.
  at::Tensor gather_sequence(const at::Tensor& x) const;
  at::Tensor scatter_sequence(const at::Tensor& x) const;   // partial sums [B, T, ...] → [B, T/tp, ...]
  at::Tensor gather_vocabulary(const at::Tensor& x) const;  // [..., V/tp] → [..., V]

 private:
  void install(const TPPlan& plan, int64_t vocab_size);

  std::shared_ptr<Comm> group_;
  TPOptions opt_;
  std::set<std::string> replicated_;
  std::map<std::string, TPStyle> style_;
};

}  // namespace ctitan
