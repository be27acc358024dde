// torch.distributed.checkpoint folders (checkpoint.format = "dcp"): __<rank>_0.distcp per rank,
// each item a torch.save archive, and rank 0's pickled .metadata (checkpoint/dcp.h), which
// PyTorch's and torchtitan's dcp.load read.
#include <filesystem>
#include <set>
#include <sstream>

#include <torch/torch.h>

#include "checkpoint/dcp.h"
#include "checkpoint/format.h"
#include "checkpoint/writer.h"

namespace ctitan {
namespace {

namespace fs = std::filesystem;
using ckpt::Rule;

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
    if (i == entries.size() / 2) ckpt::maybe_fault_in_save(rank, step, path);
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
      const std::string dt = ckpt::dtype_name(t.scalar_type());
      item = dcp::tensor_item(dt, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
      line = "dcp tensor " + e.key + " " + dt + " " + csv(shape) + " " + csv(t.sizes().vec()) + " " +
             std::to_string(row_begin);
    }
    const uint64_t off = w.append(item.data(), item.size());
    frag += line + " " + name + " " + std::to_string(off) + " " + std::to_string(item.size()) + "\n";
  }
  if (entries.size() < 2) ckpt::maybe_fault_in_save(rank, step, path);
  w.commit();
  return frag;
}

// Rank 0: every rank's item lines (write_rank_dcp's) → <stage>/.metadata, then the
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
    std::istringstream in(st);
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

class DcpWriter : public CheckpointWriter {
 public:
  std::string write_rank(const std::vector<StateEntry>& entries, const SaveInfo& info, int64_t rank) const override {
    return write_rank_dcp(entries, info.stage, rank, info.step);
  }
  void commit(const SaveInfo& info, const std::vector<std::string>& fragments) const override {
    write_dcp_metadata(fragments, info.stage, info.step);
  }
  bool stores_python_objects() const override { return true; }
};

}  // namespace

const CheckpointWriter& dcp_writer() {
  static const DcpWriter w;
  return w;
}

}  // namespace ctitan
