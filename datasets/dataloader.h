// DataLoader: packed next-token-prediction batches for one data-parallel rank.
//
// Packing follows torchtitan's HuggingFaceDataset:
//   every document is encoded with BOS and EOS and appended to a token buffer; windows of
//   seq_len+1 tokens are cut from the front of the buffer, consecutive windows do not
//   overlap (the next window starts after the seq_len+1 tokens just consumed), nothing is
//   padded, and tokens left over carry into the next window, across documents and epochs.
//   A window x gives inputs = x[0:T] and labels = x[1:T+1] (T = seq_len).
//   At the end of the data the reader starts over (epoch += 1) and a line is logged —
//   unless repetition is turned off (set_repeat(false), validation's "until the set is
//   exhausted"): then has_next_batch() turns false once fewer than a whole batch of windows
//   remain, and the tokens left over are not used.
// Per-rank split and the state: datasets/sharding.h. Each rank reads only its own ranges of
// the corpus (files, byte ranges, shard document ranges), so ranks do not parse each other's
// documents; state_dict() is sharding.h's version 2 (what this pass still holds, and the
// tokens read but not yet emitted), and load_state_dict() also reads version 1 states of
// older builds. redistributed_state() builds this rank's state from the states of a run with
// another dp degree.
//
// Pre-tokenized shards (.ctok, token_shard.h) give their ids as stored; the loader refuses
// one made with another tokenizer (hash mismatch), naming both.
//
// Documents are read and encoded lazily, one at a time, when the buffer runs short.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "datasets/sharding.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"

namespace ctitan {

// One batch, row-major: inputs[b * seq + t], labels[b * seq + t] = next token.
struct Batch {
  std::vector<int64_t> inputs;  // [batch, seq]
  std::vector<int64_t> labels;  // [batch, seq]
  int64_t batch = 0;
  int64_t seq = 0;
};

class DataLoader {
 public:
  // tokenizer must outlive the loader. name is used in logs (default: the source's
  // file/folder name). UserError for bad sizes or ranks, or an unusable source.
  DataLoader(const Tokenizer& tokenizer, std::string source_path, int64_t seq_len, int64_t local_batch_size,
             int64_t dp_rank, int64_t dp_world, std::string name = "");

  // local_batch_size windows. Test hook: CTITAN_DATA_DELAY_MS=<ms> (util/env.h, read when the
  // loader is made) makes each call sleep that long first, as a slow corpus would.
  Batch next();
  std::vector<int64_t> next_window();  // one window of seq_len+1 tokens

  // Malformed documents (bad JSON, no string "text", NUL bytes, invalid UTF-8):
  // stop (the default) throws a UserError naming file, line and reason; skip leaves them out,
  // logs the first few and counts them (skipped_documents(), kept in the state).
  enum class BadDocuments { kStop, kSkip };
  void set_bad_documents(BadDocuments mode) { bad_mode_ = mode; }
  int64_t skipped_documents() const { return skipped_; }

  // repeat (the default): loop over the data forever. Off: one pass, then no more batches.
  void set_repeat(bool repeat) { repeat_ = repeat; }
  // Whether next() can give a whole batch (reads ahead; always true when repeating). Without
  // repetition, next() past the end is a logic error (std::logic_error).
  bool has_next_batch();

  int64_t seq_len() const { return seq_len_; }
  int64_t local_batch_size() const { return batch_size_; }
  int64_t dp_rank() const { return dp_rank_; }
  int64_t dp_world() const { return dp_world_; }
  int64_t windows_produced() const { return windows_; }
  int64_t epoch() const { return epoch_; }  // completed passes over the data
  // Documents this rank has parsed (taken or passed over inside a shared .gz), all passes.
  int64_t documents_parsed() const { return parsed_; }
  // Corpus bytes this rank has read (a .ctok shard: its token bytes), all passes.
  uint64_t bytes_read() const { return reader_.bytes_read(); }
  int64_t buffered_tokens() const { return static_cast<int64_t>(buffer_.size() - head_); }
  const std::string& name() const { return name_; }
  const std::vector<std::string>& files() const { return reader_.files(); }

  // The position as sharding.h's LoaderState; state_dict() is its JSON. A copy of what is
  // still to read (this pass's ranges and the buffered tokens): cheap enough to take after
  // every batch, as the training loop's prefetcher does (training/prefetcher.h).
  LoaderState state() const;
  std::string state_dict() const;
  // Restores a state_dict() of a loader over the same source, tokenizer vocabulary and
  // (dp_rank, dp_world); the following batches are then identical to an uninterrupted
  // run. UserError on corruption or mismatch; the loader is unchanged when it throws.
  // seq_len may differ (windows are simply cut at the new length).
  void load_state_dict(const std::string& state);
  // This rank's state from every saved rank's state_dict() (index = saved dp rank) of a run
  // over the same corpus with another dp degree (sharding.h: redistribution). UserError on
  // a corrupt or foreign state.
  std::string redistributed_state(const std::vector<std::string>& saved) const;

 private:
  void fill(size_t need);  // reads documents until `need` tokens are buffered
  void new_pass();         // this rank's fresh list of ranges
  [[noreturn]] void no_documents() const;

  const Tokenizer* tokenizer_;
  DocumentReader reader_;
  std::string name_;
  int64_t seq_len_, batch_size_, dp_rank_, dp_world_;
  int64_t epoch_ = 0;
  int64_t windows_ = 0;
  bool repeat_ = true;
  BadDocuments bad_mode_ = BadDocuments::kStop;
  int64_t skipped_ = 0;          // malformed documents left out, this rank, all epochs
  bool exhausted_ = false;       // repeat_ off and the data's end reached
  std::vector<int64_t> buffer_;  // tokens not yet emitted start at head_
  size_t head_ = 0;
  std::vector<SourceFile> sources_;  // what sharding needs of each file
  std::vector<WorkUnit> work_;       // this pass's ranges; work_[cur_] is being read
  size_t cur_ = 0;
  bool unit_open_ = false;
  bool pass_fresh_ = true;  // this pass began with a full plan (not a restored remainder)
  int64_t pass_docs_ = 0;   // documents taken in this pass
  int64_t parsed_ = 0;
  int64_t delay_ms_ = 0;  // the CTITAN_DATA_DELAY_MS test hook
};

}  // namespace ctitan
