// TrainModel: the one type through which code outside models/ holds a model.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "models/tp_plan.h"
#include "models/unit_runner.h"

namespace ctitan {

// Sums a tensor over every rank in place (nothing on one rank); `tag` names the collective.
using WorldSumFn = std::function<void(torch::Tensor& t, const char* tag)>;
// The mean of a value over every rank (each rank calls it, in the same order).
using WorldMeanFn = std::function<double(double v, const char* tag)>;

// A family's own work in the training step, beside the cross-entropy the trainer computes.
// Every member may be empty (dense families have none; models/mixtral/spec.cpp fills them).
// The step's hooks work on tensors and read nothing back to the host; only `metrics`, which
// runs on log steps, may.
struct StepHooks {
  // Once before training: the micro-batches of a step (each one's terms are scaled by 1/n).
  std::function<void(int64_t micro_batches)> set_micro_batches;
  // After each micro-batch's backward: the term the family added to the objective in the last
  // forward beyond the cross-entropy, already scaled by 1/micro_batches and already
  // differentiated (its gradient flowed in backward); a float64 scalar the trainer adds to the
  // loss it reports.
  std::function<torch::Tensor()> extra_loss;
  // After the optimizer step (also when training.on_nonfinite skipped it), on every rank.
  std::function<void(const WorldSumFn& world_sum)> after_optimizer_step;
  // After validation: zero what the forwards counted since the last step, so validation's
  // forwards leave the next step as it would be without them.
  std::function<void()> reset_step_counters;
  // On log steps, after after_optimizer_step: (name, value) pairs for the metrics line.
  std::function<std::vector<std::pair<std::string, double>>(const WorldMeanFn& world_mean)> metrics;
};

// The trainer's view of a model, whichever family: the calls FSDP, AC, the checkpoint and
// the loop make.
struct TrainModel {
  std::shared_ptr<torch::nn::Module> module;                   // parameters, named_parameters
  std::function<torch::Tensor(const torch::Tensor&)> forward;  // tokens [B, T] -> logits [B, T, V]
  std::function<std::vector<ModelUnit>()> units;
  std::function<void(UnitWrapper)> set_unit_wrapper;
  std::function<void(size_t)> init_unit;  // unit i of units(), as the full init draws it
  // Tensor parallelism's plan (models/tp_plan.h); empty, or nullopt: the family has none.
  std::function<std::optional<TPPlan>()> tp_plan;
  // The training loss of the forward's logits [N, V'] against labels [N]: Σ token
  // cross-entropy · scale. Empty: kernels/fused_ops' fused_cross_entropy over the whole
  // vocabulary; tensor parallelism's loss parallelism sets its vocabulary-split one.
  std::function<torch::Tensor(const torch::Tensor& logits, const torch::Tensor& labels, double scale)> loss;
  int64_t n_layers = 0;
  int64_t total_params = 0, embedding_params = 0;
  double flops_per_token = 0;
  StepHooks step;  // the family's work in the step

  // FSDP installs its runner and AC its transform, each in its own slot (models/unit_runner.h):
  // applied in either order, the model runs FSDP(AC(unit)).
  UnitSlots unit_slots;
  void set_unit_runner(UnitWrapper runner) {
    unit_slots.runner = std::move(runner);
    set_unit_wrapper(unit_slots.wrapper());
  }
  void set_unit_transform(UnitTransform transform) {
    unit_slots.transform = std::move(transform);
    set_unit_wrapper(unit_slots.wrapper());
  }
};

// How build_model leaves the parameters.
enum class ModelInit {
  Full,      // allocated and initialised (every rank the full model from the same seed)
  Deferred,  // no storage: FSDP gives each unit storage and initialises it (init_unit) in turn
  None,      // allocated, not initialised: a checkpoint fills them
};

}  // namespace ctitan
