// The standard Stateful components (checkpoint/state_dict.h): the model, the Adam(W) state,
// replicated integers (LR schedule, train state), the RNG and the data loader, each under
// torchtitan's keys with its reshard rule (checkpoint/checkpoint.h's opening comment).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/reader.h"
#include "checkpoint/state_dict.h"

namespace torch::optim {
class Optimizer;
}

namespace ctitan {

class HFCheckpoint;

// ---- the standard components --------------------------------------------------------------

// A parameter as this rank holds it: global rows [begin, end) in local[0 : end-begin]
// (FSDP: the fp32 shard, padded to ceil(rows / N) rows; one process: the full tensor).
struct ShardedParam {
  ShardedParam() = default;
  ShardedParam(std::string fqn_, at::Tensor local_, std::vector<int64_t> global_shape_, int64_t begin_, int64_t end_)
      : fqn(std::move(fqn_)),
        local(std::move(local_)),
        global_shape(std::move(global_shape_)),
        begin(begin_),
        end(end_) {}

  std::string fqn;
  at::Tensor local;
  std::vector<int64_t> global_shape;
  int64_t begin = 0, end = 0;
  // Tensor parallelism: a parameter split over the tp ranks on a dimension after the first is
  // saved and loaded as whole rows [begin, end): `whole_rows` gathers a local tensor's columns
  // (the parameter's, or its optimizer moments') over the tp group — a collective every tp rank
  // calls — and `own_columns` cuts this rank's share out of whole rows. Empty: `local` holds
  // whole rows.
  std::function<at::Tensor(const at::Tensor&)> whole_rows, own_columns;
  bool save_here = true;  // false: another rank (tp rank 0) stores the same rows
};

// Model parameters at top level, under their FQNs. Reshard rule: sharded. save_here is
// false on HSDP replicas other than the first (they hold the same rows).
class ModelState : public Stateful {
 public:
  ModelState(std::vector<ShardedParam> params, bool save_here) : params_(std::move(params)), save_here_(save_here) {}
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader& ckpt) const override;
  void load_state_dict(const CheckpointReader& ckpt) override;
  // Model entries are saved in this dtype ("" = as held); used by the final model-only save.
  void set_export_dtype(std::string d) { export_dtype_ = std::move(d); }
  // The same from a Hugging Face folder (checkpoint/hf.h): every parameter's HF tensors
  // exist with the right shapes; then each rank reads its rows (q/k rows un-permuted).
  void check_load_hf(const HFCheckpoint& hf) const;
  void load_hf(const HFCheckpoint& hf);
  // Rows of tok_embeddings.weight (the run's vocabulary), 0 when there is no such parameter.
  int64_t vocab_size() const;

 private:
  std::vector<ShardedParam> params_;
  bool save_here_;
  std::string export_dtype_;
};

// Adam / AdamW state of the parameters in `params` (the optimizer's own tensors):
// exp_avg and exp_avg_sq sharded like their parameter, step replicated. Hyper-parameters
// (lr, betas, eps, weight decay) come from the config, as the LR comes from the schedule.
class OptimizerState : public Stateful {
 public:
  OptimizerState(torch::optim::Optimizer& opt, std::vector<ShardedParam> params, bool save_here);
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader& ckpt) const override;
  void load_state_dict(const CheckpointReader& ckpt) override;

 private:
  torch::optim::Optimizer* opt_;
  std::vector<ShardedParam> params_;
  bool save_here_;
};

// Integers every rank holds the same value of (replicated): LRScheduler::last_step as
// "lr_scheduler.last_step", the train state's step and ntokens_seen.
class ScalarsState : public Stateful {
 public:
  ScalarsState(std::string prefix, std::vector<std::pair<std::string, int64_t*>> fields)
      : prefix_(std::move(prefix)), fields_(std::move(fields)) {}
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader& ckpt) const override;
  void load_state_dict(const CheckpointReader& ckpt) override;

 private:
  std::string prefix_;
  std::vector<std::pair<std::string, int64_t*>> fields_;
};

// The default CPU generator of this rank, "rng.rank_<r>". A rank the checkpoint has no
// state for (the job grew) seeds it from seed and rank, with a warning.
class RngState : public Stateful {
 public:
  RngState(int64_t rank, uint64_t seed) : rank_(rank), seed_(seed) {}
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader&) const override {}
  void load_state_dict(const CheckpointReader& ckpt) override;

 private:
  int64_t rank_;
  uint64_t seed_;
};

// The data loader of this dp rank: "dataloader.dp_rank_<r>" (the loader's own state
// string) and "dataloader.world_size". Same dp degree: each rank loads its own state.
// Another degree: rule "error" (default) refuses before anything is loaded, naming both
// degrees and the two choices; rule "redistribute" calls `redistribute` with every saved
// rank's state (index = saved dp rank) to build this rank's state.
class DataLoaderState : public Stateful {
 public:
  using Redistribute =
      std::function<std::string(const std::vector<std::string>& saved, int64_t dp_rank, int64_t dp_world)>;
  // save_here: false on the tp ranks other than 0, which read the same batches.
  DataLoaderState(std::function<std::string()> get, std::function<void(const std::string&)> set, int64_t dp_rank,
                  int64_t dp_world, std::string reshard, Redistribute redistribute, bool save_here = true)
      : get_(std::move(get)),
        set_(std::move(set)),
        dp_rank_(dp_rank),
        dp_world_(dp_world),
        reshard_(std::move(reshard)),
        redistribute_(std::move(redistribute)),
        save_here_(save_here) {}
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader& ckpt) const override;
  void load_state_dict(const CheckpointReader& ckpt) override;

 private:
  std::function<std::string()> get_;
  std::function<void(const std::string&)> set_;
  int64_t dp_rank_, dp_world_;
  std::string reshard_;
  Redistribute redistribute_;
  bool save_here_;
};

}  // namespace ctitan
