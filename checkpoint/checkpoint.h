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
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Tensor.h>

#include "checkpoint/format.h"
#include "checkpoint/pickle.h"
#include "checkpoint/staging.h"

namespace torch::optim {
class Optimizer;
}

namespace ctitan {

struct JobConfig;
class HFCheckpoint;

// True for the model's own entries (top-level FQNs), false for optimizer., lr_scheduler.,
// train_state., dataloader. and rng. keys.
bool is_model_key(const std::string& key);

// The world-group collectives the manager needs; every rank calls them in the same order.
struct CheckpointComm {
  int64_t rank = 0, world_size = 1;
  // Every rank's string in rank order. Throws (CollectiveFailure) when a rank is gone.
  std::function<std::vector<std::string>(const std::string& mine, const std::string& tag)> all_gather;
  // Optional: announce that this rank reached `tag`; list the ranks that have not. Used to
  // name the rank responsible when a collective fails (it died or stalled).
  std::function<void(const std::string& tag)> arrive;
  std::function<std::vector<int64_t>(const std::string& tag)> missing;

  static CheckpointComm single_process();
};

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
  void per_rank_bytes(const std::string& key, std::string bytes);
  // A plain Python value (None, bool, int, float, str, tuple, list) rank 0 stores: written only
  // into DCP folders, for PyTorch's and torchtitan's readers.
  void python_object(const std::string& key, pickle::Ptr value);
  std::vector<StateEntry>& entries() { return entries_; }
  const std::vector<StateEntry>& entries() const { return entries_; }

 private:
  std::vector<StateEntry> entries_;
};

// A complete checkpoint opened for reading. Opening checks the structure (metadata parses,
// matches the COMPLETE marker, every data file exists with its recorded size); every chunk
// read is checked against its CRC-32.
//
// A folder with a .metadata file is read as a torch.distributed.checkpoint (DCP) folder
// (checkpoint/dcp.h): written by ctitan (checkpoint.format = "dcp", its COMPLETE marker
// checked) or by PyTorch / torchtitan (no marker: DCP writes .metadata last). Its keys are
// ctitan's (torchtitan flattens the same way); tensors must be sharded along dim 0 (FSDP),
// and are re-sliced like ctitan's own. torchtitan's Python ints (train_state.step,
// train_state.ntokens_seen, lr_scheduler.last_epoch = ctitan's lr_scheduler.last_step,
// dataloader.world_size) read as integer scalars; every item's archive is checked (zip
// structure, CRC-32 of its records) and unpickled with exactly the classes torch.save
// writes for it.
class CheckpointReader {
 public:
  // RuntimeFailure naming the folder and the problem.
  explicit CheckpointReader(std::string dir);
  const ckpt::Metadata& meta() const { return meta_; }
  const std::string& path() const { return dir_; }
  bool has(const std::string& key) const { return meta_.entries.count(key) > 0; }
  const ckpt::EntryMeta& entry(const std::string& key) const;  // UserError when absent
  // UserError unless `key` is a tensor of this global shape.
  void require_tensor(const std::string& key, const std::vector<int64_t>& shape) const;

  // Global rows [begin, end) of `key` into dest[0 : end-begin] (any saved sharding; dtype
  // converted), dest rows past that zeroed (FSDP padding). dest: [>= end-begin, ...].
  void read_rows(const std::string& key, int64_t begin, int64_t end, const at::Tensor& dest) const;
  at::Tensor read_tensor(const std::string& key) const;  // the whole tensor, saved dtype
  int64_t read_int(const std::string& key) const;        // a scalar integer entry
  std::string read_bytes(const std::string& key) const;
  uint64_t bytes_read() const { return bytes_read_; }  // chunk bytes read so far
  bool is_dcp() const { return dcp_; }
  // A DCP folder ctitan did not write (torchtitan's): its dataloader state is not ctitan's.
  bool is_foreign_dcp() const { return dcp_ && !dcp_by_ctitan_; }

 private:
  void open_dcp();
  std::string read_item(const ckpt::ChunkMeta& c) const;  // a DCP item's archive
  std::string item_where(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c) const;
  std::string read_chunk(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c) const;
  void read_chunk_into(const ckpt::EntryMeta& e, const ckpt::ChunkMeta& c, void* dst) const;  // CRC-checked
  std::string dir_;
  ckpt::Metadata meta_;
  mutable std::atomic<uint64_t> bytes_read_{0};
  bool dcp_ = false, dcp_by_ctitan_ = false;
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

// ---- the standard components --------------------------------------------------------------

// A parameter as this rank holds it: global rows [begin, end) in local[0 : end-begin]
// (FSDP: the fp32 shard, padded to ceil(rows / N) rows; one process: the full tensor).
struct ShardedParam {
  std::string fqn;
  at::Tensor local;
  std::vector<int64_t> global_shape;
  int64_t begin = 0, end = 0;
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
  DataLoaderState(std::function<std::string()> get, std::function<void(const std::string&)> set, int64_t dp_rank,
                  int64_t dp_world, std::string reshard, Redistribute redistribute)
      : get_(std::move(get)),
        set_(std::move(set)),
        dp_rank_(dp_rank),
        dp_world_(dp_world),
        reshard_(std::move(reshard)),
        redistribute_(std::move(redistribute)) {}
  void state_dict(StateDict& sd) override;
  void check_load(const CheckpointReader& ckpt) const override;
  void load_state_dict(const CheckpointReader& ckpt) override;

 private:
  std::function<std::string()> get_;
  std::function<void(const std::string&)> set_;
  int64_t dp_rank_, dp_world_;
  std::string reshard_;
  Redistribute redistribute_;
};

// ---- the manager ---------------------------------------------------------------------------

struct CheckpointOptions {
  bool enable = false;
  std::string folder;  // <job.dump_folder>/<checkpoint.folder>
  int64_t interval = 500;
  int64_t keep_latest_k = 10;
  int64_t load_step = -1;
  std::vector<std::string> exclude_from_loading;
  bool last_save_model_only = true;
  std::string export_dtype = "float32";
  std::string initial_load_path;  // initial_load_in_hf without it: model.hf_assets_path
  bool initial_load_model_only = true;
  bool initial_load_in_hf = false;  // initial_load_path is an HF safetensors folder
  bool last_save_in_hf = false;     // the final (model-only) save is an HF folder
  bool async = false;
  bool load_only = false;
  bool enable_first_step_checkpoint = false;
  bool dcp = false;  // checkpoint.format = "dcp": saves are torch.distributed.checkpoint folders
  // Written into the metadata; loading checks name and flavor.
  std::string model_name, model_flavor;
  int64_t dp_replicate = 1, dp_shard = 1;
};

// The component names a checkpoint knows, in load order (exclude_from_loading's choices).
const std::vector<std::string>& checkpoint_component_names();
// UserError for checkpoint settings that cannot work (unknown exclude_from_loading names,
// create_seed_checkpoint without enable, ...). Called with the rest of the config checks.
void check_checkpoint_config(const JobConfig& cfg);
CheckpointOptions checkpoint_options(const JobConfig& cfg);

// Whether load() is going to load model weights: checkpointing on, "model" not in
// exclude_from_loading, and a checkpoint to load (load_step, a complete step in folder, or
// initial_load_path). Known before the model exists (it reads the folder only), so a run
// that loads never draws random initial weights.
bool will_load_model(const CheckpointOptions& o);

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
  // checkpoint.format = "dcp": adds, to every full (not model-only) save, the entries
  // PyTorch's state-dict APIs and torchtitan expect beside ctitan's (optimizer.param_groups.*,
  // LambdaLR's lr_scheduler.*), so torchtitan's flattened load finds every key it asks for.
  void set_dcp_extras(std::function<void(StateDict&)> f) { dcp_extras_ = std::move(f); }

  const CheckpointOptions& options() const { return opt_; }

 private:
  struct Pending;  // a save whose files are being written
  // load(), step by step (checkpoint.cpp).
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
  void begin_save(const std::string& folder, int64_t step, bool model_only, bool async, bool hf = false);
  void complete_save();
  // Saving, step by step (checkpoint.cpp).
  struct SaveBegin {  // a rank's answer in round 1
    uint64_t need = 0, free = 0;
    std::string fs, prep;
  };
  std::vector<StateEntry> collect_entries(bool model_only, bool hf, uint64_t& bytes);
  void agree_to_begin(const std::string& folder, const std::string& stage, int64_t step, uint64_t bytes);
  std::string space_shortage(const std::string& folder, const std::vector<SaveBegin>& begins) const;
  void stage_entries(std::vector<StateEntry>& entries, bool async, Pending& p);
  void start_write(Pending& p, bool async);
  std::vector<std::string> agree_written(Pending& p);
  std::string commit_on_rank0(Pending& p, const std::vector<std::string>& all);
  std::string metadata_text(const Pending& p, const std::vector<std::string>& all) const;
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
  int64_t last_saved_step_ = -1;
};

}  // namespace ctitan
