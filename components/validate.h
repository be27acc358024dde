// Validation, torchtitan's [validation]: after step 1 and every validation.freq steps, a
// forward-only pass of the training model (same FSDP setup, no-grad) over a held-out dataset.
//
//   loss = Σ_ranks Σ_batches Σ_tokens CE / (number of those tokens)
//
// i.e. the mean token cross-entropy over every validation token of every rank (each window is
// full: packing never pads, so this is also the mean of the per-batch means).
// The dataset is packed as the training data is (datasets/dataloader.h), split over the dp
// ranks, and read from its start at every validation: every run sees the same tokens, and
// nothing of it goes into a checkpoint.
//   validation.steps = N : N batches per rank (the data repeats when it holds fewer).
//   validation.steps = -1: until the set is exhausted — until the first rank has no whole
//                          batch left; the ranks agree on that before each batch (a one-number
//                          all-reduce), so no rank waits in a collective another never joins
//                          (torchtitan warns that -1 may hang for this reason).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "components/metrics.h"
#include "datasets/tokenizer.h"

namespace ctitan {

struct ValidationSpec {
  std::string source;  // resolved .txt/.jsonl file or folder
  int64_t local_batch_size = 8;
  int64_t seq_len = 2048;
  int64_t freq = 10;
  int64_t steps = -1;  // -1: until exhausted
};

class Validator {
 public:
  // tokens [B, T] → logits [B, T, V], in evaluation mode (the caller's model.eval()).
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;
  // In place: each element becomes its sum over the data-parallel ranks.
  using SumOverRanks = std::function<void(std::vector<double>&)>;
  // Σ token cross-entropy · scale of logits [N, V'] against labels [N] (TrainModel::loss);
  // empty: fused_cross_entropy over the whole vocabulary.
  using Loss = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, double)>;

  // The tokenizer must outlive the validator. UserError when this rank's share of the data
  // holds no whole batch of local_batch_size × (seq_len + 1) tokens (checked here, before
  // training starts, not at the first validation).
  Validator(const Tokenizer& tokenizer, ValidationSpec spec, int64_t dp_rank, int64_t dp_world);

  // torchtitan's rule: after step 1 and every freq-th step.
  bool should_validate(int64_t step) const { return step == 1 || step % spec_.freq == 0; }

  // One validation run under no-grad; the same result on every rank.
  ValidationMetrics validate(int64_t step, const Forward& forward, const SumOverRanks& sum_over_ranks,
                             const Loss& loss = {}) const;

  const ValidationSpec& spec() const { return spec_; }

 private:
  const Tokenizer* tokenizer_;
  ValidationSpec spec_;
  int64_t dp_rank_, dp_world_;
};

}  // namespace ctitan
