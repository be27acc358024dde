// The on-disk formats of a save, one writer each behind one interface. A save is three rounds
// (checkpoint/checkpoint.h): every rank writes its entries into the staging folder
// (write_rank), the ranks agree that all did, then rank 0 commits the folder (commit: the
// index and the COMPLETE marker) and the manager moves it to its step name. The manager does
// the agreeing, the staging, the publishing and the retention; a writer only lays out files.
//
// The formats, one file each: checkpoint/writer_ctitan.cpp (ctitan's own, format.h),
// writer_dcp.cpp (torch.distributed.checkpoint), writer_hf.cpp (the final model-only save as
// Hugging Face safetensors). A new format is one such file and one line in writers.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/state_dict.h"
#include "hf_types/hf_adapter.h"

namespace ctitan {

// What every rank knows of the save it is writing.
struct SaveInfo {
  std::string folder;     // checkpoint.folder (or a tool's), holding the step folders
  std::string stage;      // <folder>/step-<N>.partial: every rank's files go here
  std::string final_dir;  // <folder>/step-<N>: the stage's name once committed
  int64_t step = 0;
  bool model_only = false;
  int64_t world_size = 1, dp_replicate = 1, dp_shard = 1;
  std::string model_name, model_flavor;
  const HFAdapter* families = nullptr;  // the model families' HF adapter, when handed in
};

class CheckpointWriter {
 public:
  virtual ~CheckpointWriter() = default;
  // This rank's entries (each one it stores) into its files under info.stage, durably.
  // Returns this rank's fragment: what rank 0 needs of them to write the index.
  virtual std::string write_rank(const std::vector<StateEntry>& entries, const SaveInfo& info, int64_t rank) const = 0;
  // Rank 0, once every rank wrote: the index from every rank's fragment (rank order) and the
  // COMPLETE marker, written last, into info.stage. Throws on failure.
  virtual void commit(const SaveInfo& info, const std::vector<std::string>& fragments) const = 0;
  // Whether full saves carry the Python objects of StateDict::python_object (torchtitan's
  // extras, CheckpointManager::set_dcp_extras).
  virtual bool stores_python_objects() const { return false; }
  // What the files are, for the save's log line ("HF safetensors"), "" for a step folder.
  virtual std::string form() const { return ""; }
};

// The writer of `format` (checkpoint.format's value, or "hf"); TORCH_CHECK for another name.
const CheckpointWriter& checkpoint_writer(const std::string& format);

namespace ckpt {
// Test hook: CTITAN_CHECKPOINT_FAULT=<kind>:<rank>:<step> makes that rank fail halfway through
// writing `file`, its file of that step's checkpoint (util/env.h). Writers call it once, with
// half their entries written.
void maybe_fault_in_save(int64_t rank, int64_t step, const std::string& file);
}  // namespace ckpt

}  // namespace ctitan
