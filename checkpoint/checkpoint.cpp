// Stateful components, the checkpoint reader and the manager; see checkpoint.h / format.h.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/dcp.h"
#include "checkpoint/hf.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "kernels/device_route.h"
#include "util/env.h"
#include "util/strings.h"
#include "util/crc.h"

namespace fs = std::filesystem;

namespace ctitan {

using ckpt::ChunkMeta;
using ckpt::EntryMeta;
using ckpt::Metadata;
using ckpt::Rule;

namespace {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    default: break;
  }
  TORCH_CHECK(false, "[checkpoint] unsupported dtype ", t);
}

at::ScalarType dtype_of(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  if (s == "float64") return at::kDouble;
  if (s == "int64") return at::kLong;
  if (s == "int32") return at::kInt;
  if (s == "uint8") return at::kByte;
  TORCH_CHECK(false, "[checkpoint] unsupported dtype ", s);
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// Test hook: CTITAN_CHECKPOINT_FAULT=<kind>:<rank>:<step> makes that rank fail halfway through
// writing `file`, its file of that step's checkpoint. kind: raise (an exception), kill
// (SIGKILL), enospc (the write fails as a full disk makes it fail), fill (fills the file system
// under the staging folder with a filler file, so that the rest of the write hits a real
// ENOSPC; refused where more than 256 MiB are free: meant for a small tmpfs).
void maybe_fault_in_save(int64_t rank, int64_t step, const std::string& file) {
  const auto& hook = runtime_env().checkpoint_fault;
  if (!hook || !hook->at(rank, step)) return;
  const std::string& k = hook->kind;
  const std::string& f = hook->spec;
  if (k == "kill") raise(SIGKILL);
  if (k == "raise")
    throw RuntimeFailure("injected fault while writing the checkpoint (CTITAN_CHECKPOINT_FAULT=" + f + ")");
  if (k == "enospc")  // the text of ckpt::DurableFileWriter's error for a failed write
    throw RuntimeFailure("checkpoint: cannot write " + file + ".tmp: " + std::strerror(ENOSPC));
  if (k == "fill") {
    const std::string filler = file + ".filler";  // in the staging folder: removed with it
    if (ckpt::disk_space(filler).free > (256u << 20))
      throw RuntimeFailure("CTITAN_CHECKPOINT_FAULT=fill refuses to fill a file system with more than 256 MiB free");
    const int fd = ::open(filler.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char> block(1 << 16, 0);
    while (fd >= 0 && ::write(fd, block.data(), block.size()) > 0) {
    }
    if (fd >= 0) ::close(fd);
    spdlog::warn("CTITAN_CHECKPOINT_FAULT={}: filled the file system of {}", f, filler);
  }
}

// What a failed save leaves to resume from, for its error message.
std::string previous_checkpoint_note(const std::string& folder) {
  const auto scan = ckpt::scan_folder(folder);
  return scan.complete.empty() ? "no earlier complete checkpoint exists"
                               : "the previous checkpoint step-" + std::to_string(scan.complete.back()) + " is intact";
}

std::string entry_line(const EntryMeta& e) {
  if (e.is_bytes) return "entry " + e.key + " bytes " + ckpt::rule_name(e.rule) + "\n";
  std::string shape = e.shape.empty() ? "scalar" : "";
  for (size_t i = 0; i < e.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(e.shape[i]);
  return "entry " + e.key + " tensor " + ckpt::rule_name(e.rule) + " " + e.dtype + " " + shape + "\n";
}

// Writes this rank's entries into <stage>/rank<r>.bin; returns the metadata fragment
// (file, entry and chunk records) rank 0 merges.
std::string write_rank_file(const std::vector<StateEntry>& entries, const std::string& stage, int64_t rank,
                            int64_t step) {
  const std::string name = "rank" + std::to_string(rank) + ".bin";
  ckpt::DurableFileWriter w((fs::path(stage) / name).string());
  std::vector<EntryMeta> metas;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StateEntry& e = entries[i];
    if (i == entries.size() / 2) maybe_fault_in_save(rank, step, (fs::path(stage) / name).string());
    EntryMeta m;
    m.key = e.key;
    m.rule = e.rule;
    m.is_bytes = e.is_bytes;
    ChunkMeta c;
    c.file = name;
    if (e.is_bytes) {
      c.nbytes = e.bytes.size();
      c.crc = crc::crc32(e.bytes.data(), e.bytes.size());
      c.offset = w.append(e.bytes.data(), e.bytes.size(), c.crc);
    } else {
      at::Tensor t = e.tensor;
      if (e.rule == Rule::Sharded) {
        t = t.narrow(0, 0, e.row_end - e.row_begin);
        m.shape = e.global_shape;
        c.row_begin = e.row_begin;
        c.row_end = e.row_end;
      } else {
        m.shape = t.sizes().vec();
        c.row_begin = 0;
        c.row_end = m.shape.empty() ? 1 : m.shape[0];
      }
      t = t.detach().contiguous();
      m.dtype = dtype_name(t.scalar_type());
      const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
      c.nbytes = n;
      c.crc = crc::crc32(t.data_ptr(), n);  // once: the file's CRC is combined from it
      c.offset = w.append(t.data_ptr(), n, c.crc);
    }
    m.chunks.push_back(c);
    metas.push_back(std::move(m));
  }
  if (entries.size() < 2) maybe_fault_in_save(rank, step, (fs::path(stage) / name).string());
  w.commit();
  std::string frag = "file " + name + " " + std::to_string(w.size()) + " " + ckpt::hex32(w.crc()) + "\n";
  for (const auto& m : metas) frag += entry_line(m);
  frag += ckpt::chunk_lines(metas);
  return frag;
}

template <class S>
S& adam_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  // The key LibTorch's Adam/AdamW use for a parameter's state.
  void* const key = p.unsafeGetTensorImpl();
  auto& st = opt.state();
  auto it = st.find(key);
  if (it == st.end()) {
    // What Adam(W)::step creates on a parameter's first step: step 0, zero moments.
    auto s = std::make_unique<S>();
    s->step(0);
    s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
    st[key] = std::move(s);
    it = st.find(key);
  }
  return static_cast<S&>(*it->second);
}

struct AdamRefs {
  at::Tensor exp_avg, exp_avg_sq;
  std::function<int64_t()> get_step;
  std::function<void(int64_t)> set_step;
};

AdamRefs adam_refs(torch::optim::Optimizer& opt, const at::Tensor& p) {
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) {
    auto& s = adam_state<torch::optim::AdamWParamState>(opt, p);
    return {s.exp_avg(), s.exp_avg_sq(), [&s] { return s.step(); }, [&s](int64_t v) { s.step(v); }};
  }
  if (dynamic_cast<torch::optim::Adam*>(&opt)) {
    auto& s = adam_state<torch::optim::AdamParamState>(opt, p);
    return {s.exp_avg(), s.exp_avg_sq(), [&s] { return s.step(); }, [&s](int64_t v) { s.step(v); }};
  }
  TORCH_CHECK(false, "[checkpoint] only Adam and AdamW optimizer state can be checkpointed");
}

// Integers torchtitan keeps as Python ints (BytesStorageMetadata items): written and read so.
const std::set<std::string> kPythonInts = {"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch",
                                           "dataloader.world_size"};

// checkpoint.format = "dcp": this rank's entries as items of __<rank>_0.distcp, each one a
// torch.save archive (a tensor chunk of this rank's rows, or bytes), as PyTorch's
// FileSystemWriter stores them. Returns one line per item for rank 0's .metadata:
//   dcp tensor <key> <dtype> <global shape> <chunk sizes> <row_begin> <file> <offset> <length>
//   dcp bytes <key> <file> <offset> <length>
// (shapes comma-separated, "scalar" for none).
std::string write_rank_dcp(const std::vector<StateEntry>& entries, const std::string& stage, int64_t rank,
                           int64_t step) {
  const std::string name = "__" + std::to_string(rank) + "_0.distcp";
  const std::string path = (fs::path(stage) / name).string();
  ckpt::DurableFileWriter w(path);
  auto csv = [](const std::vector<int64_t>& v) {
    std::string o;
    for (size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + std::to_string(v[i]);
    return o.empty() ? std::string("scalar") : o;
  };
  std::string frag;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StateEntry& e = entries[i];
    if (i == entries.size() / 2) maybe_fault_in_save(rank, step, path);
    std::string item, line;
    if (e.object) {
      item = dcp::object_item(*e.object);
      line = "dcp bytes " + e.key;
    } else if (e.is_bytes) {
      item = dcp::bytes_item(e.bytes);
      line = "dcp bytes " + e.key;
    } else if (kPythonInts.count(e.key) && e.tensor.dim() == 0) {
      item = dcp::int_item(e.tensor.item<int64_t>());  // a Python int, as torchtitan stores it
      line = "dcp bytes " + e.key;
    } else {
      at::Tensor t = e.tensor;
      std::vector<int64_t> shape;
      int64_t row_begin = 0;
      if (e.rule == Rule::Sharded) {
        t = t.narrow(0, 0, e.row_end - e.row_begin);
        shape = e.global_shape;
        row_begin = e.row_begin;
      } else {
        shape = t.sizes().vec();
      }
      t = t.detach().contiguous();
      const std::string dt = dtype_name(t.scalar_type());
      item = dcp::tensor_item(dt, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
      line = "dcp tensor " + e.key + " " + dt + " " + csv(shape) + " " + csv(t.sizes().vec()) + " " +
             std::to_string(row_begin);
    }
    const uint64_t off = w.append(item.data(), item.size());
    frag += line + " " + name + " " + std::to_string(off) + " " + std::to_string(item.size()) + "\n";
  }
  if (entries.size() < 2) maybe_fault_in_save(rank, step, path);
  w.commit();
  return frag;
}

// Rank 0: every rank's item lines ("ok\n" + write_rank_dcp's) → <stage>/.metadata, then the
// COMPLETE marker over it (after the data files, which are durable already).
void write_dcp_metadata(const std::vector<std::string>& statuses, const std::string& stage, int64_t step) {
  dcp::Metadata m;
  m.version = "1.0.0";
  auto dims = [](const std::string& s) {
    std::vector<int64_t> v;
    if (s == "scalar") return v;
    std::istringstream in(s);
    for (std::string x; std::getline(in, x, ',');) v.push_back(std::stoll(x));
    return v;
  };
  for (const auto& st : statuses) {
    std::istringstream in(st.substr(3));
    for (std::string line; std::getline(in, line);) {
      std::istringstream f(line);
      std::string tag, kind, key;
      f >> tag >> kind >> key;
      TORCH_CHECK(tag == "dcp", "[checkpoint] unexpected DCP item line: ", line);
      dcp::Item& it = m.items[key];
      it.key = key;
      dcp::Chunk c;
      if (kind == "bytes") {
        TORCH_CHECK(it.chunks.empty(), "[checkpoint] two ranks saved ", key);
        it.is_bytes = true;
      } else {
        std::string dt, shape, sizes;
        int64_t row_begin = 0;
        f >> dt >> shape >> sizes >> row_begin;
        it.dtype = dt;
        it.size = dims(shape);
        c.sizes = dims(sizes);
        c.offsets.assign(c.sizes.size(), 0);
        if (!c.offsets.empty()) c.offsets[0] = row_begin;
      }
      f >> c.file >> c.offset >> c.length;
      TORCH_CHECK(f, "[checkpoint] malformed DCP item line: ", line);
      it.chunks.push_back(std::move(c));
    }
  }
  const std::string md = dcp::metadata_pickle(m);
  ckpt::write_file_durable((fs::path(stage) / dcp::kMetadataFile).string(), md);
  ckpt::write_file_durable((fs::path(stage) / "COMPLETE").string(), ckpt::dcp_complete_marker_text(step, md));
}

// Moves a finished staging folder to its final name. An older folder of the same step
// (load_step rewound the run) is set aside first and removed only once the new one is in place.
void publish_stage(const std::string& stage, const std::string& final_dir, const std::string& folder) {
  const std::string old = final_dir + ".replaced";
  fs::remove_all(old);
  if (fs::exists(final_dir)) fs::rename(final_dir, old);
  fs::rename(stage, final_dir);
  ckpt::fsync_dir(folder);
  fs::remove_all(old);
}

}  // namespace

bool is_model_key(const std::string& k) {
  for (const char* p : {"optimizer.", "lr_scheduler.", "train_state.", "dataloader.", "rng."})
    if (k.rfind(p, 0) == 0) return false;
  return true;
}

// ---- CheckpointComm ------------------------------------------------------------------------

CheckpointComm CheckpointComm::single_process() {
  CheckpointComm c;
  c.all_gather = [](const std::string& mine, const std::string&) { return std::vector<std::string>{mine}; };
  return c;
}

// ---- StateDict -----------------------------------------------------------------------------

void StateDict::sharded(const std::string& key, const at::Tensor& local, std::vector<int64_t> global_shape,
                        int64_t row_begin, int64_t row_end, bool save_here) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Sharded;
  e.tensor = local.detach();
  e.global_shape = std::move(global_shape);
  e.row_begin = row_begin;
  e.row_end = row_end;
  // A rank whose shard has no real rows (more ranks than rows) stores nothing.
  e.save_here = save_here && row_end > row_begin;
  entries_.push_back(std::move(e));
}

void StateDict::replicated(const std::string& key, const at::Tensor& value) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Replicated;
  e.tensor = value.detach();
  e.global_shape = value.sizes().vec();
  entries_.push_back(std::move(e));
}

void StateDict::replicated_int(const std::string& key, int64_t value) {
  replicated(key, torch::tensor(value, torch::kInt64));
}

void StateDict::python_object(const std::string& key, pickle::Ptr value) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Replicated;
  e.is_bytes = true;
  e.object = std::move(value);
  entries_.push_back(std::move(e));
}

void StateDict::per_rank_bytes(const std::string& key, std::string bytes) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::PerRank;
  e.is_bytes = true;
  e.bytes = std::move(bytes);
  entries_.push_back(std::move(e));
}

// ---- CheckpointReader ----------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  const fs::path p(dir_);
  std::error_code ec;
  if (!fs::is_directory(p, ec)) throw RuntimeFailure("checkpoint " + dir_ + " does not exist");
  if (!fs::exists(p / "metadata", ec) && dcp::is_dcp_folder(dir_)) {
    open_dcp();
    return;
  }
  if (!fs::exists(p / "metadata", ec))
    throw RuntimeFailure("checkpoint " + dir_ + " is not usable: the metadata file is missing");
  const std::string text = ckpt::read_whole_file((p / "metadata").string());
  meta_ = Metadata::parse(text, "checkpoint " + dir_ + "/metadata");
  if (!fs::exists(p / "COMPLETE", ec))
    throw RuntimeFailure("checkpoint " + dir_ + " is not complete: no COMPLETE marker (the save did not finish)");
  if (ckpt::read_whole_file((p / "COMPLETE").string()) != ckpt::complete_marker_text(meta_.step, text))
    throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: metadata does not match its COMPLETE marker");
  for (const auto& f : meta_.files) {
    const fs::path fp = p / f.name;
    if (!fs::exists(fp, ec)) throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: " + f.name + " is missing");
    const uint64_t size = fs::file_size(fp, ec);
    if (size != f.size)
      throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: " + f.name + " has " + std::to_string(size) +
                           " bytes, the metadata records " + std::to_string(f.size) + " (truncated?)");
  }
}

namespace {

// A DCP tensor item as ctitan's entry: its chunks, dim-0 slices covering its rows exactly once
// (replicated when one chunk holds them all); the items' files are added to `files`.
EntryMeta dcp_tensor_entry(const std::string& dir, const std::string& key, const dcp::Item& it,
                           std::set<std::string>& files) {
  EntryMeta e;
  e.key = key;
  e.dtype = it.dtype;
  e.shape = it.size;
  for (const auto& c : it.chunks) {
    for (size_t d = 1; d < it.size.size(); ++d)
      if (c.offsets[d] != 0 || c.sizes[d] != it.size[d])
        throw RuntimeFailure("checkpoint " + dir + ": " + key + " is split along dimension " + std::to_string(d) +
                             " (tensor parallel?); ctitan re-slices tensors sharded along dimension 0 (FSDP) only");
    ChunkMeta cm;
    cm.file = c.file;
    cm.offset = c.offset;
    cm.nbytes = c.length;
    cm.encoding = ChunkMeta::Encoding::TorchSave;
    cm.row_begin = it.size.empty() ? 0 : c.offsets[0];
    cm.row_end = it.size.empty() ? 1 : c.offsets[0] + c.sizes[0];
    if (cm.row_end > cm.row_begin) e.chunks.push_back(cm);
    files.insert(c.file);
  }
  std::sort(e.chunks.begin(), e.chunks.end(),
            [](const ChunkMeta& a, const ChunkMeta& b) { return a.row_begin < b.row_begin; });
  int64_t next = 0;
  for (const auto& c : e.chunks) {
    if (c.row_begin != next) break;
    next = c.row_end;
  }
  if (next != e.rows())
    throw RuntimeFailure("checkpoint " + dir + " is corrupt: the chunks of " + key + " do not cover its " +
                         std::to_string(e.rows()) + " rows exactly once");
  e.rule = e.chunks.size() > 1 ? Rule::Sharded : Rule::Replicated;
  return e;
}

}  // namespace

// A DCP folder as ctitan's metadata: one entry per key, its chunks pointing at the items'
// torch.save archives (dim-0 slices: FSDP's sharding, the only one re-sliced here).
void CheckpointReader::open_dcp() {
  dcp_ = true;
  const fs::path p(dir_);
  std::error_code ec;
  const std::string md_bytes = ckpt::read_whole_file((p / dcp::kMetadataFile).string());
  if (fs::exists(p / "COMPLETE", ec)) {  // written by ctitan: the marker must match
    const std::string marker = ckpt::read_whole_file((p / "COMPLETE").string());
    const std::string head = "ctitan-dcp-complete step ";
    const int64_t step = marker.rfind(head, 0) == 0 ? std::atoll(marker.c_str() + head.size()) : -1;
    if (step < 0 || marker != ckpt::dcp_complete_marker_text(step, md_bytes))
      throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: .metadata does not match its COMPLETE marker");
    dcp_by_ctitan_ = true;
    meta_.step = step;
  }
  const dcp::Metadata dm = dcp::read_metadata(dir_);
  // torchtitan's Python ints (BytesStorageMetadata items), read as integer scalars.
  static const std::set<std::string> ints = {"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch",
                                             "lr_scheduler.last_step", "dataloader.world_size"};
  std::set<std::string> files;
  for (const auto& [key, it] : dm.items) {
    EntryMeta e;
    e.key = key;
    if (it.is_bytes) {
      // Other Python objects (optimizer.param_groups.*, LambdaLR's base_lrs, ...) are
      // hyper-parameters ctitan takes from its config: not entries.
      if (!ints.count(key) && key.rfind("dataloader.", 0) != 0 && key.rfind("rng.", 0) != 0) continue;
      const dcp::Chunk& c = it.chunks.at(0);
      ChunkMeta cm;
      cm.file = c.file;
      cm.offset = c.offset;
      cm.nbytes = c.length;
      cm.encoding = ints.count(key) ? ChunkMeta::Encoding::PickledInt : ChunkMeta::Encoding::TorchSave;
      if (ints.count(key)) {
        e.dtype = "int64";
        cm.row_end = 1;
      } else {
        e.is_bytes = true;
        e.rule = Rule::PerRank;
      }
      e.chunks.push_back(cm);
      files.insert(c.file);
    } else {
      e = dcp_tensor_entry(dir_, key, it, files);
    }
    meta_.entries.emplace(key, std::move(e));
  }
  if (!meta_.entries.count("lr_scheduler.last_step") && meta_.entries.count("lr_scheduler.last_epoch")) {
    EntryMeta e = meta_.entries.at("lr_scheduler.last_epoch");  // LambdaLR's count of steps taken
    e.key = "lr_scheduler.last_step";
    meta_.entries.emplace(e.key, std::move(e));
  }
  for (const auto& f : files) meta_.files.push_back({f, static_cast<uint64_t>(fs::file_size(p / f, ec)), 0});
  meta_.world_size = std::max<int64_t>(1, static_cast<int64_t>(files.size()));
  meta_.dp_shard = meta_.world_size;
  meta_.model_only = true;
  for (const auto& kv : meta_.entries)
    if (kv.first.rfind("optimizer.", 0) == 0) meta_.model_only = false;
  if (!dcp_by_ctitan_) meta_.step = has("train_state.step") ? read_int("train_state.step") : 0;
}

std::string CheckpointReader::read_item(const ChunkMeta& c) const {
  const std::string path = (fs::path(dir_) / c.file).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw RuntimeFailure("checkpoint: cannot open " + path + ": " + std::strerror(errno));
  std::string buf(c.nbytes, '\0');
  size_t done = 0;
  while (done < c.nbytes) {
    const ssize_t r = ::pread(fd, &buf[done], c.nbytes - done, static_cast<off_t>(c.offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  if (done < c.nbytes)
    throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: " + c.file + " ends at byte " +
                         std::to_string(c.offset + done) + ", inside an item that .metadata places at [" +
                         std::to_string(c.offset) + ", " + std::to_string(c.offset + c.nbytes) + ") (truncated?)");
  bytes_read_ += c.nbytes;
  return buf;
}

std::string CheckpointReader::item_where(const EntryMeta& e, const ChunkMeta& c) const {
  return "checkpoint " + dir_ + ": " + c.file + " bytes [" + std::to_string(c.offset) + ", " +
         std::to_string(c.offset + c.nbytes) + ") holding " + e.key;
}

const EntryMeta& CheckpointReader::entry(const std::string& key) const {
  auto it = meta_.entries.find(key);
  if (it == meta_.entries.end()) throw UserError("checkpoint " + dir_ + " has no entry " + key);
  return it->second;
}

void CheckpointReader::require_tensor(const std::string& key, const std::vector<int64_t>& shape) const {
  const EntryMeta& e = entry(key);
  if (e.is_bytes) throw UserError("checkpoint " + dir_ + ": " + key + " is not a tensor");
  if (e.shape != shape)
    throw UserError("checkpoint " + dir_ + ": " + key + " has shape " + shape_str(e.shape) + ", this run's is " +
                    shape_str(shape));
}

std::string CheckpointReader::read_chunk(const EntryMeta& e, const ChunkMeta& c) const {
  if (c.encoding != ChunkMeta::Encoding::Raw && e.is_bytes) {
    const pickle::Ptr v = dcp::read_object_item(read_item(c), item_where(e, c));
    if (!v->is(pickle::Value::Kind::Bytes))
      throw RuntimeFailure(item_where(e, c) + ": holds " + pickle::describe(*v) + ", not a byte string");
    return v->s;
  }
  const size_t n = c.encoding == ChunkMeta::Encoding::Raw
                       ? c.nbytes
                       : static_cast<size_t>((c.row_end - c.row_begin) * e.row_numel()) * ckpt::dtype_size(e.dtype);
  std::string buf(n, '\0');
  read_chunk_into(e, c, buf.data());
  return buf;
}

void CheckpointReader::read_chunk_into(const EntryMeta& e, const ChunkMeta& c, void* dst) const {
  if (c.encoding == ChunkMeta::Encoding::PickledInt) {
    const pickle::Ptr v = dcp::read_object_item(read_item(c), item_where(e, c));
    if (!v->is(pickle::Value::Kind::Int))
      throw RuntimeFailure(item_where(e, c) + ": holds " + pickle::describe(*v) + ", not an integer");
    std::memcpy(dst, &v->i, sizeof v->i);
    return;
  }
  if (c.encoding == ChunkMeta::Encoding::TorchSave) {
    std::vector<int64_t> sizes = e.shape;
    if (!sizes.empty()) sizes[0] = c.row_end - c.row_begin;
    dcp::read_tensor_item(read_item(c), item_where(e, c), e.dtype, sizes, dst);
    return;
  }
  const std::string path = (fs::path(dir_) / c.file).string();
  char* buf = static_cast<char*>(dst);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw RuntimeFailure("checkpoint: cannot open " + path + ": " + std::strerror(errno));
  ::posix_fadvise(fd, static_cast<off_t>(c.offset), static_cast<off_t>(c.nbytes), POSIX_FADV_SEQUENTIAL);
  // Block by block, each checksummed while it is still in cache and while the kernel reads
  // ahead the next: the check overlaps the I/O instead of following it.
  constexpr size_t kBlock = size_t{4} << 20;
  uint32_t crc = 0;
  size_t done = 0;
  while (done < c.nbytes) {
    const size_t end = std::min<size_t>(c.nbytes, done + kBlock);
    const size_t start = done;
    while (done < end) {
      const ssize_t r = ::pread(fd, &buf[done], end - done, static_cast<off_t>(c.offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ::close(fd);
        throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: " + c.file + " ends inside " + e.key);
      }
      done += static_cast<size_t>(r);
    }
    crc = crc::crc32(buf + start, end - start, crc);
  }
  ::close(fd);
  bytes_read_ += c.nbytes;
  if (crc != c.crc)
    throw RuntimeFailure("checkpoint " + dir_ + " is corrupt: " + c.file + " bytes [" + std::to_string(c.offset) +
                         ", " + std::to_string(c.offset + c.nbytes) + ") holding " + e.key +
                         " fail their CRC-32 check (recorded " + ckpt::hex32(c.crc) + ", computed " + ckpt::hex32(crc) +
                         ")");
}

void CheckpointReader::read_rows(const std::string& key, int64_t begin, int64_t end, const at::Tensor& dest) const {
  torch::NoGradGuard no_grad;
  if (on_gpu(dest)) {  // read on the host, then one copy to the device
    at::Tensor host = at::empty(dest.sizes(), dest.options().device(at::kCPU));
    read_rows(key, begin, end, host);
    dest.copy_(host);
    return;
  }
  const EntryMeta& e = entry(key);
  TORCH_CHECK(!e.is_bytes, "[checkpoint] ", key, " is not a tensor");
  TORCH_CHECK(0 <= begin && begin <= end && end <= e.rows(), "[checkpoint] rows [", begin, ", ", end, ") of ", key,
              " outside [0, ", e.rows(), ")");
  TORCH_CHECK(dest.is_contiguous(), "[checkpoint] destination of ", key, " must be contiguous");
  const int64_t rn = e.row_numel();
  at::Tensor d2 = dest.dim() == 0 ? dest.view({1, 1}) : dest.view({dest.size(0), -1});
  TORCH_CHECK(d2.size(0) >= end - begin && d2.size(1) == rn, "[checkpoint] destination of ", key,
              " has the wrong shape");
  const at::ScalarType st = dtype_of(e.dtype);
  for (const ChunkMeta& c : e.chunks) {
    const int64_t s = std::max(begin, c.row_begin), t = std::min(end, c.row_end);
    if (s >= t) continue;
    if (s == c.row_begin && t == c.row_end && st == d2.scalar_type()) {
      // The whole chunk lands in the destination as stored: read it there (no staging copy).
      read_chunk_into(e, c, d2.narrow(0, s - begin, t - s).data_ptr());
      continue;
    }
    std::string bytes = read_chunk(e, c);
    auto src = torch::from_blob(bytes.data(), {c.row_end - c.row_begin, rn}, torch::TensorOptions().dtype(st));
    d2.narrow(0, s - begin, t - s).copy_(src.narrow(0, s - c.row_begin, t - s));
  }
  if (d2.size(0) > end - begin) d2.narrow(0, end - begin, d2.size(0) - (end - begin)).zero_();
}

at::Tensor CheckpointReader::read_tensor(const std::string& key) const {
  const EntryMeta& e = entry(key);
  if (e.is_bytes) throw UserError("checkpoint " + dir_ + ": " + key + " is not a tensor");
  auto t = torch::empty(e.shape, torch::TensorOptions().dtype(dtype_of(e.dtype)));
  read_rows(key, 0, e.rows(), t);
  return t;
}

int64_t CheckpointReader::read_int(const std::string& key) const {
  auto t = read_tensor(key);
  // PyTorch's Adam keeps its step as a float32 scalar (DCP checkpoints): an integral value is fine.
  if (t.numel() != 1 || (t.is_floating_point() && t.item<double>() != std::floor(t.item<double>())))
    throw RuntimeFailure("checkpoint " + dir_ + ": " + key + " is not an integer scalar");
  return t.is_floating_point() ? static_cast<int64_t>(t.item<double>()) : t.item<int64_t>();
}

std::string CheckpointReader::read_bytes(const std::string& key) const {
  const EntryMeta& e = entry(key);
  if (!e.is_bytes) throw UserError("checkpoint " + dir_ + ": " + key + " is not a byte string");
  return read_chunk(e, e.chunks.at(0));
}

// ---- ModelState ----------------------------------------------------------------------------

void ModelState::state_dict(StateDict& sd) {
  for (const auto& p : params_) {
    at::Tensor t = p.local.detach();
    if (!export_dtype_.empty() && dtype_of(export_dtype_) != t.scalar_type())
      t = t.narrow(0, 0, p.end - p.begin).to(dtype_of(export_dtype_));
    sd.sharded(p.fqn, t, p.global_shape, p.begin, p.end, save_here_);
  }
}

void ModelState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& p : params_) {
    if (!ckpt.has(p.fqn))
      throw UserError("checkpoint " + ckpt.path() + " has no model parameter " + p.fqn + " (another model?)");
    ckpt.require_tensor(p.fqn, p.global_shape);
  }
}

void ModelState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& p : params_) ckpt.read_rows(p.fqn, p.begin, p.end, p.local.detach());
}

void ModelState::check_load_hf(const HFCheckpoint& hf) const {
  for (const auto& p : params_) hf.check_param(p.fqn, p.global_shape);
}

void ModelState::load_hf(const HFCheckpoint& hf) {
  for (const auto& p : params_) hf.read_param_rows(p.fqn, p.global_shape, p.begin, p.end, p.local.detach());
}

int64_t ModelState::vocab_size() const {
  for (const auto& p : params_)
    if (p.fqn == "tok_embeddings.weight") return p.global_shape.at(0);
  return 0;
}

// ---- OptimizerState ------------------------------------------------------------------------

OptimizerState::OptimizerState(torch::optim::Optimizer& opt, std::vector<ShardedParam> params, bool save_here)
    : opt_(&opt), params_(std::move(params)), save_here_(save_here) {
  TORCH_CHECK(dynamic_cast<torch::optim::AdamW*>(&opt) || dynamic_cast<torch::optim::Adam*>(&opt),
              "[checkpoint] only Adam and AdamW optimizer state can be checkpointed");
}

void OptimizerState::state_dict(StateDict& sd) {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    AdamRefs a = adam_refs(*opt_, p.local);
    sd.sharded(k + "exp_avg", a.exp_avg, p.global_shape, p.begin, p.end, save_here_);
    sd.sharded(k + "exp_avg_sq", a.exp_avg_sq, p.global_shape, p.begin, p.end, save_here_);
    sd.replicated_int(k + "step", a.get_step());
  }
}

void OptimizerState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    if (!ckpt.has(k + "exp_avg") || !ckpt.has(k + "exp_avg_sq") || !ckpt.has(k + "step"))
      throw UserError("checkpoint " + ckpt.path() + " has no optimizer state for " + p.fqn +
                      " (HINT: checkpoint.exclude_from_loading = [\"optimizer\"] starts a fresh optimizer)");
    ckpt.require_tensor(k + "exp_avg", p.global_shape);
    ckpt.require_tensor(k + "exp_avg_sq", p.global_shape);
  }
}

void OptimizerState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    AdamRefs a = adam_refs(*opt_, p.local);
    ckpt.read_rows(k + "exp_avg", p.begin, p.end, a.exp_avg);
    ckpt.read_rows(k + "exp_avg_sq", p.begin, p.end, a.exp_avg_sq);
    a.set_step(ckpt.read_int(k + "step"));
  }
}

// ---- ScalarsState --------------------------------------------------------------------------

void ScalarsState::state_dict(StateDict& sd) {
  for (const auto& [name, ptr] : fields_) sd.replicated_int(prefix_ + "." + name, *ptr);
}

void ScalarsState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& f : fields_)
    if (!ckpt.has(prefix_ + "." + f.first))
      throw UserError("checkpoint " + ckpt.path() + " has no " + prefix_ + "." + f.first +
                      " (HINT: checkpoint.exclude_from_loading = [\"" + prefix_ + "\"] starts it fresh)");
}

void ScalarsState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& [name, ptr] : fields_) *ptr = ckpt.read_int(prefix_ + "." + name);
}

// ---- RngState ------------------------------------------------------------------------------

void RngState::state_dict(StateDict& sd) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor st;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    st = gen.get_state();
  }
  sd.per_rank_bytes("rng.rank_" + std::to_string(rank_),
                    std::string(static_cast<const char*>(st.data_ptr()), st.numel()));
}

void RngState::load_state_dict(const CheckpointReader& ckpt) {
  auto gen = at::detail::getDefaultCPUGenerator();
  const std::string key = "rng.rank_" + std::to_string(rank_);
  if (!ckpt.has(key)) {
    spdlog::warn("checkpoint {} has no RNG state for rank {} (saved on {} ranks): seeding it from seed {} + rank",
                 ckpt.path(), rank_, ckpt.meta().world_size, seed_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed_ + static_cast<uint64_t>(rank_));
    return;
  }
  std::string bytes = ckpt.read_bytes(key);
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

// ---- DataLoaderState -----------------------------------------------------------------------

void DataLoaderState::state_dict(StateDict& sd) {
  sd.per_rank_bytes("dataloader.dp_rank_" + std::to_string(dp_rank_), get_());
  sd.replicated_int("dataloader.world_size", dp_world_);
}

void DataLoaderState::check_load(const CheckpointReader& ckpt) const {
  if (!ckpt.has("dataloader.world_size"))
    throw UserError("checkpoint " + ckpt.path() +
                    " has no dataloader state (HINT: checkpoint.exclude_from_loading = "
                    "[\"dataloader\"] starts a fresh data order)");
  const int64_t saved = ckpt.read_int("dataloader.world_size");
  if (saved == dp_world_) {
    ckpt.entry("dataloader.dp_rank_" + std::to_string(dp_rank_));
    return;
  }
  if (reshard_ != "redistribute")
    throw UserError("checkpoint " + ckpt.path() + " was saved with data-parallel degree " + std::to_string(saved) +
                    " and this run has data-parallel degree " + std::to_string(dp_world_) +
                    ": the data loader position cannot be restored as saved; choose "
                    "checkpoint.exclude_from_loading = [\"dataloader\"] (start a fresh data order) or "
                    "checkpoint.dataloader_reshard = \"redistribute\" (continue the document stream where the "
                    "saved ranks had reached; the setting for elastic runs, torchrun --nnodes MIN:MAX, whose "
                    "restarts may change the world size)");
  for (int64_t r = 0; r < saved; ++r) ckpt.entry("dataloader.dp_rank_" + std::to_string(r));
}

void DataLoaderState::load_state_dict(const CheckpointReader& ckpt) {
  const int64_t saved = ckpt.read_int("dataloader.world_size");
  if (saved == dp_world_) {
    set_(ckpt.read_bytes("dataloader.dp_rank_" + std::to_string(dp_rank_)));
    return;
  }
  TORCH_CHECK(redistribute_, "[checkpoint] dataloader redistribution requested but not available");
  std::vector<std::string> states;
  for (int64_t r = 0; r < saved; ++r) states.push_back(ckpt.read_bytes("dataloader.dp_rank_" + std::to_string(r)));
  set_(redistribute_(states, dp_rank_, dp_world_));
}

// ---- config --------------------------------------------------------------------------------

const std::vector<std::string>& checkpoint_component_names() {
  static const std::vector<std::string> names = {"model",      "optimizer",   "lr_scheduler",
                                                 "dataloader", "train_state", "rng"};
  return names;
}

void check_checkpoint_config(const JobConfig& cfg) {
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

bool will_load_model(const CheckpointOptions& o) {
  if (!o.enable) return false;
  const auto& ex = o.exclude_from_loading;
  if (std::find(ex.begin(), ex.end(), "model") != ex.end()) return false;
  return o.load_step >= 0 || !ckpt::scan_folder(o.folder).complete.empty() || !o.initial_load_path.empty();
}

CheckpointOptions checkpoint_options(const JobConfig& cfg) {
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
  o.dcp = c.format == "dcp";
  o.model_name = cfg.model.name;
  o.model_flavor = cfg.model.flavor;
  return o;
}

// ---- CheckpointManager ---------------------------------------------------------------------

struct CheckpointManager::Pending {
  std::string folder, stage, final_dir;
  int64_t step = 0;
  bool model_only = false;
  bool hf = false;      // converted to an HF folder when committed (checkpoint.last_save_in_hf)
  bool dcp = false;     // a torch.distributed.checkpoint folder (checkpoint.format = "dcp")
  bool pinned = false;  // some entries live in the pinned staging buffer until the write ends
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
  begin_save(opt_.folder, step, model_only, opt_.async && !last_step, model_only && opt_.last_save_in_hf);
  if (ms) ms->set_export_dtype("");
  if (!opt_.async || last_step) complete_save();
}

bool CheckpointManager::save_now(int64_t step) {
  if (!opt_.enable || opt_.load_only) return false;
  if (pending_ && pending_->step == step) {  // an async save of this very step: commit it
    complete_save();
    return true;
  }
  if (step == last_saved_step_) return true;
  if (pending_) complete_save();
  begin_save(opt_.folder, step, /*model_only=*/false, /*async=*/false);
  complete_save();
  return true;
}

void CheckpointManager::save_to(const std::string& folder, int64_t step, bool model_only) {
  if (pending_) complete_save();
  begin_save(folder, step, model_only, false);
  complete_save();
}

void CheckpointManager::finalize() {
  if (pending_) complete_save();
}

void CheckpointManager::begin_save(const std::string& folder, int64_t step, bool model_only, bool async, bool hf) {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  std::vector<StateEntry> entries = collect_entries(model_only, hf, bytes);
  const std::string stage = ckpt::staging_dir(folder, step);
  agree_to_begin(folder, stage, step, bytes);
  pending_ = std::make_unique<Pending>();
  Pending& p = *pending_;
  p.folder = folder;
  p.stage = stage;
  p.final_dir = ckpt::step_dir(folder, step);
  p.step = step;
  p.model_only = model_only;
  p.hf = hf;
  p.dcp = opt_.dcp && !hf;  // an HF final save is assembled from ctitan's own shard files
  p.t0 = t0;
  p.bytes = bytes;
  stage_entries(entries, async, p);
  p.entries = std::move(entries);
  start_write(p, async);
  p.blocked_s = seconds_since(t0);  // async: staging and starting the writer; sync: the whole write
}

// What this rank will write: its own entries (replicated ones only on rank 0), and their bytes.
std::vector<StateEntry> CheckpointManager::collect_entries(bool model_only, bool hf, uint64_t& bytes) {
  StateDict sd;
  for (const auto& [name, s] : components_)
    if (!model_only || name == "model") s->state_dict(sd);
  if (opt_.dcp && !hf && !model_only && dcp_extras_) dcp_extras_(sd);
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
      p.status = "ok\n" + (p.dcp ? write_rank_dcp(p.entries, p.stage, comm_.rank, p.step)
                                 : write_rank_file(p.entries, p.stage, comm_.rank, p.step));
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
      // Measured by bench/checkpoint_io.sh (README, "Checkpoint I/O").
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
  const std::string tag = "checkpoint_save:step-" + std::to_string(p.step);
  const std::string what = "checkpoint save of step " + std::to_string(p.step);
  const std::vector<std::string> all = agree_written(p);
  const std::string previous = previous_checkpoint_note(p.folder);
  std::vector<std::string> failed;
  for (int64_t r = 0; r < comm_.world_size; ++r)
    if (all[r].rfind("ok\n", 0) != 0) failed.push_back("rank " + std::to_string(r) + ": " + all[r].substr(6));
  if (!failed.empty()) {
    if (comm_.rank == 0) {
      std::error_code ec;
      fs::remove_all(p.stage, ec);
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
  spdlog::info(
      "checkpoint: saved step {}{} to {} ({:.1f} MiB on this rank, {:.2f} s; file written in {:.2f} s; "
      "training blocked {:.2f} s)",
      p.step,
      p.hf           ? " (model only, HF safetensors)"
      : p.model_only ? " (model only)"
                     : "",
      p.final_dir, p.bytes / double(1 << 20), seconds_since(p.t0), p.write_s, p.blocked_s);
  last_saved_step_ = p.step;
  const std::string folder = p.folder;
  const bool regular = folder == opt_.folder;
  pending_.reset();
  if (regular && comm_.rank == 0) purge(folder);
}

// Every rank's write status ("ok\n<its file, chunk and entry records>" or "error ..."). A rank
// that never arrives (died or stalled) is named, and the save abandoned.
std::vector<std::string> CheckpointManager::agree_written(Pending& p) {
  const std::string tag = "checkpoint_save:step-" + std::to_string(p.step);
  const std::string what = "checkpoint save of step " + std::to_string(p.step);
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
    if (comm_.rank == 0) fs::remove_all(p.stage);
    pending_.reset();
    throw CollectiveFailure(what + " failed: " + who + e.what());
  }
}

// Rank 0's part of round 3: the metadata (ctitan's or DCP's), the marker, the HF assembly of a
// final HF save, the folder moved into place. Returns "ok" or "error <why>".
std::string CheckpointManager::commit_on_rank0(Pending& p, const std::vector<std::string>& all) {
  try {
    if (p.dcp) {
      write_dcp_metadata(all, p.stage, p.step);
      publish_stage(p.stage, p.final_dir, p.folder);
      return "ok";
    }
    const std::string text = metadata_text(p, all);
    Metadata::parse(text, "checkpoint metadata of step " + std::to_string(p.step));  // validates coverage
    ckpt::write_file_durable((fs::path(p.stage) / "metadata").string(), text);
    ckpt::write_file_durable((fs::path(p.stage) / "COMPLETE").string(), ckpt::complete_marker_text(p.step, text));
    if (p.hf) {
      // As torchtitan's HF storage writer with consolidation: every rank wrote its shards,
      // one rank assembles the full tensors into the safetensors file. The shard files go;
      // the marker then covers the HF index instead of the metadata.
      const std::string index = write_hf_from_checkpoint(CheckpointReader(p.stage), p.stage, "");
      for (const auto& de : fs::directory_iterator(p.stage)) {
        const std::string n = de.path().filename().string();
        if (n.rfind("rank", 0) == 0 || n == "metadata") fs::remove(de.path());
      }
      ckpt::write_file_durable((fs::path(p.stage) / "COMPLETE").string(), ckpt::hf_complete_marker_text(p.step, index));
    }
    // An older checkpoint of the same step (load_step rewound the run) is replaced only now.
    publish_stage(p.stage, p.final_dir, p.folder);
    return "ok";
  } catch (const std::exception& e) {
    return "error " + one_line(e.what());
  }
}

// The metadata file's text: the header, then every rank's file records, the entries (which
// every rank must describe alike) and the chunks.
std::string CheckpointManager::metadata_text(const Pending& p, const std::vector<std::string>& all) const {
  Metadata m;
  m.step = p.step;
  m.world_size = comm_.world_size;
  m.dp_replicate = opt_.dp_replicate;
  m.dp_shard = opt_.dp_shard;
  m.model_name = opt_.model_name;
  m.model_flavor = opt_.model_flavor;
  m.model_only = p.model_only;
  std::string head = "ctitan-checkpoint " + std::to_string(ckpt::kFormatVersion) + "\nstep " + std::to_string(m.step) +
                     "\nworld_size " + std::to_string(m.world_size) + "\ndp " + std::to_string(m.dp_replicate) + " " +
                     std::to_string(m.dp_shard) + "\nmodel " + m.model_name + " " + m.model_flavor + "\nmodel_only " +
                     (m.model_only ? "1" : "0") + "\n";
  std::string files, chunks;
  std::map<std::string, std::string> entries;  // key → entry record (identical on every rank)
  for (int64_t r = 0; r < comm_.world_size; ++r) {
    std::istringstream in(all[r].substr(3));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("file ", 0) == 0) {
        files += line + "\n";
      } else if (line.rfind("chunk ", 0) == 0) {
        chunks += line + "\n";
      } else if (line.rfind("entry ", 0) == 0) {
        const std::string key = line.substr(6, line.find(' ', 6) - 6);
        auto [it, fresh] = entries.emplace(key, line);
        TORCH_CHECK(fresh || it->second == line, "[checkpoint] ranks disagree on ", key, ": ", it->second, " vs ",
                    line);
      }
    }
  }
  std::string text = head + files;
  for (const auto& kv : entries) text += kv.second + "\n";
  return text + chunks + "end\n";
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

// ---- load: find the step, decide what to load, read, apply, fall back ----------------------

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
    hf = std::make_unique<HFCheckpoint>(path);
    const HFModelConfig want = hf_config_for(opt_.model_name, opt_.model_flavor, ms->vocab_size());
    const std::string diff = structure_difference(hf->config(), want);
    if (!diff.empty())
      throw UserError("HF checkpoint " + path + " (config.json) describes another model than this run's " +
                      opt_.model_name + " \"" + opt_.model_flavor + "\" (" + diff + ", checkpoint vs run)");
    ms->check_load_hf(*hf);
  });
  if (comm_.rank == 0) {
    const HFModelConfig& c = hf->config();
    const HFModelConfig want = hf_config_for(opt_.model_name, opt_.model_flavor, ms->vocab_size());
    if (c.rope_theta != want.rope_theta || c.rms_norm_eps != want.rms_norm_eps ||
        c.rope_scaling.has_value() != want.rope_scaling.has_value())
      spdlog::warn(
          "checkpoint: HF config.json has rope_theta {}, rms_norm_eps {}, rope_scaling {}; this run's model "
          "uses {}, {}, {} (the weights load, the outputs will differ from the HF model's)",
          c.rope_theta, c.rms_norm_eps, c.rope_scaling ? kHfRopeScalingType : "none", want.rope_theta,
          want.rms_norm_eps, want.rope_scaling ? kHfRopeScalingType : "none");
    const auto unused = hf->unused_keys(ctitan_params(c));
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
