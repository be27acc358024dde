// Activation checkpointing (AC), as torchtitan's apply_ac, for LibTorch (which has no
// torch.utils.checkpoint).
//
// A checkpointed unit runs through a custom autograd function:
//   forward : the unit under no-grad; only its input is kept (plus, when asked, the CPU
//             RNG state, the metadata of every tensor it produced, the decisions the model
//             made through models/recompute.h and, for op-level SAC, some matmul outputs).
//   backward: the unit runs again with autograd on a detached copy of the input (RNG
//             replayed, decisions reused, kept matmul outputs reused), its metadata is
//             checked against the forward's, and torch::autograd::backward on the
//             recomputed output with the incoming gradient accumulates the parameter
//             gradients into .grad ("reentrant" style; FSDP's gradient-accumulator hooks
//             fire once per unit as without AC); the input's gradient is returned.
//
// Which units (torchtitan's names and semantics):
//   mode = "none"                             nothing
//   mode = "full"                             every block "layers.<i>"
//   mode = "selective", option "N"            every N-th block: layers.<i> with (i+1) % N == 0,
//                                             i.e. torchtitan's 1-based count % N == 0
//   mode = "selective", option "op"           every block, with op-level SAC: the outputs of
//                                             the 1st, 3rd, 5th, … matmul of a block are kept
//                                             and reused (torchtitan saves every mm output
//                                             but every second one), except matmuls with the
//                                             weights of per_op_sac_force_recompute_mm_shapes
//                                             _by_fqns (the MoE router gate), always recomputed.
// tok_embeddings and output are never checkpointed (as torchtitan).
//
// determinism_check = "default": an at::RecordFunction observer (thread-local, installed
// only while a checkpointed unit runs) records shape, dtype and device of every tensor an
// ATen op returns inside the unit, in order, in the forward and in the recompute (a matmul
// site or a decision of models/recompute.h counts as one tensor, since a recompute may
// skip its inner ops). The first difference throws ctitan::RuntimeFailure, e.g.
//   "layers.3: recomputed tensor 18 has shape [1,50,32,128] but the forward saved [1,25,32,128]"
// (positions from 0; dtype and device differences read "has dtype BFloat16 but the forward
// saved Float"). This checks every produced tensor, a superset of the tensors autograd saves.
//
// preserve_rng_state: the CPU default generator's state before the forward (and, for a unit
// whose input is on a GPU, that GPU's default generator's) is put back for the recompute, and
// the state backward found is restored after it (dropout masks repeat, the outer random
// stream is as without AC). The GPU half is compiled in the CUDA build and not yet run on a GPU.
//
// With FSDP the model's wrapper is FSDP(AC(block)): AC's transform() and FSDP's wrapper() go
// into their own slots (models/unit_runner.h: UnitSlots, TrainModel::set_unit_transform and
// set_unit_runner), so either order of applying them builds this nesting. FSDP's
// pre-backward hook on the unit's output has re-gathered the parameters before the AC
// backward recomputes, so a recompute costs no extra all-gather, and the recompute's
// parameter gradients complete the unit's gradients once: one reduce-scatter per unit.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "models/unit_runner.h"

namespace ctitan {

struct ACOptions {
  ACMode mode = ACMode::None;                 // none | full | selective
  std::string selective_ac_option = "2";      // a positive integer N, or "op"
  bool preserve_rng_state = true;             // replay the CPU RNG in the recompute
  std::string determinism_check = "default";  // default: compare metadata; none
  // Op-level SAC: Linear modules (substring of the module's fully qualified name) whose
  // matmuls are always recomputed (torchtitan: per_op_sac_force_recompute_mm_shapes_by_fqns).
  std::vector<std::string> force_recompute_mm_fqns;
};

// The options of the [activation_checkpoint] table.
ACOptions ac_options(const config::ActivationCheckpoint& cfg);

struct ACStats {
  int64_t checkpointed_forwards = 0;  // unit forwards run under AC
  int64_t recomputes = 0;             // unit recomputes in backward
  int64_t kept_matmuls = 0;           // op SAC: matmul outputs kept by forwards
  int64_t reused_matmuls = 0;         // op SAC: ... and reused by recomputes
  int64_t kept_bytes = 0;             // bytes of the inputs + matmul outputs kept by forwards
};

class ActivationCheckpoint {
 public:
  // units: the model's units (for the op-SAC force-recompute weight shapes). Throws
  // UserError for a mode or option it does not know.
  ActivationCheckpoint(ACOptions options, const std::vector<ModelUnit>& units);
  ~ActivationCheckpoint();

  // Whether `unit` is checkpointed ("layers.<i>" only, per the mode).
  bool applies_to(const std::string& unit) const;
  // fn itself when the unit is not checkpointed; else a function that, with grad enabled,
  // runs fn under checkpointing (without grad: just fn).
  UnitFn wrap(const std::string& unit, UnitFn fn);
  UnitTransform transform() {
    return [this](const std::string& u, const UnitFn& fn) { return wrap(u, fn); };
  }
  const ACOptions& options() const { return opt_; }
  // How many blocks of `units` are checkpointed.
  int64_t checkpointed_units(const std::vector<ModelUnit>& units) const;

  ACStats& stats() { return *stats_; }

  struct Policy;  // internal: shared with the autograd function

 private:
  ACOptions opt_;
  int64_t every_n_ = 0;  // selective N; 1 for full; 0 for none
  bool op_sac_ = false;
  std::shared_ptr<Policy> policy_;
  std::shared_ptr<ACStats> stats_;
};

// The model's wrapper for FSDP(AC(unit)): `outer` (FSDP's wrapper, or empty for plain
// calls) runs the unit function that `inner` (AC's transform, or empty) made of it; the same
// as UnitSlots{outer, inner}.wrapper() except that it is never empty.
UnitWrapper compose(UnitWrapper outer, UnitTransform inner);

}  // namespace ctitan
