// TrainModel: the one type through which code outside models/ holds a model.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "models/unit_runner.h"

namespace ctitan {

// The trainer's view of a model, whichever family: the calls FSDP, AC, the checkpoint and
// the loop make. The MoE-only members are empty for dense models.
struct TrainModel {
  std::shared_ptr<torch::nn::Module> module;                   // parameters, named_parameters
  std::function<torch::Tensor(const torch::Tensor&)> forward;  // tokens [B, T] -> logits [B, T, V]
  std::function<std::vector<ModelUnit>()> units;
  std::function<void(UnitWrapper)> set_unit_wrapper;
  std::function<void(size_t)> init_unit;  // unit i of units(), as the full init draws it
  int64_t n_layers = 0;
  int64_t total_params = 0, embedding_params = 0;
  double flops_per_token = 0;
  // MoE: the load-balancing loss joins the objective inside the blocks' backward; these
  // report it and keep the routing statistics (models/mixtral/model.h).
  std::function<void(double)> set_aux_loss_scale;               // 1 / micro-batches
  std::function<double()> load_balance_loss;                    // Σ layers, last forward, unscaled
  std::function<double()> aux_loss;                             // coeff · load_balance_loss()
  std::function<torch::Tensor()> tokens_per_expert;             // [L, E] since the last step
  std::function<void(const torch::Tensor&)> step_load_balance;  // after the optimizer step
  bool moe() const { return static_cast<bool>(step_load_balance); }

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
