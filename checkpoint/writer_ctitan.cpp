// ctitan's own format (checkpoint/format.h): rank<r>.bin per rank, raw and CRC-32-checked,
// and rank 0's metadata index with its COMPLETE marker.
#include <filesystem>
#include <map>
#include <sstream>

#include <torch/torch.h>

#include "checkpoint/format.h"
#include "checkpoint/writer.h"
#include "util/crc.h"

namespace ctitan {
namespace {

namespace fs = std::filesystem;
using ckpt::ChunkMeta;
using ckpt::EntryMeta;
using ckpt::Metadata;
using ckpt::Rule;

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
    if (i == entries.size() / 2) ckpt::maybe_fault_in_save(rank, step, (fs::path(stage) / name).string());
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
      m.dtype = ckpt::dtype_name(t.scalar_type());
      const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
      c.nbytes = n;
      c.crc = crc::crc32(t.data_ptr(), n);  // once: the file's CRC is combined from it
      c.offset = w.append(t.data_ptr(), n, c.crc);
    }
    m.chunks.push_back(c);
    metas.push_back(std::move(m));
  }
  if (entries.size() < 2) ckpt::maybe_fault_in_save(rank, step, (fs::path(stage) / name).string());
  w.commit();
  std::string frag = "file " + name + " " + std::to_string(w.size()) + " " + ckpt::hex32(w.crc()) + "\n";
  for (const auto& m : metas) frag += entry_line(m);
  frag += ckpt::chunk_lines(metas);
  return frag;
}

// The metadata file's text: the header, then every rank's file records, the entries (which
// every rank must describe alike) and the chunks.
std::string metadata_text(const SaveInfo& info, const std::vector<std::string>& all) {
  Metadata m;
  m.step = info.step;
  m.world_size = info.world_size;
  m.dp_replicate = info.dp_replicate;
  m.dp_shard = info.dp_shard;
  m.model_name = info.model_name;
  m.model_flavor = info.model_flavor;
  m.model_only = info.model_only;
  std::string head = "ctitan-checkpoint " + std::to_string(ckpt::kFormatVersion) + "\nstep " + std::to_string(m.step) +
                     "\nworld_size " + std::to_string(m.world_size) + "\ndp " + std::to_string(m.dp_replicate) + " " +
                     std::to_string(m.dp_shard) + "\nmodel " + m.model_name + " " + m.model_flavor + "\nmodel_only " +
                     (m.model_only ? "1" : "0") + "\n";
  std::string files, chunks;
  std::map<std::string, std::string> entries;  // key → entry record (identical on every rank)
  for (const std::string& fragment : all) {
    std::istringstream in(fragment);
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

class CtitanWriter : public CheckpointWriter {
 public:
  std::string write_rank(const std::vector<StateEntry>& entries, const SaveInfo& info, int64_t rank) const override {
    return write_rank_file(entries, info.stage, rank, info.step);
  }
  void commit(const SaveInfo& info, const std::vector<std::string>& fragments) const override {
    const std::string text = metadata_text(info, fragments);
    Metadata::parse(text, "checkpoint metadata of step " + std::to_string(info.step));  // validates coverage
    ckpt::write_file_durable((fs::path(info.stage) / "metadata").string(), text);
    ckpt::write_file_durable((fs::path(info.stage) / "COMPLETE").string(), ckpt::complete_marker_text(info.step, text));
  }
};

}  // namespace

const CheckpointWriter& ctitan_writer() {
  static const CtitanWriter w;
  return w;
}

}  // namespace ctitan
