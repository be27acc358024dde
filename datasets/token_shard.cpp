// The .ctok shard format; see token_shard.h.
#include "datasets/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <filesystem>
#include <fstream>

#include "config/cli.h"
#include "config/errors.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"

namespace ctitan {
namespace fs = std::filesystem;
namespace {

constexpr char kMagic[8] = {'C', 'T', 'I', 'T', 'A', 'N', 'T', 'K'};
constexpr size_t kHeaderBytes = 128;
constexpr size_t kNameBytes = 80;

uint64_t fnv(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

uint64_t fnv_file(uint64_t h, const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return h;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    h = fnv(h, buf, static_cast<size_t>(in.gcount()));
  }
  return h;
}

uint64_t get_u64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw UserError("dataset: " + path + ": " + what);
}

TokenShardHeader parse_header(const std::string& path, const unsigned char* p, uint64_t file_size) {
  if (file_size < kHeaderBytes)
    bad(path, "truncated token shard (" + std::to_string(file_size) + " bytes, less than its " +
                  std::to_string(kHeaderBytes) + "-byte header)");
  if (std::memcmp(p, kMagic, 8) != 0) bad(path, "not a ctitan token shard (no CTITANTK magic)");
  TokenShardHeader h;
  h.version = get_u32(p + 8);
  h.token_bytes = get_u32(p + 12);
  h.vocab_size = get_u64(p + 16);
  h.tokenizer_hash = get_u64(p + 24);
  h.documents = get_u64(p + 32);
  h.tokens = get_u64(p + 40);
  const char* name = reinterpret_cast<const char*>(p + 48);
  h.tokenizer_name.assign(name, strnlen(name, kNameBytes));
  if (h.version != 1) bad(path, "token shard version " + std::to_string(h.version) + "; this build reads 1");
  if (h.token_bytes != 2 && h.token_bytes != 4)
    bad(path, "corrupt token shard header (" + std::to_string(h.token_bytes) + " bytes per token; 2 or 4)");
  // Sizes checked in 128-bit arithmetic: a corrupt count must not wrap around.
  const unsigned __int128 want = static_cast<unsigned __int128>(kHeaderBytes) +
                                 static_cast<unsigned __int128>(h.tokens) * h.token_bytes +
                                 (static_cast<unsigned __int128>(h.documents) + 1) * 8;
  if (want != file_size)
    bad(path, "truncated or corrupt token shard: " + std::to_string(file_size) + " bytes, its header (" +
                  std::to_string(h.documents) + " documents, " + std::to_string(h.tokens) + " tokens of " +
                  std::to_string(h.token_bytes) + " bytes) says " +
                  (want > ~uint64_t{0} ? std::string("more") : std::to_string(static_cast<uint64_t>(want))));
  return h;
}

}  // namespace

uint64_t tokenizer_hash(const Tokenizer& tok) {
  uint64_t h = 0xcbf29ce484222325ULL;
  const std::string kind = tok.kind();
  h = fnv(h, kind.data(), kind.size());
  const fs::path model(tok.model_path());
  h = fnv_file(h, model);
  if (tok.kind() != "sentencepiece") {
    h = fnv_file(h, model.parent_path() / "tokenizer_config.json");
    if (model.filename() == "vocab.json") h = fnv_file(h, model.parent_path() / "merges.txt");
  }
  const int64_t ids[3] = {tok.vocab_size(), tok.bos_id(), tok.eos_id()};
  return fnv(h, ids, sizeof ids);
}

TokenShardHeader read_token_shard_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(path, "cannot open");
  unsigned char p[kHeaderBytes] = {};
  in.read(reinterpret_cast<char*>(p), kHeaderBytes);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  return parse_header(path, p, ec ? 0 : size);
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      bad(path, std::string("cannot map: ") + std::strerror(errno));
    }
    base_ = static_cast<const unsigned char*>(m);
  }
  ::close(fd);
  try {
    unsigned char empty[kHeaderBytes] = {};
    h_ = parse_header(path, size_ >= kHeaderBytes ? base_ : empty, size_);
    // The offset table: 8 bytes a document, read once here so a damaged one is named now.
    const unsigned char* off = base_ + kHeaderBytes + h_.tokens * h_.token_bytes;
    uint64_t prev = 0;
    for (uint64_t d = 0; d <= h_.documents; ++d) {
      const uint64_t o = get_u64(off + d * 8);
      if ((d == 0 && o != 0) || o < prev || o > h_.tokens || (d == h_.documents && o != h_.tokens))
        bad(path, "corrupt token shard: offset table entry " + std::to_string(d) + " is " + std::to_string(o) +
                      " (after " + std::to_string(prev) + ", of " + std::to_string(h_.tokens) + " tokens)");
      prev = o;
    }
    ::madvise(const_cast<unsigned char*>(base_), size_, MADV_SEQUENTIAL);
  } catch (...) {
    if (base_) ::munmap(const_cast<unsigned char*>(base_), size_);
    base_ = nullptr;
    throw;
  }
}

TokenShard::~TokenShard() {
  if (base_) ::munmap(const_cast<unsigned char*>(base_), size_);
}

void TokenShard::document(uint64_t d, std::vector<int32_t>* ids) const {
  const unsigned char* off = base_ + kHeaderBytes + h_.tokens * h_.token_bytes;
  const uint64_t b = get_u64(off + d * 8), e = get_u64(off + (d + 1) * 8);
  ids->resize(e - b);
  const unsigned char* t = base_ + kHeaderBytes + b * h_.token_bytes;
  for (uint64_t i = 0; i < e - b; ++i) {
    const uint32_t v =
        h_.token_bytes == 2 ? uint32_t{static_cast<uint16_t>(t[2 * i] | t[2 * i + 1] << 8)} : get_u32(t + 4 * i);
    if (v >= h_.vocab_size)
      bad(path_, "corrupt token shard: document " + std::to_string(d) + " holds id " + std::to_string(v) +
                     ", not below vocab_size " + std::to_string(h_.vocab_size));
    (*ids)[i] = static_cast<int32_t>(v);
  }
  constexpr size_t kBehind = size_t{64} << 20;
  const auto at = static_cast<size_t>(t - base_);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (at < released_) released_ = at / page * page;  // a new pass: count again from here
  if (at > released_ + 2 * kBehind) {
    const size_t upto = (at - kBehind) / page * page;
    if (upto > released_) {
      ::madvise(const_cast<unsigned char*>(base_) + released_, upto - released_, MADV_DONTNEED);
      released_ = upto;
    }
  }
}

TokenShardWriter::TokenShardWriter(const std::string& path, const Tokenizer& tok) : path_(path), tmp_(path + ".tmp") {
  h_.vocab_size = static_cast<uint64_t>(tok.vocab_size());
  h_.token_bytes = h_.vocab_size <= 65536 ? 2 : 4;
  h_.tokenizer_hash = tokenizer_hash(tok);
  h_.tokenizer_name = tok.model_path().substr(0, kNameBytes);
  FILE* f = std::fopen(tmp_.c_str(), "wb");
  if (!f) throw UserError("tokenize: cannot write " + tmp_ + ": " + std::strerror(errno));
  file_ = f;
  const unsigned char zeros[kHeaderBytes] = {};
  std::fwrite(zeros, 1, kHeaderBytes, f);  // the header is written last, once the counts are known
}

TokenShardWriter::~TokenShardWriter() {
  if (file_) {
    std::fclose(static_cast<FILE*>(file_));
    std::remove(tmp_.c_str());
  }
}

void TokenShardWriter::add(const std::vector<int32_t>& ids) {
  buf_.clear();
  for (int32_t id : ids) {
    const auto v = static_cast<uint32_t>(id);
    for (uint32_t b = 0; b < h_.token_bytes; ++b) buf_.push_back(static_cast<unsigned char>(v >> (8 * b)));
  }
  if (std::fwrite(buf_.data(), 1, buf_.size(), static_cast<FILE*>(file_)) != buf_.size())
    throw RuntimeFailure("tokenize: write error on " + tmp_ + ": " + std::strerror(errno));
  offsets_.push_back(offsets_.back() + ids.size());
}

void TokenShardWriter::finish() {
  FILE* f = static_cast<FILE*>(file_);
  h_.documents = documents();
  h_.tokens = tokens();
  std::fwrite(offsets_.data(), 8, offsets_.size(), f);
  unsigned char p[kHeaderBytes] = {};
  std::memcpy(p, kMagic, 8);
  std::memcpy(p + 8, &h_.version, 4);
  std::memcpy(p + 12, &h_.token_bytes, 4);
  std::memcpy(p + 16, &h_.vocab_size, 8);
  std::memcpy(p + 24, &h_.tokenizer_hash, 8);
  std::memcpy(p + 32, &h_.documents, 8);
  std::memcpy(p + 40, &h_.tokens, 8);
  std::memcpy(p + 48, h_.tokenizer_name.data(), h_.tokenizer_name.size());
  const bool ok = std::fseek(f, 0, SEEK_SET) == 0 && std::fwrite(p, 1, kHeaderBytes, f) == kHeaderBytes &&
                  std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const bool closed = std::fclose(f) == 0;
  file_ = nullptr;
  if (!ok || !closed || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw RuntimeFailure("tokenize: cannot finish " + path_ + ": " + std::strerror(errno));
  }
}

TokenizeReport tokenize_corpus(const std::string& source, const Tokenizer& tok, const std::string& out_dir,
                               bool skip_bad) {
  TokenizeReport rep;
  DocumentReader reader(source);
  reader.report_bad_documents(true);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw UserError("tokenize: cannot create " + out_dir + ": " + ec.message());
  const std::vector<std::string> files = reader.files();
  std::unique_ptr<TokenShardWriter> out;
  size_t file = 0;
  auto finish = [&] {
    if (!out) return;
    out->finish();
    rep.files += 1;
    rep.bytes_out += fs::file_size(out_dir + "/" + fs::path(files[file]).filename().string() + ".ctok", ec);
    out.reset();
  };
  Document doc;
  while (reader.next(&doc)) {
    if (!out || doc.file != file) {
      finish();
      file = doc.file;
      out =
          std::make_unique<TokenShardWriter>(out_dir + "/" + fs::path(files[file]).filename().string() + ".ctok", tok);
    }
    if (!doc.ids.empty()) throw UserError("tokenize: " + files[file] + " is already a token shard");
    if (!doc.error.empty()) {
      const std::string where = files[file] + ":" + std::to_string(doc.line);
      if (!skip_bad)
        throw UserError("dataset: " + where + ": " + doc.error + " (--on_bad_document skip would skip and count it)");
      rep.skipped += 1;
      continue;
    }
    const std::vector<int32_t> ids = tok.encode(doc.text, /*bos=*/true, /*eos=*/true);
    out->add(ids);
    rep.documents += 1;
    rep.tokens += static_cast<int64_t>(ids.size());
  }
  finish();
  rep.bytes_in = reader.bytes_read();
  return rep;
}

int tokenize_main(const std::vector<std::string>& args) {
  static const char* kUsage =
      "usage: tokenize --tokenizer <tokenizer.json | tokenizer.model | hf_assets folder> --output <folder>\n"
      "                [--on_bad_document stop|skip] <corpus: .txt/.jsonl/.json/.jsonl.gz/.json.gz file or folder>\n"
      "Writes one pre-tokenized shard (<file name>.ctok) per corpus file; training.dataset_path = <folder>\n"
      "then trains on them without parsing or encoding.\n";
  return run_tool([&]() -> int {
    std::string tokenizer, output, source, bad = "stop";
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= args.size()) throw UserError("tokenize: " + a + " needs a value");
        return args[++i];
      };
      if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      } else if (a == "--tokenizer") {
        tokenizer = value();
      } else if (a == "--output") {
        output = value();
      } else if (a == "--on_bad_document") {
        bad = value();
        if (bad != "stop" && bad != "skip")
          throw UserError("tokenize: --on_bad_document " + bad + " is not one of stop, skip");
      } else if (a.rfind("--", 0) == 0) {
        throw UserError("tokenize: unknown option " + a + " (see --help)");
      } else if (source.empty()) {
        source = a;
      } else {
        throw UserError("tokenize: one corpus path, got " + source + " and " + a);
      }
    }
    if (tokenizer.empty() || output.empty() || source.empty())
      throw UserError("tokenize: --tokenizer, --output and a corpus path are all needed (see --help)");
    const bool folder = fs::is_directory(tokenizer);
    const auto tok = Tokenizer::load(resolve_tokenizer_path(folder ? "" : tokenizer, folder ? tokenizer : ""));
    const TokenizeReport r = tokenize_corpus(source, *tok, output, bad == "skip");
    std::cout << "tokenize: " << r.files << " shards in " << output << ": " << r.documents << " documents, " << r.tokens
              << " tokens (" << (tok->vocab_size() <= 65536 ? "uint16" : "uint32") << "), " << r.skipped << " skipped; "
              << r.bytes_in << " bytes of text -> " << r.bytes_out << " bytes\n";
    return 0;
  });
}

}  // namespace ctitan
