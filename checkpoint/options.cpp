// checkpoint.* as CheckpointOptions, in one place; see options.h.
#include "checkpoint/options.h"

#include <algorithm>
#include <filesystem>

#include "checkpoint/format.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "util/strings.h"

namespace ctitan {

namespace fs = std::filesystem;

const std::vector<std::string>& checkpoint_component_names() {
  static const std::vector<std::string> names = {"model",      "optimizer",   "lr_scheduler",
                                                 "dataloader", "train_state", "rng"};
  return names;
}

namespace {

// The settings that cannot work together, each refused with one line.
void check_settings(const JobConfig& cfg) {
  const auto& c = cfg.checkpoint;
  const auto& names = checkpoint_component_names();
  for (const auto& x : c.exclude_from_loading)
    if (std::find(names.begin(), names.end(), x) == names.end())
      throw UserError("config error: checkpoint.exclude_from_loading names \"" + x +
                      "\", which is not one of: " + join(names, ", "));
  if (c.create_seed_checkpoint && !c.enable)
    throw UserError("config error: checkpoint.create_seed_checkpoint = true needs checkpoint.enable = true");
  if (c.initial_load_in_hf && !c.initial_load_model_only)
    throw UserError(
        "config error: checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_model_only = true");
  if (c.last_save_in_hf && !c.last_save_model_only)
    throw UserError(
        "config error: checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true "
        "(an HF folder holds the model only)");
}

}  // namespace

bool will_load_model(const CheckpointOptions& o) {
  if (!o.enable || o.create_seed_checkpoint) return false;  // a seed checkpoint saves the fresh model
  const auto& ex = o.exclude_from_loading;
  if (std::find(ex.begin(), ex.end(), "model") != ex.end()) return false;
  return o.load_step >= 0 || !ckpt::scan_folder(o.folder).complete.empty() || !o.initial_load_path.empty();
}

CheckpointOptions checkpoint_options(const JobConfig& cfg) {
  check_settings(cfg);
  const auto& c = cfg.checkpoint;
  CheckpointOptions o;
  o.enable = c.enable;
  o.folder = (fs::path(cfg.job.dump_folder) / c.folder).string();
  o.interval = c.interval;
  o.keep_latest_k = c.keep_latest_k;
  o.load_step = c.load_step;
  o.exclude_from_loading = c.exclude_from_loading;
  o.last_save_model_only = c.last_save_model_only;
  o.export_dtype = c.export_dtype;
  o.initial_load_path = c.initial_load_path;
  o.initial_load_model_only = c.initial_load_model_only;
  o.initial_load_in_hf = c.initial_load_in_hf;
  // torchtitan: HF weights come from model.hf_assets_path when initial_load_path is unset.
  if (c.initial_load_in_hf && o.initial_load_path.empty()) o.initial_load_path = cfg.model.hf_assets_path;
  o.last_save_in_hf = c.last_save_in_hf;
  o.async = c.async_mode != "disabled";
  o.load_only = c.load_only;
  o.enable_first_step_checkpoint = c.enable_first_step_checkpoint;
  o.create_seed_checkpoint = c.create_seed_checkpoint;
  o.format = c.format;
  o.dataloader_reshard = c.dataloader_reshard;
  o.model_name = cfg.model.name;
  o.model_flavor = cfg.model.flavor;
  return o;
}

}  // namespace ctitan
