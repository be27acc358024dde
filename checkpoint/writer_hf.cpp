// The final model-only save as Hugging Face safetensors (checkpoint.last_save_in_hf), as
// torchtitan's HF storage writer with consolidation: every rank writes its shards in ctitan's
// format, then rank 0 assembles the full tensors into the safetensors file (checkpoint/hf.h),
// removes the shard files and the metadata, and marks the HF index complete instead.
#include <filesystem>

#include "checkpoint/format.h"
#include "checkpoint/hf.h"
#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "config/errors.h"

namespace ctitan {
namespace {

class HfWriter : public CheckpointWriter {
 public:
  std::string write_rank(const std::vector<StateEntry>& entries, const SaveInfo& info, int64_t rank) const override {
    return checkpoint_writer("ctitan").write_rank(entries, info, rank);
  }
  void commit(const SaveInfo& info, const std::vector<std::string>& fragments) const override {
    namespace fs = std::filesystem;
    TORCH_CHECK(info.families, "[checkpoint] an HF save needs the model families' HF adapter (set_hf_adapter)");
    checkpoint_writer("ctitan").commit(info, fragments);
    const std::string index = write_hf_from_checkpoint(CheckpointReader(info.stage), info.stage, "", *info.families);
    for (const auto& de : fs::directory_iterator(info.stage)) {
      const std::string n = de.path().filename().string();
      if (n.rfind("rank", 0) == 0 || n == "metadata") fs::remove(de.path());
    }
    ckpt::write_file_durable((fs::path(info.stage) / "COMPLETE").string(),
                             ckpt::hf_complete_marker_text(info.step, index));
  }
  std::string form() const override { return "HF safetensors"; }
};

}  // namespace

const CheckpointWriter& hf_writer() {
  static const HfWriter w;
  return w;
}

}  // namespace ctitan
