// The checkpoint manager's load side: find the step, agree on it, check it against this job,
// read and apply it, fall back to an older one; Hugging Face folders. See checkpoint.h.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <regex>

#include <spdlog/spdlog.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "config/errors.h"
#include "util/env.h"
#include "util/strings.h"

namespace ctitan {

using ckpt::Metadata;
using ckpt::one_line;
namespace fs = std::filesystem;

namespace {

// Rank 0: what the folder holds that is not a complete checkpoint (an unfinished save's
// staging folder is removed).
void report_unfinished(const ckpt::FolderScan& scan) {
  for (const auto& [dir, why] : scan.incomplete) spdlog::warn("checkpoint: ignoring {}: {}", dir, why);
  for (const auto& dir : scan.staging) {
    spdlog::warn("checkpoint: removing {} (a save that did not finish)", dir);
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
}

// "; or set checkpoint.load_step = <s>" for the newest complete checkpoint before `step`.
std::string earlier_hint(const std::string& folder, const std::vector<int64_t>& complete, int64_t step) {
  for (auto it = complete.rbegin(); it != complete.rend(); ++it)
    if (*it < step && !ckpt::is_hf_step(ckpt::step_dir(folder, *it)))
      return "; or set checkpoint.load_step = " + std::to_string(*it) + " to resume the earlier checkpoint";
  return std::string();
}

// A folder of HF safetensors (checkpoint.last_save_in_hf) cannot resume training.
void check_not_hf_weights(const std::string& path, const std::string& folder, const std::vector<int64_t>& complete) {
  std::error_code ec;
  if (!ckpt::is_hf_step(path) && !(is_hf_folder(path) && !fs::exists(fs::path(path) / "metadata", ec))) return;
  std::smatch sm;
  const std::string name = fs::path(path).filename().string();
  static const std::regex step_re("step-([0-9]+)");
  const int64_t step = std::regex_match(name, sm, step_re) ? std::stoll(sm[1]) : -1;
  throw UserError("checkpoint " + path +
                  " holds model weights only, as HF safetensors (checkpoint.last_save_in_hf), "
                  "not the optimizer, schedule and data state needed to resume training; to start a new run from "
                  "these weights, set checkpoint.initial_load_path = \"" +
                  path + "\" and checkpoint.initial_load_in_hf = true with another checkpoint.folder" +
                  (step >= 0 ? earlier_hint(folder, complete, step) : ""));
}

}  // namespace

// The checkpoint load() chose: where, how, and the older ones to fall back to.
struct CheckpointManager::LoadChoice {
  std::string path;  // empty: nothing to load
  bool model_only_requested = false;
  bool from_hf = false;
  std::string error;               // load_step names no complete checkpoint
  std::vector<std::string> older;  // complete checkpoints older than path, newest first
  std::vector<int64_t> complete;   // the folder's complete steps, ascending
};

// One try at loading a checkpoint: its reader and the components it loads.
struct CheckpointManager::LoadAttempt {
  std::unique_ptr<CheckpointReader> reader;
  std::vector<std::pair<std::string, Stateful*>> todo;
  bool model_only = false;
  std::chrono::steady_clock::time_point t0;
};

LoadResult CheckpointManager::load() {
  if (!opt_.enable) return LoadResult();
  const auto scan = ckpt::scan_folder(opt_.folder);
  if (comm_.rank == 0) report_unfinished(scan);
  LoadChoice choice = choose_checkpoint(scan);
  agree_on_choice(choice);
  if (choice.path.empty()) {
    if (comm_.rank == 0) spdlog::info("checkpoint: no checkpoint in {}: training starts from scratch", opt_.folder);
    return LoadResult();
  }
  if (choice.from_hf) return load_hf(choice.path);
  LoadAttempt a;
  load_with_fallback(choice, a);
  return finish_load(a, choice.path);
}

// Finds the step: load_step, else the newest complete checkpoint of the folder, else
// initial_load_path. The newest complete checkpoint, chosen automatically, may still be
// damaged: `older` lists the ones to fall back to.
CheckpointManager::LoadChoice CheckpointManager::choose_checkpoint(const ckpt::FolderScan& scan) const {
  LoadChoice c;
  c.complete = scan.complete;
  if (opt_.load_step >= 0) {
    c.path = ckpt::step_dir(opt_.folder, opt_.load_step);
    std::error_code ec;
    const std::string why =
        fs::is_directory(c.path, ec) ? ckpt::incomplete_reason(c.path, opt_.load_step) : "it does not exist";
    if (!why.empty()) {
      std::vector<std::string> have;
      for (int64_t s : scan.complete) have.push_back("step-" + std::to_string(s));
      c.error = "checkpoint.load_step = " + std::to_string(opt_.load_step) + ": " + c.path +
                " is not a complete checkpoint (" + why + "); complete checkpoints in " + opt_.folder + ": " +
                (have.empty() ? "none" : join(have, ", "));
    }
  } else if (!scan.complete.empty()) {
    c.path = ckpt::step_dir(opt_.folder, scan.complete.back());
    if (!opt_.initial_load_path.empty() && comm_.rank == 0)
      spdlog::warn("checkpoint: {} holds checkpoints, so checkpoint.initial_load_path = {} is not used", opt_.folder,
                   opt_.initial_load_path);
    for (auto it = scan.complete.rbegin() + 1; it != scan.complete.rend(); ++it)
      if (!ckpt::is_hf_step(ckpt::step_dir(opt_.folder, *it))) c.older.push_back(ckpt::step_dir(opt_.folder, *it));
  } else if (!opt_.initial_load_path.empty()) {
    c.path = opt_.initial_load_path;
    c.model_only_requested = opt_.initial_load_model_only;
    c.from_hf = opt_.initial_load_in_hf;
  }
  return c;
}

// Every rank must have chosen the same checkpoint (a folder not shared by all ranks would
// otherwise load different states). Collective; then a bad load_step is the user's error.
void CheckpointManager::agree_on_choice(const LoadChoice& c) {
  auto chosen = agree(c.path + "\n" + c.error, "checkpoint_load:choose");
  for (int64_t r = 1; r < comm_.world_size; ++r)
    if (chosen[r] != chosen[0])
      throw RuntimeFailure("checkpoint: ranks chose different checkpoints (rank 0: \"" + one_line(chosen[0]) +
                           "\", rank " + std::to_string(r) + ": \"" + one_line(chosen[r]) +
                           "\"); is checkpoint.folder on a file system every rank shares?");
  if (!c.error.empty()) throw UserError(c.error);
}

// Runs fn on every rank, then agrees: when any rank failed, every rank throws (its own
// error, or the first failing rank's), so none is left waiting in a later collective.
void CheckpointManager::agreed(const std::string& tag, const std::function<void()>& fn) {
  std::string status = "ok";
  std::exception_ptr mine;
  try {
    fn();
  } catch (const CollectiveFailure&) {
    throw;
  } catch (const UserError& e) {
    status = "user " + one_line(e.what());
    mine = std::current_exception();
  } catch (const std::exception& e) {
    status = "fail " + one_line(e.what());
    mine = std::current_exception();
  }
  auto all = agree(status, tag);
  if (mine) std::rethrow_exception(mine);
  for (int64_t r = 0; r < comm_.world_size; ++r) {
    if (all[r] == "ok") continue;
    const std::string msg = "checkpoint load failed on rank " + std::to_string(r) + ": " + all[r].substr(5);
    if (all[r].rfind("user ", 0) == 0) throw UserError(msg);
    throw RuntimeFailure(msg);
  }
}

// A checkpoint that fails to load for another reason than the user's input (a flipped byte,
// a truncated file, an unreadable disk) makes every rank (the failure is agreed) warn and
// fall back to the next older complete checkpoint, so a re-run resumes from the newest one
// that loads. A checkpoint named by load_step or initial_load_path has no older ones: it fails.
void CheckpointManager::load_with_fallback(LoadChoice& c, LoadAttempt& a) {
  for (size_t next_older = 0;; ++next_older) {
    try {
      load_from(c, a);
      return;
    } catch (const CollectiveFailure&) {
      throw;
    } catch (const UserError&) {
      throw;
    } catch (const std::exception& e) {
      if (next_older >= c.older.size()) throw;
      if (comm_.rank == 0)
        spdlog::warn("checkpoint: {} cannot be loaded ({}); falling back to {}", c.path, one_line(e.what()),
                     c.older[next_older]);
      c.path = c.older[next_older];
    }
  }
}

// Reads c.path and checks it against this job on every rank, then applies it (both agreed).
void CheckpointManager::load_from(const LoadChoice& c, LoadAttempt& a) {
  a.reader.reset();
  a.todo.clear();
  agreed("checkpoint_load:check", [&] {
    check_not_hf_weights(c.path, opt_.folder, c.complete);
    a.reader = std::make_unique<CheckpointReader>(c.path);
    check_checkpoint(c, a);
    for (const auto& [name, s] : a.todo) s->check_load(*a.reader);
  });
  a.t0 = std::chrono::steady_clock::now();
  agreed("checkpoint_load:load", [&] {
    for (const auto& [name, s] : a.todo) s->load_state_dict(*a.reader);
  });
}

// Decides what to load from the opened checkpoint: the model's name and flavor must be this
// run's; a model-only checkpoint resumes nothing else; exclude_from_loading is left out.
void CheckpointManager::check_checkpoint(const LoadChoice& c, LoadAttempt& a) const {
  const std::string& path = c.path;
  const Metadata& m = a.reader->meta();
  if (!a.reader->is_dcp() && (m.model_name != opt_.model_name || m.model_flavor != opt_.model_flavor))
    throw UserError("checkpoint " + path + " holds a " + m.model_name + " \"" + m.model_flavor +
                    "\" model; this run builds " + opt_.model_name + " \"" + opt_.model_flavor +
                    "\" (model.name / model.flavor must match)");
  if (m.model_only && !c.model_only_requested && m.step != 0) {
    const std::string hint = earlier_hint(opt_.folder, c.complete, m.step);
    throw UserError("checkpoint " + path +
                    " holds model weights only (checkpoint.last_save_model_only), not the "
                    "optimizer, schedule and data state needed to resume training; to start a new run from these "
                    "weights, set checkpoint.initial_load_path = \"" +
                    path + "\" and checkpoint.initial_load_model_only = true with another checkpoint.folder" + hint);
  }
  a.model_only = c.model_only_requested || m.model_only;
  for (const auto& [name, s] : components_) {
    const bool excluded = std::find(opt_.exclude_from_loading.begin(), opt_.exclude_from_loading.end(), name) !=
                          opt_.exclude_from_loading.end();
    if (a.model_only && name != "model") continue;
    if (excluded) {
      if (comm_.rank == 0)
        spdlog::warn("checkpoint: not loading {} (checkpoint.exclude_from_loading){}", name,
                     name == "dataloader" ? ": the data order starts afresh" : "");
      continue;
    }
    a.todo.emplace_back(name, s);
  }
  if (a.reader->is_foreign_dcp())
    for (const auto& t : a.todo)
      if (t.first == "dataloader")
        throw UserError("checkpoint " + path +
                        " is a torch.distributed.checkpoint folder ctitan did not write "
                        "(torchtitan's?): its dataloader state (a pickled Python data-loader state) is not "
                        "transferable to ctitan; set checkpoint.exclude_from_loading = [\"dataloader\"] to load "
                        "the rest and start a fresh data order");
}

// What was loaded, logged; the CTITAN_CHECKPOINT_DUMP_LOADED test hook.
LoadResult CheckpointManager::finish_load(const LoadAttempt& a, const std::string& path) {
  const Metadata& m = a.reader->meta();
  LoadResult res;
  res.loaded = true;
  res.step = m.step;
  res.path = path;
  res.model_only = a.model_only;
  for (const auto& t : a.todo) res.components.push_back(t.first);
  spdlog::info(
      "checkpoint: loaded step {} from {} in {:.2f} s, {:.1f} MiB read on this rank (saved by {} ranks, dp "
      "{}×{}; now {} ranks): {}",
      m.step, path, seconds_since(a.t0), a.reader->bytes_read() / double(1 << 20), m.world_size, m.dp_replicate,
      m.dp_shard, comm_.world_size, join(res.components, ", "));
  // Test hook: write what was just loaded, as this job holds it, to another folder, so a
  // test can compare it with the checkpoint it came from.
  if (const std::string& dump = runtime_env().checkpoint_dump_loaded; !dump.empty()) {
    auto keep = components_;
    components_ = a.todo;
    save_to(dump, m.step, a.model_only);
    components_ = keep;
  }
  return res;
}

// Model weights from a Hugging Face folder (checkpoint.initial_load_in_hf): every rank checks
// that config.json describes this run's model and that every tensor is there, then reads
// its own rows. Nothing else is loaded (torchtitan: HF loads are model-only).
LoadResult CheckpointManager::load_hf(const std::string& path) {
  ModelState* ms = model_state();
  std::unique_ptr<HFCheckpoint> hf;
  agreed("checkpoint_load:check", [&] {
    if (!ms) throw UserError("checkpoint: this job registered no model to load HF weights into");
    hf = std::make_unique<HFCheckpoint>(path, families());
    const HFModelConfig want = families().config_for(opt_.model_name, opt_.model_flavor, ms->vocab_size());
    const std::string diff = structure_difference(hf->config(), want);
    if (!diff.empty())
      throw UserError("HF checkpoint " + path + " (config.json) describes another model than this run's " +
                      opt_.model_name + " \"" + opt_.model_flavor + "\" (" + diff + ", checkpoint vs run)");
    ms->check_load_hf(*hf);
  });
  if (comm_.rank == 0) {
    const HFModelConfig& c = hf->config();
    const HFModelConfig want = families().config_for(opt_.model_name, opt_.model_flavor, ms->vocab_size());
    if (c.rope_theta != want.rope_theta || c.rms_norm_eps != want.rms_norm_eps ||
        c.rope_scaling.has_value() != want.rope_scaling.has_value())
      spdlog::warn(
          "checkpoint: HF config.json has rope_theta {}, rms_norm_eps {}, rope_scaling {}; this run's model "
          "uses {}, {}, {} (the weights load, the outputs will differ from the HF model's)",
          c.rope_theta, c.rms_norm_eps, c.rope_scaling ? kHfRopeScalingType : "none", want.rope_theta,
          want.rms_norm_eps, want.rope_scaling ? kHfRopeScalingType : "none");
    const auto unused = hf->unused_keys(families().params(c));
    if (!unused.empty())
      spdlog::warn("checkpoint: {} tensors of {} have no ctitan parameter and are ignored (first: {})", unused.size(),
                   path, unused.front());
  }
  const auto t0 = std::chrono::steady_clock::now();
  agreed("checkpoint_load:load", [&] { ms->load_hf(*hf); });
  LoadResult res;
  res.loaded = true;
  res.path = path;
  res.model_only = true;
  res.components = {"model"};
  if (auto it = hf->metadata().find("ctitan.step"); it != hf->metadata().end())
    res.step = std::atoll(it->second.c_str());
  spdlog::info("checkpoint: loaded HF safetensors from {} in {:.2f} s ({} tensors, {}; now {} ranks): model", path,
               seconds_since(t0), hf->keys().size(), hf->config().architecture, comm_.world_size);
  if (const std::string& dump = runtime_env().checkpoint_dump_loaded; !dump.empty()) {
    auto keep = components_;
    components_ = {{"model", ms}};
    save_to(dump, res.step, true);
    components_ = keep;
  }
  return res;
}

}  // namespace ctitan
