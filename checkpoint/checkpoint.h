// Checkpointing: one Stateful interface, explicit reshard rules, a manager that saves as a
// collective every rank enters and loads onto any number of ranks.
//
// Keys are flattened as torchtitan's:
//   <fqn>                                  model parameter            sharded (dim 0)
//   optimizer.state.<fqn>.exp_avg|exp_avg_sq                          sharded (dim 0)
//   optimizer.state.<fqn>.step             Adam step count            replicated
//   lr_scheduler.last_step                 completed scheduler steps  replicated
//   train_state.step, train_state.ntokens_seen                        replicated
//   dataloader.world_size                  dp degree that saved       replicated
//   dataloader.dp_rank_<r>                 loader position of dp rank r   per rank
//   rng.rank_<r>                           CPU generator state of rank r  per rank
// Reshard rules (what a job of another size does with each):
//   sharded     re-sliced to the current shard degree, up or down, uneven (FSDP's
//               ceil(rows / N) rows per rank, padding rows zero and never stored);
//   replicated  every rank loads the one stored copy;
//   per rank    RNG: ranks beyond the saved world derive theirs from debug.seed and the rank
//               (warning). Dataloader: only when the dp degree is unchanged; otherwise an error
//               before anything is loaded, unless checkpoint.exclude_from_loading names
//               "dataloader" (fresh data order) or checkpoint.dataloader_reshard =
//               "redistribute" (DataLoaderState below).
// The on-disk format is in checkpoint/format.h.
//
// The manager here; the state dict (state_dict.h), the reader (reader.h), the standard
// components (stateful.h), the options (options.h) and the formats' writers (writer.h) beside it.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/format.h"
#include "checkpoint/options.h"
#include "checkpoint/reader.h"
#include "checkpoint/staging.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/stateful.h"
#include "hf_types/hf_adapter.h"

namespace ctitan {

class CheckpointWriter;

// The world-group collectives the manager needs; every rank calls them in the same order.
struct CheckpointComm {
  int64_t rank = 0, world_size = 1;
  int64_t dp_replicate = 1, dp_shard = 1;  // the world's data-parallel layout, recorded in the metadata
  // Every rank's string in rank order. Throws (CollectiveFailure) when a rank is gone.
  std::function<std::vector<std::string>(const std::string& mine, const std::string& tag)> all_gather;
  // Optional: announce that this rank reached `tag`; list the ranks that have not. Used to
  // name the rank responsible when a collective fails (it died or stalled).
  std::function<void(const std::string& tag)> arrive;
  std::function<std::vector<int64_t>(const std::string& tag)> missing;

  static CheckpointComm single_process();
};

// ---- the manager ---------------------------------------------------------------------------

struct LoadResult {
  bool loaded = false;
  int64_t step = 0;
  std::string path;
  bool model_only = false;
  std::vector<std::string> components;  // what was loaded
};

class CheckpointManager {
 public:
  CheckpointManager(CheckpointOptions options, CheckpointComm comm);
  ~CheckpointManager();  // joins a background write (it is not committed)

  // name: one of checkpoint_component_names(); the object must outlive the manager.
  void add(const std::string& name, Stateful* s);
  ModelState* model_state() const;

  // Resumes when checkpoint.enable and a checkpoint exists: the latest complete one under
  // folder (or load_step), else initial_load_path. Collective. Throws UserError (config /
  // incompatible checkpoint) or RuntimeFailure (corrupt files) on every rank alike.
  LoadResult load();

  bool should_save(int64_t step, bool last_step) const;
  // Saves when should_save(): a collective that every rank enters. When any rank fails,
  // every rank throws naming it; the previous checkpoints are untouched.
  void save(int64_t step, bool last_step);
  // Saves the full training state of `step` now, whatever the interval (a stop request),
  // unless that step is already saved; waits for the write. Collective. No-op when
  // checkpointing is off. Returns whether step `step` is now saved.
  bool save_now(int64_t step);
  // Writes a checkpoint of `components` at `step` into `folder` now (seed checkpoints,
  // tools, the CTITAN_CHECKPOINT_DUMP_LOADED test hook). Synchronous, collective.
  void save_to(const std::string& folder, int64_t step, bool model_only);
  // Waits for a background save and commits it (collective). Call before exiting.
  void finalize();
  // A format that stores Python objects (checkpoint.format = "dcp"): adds, to every full
  // (not model-only) save, the entries
  // PyTorch's state-dict APIs and torchtitan expect beside ctitan's (optimizer.param_groups.*,
  // LambdaLR's lr_scheduler.*), so torchtitan's flattened load finds every key it asks for.
  void set_dcp_extras(std::function<void(StateDict&)> f) { dcp_extras_ = std::move(f); }

  // The model families' HF adapter (models/hf_adapter.h, handed in by the caller): needed to
  // load an HF folder (initial_load_in_hf) and to write the final save as one (last_save_in_hf).
  void set_hf_adapter(HFAdapter families) { families_ = std::move(families); }

  const CheckpointOptions& options() const { return opt_; }

 private:
  struct Pending;  // a save whose files are being written
  // load(), step by step (checkpoint_load.cpp).
  struct LoadChoice;
  struct LoadAttempt;
  LoadChoice choose_checkpoint(const ckpt::FolderScan& scan) const;
  void agree_on_choice(const LoadChoice& c);
  void agreed(const std::string& tag, const std::function<void()>& fn);
  void load_with_fallback(LoadChoice& c, LoadAttempt& a);
  void load_from(const LoadChoice& c, LoadAttempt& a);
  void check_checkpoint(const LoadChoice& c, LoadAttempt& a) const;
  LoadResult finish_load(const LoadAttempt& a, const std::string& path);
  LoadResult load_hf(const std::string& path);
  void begin_save(const std::string& folder, int64_t step, bool model_only, bool async, const CheckpointWriter& writer);
  void complete_save();
  // Saving, step by step (checkpoint.cpp).
  struct SaveBegin {  // a rank's answer in round 1
    uint64_t need = 0, free = 0;
    std::string fs, prep;
  };
  std::vector<StateEntry> collect_entries(bool model_only, const CheckpointWriter& writer, uint64_t& bytes);
  void agree_to_begin(const std::string& folder, const std::string& stage, int64_t step, uint64_t bytes);
  std::string space_shortage(const std::string& folder, const std::vector<SaveBegin>& begins) const;
  void stage_entries(std::vector<StateEntry>& entries, bool async, Pending& p);
  void start_write(Pending& p, bool async);
  std::vector<std::string> agree_written(Pending& p);
  std::string commit_on_rank0(Pending& p, const std::vector<std::string>& all);
  void purge(const std::string& folder);
  std::vector<std::string> agree(const std::string& status, const std::string& tag);

  CheckpointOptions opt_;
  CheckpointComm comm_;
  std::vector<std::pair<std::string, Stateful*>> components_;
  std::unique_ptr<Pending> pending_;
  std::vector<at::Tensor> staging_;  // async: this rank's copy of the state, reused save to save
  // Tensors on a GPU: copied into one pinned host buffer (checkpoint/staging.h), kept from
  // save to save; pinned_ says where each goes and when the buffer may be reused.
  void stage_gpu_tensors(std::vector<StateEntry>& entries, const std::vector<size_t>& on_gpu);
  ckpt::StagingBuffer pinned_;
  at::Tensor pinned_buffer_;
  std::function<void(StateDict&)> dcp_extras_;
  std::optional<HFAdapter> families_;
  const HFAdapter& families() const;  // families_, or an internal error when none was handed in
  int64_t last_saved_step_ = -1;
};

}  // namespace ctitan
