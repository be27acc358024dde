// Packing, per-rank split and exact resume; see dataloader.h.
#include "datasets/dataloader.h"

#include <filesystem>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "datasets/json_lite.h"

namespace ctitan {
namespace {

constexpr const char* kFormat = "ctitan.dataloader";
constexpr int64_t kVersion = 1;

std::string basename_of(const std::string& path) {
  std::filesystem::path p(path);
  if (!p.has_filename()) p = p.parent_path();  // "dir/" -> "dir"
  return p.filename().string();
}

}  // namespace

DataLoader::DataLoader(const Tokenizer& tokenizer, std::string source_path, int64_t seq_len,
                       int64_t local_batch_size, int64_t dp_rank, int64_t dp_world,
                       std::string name)
    : tokenizer_(&tokenizer),
      reader_(source_path),
      name_(name.empty() ? basename_of(source_path) : std::move(name)),
      seq_len_(seq_len),
      batch_size_(local_batch_size),
      dp_rank_(dp_rank),
      dp_world_(dp_world) {
  reader_.report_bad_documents(true);
  if (seq_len < 1) {
    throw UserError("dataloader: seq_len=" + std::to_string(seq_len) + " must be >= 1");
  }
  if (local_batch_size < 1) {
    throw UserError("dataloader: local_batch_size=" + std::to_string(local_batch_size) +
                    " must be >= 1");
  }
  if (dp_world < 1 || dp_rank < 0 || dp_rank >= dp_world) {
    throw UserError("dataloader: dp rank " + std::to_string(dp_rank) + " is not in [0, " +
                    std::to_string(dp_world) + ")");
  }
}

void DataLoader::fill(size_t need) {
  Document doc;
  while (buffer_.size() - head_ < need && !exhausted_) {
    if (!reader_.next(&doc)) {
      // End of data. The stream held next_document documents; rank r owns some iff r < N.
      const int64_t total = reader_.position().next_document;
      if (total == 0)
        throw UserError("dataset " + name_ + " holds no documents (its files are empty or only blank lines)");
      if (total <= dp_rank_) {
        throw UserError("dataset " + name_ + " has " + std::to_string(total) +
                        " documents, too few for dp degree " + std::to_string(dp_world_) +
                        ": dp rank " + std::to_string(dp_rank_) + " gets none");
      }
      if (!repeat_) {
        exhausted_ = true;
        return;
      }
      epoch_ += 1;
      spdlog::warn("dataset {} exhausted on dp rank {}, re-looping (epoch {})", name_, dp_rank_,
                   epoch_);
      reader_.rewind();
      continue;
    }
    if (doc.index % dp_world_ != dp_rank_) continue;
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
    const std::vector<int32_t> ids = tokenizer_->encode(doc.text, /*bos=*/true, /*eos=*/true);
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

std::string DataLoader::state_dict() const {
  const SourcePosition pos = reader_.position();
  const std::string file_name =
      pos.file < reader_.files().size() ? basename_of(reader_.files()[pos.file]) : "";
  std::string s;
  s.reserve(512 + (buffer_.size() - head_) * 6);
  s += "{\"format\":" + json::quote(kFormat);
  s += ",\"version\":" + std::to_string(kVersion);
  s += ",\"dp_rank\":" + std::to_string(dp_rank_);
  s += ",\"dp_world\":" + std::to_string(dp_world_);
  s += ",\"seq_len\":" + std::to_string(seq_len_);
  s += ",\"vocab_size\":" + std::to_string(tokenizer_->vocab_size());
  s += ",\"epoch\":" + std::to_string(epoch_);
  s += ",\"windows_produced\":" + std::to_string(windows_);
  s += ",\"next_document\":" + std::to_string(pos.next_document);
  s += ",\"file_index\":" + std::to_string(pos.file);
  s += ",\"file_name\":" + json::quote(file_name);
  s += ",\"file_offset\":" + std::to_string(pos.offset);
  s += ",\"file_line\":" + std::to_string(pos.line);
  s += ",\"skipped_documents\":" + std::to_string(skipped_);
  s += ",\"buffer\":[";
  for (size_t i = head_; i < buffer_.size(); ++i) {
    if (i > head_) s += ',';
    s += std::to_string(buffer_[i]);
  }
  s += "]}";
  return s;
}

void DataLoader::load_state_dict(const std::string& state) {
  const std::string where = "dataloader state for dataset " + name_;
  json::Value root;
  std::string err;
  if (!json::parse(state, &root, &err)) {
    throw UserError(where + " is corrupt: invalid JSON (" + err + ")");
  }
  if (root.type != json::Value::Type::Object) {
    throw UserError(where + " is corrupt: expected a JSON object");
  }
  auto get_int = [&](const char* key, int64_t min) {
    const json::Value* v = root.find(key);
    int64_t out = 0;
    if (v == nullptr) throw UserError(where + " is corrupt: missing \"" + key + "\"");
    if (!v->as_int64(&out) || out < min) {
      throw UserError(where + " is corrupt: \"" + key + "\" is not an integer >= " +
                      std::to_string(min));
    }
    return out;
  };
  const json::Value* format = root.find("format");
  if (format == nullptr || format->type != json::Value::Type::String || format->text != kFormat) {
    throw UserError(where + " is corrupt: \"format\" is not \"" + kFormat + "\"");
  }
  const int64_t version = get_int("version", 0);
  if (version != kVersion) {
    throw UserError(where + " has version " + std::to_string(version) + "; this build reads " +
                    std::to_string(kVersion));
  }
  const int64_t rank = get_int("dp_rank", 0);
  const int64_t world = get_int("dp_world", 1);
  if (rank != dp_rank_ || world != dp_world_) {
    throw UserError(where + " was saved by dp rank " + std::to_string(rank) + " of " +
                    std::to_string(world) + ", this is dp rank " + std::to_string(dp_rank_) +
                    " of " + std::to_string(dp_world_) +
                    " (changing the data-parallel degree of the dataloader is not supported)");
  }
  const int64_t vocab = get_int("vocab_size", 1);
  if (vocab != tokenizer_->vocab_size()) {
    throw UserError(where + " was saved with a tokenizer of vocab_size " +
                    std::to_string(vocab) + ", this tokenizer has " +
                    std::to_string(tokenizer_->vocab_size()));
  }
  const int64_t epoch = get_int("epoch", 0);
  const int64_t windows = get_int("windows_produced", 0);
  SourcePosition pos;
  pos.next_document = get_int("next_document", 0);
  pos.file = static_cast<size_t>(get_int("file_index", 0));
  pos.offset = static_cast<uint64_t>(get_int("file_offset", 0));
  pos.line = get_int("file_line", 0);
  const int64_t skipped = root.find("skipped_documents") ? get_int("skipped_documents", 0) : 0;
  const json::Value* file_name = root.find("file_name");
  if (file_name == nullptr || file_name->type != json::Value::Type::String) {
    throw UserError(where + " is corrupt: missing \"file_name\"");
  }
  if (pos.file < reader_.files().size() &&
      file_name->text != basename_of(reader_.files()[pos.file])) {
    throw UserError(where + " points into " + file_name->text + " but file " +
                    std::to_string(pos.file) + " of " + reader_.source_path() + " is " +
                    basename_of(reader_.files()[pos.file]) + " (different corpus?)");
  }
  const json::Value* buf = root.find("buffer");
  if (buf == nullptr || buf->type != json::Value::Type::Array) {
    throw UserError(where + " is corrupt: missing \"buffer\" array");
  }
  std::vector<int64_t> buffer;
  buffer.reserve(buf->items.size());
  for (const auto& item : buf->items) {
    int64_t id = 0;
    if (!item.as_int64(&id) || id < 0 || id >= vocab) {
      throw UserError(where + " is corrupt: \"buffer\" holds a value that is not a token id");
    }
    buffer.push_back(id);
  }
  reader_.seek(pos);  // validates the position against the files; throws before any change
  epoch_ = epoch;
  windows_ = windows;
  skipped_ = skipped;
  buffer_ = std::move(buffer);
  head_ = 0;
}

}  // namespace ctitan
