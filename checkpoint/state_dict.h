// The state dict: what a rank saves, flattened under torchtitan's keys, and the Stateful
// interface a component implements to take part in saves and loads (checkpoint/stateful.h has
// the standard components, checkpoint/checkpoint.h the manager).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/format.h"
#include "checkpoint/pickle.h"

namespace ctitan {

class CheckpointReader;

namespace ckpt {
// A tensor dtype's name in the metadata ("float32", "bfloat16", ...) and back; a TORCH_CHECK
// for any other dtype.
std::string dtype_name(at::ScalarType t);
at::ScalarType scalar_type_of(const std::string& name);
}  // namespace ckpt

// True for the model's own entries (top-level FQNs), false for optimizer., lr_scheduler.,
// train_state., dataloader. and rng. keys.
bool is_model_key(const std::string& key);

// One entry of a rank's flattened state dict.
struct StateEntry {
  std::string key;
  ckpt::Rule rule = ckpt::Rule::Replicated;
  bool is_bytes = false;
  at::Tensor tensor;  // Sharded: [c, ...] local buffer whose first end-begin rows are global
                      // rows [row_begin, row_end); Replicated/PerRank: the whole value
  std::vector<int64_t> global_shape;
  int64_t row_begin = 0, row_end = 0;
  std::string bytes;      // is_bytes
  pickle::Ptr object;     // is_bytes: a plain Python value instead (DCP saves only; see
                          // CheckpointManager::set_dcp_extras)
  bool save_here = true;  // false: another rank stores it (HSDP replicas; replicated: rank 0)
};

class StateDict {
 public:
  void sharded(const std::string& key, const at::Tensor& local, std::vector<int64_t> global_shape, int64_t row_begin,
               int64_t row_end, bool save_here = true);
  void replicated(const std::string& key, const at::Tensor& value);
  void replicated_int(const std::string& key, int64_t value);
  void per_rank_bytes(const std::string& key, std::string bytes, bool save_here = true);
  // A plain Python value (None, bool, int, float, str, tuple, list) rank 0 stores: written only
  // into DCP folders, for PyTorch's and torchtitan's readers.
  void python_object(const std::string& key, pickle::Ptr value);
  std::vector<StateEntry>& entries() { return entries_; }
  const std::vector<StateEntry>& entries() const { return entries_; }

 private:
  std::vector<StateEntry> entries_;
};

// A component with state: torchtitan's Stateful, plus the check that runs on every rank
// before anything at all is loaded.
class Stateful {
 public:
  virtual ~Stateful() = default;
  // Adds this rank's entries. Tensors may alias live state (the manager copies what it
  // needs before save() returns, or before training resumes with async saves).
  virtual void state_dict(StateDict& sd) = 0;
  // Throws UserError when this component cannot be restored from `ckpt` on this job
  // (missing keys, wrong shapes, a changed degree the rule refuses). Loads nothing.
  virtual void check_load(const CheckpointReader& ckpt) const = 0;
  virtual void load_state_dict(const CheckpointReader& ckpt) = 0;
};

}  // namespace ctitan
