// The checkpoint reader: a folder's index opened and checked, chunks read CRC-checked and
// re-sliced; see reader.h.
#include "checkpoint/reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <tuple>

#include <torch/torch.h>

#include "checkpoint/dcp.h"
#include "checkpoint/pickle.h"
#include "checkpoint/state_dict.h"
#include "config/errors.h"
#include "kernels/device_route.h"
#include "util/crc.h"
#include "util/strings.h"

namespace ctitan {

namespace fs = std::filesystem;
using ckpt::ChunkMeta;
using ckpt::EntryMeta;
using ckpt::Metadata;
using ckpt::Rule;

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

// Elements per row of a chunk: the entry's row, or the width of the chunk's box.
int64_t chunk_row_numel(const EntryMeta& e, const ChunkMeta& c) {
  if (c.inner_sizes.empty()) return e.row_numel();
  int64_t n = 1;
  for (int64_t s : c.inner_sizes) n *= s;
  return n;
}

// The chunk's {offset, size} in dim d >= 1 (no box: the whole dim).
std::pair<int64_t, int64_t> extent_in(const EntryMeta& e, const ChunkMeta& c, size_t d) {
  if (c.inner_sizes.empty()) return {0, e.shape[d]};
  return {c.inner_offsets[d - 1], c.inner_sizes[d - 1]};
}

// "offsets [o0, o1, ...] sizes [s0, s1, ...]": where a chunk lies, for errors.
std::string box_str(const ChunkMeta& c, const EntryMeta& e) {
  std::vector<int64_t> o = {c.row_begin}, n = {c.row_end - c.row_begin};
  for (size_t d = 1; d < e.shape.size(); ++d) {
    const auto [off, size] = extent_in(e, c, d);
    o.push_back(off);
    n.push_back(size);
  }
  return "offsets " + shape_str(o) + " sizes " + shape_str(n);
}

// True when the boxes of a and b share an element (their rows are known to intersect).
bool inner_overlap(const EntryMeta& e, const ChunkMeta& a, const ChunkMeta& b) {
  for (size_t d = 1; d < e.shape.size(); ++d) {
    const auto [ao, an] = extent_in(e, a, d);
    const auto [bo, bn] = extent_in(e, b, d);
    if (std::max(ao, bo) >= std::min(ao + an, bo + bn)) return false;
  }
  return true;
}

// The chunks (sorted by first row) must tile the tensor exactly once: none overlaps another,
// and their elements add up to the tensor's (so none is missing). Chunks sharing rows are
// compared pairwise; a dim-0 sharding compares each chunk with its successor only.
void check_tiling(const std::string& dir, const EntryMeta& e) {
  const int64_t numel = e.rows() * e.row_numel();
  int64_t total = 0;
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const ChunkMeta& a = e.chunks[i];
    total += (a.row_end - a.row_begin) * chunk_row_numel(e, a);
    for (size_t j = i + 1; j < e.chunks.size() && e.chunks[j].row_begin < a.row_end; ++j)
      if (inner_overlap(e, a, e.chunks[j]))
        throw RuntimeFailure("checkpoint " + dir + " is corrupt: two chunks of " + e.key + " overlap (" +
                             box_str(a, e) + " and " + box_str(e.chunks[j], e) + ")");
  }
  if (total != numel)
    throw RuntimeFailure("checkpoint " + dir + " is corrupt: the chunks of " + e.key + " do not cover its shape " +
                         shape_str(e.shape) + " exactly once (they hold " + std::to_string(total) + " of its " +
                         std::to_string(numel) + " elements)");
}

// A DCP tensor item as ctitan's entry: its chunks, boxes tiling it exactly once (replicated
// when one chunk holds it all). A chunk spanning dims 1.. whole is a dim-0 slice (FSDP),
// re-sliced like ctitan's own chunks; others (tensor parallelism) keep their box in
// inner_offsets / inner_sizes. The items' files are added to `files`.
EntryMeta dcp_tensor_entry(const std::string& dir, const std::string& key, const dcp::Item& it,
                           std::set<std::string>& files) {
  EntryMeta e;
  e.key = key;
  e.dtype = it.dtype;
  e.shape = it.size;
  for (const auto& c : it.chunks) {
    files.insert(c.file);
    ChunkMeta cm;
    cm.file = c.file;
    cm.offset = c.offset;
    cm.nbytes = c.length;
    cm.encoding = ChunkMeta::Encoding::TorchSave;
    cm.row_begin = it.size.empty() ? 0 : c.offsets[0];
    cm.row_end = it.size.empty() ? 1 : c.offsets[0] + c.sizes[0];
    bool whole_rows = true, empty = cm.row_end <= cm.row_begin;
    for (size_t d = 0; d < it.size.size(); ++d) {
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] + c.sizes[d] > it.size[d])
        throw RuntimeFailure("checkpoint " + dir + " is corrupt: a chunk of " + key + " at offsets " +
                             shape_str(c.offsets) + " sizes " + shape_str(c.sizes) + " lies outside its shape " +
                             shape_str(it.size));
      if (d > 0 && (c.offsets[d] != 0 || c.sizes[d] != it.size[d])) whole_rows = false;
      if (c.sizes[d] == 0) empty = true;
    }
    if (empty) continue;  // FSDP's share of a rank past the last row
    if (!whole_rows) {
      cm.inner_offsets.assign(c.offsets.begin() + 1, c.offsets.end());
      cm.inner_sizes.assign(c.sizes.begin() + 1, c.sizes.end());
    }
    e.chunks.push_back(std::move(cm));
  }
  std::sort(e.chunks.begin(), e.chunks.end(), [](const ChunkMeta& a, const ChunkMeta& b) {
    return std::tie(a.row_begin, a.inner_offsets) < std::tie(b.row_begin, b.inner_offsets);
  });
  check_tiling(dir, e);
  e.rule = e.chunks.size() > 1 ? Rule::Sharded : Rule::Replicated;
  return e;
}

}  // namespace

// A DCP folder as ctitan's metadata: one entry per key, its chunks pointing at the items'
// torch.save archives (dim-0 slices, FSDP's, or boxes, tensor parallelism's).
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
  // torchtitan's dataloader.world_size is its data-parallel degree: under tensor parallelism
  // fewer than the ranks that wrote files (what "saved by N ranks, dp ..." reports).
  if (!dcp_by_ctitan_ && has("dataloader.world_size")) {
    const int64_t dp = read_int("dataloader.world_size");
    if (dp >= 1 && meta_.world_size % dp == 0) meta_.dp_shard = dp;
  }
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
  const size_t n =
      c.encoding == ChunkMeta::Encoding::Raw
          ? c.nbytes
          : static_cast<size_t>((c.row_end - c.row_begin) * chunk_row_numel(e, c)) * ckpt::dtype_size(e.dtype);
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
    if (!c.inner_sizes.empty()) std::copy(c.inner_sizes.begin(), c.inner_sizes.end(), sizes.begin() + 1);
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
  const at::ScalarType st = ckpt::scalar_type_of(e.dtype);
  for (const ChunkMeta& c : e.chunks) {
    const int64_t s = std::max(begin, c.row_begin), t = std::min(end, c.row_end);
    if (s >= t) continue;
    if (!c.inner_sizes.empty()) {  // a box (tensor parallel): its part of rows [s, t), strided
      std::string bytes = read_chunk(e, c);
      std::vector<int64_t> box = {c.row_end - c.row_begin}, whole = e.shape;
      box.insert(box.end(), c.inner_sizes.begin(), c.inner_sizes.end());
      whole[0] = d2.size(0);
      at::Tensor to = d2.view(whole).narrow(0, s - begin, t - s);
      for (size_t i = 0; i < c.inner_offsets.size(); ++i) to = to.narrow(i + 1, c.inner_offsets[i], c.inner_sizes[i]);
      to.copy_(torch::from_blob(bytes.data(), box, torch::TensorOptions().dtype(st)).narrow(0, s - c.row_begin, t - s));
      continue;
    }
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
  auto t = torch::empty(e.shape, torch::TensorOptions().dtype(ckpt::scalar_type_of(e.dtype)));
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

}  // namespace ctitan
