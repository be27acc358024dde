// Pre-tokenized shards (.ctok): a corpus tokenized once (by the `tokenize` tool) and read
// memory-mapped by the dataloader, so training on it again costs no parsing or encoding.
//
// Layout, little-endian:
//   [0, 128)   header: "CTITANTK" | u32 version (1) | u32 bytes per token (2: uint16 when
//              the vocabulary has at most 65536 ids, else 4: uint32) | u64 vocab_size |
//              u64 tokenizer hash | u64 documents N | u64 tokens M | char[80] tokenizer name
//              (the file it was made with, NUL-padded; for messages)
//   [128, 128 + M·b)        the tokens of every document, one after the other, each document
//                           framed with BOS/EOS exactly as the run's tokenizer applies them
//   then (N+1) u64 offsets  document d is tokens [offsets[d], offsets[d+1])
// The file's size must be exactly that; offsets start at 0, never decrease and end at M.
// The tokenizer hash (tokenizer_hash below) ties a shard to the tokenizer that made it: a
// run whose tokenizer differs is refused with both named.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

class Tokenizer;

// FNV-1a 64 over what decides the ids: the back-end, the tokenizer file(s) (tokenizer.json or
// vocab.json + merges.txt, tokenizer_config.json beside them; a sentencepiece .model) and
// the vocabulary size with the BOS/EOS ids.
uint64_t tokenizer_hash(const Tokenizer& tokenizer);

struct TokenShardHeader {
  uint32_t version = 1;
  uint32_t token_bytes = 4;
  uint64_t vocab_size = 0;
  uint64_t tokenizer_hash = 0;
  uint64_t documents = 0;
  uint64_t tokens = 0;
  std::string tokenizer_name;
};

// An open shard, mapped read-only. open() checks the header, the size and the offset table:
// UserError "dataset: <path>: <what is wrong>" (a truncated or foreign file, exit 2).
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const TokenShardHeader& header() const { return h_; }
  const std::string& path() const { return path_; }
  uint64_t documents() const { return h_.documents; }
  // Document d's ids (d < documents()); UserError when one is not below vocab_size.
  void document(uint64_t d, std::vector<int32_t>* ids) const;

 private:
  std::string path_;
  TokenShardHeader h_;
  const unsigned char* base_ = nullptr;
  size_t size_ = 0;
};

// Reads only the header (for the tokenizer check): UserError as TokenShard's.
TokenShardHeader read_token_shard_header(const std::string& path);

// Writes one shard: add() documents (ids with BOS/EOS), then finish(); the file appears
// (renamed from <path>.tmp) only when finish() succeeds.
class TokenShardWriter {
 public:
  TokenShardWriter(const std::string& path, const Tokenizer& tokenizer);
  ~TokenShardWriter();
  void add(const std::vector<int32_t>& ids);
  void finish();
  uint64_t documents() const { return offsets_.size() - 1; }
  uint64_t tokens() const { return offsets_.back(); }

 private:
  std::string path_, tmp_;
  TokenShardHeader h_;
  void* file_ = nullptr;  // FILE*
  std::vector<uint64_t> offsets_{0};
  std::vector<unsigned char> buf_;
};

// The `tokenize` tool: every corpus file of `source` (a file, folder or pattern, as
// training.dataset_path) becomes <out_dir>/<file name>.ctok, documents in file order, each
// encoded with BOS and EOS. Malformed documents: skip_bad false stops with a UserError
// naming file:line (nothing written for that file); true leaves them out and counts them.
struct TokenizeReport {
  int64_t files = 0, documents = 0, tokens = 0, skipped = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
};
TokenizeReport tokenize_corpus(const std::string& source, const Tokenizer& tokenizer, const std::string& out_dir,
                               bool skip_bad);

// The tool's command line: tokenize --tokenizer <tokenizer file or hf_assets folder>
//   --output <folder> [--on_bad_document stop|skip] <source>. Returns the exit code (2: the
//   user's input, one line on stderr).
int tokenize_main(const std::vector<std::string>& args);

}  // namespace ctitan
