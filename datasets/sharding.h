// Which data-parallel rank reads what, and the dataloader's saved state (one owner: this file).
//
// A rank's work for one pass over the corpus is a list of ranges ("units") of files:
//   - files >= dp ranks: file-level sharding, rank r takes the files f with f % W == r;
//   - fewer files than ranks: the ranks r with r % F == f share file f (k of them, the j-th
//     being r / F): a text file (.txt/.jsonl/.json) is cut into k equal byte ranges and the
//     j-th reads the documents that start in its range (text_source.h says how a range is
//     entered); a .ctok shard into k equal document ranges; a .gz file cannot be cut by bytes
//     (entering it in the middle means inflating everything before), so its k ranks each read
//     all of it and keep every k-th document (stride k, phase j) — correct, but k× the
//     reading; a line in the log says so.
// So no rank parses a document another rank takes, except inside a shared .gz file. A
// document's identity is (file, byte offset of its first line), or (shard, document index).
//
// When a rank's list is used up, its next pass (epoch + 1) starts over with a fresh list.
//
// The state (DataLoader::state_dict), version 2:
//   {"format":"ctitan.dataloader","version":2,"dp_rank":r,"dp_world":W,"seq_len":T,
//    "vocab_size":V,"epoch":e,"windows_produced":n,"skipped_documents":s,
//    "files":["<basename>",...],
//    "work":[[file,begin,end,stride,phase,ordinal,chain],...],   what this pass still holds
//    "buffer":[ids...]}                                            tokens read, not yet emitted
// A unit takes the documents of `file` starting in [begin, end) (end -1: to the file's end);
// the first unit's begin is where reading goes on. Its documents are numbered from `ordinal`
// on, and only those with number % stride == phase are taken. chain 1: the unit goes on
// through all following files (only version 1 states need it).
// Version 1 (older builds: the whole stream read by every rank, rank r taking documents
// r, r+W, ... of it, "next_document"/"file_index"/"file_offset"/"file_line" pinning where)
// is read as one chained unit from that position with stride W, phase r, ordinal
// next_document — the same documents, in the same order.
//
// Redistribution (checkpoint.dataloader_reshard = "redistribute", dp degree W -> W'): the
// saved ranks' remaining units, in saved-rank order, are laid end to end by their size
// (bytes; documents × average bytes for shards) and cut into W' equal parts; a text or shard
// unit straddling a cut is split there (any byte will do: a document belongs to the part its
// first byte lies in), a .gz or strided unit goes whole to the part holding its middle. New
// rank r' takes part r', and first emits the buffers of saved ranks r ≡ r' (mod W'), in
// order. What the saved ranks had read is never read again, what they had not is read by
// exactly one new rank: no window seen twice, no token skipped. After that, each new rank
// starts a fresh pass of its own (the epoch: the largest saved).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

struct WorkUnit {
  static constexpr uint64_t kToEnd = ~uint64_t{0};
  uint64_t file = 0;
  uint64_t begin = 0, end = kToEnd;  // bytes (text) or documents (.ctok)
  int64_t stride = 1, phase = 0, ordinal = 0;
  bool chain = false;
  bool operator==(const WorkUnit& o) const;
};

// What sharding needs to know of each corpus file.
struct SourceFile {
  std::string name;          // basename
  uint64_t extent = 0;       // bytes, or documents of a .ctok shard
  bool splittable = true;    // false for .gz
  uint64_t unit_weight = 1;  // bytes per extent unit (a shard: ~bytes per document)
};

// Rank `rank` of `world`'s units for a fresh pass. `shared_gz` (may be null) receives the
// names of .gz files this rank shares with others (to be logged).
std::vector<WorkUnit> plan_pass(const std::vector<SourceFile>& files, int64_t rank, int64_t world,
                                std::vector<std::string>* shared_gz = nullptr);

struct LoaderState {
  int64_t version = 2;
  int64_t dp_rank = 0, dp_world = 1, seq_len = 0, vocab_size = 0;
  int64_t epoch = 0, windows = 0, skipped = 0;
  std::vector<std::string> files;  // basenames (v1: the one it was in, at its index)
  std::vector<WorkUnit> work;
  std::vector<int64_t> buffer;
};

std::string to_json(const LoaderState& s);
// Parses version 2 or 1 against the corpus it is loaded into (v1's position becomes a chained
// unit; its file name is checked). UserError "<where> is corrupt: ..." and the like.
// vocab_size: the tokenizer's; a state saved with another is refused.
LoaderState parse_loader_state(const std::string& json, const std::vector<SourceFile>& files, int64_t vocab_size,
                               const std::string& where);

// dp rank `rank` of `world`'s state from every saved rank's state (see above).
LoaderState redistribute(const std::vector<LoaderState>& saved, const std::vector<SourceFile>& files, int64_t rank,
                         int64_t world);

}  // namespace ctitan
