// Packing, per-rank split and exact resume; see dataloader.h.
#include "datasets/dataloader.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "datasets/token_shard.h"
#include "util/env.h"

namespace ctitan {
namespace {

std::string basename_of(const std::string& path) {
  std::filesystem::path p(path);
  if (!p.has_filename()) p = p.parent_path();  // "dir/" -> "dir"
  return p.filename().string();
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

DataLoader::DataLoader(const Tokenizer& tokenizer, std::string source_path, int64_t seq_len, int64_t local_batch_size,
                       int64_t dp_rank, int64_t dp_world, std::string name)
    : tokenizer_(&tokenizer),
      reader_(source_path),
      name_(name.empty() ? basename_of(source_path) : std::move(name)),
      seq_len_(seq_len),
      batch_size_(local_batch_size),
      dp_rank_(dp_rank),
      dp_world_(dp_world),
      delay_ms_(runtime_env().data_delay_ms) {
  reader_.report_bad_documents(true);
  if (seq_len < 1) {
    throw UserError("dataloader: seq_len=" + std::to_string(seq_len) + " must be >= 1");
  }
  if (local_batch_size < 1) {
    throw UserError("dataloader: local_batch_size=" + std::to_string(local_batch_size) + " must be >= 1");
  }
  if (dp_world < 1 || dp_rank < 0 || dp_rank >= dp_world) {
    throw UserError("dataloader: dp rank " + std::to_string(dp_rank) + " is not in [0, " + std::to_string(dp_world) +
                    ")");
  }
  // What sharding needs of each file: sizes from the file system (.ctok: from its header,
  // which is also where a shard made with another tokenizer is refused).
  uint64_t tok_hash = 0;
  for (const std::string& path : reader_.files()) {
    SourceFile f;
    f.name = basename_of(path);
    std::error_code ec;
    if (ends_with(path, ".ctok")) {
      const TokenShardHeader h = read_token_shard_header(path);
      if (tok_hash == 0) tok_hash = tokenizer_hash(tokenizer);
      if (h.tokenizer_hash != tok_hash || static_cast<int64_t>(h.vocab_size) != tokenizer.vocab_size())
        throw UserError("dataset: " + path + " was tokenized with " + h.tokenizer_name + " (hash " +
                        hex(h.tokenizer_hash) + ", vocab_size " + std::to_string(h.vocab_size) +
                        ") but this run's tokenizer is " + tokenizer.model_path() + " (hash " + hex(tok_hash) +
                        ", vocab_size " + std::to_string(tokenizer.vocab_size()) +
                        "); tokenize the corpus again with this tokenizer, or use the shard's");
      f.extent = h.documents;
      f.unit_weight = h.documents ? std::max<uint64_t>(1, h.tokens * 4 / h.documents) : 1;
    } else {
      f.extent = std::filesystem::file_size(path, ec);
      if (ec) throw UserError("dataset: cannot read the size of " + path + ": " + ec.message());
      f.splittable = !ends_with(path, ".gz");
    }
    sources_.push_back(f);
  }
  new_pass();
}

void DataLoader::new_pass() {
  std::vector<std::string> shared;
  work_ = plan_pass(sources_, dp_rank_, dp_world_, &shared);
  cur_ = 0;
  unit_open_ = false;
  pass_fresh_ = true;
  pass_docs_ = 0;
  static bool said = false;  // once a process
  if (!shared.empty() && !said) {
    said = true;
    spdlog::warn(
        "dataset {}: {} is gzip-compressed and cannot be split by bytes: the ranks sharing it each "
        "inflate all of it and keep every k-th document (more files than dp ranks avoid this)",
        name_, shared.front());
  }
}

void DataLoader::no_documents() const {
  if (dp_world_ == 1)
    throw UserError("dataset " + name_ + " holds no documents (its files are empty or only blank lines)");
  std::string share;
  for (const WorkUnit& u : plan_pass(sources_, dp_rank_, dp_world_)) {
    share += (share.empty() ? "" : ", ") + sources_[u.file].name;
    if (u.begin != 0 || u.end != WorkUnit::kToEnd)
      share += (ends_with(sources_[u.file].name, ".ctok") ? " documents " : " bytes ") + std::to_string(u.begin) +
               ".." + std::to_string(u.end);
    if (u.stride > 1) share += " every " + std::to_string(u.stride) + "th document";
  }
  throw UserError("dataset " + name_ + ": dp rank " + std::to_string(dp_rank_) + " of " + std::to_string(dp_world_) +
                  " gets no documents (its share: " + share + "); too few documents for dp degree " +
                  std::to_string(dp_world_));
}

void DataLoader::fill(size_t need) {
  Document doc;
  while (buffer_.size() - head_ < need && !exhausted_) {
    if (cur_ >= work_.size()) {  // this pass is done
      if (pass_fresh_ && pass_docs_ == 0) no_documents();
      if (!repeat_) {
        exhausted_ = true;
        return;
      }
      epoch_ += 1;
      spdlog::warn("dataset {} exhausted on dp rank {}, re-looping (epoch {})", name_, dp_rank_, epoch_);
      new_pass();
      continue;
    }
    WorkUnit& u = work_[cur_];
    if (!unit_open_) {
      reader_.set_range(u.file, u.begin, u.end, u.chain);
      unit_open_ = true;
    }
    if (!reader_.next(&doc)) {
      ++cur_;
      unit_open_ = false;
      continue;
    }
    const SourcePosition at = reader_.position();
    u.file = at.file;
    u.begin = at.offset;
    ++parsed_;
    if (u.ordinal++ % u.stride != u.phase) continue;
    ++pass_docs_;
    if (!doc.error.empty()) {
      const std::string where = reader_.files()[doc.file] + ":" + std::to_string(doc.line);
      if (bad_mode_ == BadDocuments::kStop) {
        throw UserError("dataset: " + where + ": " + doc.error +
                        " (on_bad_document = \"skip\" would skip and count it)");
      }
      skipped_ += 1;
      if (skipped_ <= 10) {
        spdlog::warn("dataset: skipping {}: {}{}", where, doc.error,
                     skipped_ == 10 ? " (further skips on this rank are only counted)" : "");
      }
      continue;
    }
    std::vector<int32_t> encoded;
    if (doc.ids.empty()) encoded = tokenizer_->encode(doc.text, /*bos=*/true, /*eos=*/true);
    const std::vector<int32_t>& ids = doc.ids.empty() ? encoded : doc.ids;
    // Drop the consumed prefix now and then so the buffer stays ~one window long.
    if (head_ > 0 && head_ * 2 >= buffer_.size()) {
      buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
    buffer_.insert(buffer_.end(), ids.begin(), ids.end());
  }
}

bool DataLoader::has_next_batch() {
  const size_t need = static_cast<size_t>(batch_size_) * static_cast<size_t>(seq_len_ + 1);
  fill(need);
  return buffer_.size() - head_ >= need;
}

std::vector<int64_t> DataLoader::next_window() {
  const size_t len = static_cast<size_t>(seq_len_) + 1;
  fill(len);
  if (buffer_.size() - head_ < len)
    throw std::logic_error("[dataloader] " + name_ + ": next() past the end of the data (repeat is off)");
  const auto first = buffer_.begin() + static_cast<std::ptrdiff_t>(head_);
  std::vector<int64_t> window(first, first + static_cast<std::ptrdiff_t>(len));
  head_ += len;  // no overlap: the next window starts after these seq_len+1 tokens
  windows_ += 1;
  return window;
}

Batch DataLoader::next() {
  if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
  Batch b;
  b.batch = batch_size_;
  b.seq = seq_len_;
  const auto T = static_cast<size_t>(seq_len_);
  b.inputs.reserve(static_cast<size_t>(batch_size_) * T);
  b.labels.reserve(static_cast<size_t>(batch_size_) * T);
  for (int64_t i = 0; i < batch_size_; ++i) {
    const std::vector<int64_t> w = next_window();
    b.inputs.insert(b.inputs.end(), w.begin(), w.begin() + static_cast<std::ptrdiff_t>(T));
    b.labels.insert(b.labels.end(), w.begin() + 1, w.end());
  }
  return b;
}

LoaderState DataLoader::state() const {
  LoaderState s;
  s.dp_rank = dp_rank_;
  s.dp_world = dp_world_;
  s.seq_len = seq_len_;
  s.vocab_size = tokenizer_->vocab_size();
  s.epoch = epoch_;
  s.windows = windows_;
  s.skipped = skipped_;
  for (const auto& f : sources_) s.files.push_back(f.name);
  s.work.assign(work_.begin() + static_cast<std::ptrdiff_t>(std::min(cur_, work_.size())), work_.end());
  s.buffer.assign(buffer_.begin() + static_cast<std::ptrdiff_t>(head_), buffer_.end());
  return s;
}

std::string DataLoader::state_dict() const { return to_json(state()); }

void DataLoader::load_state_dict(const std::string& state) {
  const std::string where = "dataloader state for dataset " + name_;
  LoaderState s = parse_loader_state(state, sources_, tokenizer_->vocab_size(), where);
  if (s.dp_rank != dp_rank_ || s.dp_world != dp_world_) {
    throw UserError(where + " was saved by dp rank " + std::to_string(s.dp_rank) + " of " + std::to_string(s.dp_world) +
                    ", this is dp rank " + std::to_string(dp_rank_) + " of " + std::to_string(dp_world_) +
                    " (changing the data-parallel degree needs checkpoint.dataloader_reshard = \"redistribute\")");
  }
  if (s.version == 1 && !s.work.empty()) {
    // An older build's position must be a document start, as that build checked it.
    SourcePosition pos;
    pos.next_document = s.work.front().ordinal;
    pos.file = s.work.front().file;
    pos.offset = s.work.front().begin;
    reader_.seek(pos);
  }
  epoch_ = s.epoch;
  windows_ = s.windows;
  skipped_ = s.skipped;
  buffer_ = std::move(s.buffer);
  head_ = 0;
  work_ = std::move(s.work);
  cur_ = 0;
  unit_open_ = false;
  pass_fresh_ = false;
  pass_docs_ = 0;
  exhausted_ = false;
}

std::string DataLoader::redistributed_state(const std::vector<std::string>& saved) const {
  std::vector<LoaderState> states;
  uint64_t buffered = 0;
  for (size_t r = 0; r < saved.size(); ++r) {
    const std::string where = "checkpoint: dataloader state of saved dp rank " + std::to_string(r);
    states.push_back(parse_loader_state(saved[r], sources_, tokenizer_->vocab_size(), where));
    buffered += states.back().buffer.size();
  }
  LoaderState mine = redistribute(states, sources_, dp_rank_, dp_world_);
  mine.seq_len = seq_len_;
  mine.vocab_size = tokenizer_->vocab_size();
  spdlog::info(
      "dataloader: redistributed from dp {} to dp {}: this rank takes {} of the saved ranks' remaining "
      "ranges and {} of their {} buffered tokens (epoch {})",
      saved.size(), dp_world_, mine.work.size(), mine.buffer.size(), buffered, mine.epoch);
  return to_json(mine);
}

}  // namespace ctitan
