// The checkpoint manager's save side: cadence, the three rounds of a collective save, async
// writes and their staging, retention; load() is in checkpoint_load.cpp. See checkpoint.h.
#include "checkpoint/checkpoint.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <sstream>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/writer.h"
#include "config/errors.h"
#include "kernels/device_route.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {

using ckpt::one_line;
using ckpt::Rule;

namespace {

// What a failed save leaves to resume from, for its error message.
std::string previous_checkpoint_note(const std::string& folder) {
  const auto scan = ckpt::scan_folder(folder);
  return scan.complete.empty() ? "no earlier complete checkpoint exists"
                               : "the previous checkpoint step-" + std::to_string(scan.complete.back()) + " is intact";
}

// Moves a committed staging folder to its final name. An older folder of the same step
// (load_step rewound the run) is set aside first and removed only once the new one is in place.
void publish_stage(const SaveInfo& info) {
  const std::string old = info.final_dir + ".replaced";
  fs::remove_all(old);
  if (fs::exists(info.final_dir)) fs::rename(info.final_dir, old);
  fs::rename(info.stage, info.final_dir);
  ckpt::fsync_dir(info.folder);
  fs::remove_all(old);
}

}  // namespace

// ---- CheckpointComm ------------------------------------------------------------------------

CheckpointComm CheckpointComm::single_process() {
  CheckpointComm c;
  c.all_gather = [](const std::string& mine, const std::string&) { return std::vector<std::string>{mine}; };
  return c;
}

// ---- CheckpointManager ---------------------------------------------------------------------

struct CheckpointManager::Pending {
  SaveInfo info;
  const CheckpointWriter* writer = nullptr;  // the format of the folder (checkpoint/writer.h)
  bool pinned = false;                       // some entries live in the pinned staging buffer until the write ends
  std::vector<StateEntry> entries;
  std::thread thread;
  std::string status;  // "ok\n<fragment>" or "error <message>"
  uint64_t bytes = 0;
  double write_s = 0;    // this rank's file: write + fsync (the background part when async)
  double blocked_s = 0;  // time the caller (training) spent inside begin_save + complete_save
  std::chrono::steady_clock::time_point t0;
};

void CheckpointManager::stage_gpu_tensors(std::vector<StateEntry>& entries, const std::vector<size_t>& on_gpu) {
  std::vector<int64_t> sizes;
  for (size_t i : on_gpu) {
    StateEntry& e = entries[i];
    e.tensor = e.tensor.contiguous();
    sizes.push_back(static_cast<int64_t>(e.tensor.numel()) * e.tensor.element_size());
  }
  const ckpt::StagingBuffer::Layout layout = pinned_.begin(sizes);  // refused while a writer reads it
  if (layout.grow) {
    pinned_buffer_ = at::Tensor();  // the old pinned block goes back before the larger one is pinned
    pinned_buffer_ = at::empty({pinned_.capacity()}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }
  for (size_t j = 0; j < on_gpu.size(); ++j) {
    StateEntry& e = entries[on_gpu[j]];
    const auto& slot = layout.slots[j];
    at::Tensor host =
        pinned_buffer_.narrow(0, slot.offset, slot.bytes).view(e.tensor.scalar_type()).view(e.tensor.sizes());
    host.copy_(e.tensor);  // device to pinned host: DMA; blocking, so the writer may read it at once
    e.tensor = host;
  }
}

CheckpointManager::CheckpointManager(CheckpointOptions options, CheckpointComm comm)
    : opt_(std::move(options)), comm_(std::move(comm)) {
  if (!comm_.all_gather) comm_ = CheckpointComm::single_process();
}

CheckpointManager::~CheckpointManager() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

void CheckpointManager::add(const std::string& name, Stateful* s) {
  const auto& names = checkpoint_component_names();
  TORCH_CHECK(std::find(names.begin(), names.end(), name) != names.end(), "[checkpoint] unknown component ", name);
  components_.emplace_back(name, s);
}

ModelState* CheckpointManager::model_state() const {
  for (const auto& [n, s] : components_)
    if (n == "model") return dynamic_cast<ModelState*>(s);
  return nullptr;
}

std::vector<std::string> CheckpointManager::agree(const std::string& status, const std::string& tag) {
  auto all = comm_.all_gather(status, tag);
  TORCH_CHECK(static_cast<int64_t>(all.size()) == comm_.world_size, "[checkpoint] gathered ", all.size(),
              " statuses from ", comm_.world_size, " ranks");
  return all;
}

const HFAdapter& CheckpointManager::families() const {
  TORCH_CHECK(families_, "[checkpoint] an HF folder needs the model families' HF adapter (set_hf_adapter)");
  return *families_;
}

bool CheckpointManager::should_save(int64_t step, bool last_step) const {
  if (!opt_.enable || opt_.load_only || step == last_saved_step_) return false;
  if (step == 1 && opt_.enable_first_step_checkpoint) return true;
  if (last_step) return true;
  return step % opt_.interval == 0;
}

void CheckpointManager::save(int64_t step, bool last_step) {
  if (!should_save(step, last_step)) return;
  const bool model_only = last_step && opt_.last_save_model_only;
  if (pending_) complete_save();  // an async save commits before the next one starts
  ModelState* ms = model_state();
  if (ms) ms->set_export_dtype(model_only ? opt_.export_dtype : "");
  // The final save is synchronous: the job is about to end anyway.
  const bool hf = model_only && opt_.last_save_in_hf;  // assembled from ctitan's own shard files
  begin_save(opt_.folder, step, model_only, opt_.async && !last_step, checkpoint_writer(hf ? "hf" : opt_.format));
  if (ms) ms->set_export_dtype("");
  if (!opt_.async || last_step) complete_save();
}

bool CheckpointManager::save_now(int64_t step) {
  if (!opt_.enable || opt_.load_only) return false;
  if (pending_ && pending_->info.step == step) {  // an async save of this very step: commit it
    complete_save();
    return true;
  }
  if (step == last_saved_step_) return true;
  if (pending_) complete_save();
  begin_save(opt_.folder, step, /*model_only=*/false, /*async=*/false, checkpoint_writer(opt_.format));
  complete_save();
  return true;
}

void CheckpointManager::save_to(const std::string& folder, int64_t step, bool model_only) {
  if (pending_) complete_save();
  begin_save(folder, step, model_only, false, checkpoint_writer(opt_.format));
  complete_save();
}

void CheckpointManager::finalize() {
  if (pending_) complete_save();
}

void CheckpointManager::begin_save(const std::string& folder, int64_t step, bool model_only, bool async,
                                   const CheckpointWriter& writer) {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  std::vector<StateEntry> entries = collect_entries(model_only, writer, bytes);
  const std::string stage = ckpt::staging_dir(folder, step);
  agree_to_begin(folder, stage, step, bytes);
  pending_ = std::make_unique<Pending>();
  Pending& p = *pending_;
  p.info.folder = folder;
  p.info.stage = stage;
  p.info.final_dir = ckpt::step_dir(folder, step);
  p.info.step = step;
  p.info.model_only = model_only;
  p.info.world_size = comm_.world_size;
  p.info.dp_replicate = comm_.dp_replicate;
  p.info.dp_shard = comm_.dp_shard;
  p.info.model_name = opt_.model_name;
  p.info.model_flavor = opt_.model_flavor;
  p.info.families = families_ ? &*families_ : nullptr;
  p.writer = &writer;
  p.t0 = t0;
  p.bytes = bytes;
  stage_entries(entries, async, p);
  p.entries = std::move(entries);
  start_write(p, async);
  p.blocked_s = seconds_since(t0);  // async: staging and starting the writer; sync: the whole write
}

// What this rank will write: its own entries (replicated ones only on rank 0), and their bytes.
std::vector<StateEntry> CheckpointManager::collect_entries(bool model_only, const CheckpointWriter& writer,
                                                           uint64_t& bytes) {
  StateDict sd;
  for (const auto& [name, s] : components_)
    if (!model_only || name == "model") s->state_dict(sd);
  if (writer.stores_python_objects() && !model_only && dcp_extras_) dcp_extras_(sd);
  std::vector<StateEntry> entries;
  for (auto& e : sd.entries()) {
    if (e.rule == Rule::Replicated) e.save_here = comm_.rank == 0;
    if (!e.save_here) continue;
    if (e.is_bytes) {
      bytes += e.bytes.size();
    } else {
      if (e.rule == Rule::Sharded) e.tensor = e.tensor.narrow(0, 0, e.row_end - e.row_begin);
      bytes += static_cast<uint64_t>(e.tensor.numel()) * e.tensor.element_size();
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

// Round 1: every rank agrees it saves this step (a rank on another path is reported, not
// waited for), rank 0 has prepared an empty staging folder, and every file system has room
// for what the ranks writing to it will write. Nothing is written before this passes.
void CheckpointManager::agree_to_begin(const std::string& folder, const std::string& stage, int64_t step,
                                       uint64_t bytes) {
  const std::string tag = "checkpoint_save:step-" + std::to_string(step);
  const std::string what = "checkpoint save of step " + std::to_string(step);
  std::string prep = "ok";
  if (comm_.rank == 0) {
    try {
      fs::create_directories(folder);
      fs::remove_all(stage);
      fs::create_directories(stage);
    } catch (const std::exception& e) {
      prep = "error " + one_line(e.what());
    }
  }
  const ckpt::DiskSpace space = ckpt::disk_space(folder);
  const uint64_t need = bytes + ckpt::kSaveOverheadBytes;
  const std::string mine = "begin " + std::to_string(step) + " " + std::to_string(need) + " " +
                           std::to_string(space.free) + " " + space.id + " " + prep;
  auto all = agree(mine, tag + ":begin");
  std::vector<SaveBegin> begins(static_cast<size_t>(comm_.world_size));
  for (int64_t r = 0; r < comm_.world_size; ++r) {
    std::istringstream in(all[r]);
    std::string word;
    int64_t their_step = -1;
    SaveBegin& b = begins[static_cast<size_t>(r)];
    if (!(in >> word >> their_step >> b.need >> b.free >> b.fs) || word != "begin" || their_step != step)
      throw RuntimeFailure(what + ": rank " + std::to_string(r) + " is not saving this step (it sent \"" +
                           one_line(all[r]) + "\"): the ranks took different paths");
    std::getline(in >> std::ws, b.prep);
  }
  auto abandon = [&](const std::string& why, const std::string& hint) {
    if (comm_.rank == 0) {
      std::error_code ec;
      fs::remove_all(stage, ec);
    }
    throw RuntimeFailure(what + " " + why + " (" + previous_checkpoint_note(folder) + ")" + hint);
  };
  if (begins[0].prep != "ok") abandon("failed on rank 0: " + begins[0].prep.substr(6), "");
  const std::string short_of = space_shortage(folder, begins);
  if (!short_of.empty())
    abandon(short_of, " HINT: free space, lower checkpoint.keep_latest_k or move checkpoint.folder");
}

// Ranks sharing a file system (same host and device) need the sum of their bytes there: ""
// when every file system has room, else why not.
std::string CheckpointManager::space_shortage(const std::string& folder, const std::vector<SaveBegin>& begins) const {
  std::map<std::string, std::pair<uint64_t, std::vector<int64_t>>> per_fs;
  for (int64_t r = 0; r < comm_.world_size; ++r) {
    auto& [sum, ranks] = per_fs[begins[r].fs];
    sum += begins[r].need;
    ranks.push_back(r);
  }
  for (const auto& [id, use] : per_fs) {
    const SaveBegin& b = begins[static_cast<size_t>(use.second.front())];
    if (id == "unknown" || use.first <= b.free) continue;
    std::vector<std::string> rs;
    for (int64_t r : use.second) rs.push_back(std::to_string(r));
    return "refused: not enough free space for " + folder + " on " + (rs.size() == 1 ? "rank " : "ranks ") +
           join(rs, ", ") + ": needs " + ckpt::bytes_text(use.first) + ", " + ckpt::bytes_text(b.free) +
           " free; nothing was written";
  }
  return "";
}

// A copy when the write runs in the background (training goes on modifying the tensors),
// into staging buffers kept from the previous async save when the layout is unchanged:
// copying into memory already mapped costs a fraction of fresh allocations' page faults
// (torchtitan keeps a pinned staging copy for the same reason).
void CheckpointManager::stage_entries(std::vector<StateEntry>& entries, bool async, Pending& p) {
  torch::NoGradGuard no_grad;
  // GPU tensors: copied to the pinned staging buffer, the copy the writer reads (either mode).
  std::vector<size_t> gpu;
  for (size_t i = 0; i < entries.size(); ++i)
    if (!entries[i].is_bytes && on_gpu(entries[i].tensor)) gpu.push_back(i);
  if (!gpu.empty()) {
    stage_gpu_tensors(entries, gpu);
    p.pinned = true;
  }
  size_t k = 0, next_gpu = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    StateEntry& e = entries[i];
    if (e.is_bytes) continue;
    if (next_gpu < gpu.size() && gpu[next_gpu] == i) {
      ++next_gpu;
      continue;  // already a copy of its own
    }
    if (!async) {
      e.tensor = e.tensor.contiguous();
      continue;
    }
    if (k >= staging_.size()) staging_.emplace_back();
    at::Tensor& buf = staging_[k++];
    if (!buf.defined() || buf.sizes() != e.tensor.sizes() || buf.scalar_type() != e.tensor.scalar_type())
      buf = torch::empty(e.tensor.sizes(), e.tensor.options().memory_format(at::MemoryFormat::Contiguous));
    buf.copy_(e.tensor);
    e.tensor = buf;
  }
  if (async) staging_.resize(k);
}

// Round 2 begins: this rank's files, written now or by a background thread.
void CheckpointManager::start_write(Pending& p, bool async) {
  auto work = [this, &p] {
    const auto tw = std::chrono::steady_clock::now();
    try {
      p.status = "ok\n" + p.writer->write_rank(p.entries, p.info, comm_.rank);
    } catch (const std::exception& e) {
      p.status = "error " + one_line(e.what());
    }
    p.write_s = seconds_since(tw);
    p.entries.clear();  // release the copies
    if (p.pinned) pinned_.finished();
  };
  if (async)
    p.thread = std::thread([work] {
      // The writer's CPU work (checksums, copies into the page cache) yields to training's
      // threads: at nice 10 it runs in their gaps instead of taking a core from a matmul.
      // Measured by bench/checkpoint_io.sh (docs/performance.md, "Checkpoint I/O").
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
      work();
    });
  else
    work();
}

void CheckpointManager::complete_save() {
  Pending& p = *pending_;
  const auto t_complete = std::chrono::steady_clock::now();
  if (p.thread.joinable()) p.thread.join();
  const std::string tag = "checkpoint_save:step-" + std::to_string(p.info.step);
  const std::string what = "checkpoint save of step " + std::to_string(p.info.step);
  const std::vector<std::string> all = agree_written(p);
  const std::string previous = previous_checkpoint_note(p.info.folder);
  std::vector<std::string> failed;
  for (int64_t r = 0; r < comm_.world_size; ++r)
    if (all[r].rfind("ok\n", 0) != 0) failed.push_back("rank " + std::to_string(r) + ": " + all[r].substr(6));
  if (!failed.empty()) {
    if (comm_.rank == 0) {
      std::error_code ec;
      fs::remove_all(p.info.stage, ec);
    }
    pending_.reset();
    throw RuntimeFailure(what + " failed on " + join(failed, "; ") + " (" + previous + ")");
  }
  // Round 3: rank 0 writes metadata and the marker, then moves the folder into place.
  const std::string commit = comm_.rank == 0 ? commit_on_rank0(p, all) : "ok";
  auto committed = agree(commit, tag + ":commit");
  if (committed[0] != "ok") {
    pending_.reset();
    throw RuntimeFailure(what + " failed on rank 0 while committing: " + committed[0].substr(6) + " (" + previous +
                         ")");
  }
  // Sync: the total is the whole collective save; async: it spans the training steps in between.
  p.blocked_s += seconds_since(t_complete);
  const std::string form = p.writer->form();
  spdlog::info(
      "checkpoint: saved step {}{} to {} ({:.1f} MiB on this rank, {:.2f} s; file written in {:.2f} s; "
      "training blocked {:.2f} s)",
      p.info.step,
      !p.info.model_only ? ""
      : form.empty()     ? " (model only)"
                         : " (model only, " + form + ")",
      p.info.final_dir, p.bytes / double(1 << 20), seconds_since(p.t0), p.write_s, p.blocked_s);
  last_saved_step_ = p.info.step;
  const std::string folder = p.info.folder;
  const bool regular = folder == opt_.folder;
  pending_.reset();
  if (regular && comm_.rank == 0) purge(folder);
}

// Every rank's write status ("ok\n<its file, chunk and entry records>" or "error ..."). A rank
// that never arrives (died or stalled) is named, and the save abandoned.
std::vector<std::string> CheckpointManager::agree_written(Pending& p) {
  const std::string tag = "checkpoint_save:step-" + std::to_string(p.info.step);
  const std::string what = "checkpoint save of step " + std::to_string(p.info.step);
  if (comm_.arrive) comm_.arrive(tag + ":written");
  try {
    return agree(p.status, tag + ":written");
  } catch (const CollectiveFailure& e) {
    std::string who;
    if (comm_.missing) {
      try {
        std::vector<std::string> rs;
        for (int64_t r : comm_.missing(tag + ":written")) rs.push_back(std::to_string(r));
        if (!rs.empty())
          who = (rs.size() == 1 ? "rank " : "ranks ") + join(rs, ", ") + " did not finish writing (died or stalled); ";
      } catch (const std::exception&) {
        who = "rank 0 is unreachable (died or stalled; it also serves the rendezvous store); ";
      }
    }
    if (comm_.rank == 0) fs::remove_all(p.info.stage);
    pending_.reset();
    throw CollectiveFailure(what + " failed: " + who + e.what());
  }
}

// Rank 0's part of round 3: the format's index and marker (from every rank's fragment), then
// the folder moved into place. Returns "ok" or "error <why>".
std::string CheckpointManager::commit_on_rank0(Pending& p, const std::vector<std::string>& all) {
  try {
    std::vector<std::string> fragments;
    for (const std::string& status : all) fragments.push_back(status.substr(3));  // "ok\n<fragment>"
    p.writer->commit(p.info, fragments);
    // An older checkpoint of the same step (load_step rewound the run) is replaced only now.
    publish_stage(p.info);
    return "ok";
  } catch (const std::exception& e) {
    return "error " + one_line(e.what());
  }
}

void CheckpointManager::purge(const std::string& folder) {
  if (opt_.keep_latest_k <= 0) return;
  const auto scan = ckpt::scan_folder(folder);
  // Only complete checkpoints are candidates, oldest first; the newest k stay. A save in
  // progress is a .partial folder and is never touched (k >= 2 is enforced by the config).
  const int64_t k = std::max<int64_t>(opt_.keep_latest_k, 1);
  const int64_t excess = static_cast<int64_t>(scan.complete.size()) - k;
  for (int64_t i = 0; i < excess; ++i) {
    const std::string dir = ckpt::step_dir(folder, scan.complete[static_cast<size_t>(i)]);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec)
      spdlog::warn("checkpoint: could not remove {} (keep_latest_k = {}): {}", dir, opt_.keep_latest_k, ec.message());
    else
      spdlog::info("checkpoint: removed {} (keep_latest_k = {})", dir, opt_.keep_latest_k);
  }
}

}  // namespace ctitan
