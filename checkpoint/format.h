// On-disk format of a ctitan checkpoint (plain C++, no LibTorch: tools can use it cheaply).
//
//   <job.dump_folder>/<checkpoint.folder>/
//     step-<N>/                 a checkpoint: complete only when COMPLETE exists and matches
//       rank<r>.bin             rank r's entries, raw bytes back to back (native little
//                               endian, row-major); only the real rows of its shards, never
//                               FSDP's padding rows
//       metadata                the index below (text, one record per line)
//       COMPLETE                the marker: written last, by rank 0, after every rank's file
//                               is durable and a collective confirmed that every rank succeeded
//     step-<N>.partial/         a save in progress (or one that failed): never loaded,
//                               removed by the next save or start-up of rank 0
//
// metadata, version 1 (fields separated by one space; keys never contain whitespace):
//   ctitan-checkpoint 1
//   step <N>
//   world_size <W>                 ranks of the job that saved
//   dp <replicate> <shard>         its data-parallel degrees (dp = replicate × shard)
//   model <name> <flavor>
//   model_only <0|1>               1: model weights only (last_save_model_only, seed)
//   file <name> <bytes> <crc32>    every data file, with its size and CRC-32 (hex)
//   entry <key> tensor <rule> <dtype> <d0,d1,...|scalar>
//   entry <key> bytes <rule>
//   chunk <key> <file> <offset> <nbytes> <row_begin> <row_end> <crc32>
//   end
// rule: sharded (dim-0 slices of one global tensor, chunks cover rows [0, d0) exactly once),
// replicated (one chunk: the whole value), per_rank (one chunk; the key names the rank).
// A chunk of a tensor holds global rows [row_begin, row_end) (a scalar is one row of one
// element); bytes entries have rows 0 0.
// COMPLETE: "ctitan-checkpoint-complete step <N> metadata <bytes> <crc32>\n", so a
// metadata file replaced or truncated after the fact is noticed.
//
// A step folder may instead hold the model in Hugging Face form (checkpoint.last_save_in_hf;
// checkpoint/hf.h): model.safetensors, model.safetensors.index.json, config.json, and
// COMPLETE = "ctitan-hf-complete step <N> index <bytes> <crc32>\n" over the index file. It is
// a complete, model-only checkpoint: listed and kept like the others, never resumed from.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ctitan::ckpt {

constexpr int64_t kFormatVersion = 1;

std::string hex32(uint32_t v);
// s with its line breaks as spaces and no trailing space: an error text as one status line.
std::string one_line(std::string s);

// ---- durable files -----------------------------------------------------------------------
// fsync of a folder, so a rename or create inside it survives a crash.
void fsync_dir(const std::string& dir);
// Writes `data` to `path`: temporary name in the same folder, fsync, rename, fsync folder.
// RuntimeFailure naming the path and errno text on any failure (disk full included).
void write_file_durable(const std::string& path, const std::string& data);
std::string read_whole_file(const std::string& path);  // RuntimeFailure when unreadable

// Appends to <path>.tmp while tracking the size and CRC-32; commit() flushes, fsyncs,
// renames to <path> and fsyncs the folder. Destroyed uncommitted: the temp file is removed.
class DurableFileWriter {
 public:
  explicit DurableFileWriter(std::string path);
  ~DurableFileWriter();
  DurableFileWriter(const DurableFileWriter&) = delete;
  DurableFileWriter& operator=(const DurableFileWriter&) = delete;
  uint64_t append(const void* data, size_t n);                        // returns the offset the data starts at
  uint64_t append(const void* data, size_t n, uint32_t crc_of_data);  // CRC already known
  void commit();
  uint64_t size() const { return size_; }
  uint32_t crc() const { return crc_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint32_t crc_ = 0;
  bool committed_ = false;
};

// ---- free space ---------------------------------------------------------------------------
// The space left for unprivileged writers on the file system holding `path` (or its nearest
// existing parent) and an id of that file system ("<host>:<device>"), or id "unknown" when
// it cannot be read. A save checks that the ranks writing to one file system fit in it.
struct DiskSpace {
  uint64_t free = 0;
  std::string id = "unknown";
};
DiskSpace disk_space(const std::string& path);
// Added to each rank's data bytes when checking: metadata, marker, file system blocks.
constexpr uint64_t kSaveOverheadBytes = 1 << 20;
// "63963136 bytes (61.0 MiB)".
std::string bytes_text(uint64_t bytes);

// ---- metadata ----------------------------------------------------------------------------
enum class Rule { Sharded, Replicated, PerRank };
const char* rule_name(Rule r);

struct ChunkMeta {
  std::string file;
  uint64_t offset = 0, nbytes = 0;
  int64_t row_begin = 0, row_end = 0;
  uint32_t crc = 0;
  // DCP folders (dcp.h): [offset, offset + nbytes) is a torch.save archive of the chunk
  // (TorchSave) or of a Python int read as an int64 scalar (PickledInt); crc is unused (the
  // archive records carry their own).
  enum class Encoding { Raw, TorchSave, PickledInt } encoding = Encoding::Raw;
  // DCP folders only: a chunk that does not span dims 1.. whole (tensor parallelism:
  // torchtitan's RowwiseParallel splits dim 1, FSDP + TP dims 0 and 1) holds, of its rows, the
  // box inner_offsets[i] + [0, inner_sizes[i]) of dim i + 1. Empty: whole rows (every chunk of
  // ctitan's own format).
  std::vector<int64_t> inner_offsets, inner_sizes;
};

struct EntryMeta {
  std::string key;
  bool is_bytes = false;
  Rule rule = Rule::Replicated;
  std::string dtype;           // float32, bfloat16, float16, float64, int64, int32, uint8
  std::vector<int64_t> shape;  // empty: a scalar
  std::vector<ChunkMeta> chunks;
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t row_numel() const;  // elements per row
};

struct FileMeta {
  std::string name;
  uint64_t size = 0;
  uint32_t crc = 0;
};

struct Metadata {
  int64_t version = kFormatVersion;
  int64_t step = 0;
  int64_t world_size = 1;
  int64_t dp_replicate = 1, dp_shard = 1;
  std::string model_name, model_flavor;
  bool model_only = false;
  std::vector<FileMeta> files;
  std::map<std::string, EntryMeta> entries;

  int64_t dp() const { return dp_replicate * dp_shard; }
  std::string to_text() const;
  // RuntimeFailure "<where>: <problem> (line n)" when malformed, truncated or inconsistent
  // (sharded chunks must cover every row exactly once).
  static Metadata parse(const std::string& text, const std::string& where);
};

size_t dtype_size(const std::string& dtype);  // 0 for an unknown name

// The chunk lines of one rank: what every rank sends rank 0 after writing its file.
std::string chunk_lines(const std::vector<EntryMeta>& entries);

// ---- folders -----------------------------------------------------------------------------
std::string step_dir(const std::string& folder, int64_t step);     // <folder>/step-<N>
std::string staging_dir(const std::string& folder, int64_t step);  // <folder>/step-<N>.partial
std::string complete_marker_text(int64_t step, const std::string& metadata_text);
std::string hf_complete_marker_text(int64_t step, const std::string& index_text);
// A DCP step folder (checkpoint.format = "dcp"): the marker covers its .metadata file.
std::string dcp_complete_marker_text(int64_t step, const std::string& metadata_bytes);
// True when the step folder's COMPLETE marker is an HF one (whether or not it is valid).
bool is_hf_step(const std::string& step_path);

struct FolderScan {
  std::vector<int64_t> complete;  // ascending
  // Folders that look like checkpoints but are not complete: (path, reason).
  std::vector<std::pair<std::string, std::string>> incomplete;
  std::vector<std::string> staging;  // *.partial folders
};
// A step-<N> folder is complete when metadata and COMPLETE exist and the marker matches the
// metadata (step, size, CRC). Data files are checked when the checkpoint is opened.
FolderScan scan_folder(const std::string& folder);
// "" when complete, else why not.
std::string incomplete_reason(const std::string& step_path, int64_t step);

}  // namespace ctitan::ckpt
