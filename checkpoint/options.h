// checkpoint.* (and the model's name and flavor, the dump folder) as the manager's options:
// translated in one place, checkpoint_options(), which every caller uses (train, the
// training layer, generate).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

struct JobConfig;

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
  bool create_seed_checkpoint = false;
  // checkpoint.format: the writer of every save but a final HF one (checkpoint/writer.h).
  std::string format = "ctitan";
  std::string dataloader_reshard = "error";  // DataLoaderState's rule for another dp degree
  // Written into the metadata; loading checks name and flavor.
  std::string model_name, model_flavor;
};

// The component names a checkpoint knows, in load order (exclude_from_loading's choices).
const std::vector<std::string>& checkpoint_component_names();
// The options of cfg's checkpointing: the one translation of checkpoint.* (folder under
// job.dump_folder, HF weights from model.hf_assets_path when initial_load_path is unset, ...).
// UserError for settings that cannot work together (unknown exclude_from_loading names,
// create_seed_checkpoint without enable, ...); train makes them once, with the config checks.
CheckpointOptions checkpoint_options(const JobConfig& cfg);

// Whether load() is going to load model weights: checkpointing on (not for a seed
// checkpoint), "model" not in
// exclude_from_loading, and a checkpoint to load (load_step, a complete step in folder, or
// initial_load_path). Known before the model exists (it reads the folder only), so a run
// that loads never draws random initial weights.
bool will_load_model(const CheckpointOptions& o);

}  // namespace ctitan
