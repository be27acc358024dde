// Corpus location and lazy document reading; see text_source.h.
#include "datasets/text_source.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <zlib.h>

#include "config/errors.h"
#include "util/text.h"
#include "util/json.h"
#include "datasets/token_shard.h"
#include "util/env.h"

namespace ctitan {
namespace fs = std::filesystem;
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Paragraph text (.txt) or JSON lines (everything else).
bool is_txt(const std::string& path) { return ends_with(path, ".txt"); }

bool is_source_file(const fs::path& p) {
  const std::string n = p.filename().string();
  for (const char* ext : {".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ctok"})
    if (ends_with(n, ext)) return true;
  return false;
}

bool is_gzip(const std::string& path) { return ends_with(path, ".gz"); }
bool is_shard(const std::string& path) { return ends_with(path, ".ctok"); }

constexpr const char* kKinds = ".txt/.jsonl/.json/.jsonl.gz/.json.gz/.ctok";

// "dir/prefix*suffix": the folder and the two halves of the name pattern; false without '*'.
bool split_pattern(const std::string& path, fs::path* dir, std::string* prefix, std::string* suffix) {
  const fs::path p(path);
  const std::string name = p.filename().string();
  const size_t star = name.find('*');
  if (star == std::string::npos) return false;
  *dir = p.parent_path();
  *prefix = name.substr(0, star);
  *suffix = name.substr(star + 1);
  return true;
}

std::string known_list() {
  std::string s;
  for (const auto& n : known_datasets()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\f' || c == '\v'; });
}

}  // namespace

const std::vector<std::string>& known_datasets() {
  static const std::vector<std::string> names = {"moby_dick", "sotu", "c4_test", "c4", "c4_validation"};
  return names;
}

std::string default_data_root(const std::string& repo_root) {
  if (const std::string& env = runtime_env().data_dir; !env.empty()) {
    return env;
  }
  return repo_root + "/data";
}

std::string resolve_dataset_path(const std::string& dataset, const std::string& dataset_path,
                                 const std::string& data_root, const std::string& section) {
  std::error_code ec;
  if (!dataset_path.empty()) {
    if (!fs::exists(dataset_path, ec)) {
      throw UserError(section + ".dataset_path=" + dataset_path + " does not exist (expected a " + kKinds +
                      " file or a folder of them)");
    }
    return dataset_path;
  }
  std::string path, fetch_arg = dataset;
  if (dataset == "moby_dick") {
    path = data_root + "/moby_dick/moby_dick.txt";
  } else if (dataset == "sotu") {
    path = data_root + "/sotu";
  } else if (dataset == "c4_test") {
    path = data_root + "/c4_test";
  } else if (dataset == "c4" || dataset == "c4_validation") {
    path = data_root + (dataset == "c4" ? "/c4/en/c4-train.*" : "/c4/en/c4-validation.*");
  } else {
    throw UserError(section + ".dataset=" + (dataset.empty() ? std::string("\"\"") : dataset) +
                    " is not a known corpus (known: " + known_list() + "); or set " + section + ".dataset_path to a " +
                    kKinds + " file or folder");
  }
  bool present = true;
  try {
    list_source_files(path);
  } catch (const UserError&) {
    present = false;
  }
  if (!present && (dataset == "moby_dick" || dataset == "sotu")) {
    throw UserError(section + ".dataset=" + dataset + ": " + path + " not found; run scripts/fetch_data.sh " +
                    fetch_arg + " (known corpora: " + known_list() + ") or set " + section + ".dataset_path");
  }
  if (!present) {
    // torchtitan downloads these from the Hugging Face hub; ctitan reads local copies only.
    throw UserError(section + ".dataset=" + dataset + ": " + path + " not found (torchtitan's " +
                    (dataset == "c4_test" ? std::string("tests/assets/c4_test, JSON lines in .json files")
                                          : std::string("allenai/c4 layout, en/*.json.gz")) +
                    "); put the files there or set " + section + ".dataset_path to them");
  }
  return path;
}

std::vector<std::string> list_source_files(const std::string& source_path) {
  std::error_code ec;
  fs::path p(source_path);
  std::string prefix, suffix;
  const bool pattern = split_pattern(source_path, &p, &prefix, &suffix);
  if (!fs::exists(p, ec)) throw UserError("dataset: " + p.string() + " does not exist");
  if (pattern || fs::is_directory(p, ec)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(p, ec)) {
      const auto name = e.path().filename().string();
      if (pattern && !(name.size() >= prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
                       ends_with(name, suffix)))
        continue;
      if (!name.empty() && name[0] != '.' && e.is_regular_file(ec) && is_source_file(e.path())) {
        files.push_back(e.path().string());
      }
    }
    if (ec) throw UserError("dataset: cannot list " + source_path + ": " + ec.message());
    if (files.empty()) {
      throw UserError("dataset: " + std::string(pattern ? "pattern " : "folder ") + source_path + " holds no " +
                      kKinds + " files");
    }
    // Byte order of the names, so every rank and every run agree on document order.
    std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
      return fs::path(a).filename().string() < fs::path(b).filename().string();
    });
    return files;
  }
  if (!is_source_file(p)) {
    throw UserError("dataset: " + source_path + " is neither a " + kKinds + " file nor a folder");
  }
  return {source_path};
}

// ---------------------------------------------------------------------------
// DocumentReader
// ---------------------------------------------------------------------------

DocumentReader::DocumentReader(const std::string& source_path)
    : source_path_(source_path), files_(list_source_files(source_path)) {}

void DocumentReader::seek(const SourcePosition& pos) {
  // Validate first: a rejected position leaves the reader where it was.
  if (pos.next_document < 0 || pos.line < 0 || pos.file > files_.size() ||
      (pos.file == files_.size() && (pos.offset != 0 || pos.line != 0))) {
    throw UserError("dataset: position (file " + std::to_string(pos.file) + ", document " +
                    std::to_string(pos.next_document) + ") does not fit " + source_path_ + " (" +
                    std::to_string(files_.size()) + " files)");
  }
  if (pos.file < files_.size()) {
    const std::string& path = files_[pos.file];
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    // A gzip file's uncompressed size is only known by inflating it: the seek below says.
    bool ok = !ec && (is_gzip(path) || pos.offset <= size);
    if (ok && pos.offset > 0) {
      // A document starts at a line start: the byte before it must be a newline.
      gzFile f = gzopen(path.c_str(), "rb");
      if (f != nullptr && !is_gzip(path)) gzdirect(f);  // a plain file: seek, not read up to it
      ok = f != nullptr && gzseek(f, static_cast<z_off_t>(pos.offset - 1), SEEK_SET) >= 0 && gzgetc(f) == '\n';
      if (f != nullptr) gzclose(f);
    }
    if (!ok) {
      throw UserError("dataset: byte offset " + std::to_string(pos.offset) + " of " + path +
                      " is not a line start (the file changed since the position was saved?)");
    }
  }
  close();
  pos_ = pos;
  end_ = kToEnd;
  chain_ = true;
  align_ = false;
  done_ = false;
  line_base_ = 0;
  line_origin_ = pos.offset;
}

void DocumentReader::set_range(size_t file, uint64_t begin, uint64_t end, bool chain) {
  if (file >= files_.size())
    throw UserError("dataset: range in file " + std::to_string(file) + " of " + source_path_ + " (" +
                    std::to_string(files_.size()) + " files)");
  close();
  pos_.file = file;
  pos_.offset = begin;
  pos_.line = 0;
  end_ = end;
  chain_ = chain;
  // A saved position inside a .gz file is always a line start; checking would re-inflate.
  align_ = begin > 0 && !is_shard(files_[file]) && !is_gzip(files_[file]);
  done_ = false;
  line_base_ = begin == 0 ? 0 : -1;
  line_origin_ = begin;
}

DocumentReader::~DocumentReader() { close(); }

struct DocumentReader::Shard {
  explicit Shard(const std::string& path) : shard(path) {}
  TokenShard shard;
};

int64_t DocumentReader::absolute_line(int64_t line) {
  if (line_base_ < 0) {
    // Counted only when a message needs it: reads the file up to where this reader began.
    gzFile f = gzopen(files_[pos_.file].c_str(), "rb");
    int64_t n = 0;
    uint64_t left = line_origin_;
    char buf[1 << 16];
    while (f != nullptr && left > 0) {
      const int got = gzread(f, buf, static_cast<unsigned>(std::min<uint64_t>(left, sizeof buf)));
      if (got <= 0) break;
      n += std::count(buf, buf + got, '\n');
      left -= static_cast<uint64_t>(got);
    }
    if (f != nullptr) gzclose(f);
    line_base_ = n;
  }
  return line_base_ + line;
}

void DocumentReader::align() {
  align_ = false;
  const std::string& path = files_[pos_.file];
  gzFile f = static_cast<gzFile>(gz_);
  const uint64_t begin = pos_.offset;
  // The byte before: a newline makes `begin` a line start; else the rest of that line is
  // the previous reader's.
  if (gzseek(f, static_cast<z_off_t>(begin - 1), SEEK_SET) < 0) return;
  const int before = gzgetc(f);
  if (before == -1) return;  // begin is at or past the end: nothing here
  if (before != '\n') {
    std::string rest;
    read_line(&rest, /*checked=*/false);
  }
  if (is_txt(path) && pos_.offset > 0) {
    // A line right after a non-blank line continues a paragraph that began before: skip to
    // after the next blank line. Look back from the line end for a non-blank byte.
    bool prev_blank = true;
    if (FILE* raw = std::fopen(path.c_str(), "rb")) {
      for (int64_t i = static_cast<int64_t>(pos_.offset) - 2; i >= 0; --i) {
        std::fseek(raw, i, SEEK_SET);
        const int c = std::fgetc(raw);
        if (c == '\n') break;
        if (c != ' ' && c != '\t' && c != '\f' && c != '\v' && c != '\r') {
          prev_blank = false;
          break;
        }
      }
      std::fclose(raw);
    }
    if (!prev_blank) {
      std::string l;
      while (read_line(&l, /*checked=*/false) && !blank(l)) {
      }
    }
  }
  pos_.line = 0;
  line_base_ = -1;
  line_origin_ = pos_.offset;
}

void DocumentReader::close() {
  if (gz_ != nullptr) gzclose(static_cast<gzFile>(gz_));
  gz_ = nullptr;
  shard_.reset();
  open_ = false;
}

bool DocumentReader::open_current() {
  if (pos_.file >= files_.size()) return false;
  if (!open_ && is_shard(files_[pos_.file])) {
    shard_ = std::make_unique<Shard>(files_[pos_.file]);
    open_ = true;
  } else if (!open_) {
    gzFile f = gzopen(files_[pos_.file].c_str(), "rb");
    if (f == nullptr) throw RuntimeFailure("dataset: cannot open " + files_[pos_.file]);
    gz_ = f;
    open_ = true;
    gzbuffer(f, 1 << 18);
    // A plain file: have zlib find that out now (it reads the first buffer to look for a gzip
    // header), so that the seek below is an lseek. Left to gzseek, the look happens after the
    // seek and zlib reads and drops every byte before the offset instead.
    if (!is_gzip(files_[pos_.file])) gzdirect(f);
    if (pos_.offset > 0 && gzseek(f, static_cast<z_off_t>(pos_.offset), SEEK_SET) < 0)
      throw RuntimeFailure("dataset: cannot seek to byte " + std::to_string(pos_.offset) + " of " + files_[pos_.file]);
    if (align_) align();
  }
  return true;
}

bool DocumentReader::read_line(std::string* line, bool checked) {
  const bool at_start = pos_.offset == 0;
  // gzgets: up to sizeof buf - 1 bytes, up to and with the newline; NUL bytes are kept
  // (the byte count comes from the offset, not from strlen).
  gzFile f = static_cast<gzFile>(gz_);
  line->clear();
  bool newline = false;
  char buf[1 << 14];
  for (;;) {
    const z_off_t before = gztell(f);
    if (gzgets(f, buf, sizeof buf) == nullptr) break;
    const size_t n = static_cast<size_t>(gztell(f) - before);
    line->append(buf, n);
    if (n > 0 && buf[n - 1] == '\n') {
      newline = true;
      line->pop_back();
      break;
    }
  }
  int zerr = Z_OK;
  const char* msg = gzerror(f, &zerr);
  if (zerr != Z_OK && zerr != Z_STREAM_END)
    throw RuntimeFailure("dataset: read error in " + files_[pos_.file] + ": " + msg + " (a damaged .gz file?)");
  if (line->empty() && !newline) return false;
  pos_.offset += line->size() + (newline ? 1 : 0);
  bytes_read_ += line->size() + (newline ? 1 : 0);
  pos_.line += 1;
  if (!checked) return true;
  if (at_start && line->compare(0, 3, "\xEF\xBB\xBF") == 0) line->erase(0, 3);
  if (!line->empty() && line->back() == '\r') line->pop_back();
  // Text only: a binary or wrongly encoded file is named, not tokenized into noise.
  if (const size_t nul = line->find('\0'); nul != std::string::npos)
    bad_line("a NUL byte at column " + std::to_string(nul + 1) + ": binary data, not text");
  if (const size_t bad = invalid_utf8_at(*line); bad != std::string::npos) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned char>((*line)[bad]));
    bad_line(std::string("not valid UTF-8 (byte ") + hex + " at column " + std::to_string(bad + 1) +
             "); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8");
  }
  return true;
}

void DocumentReader::bad_line(const std::string& what) {
  if (!report_bad_) fail_line(what);
  if (pending_error_.empty()) {
    pending_error_ = what;
    pending_line_ = absolute_line(pos_.line);
  }
}

void DocumentReader::fail_line(const std::string& what) {
  throw UserError("dataset: " + files_[pos_.file] + ":" + std::to_string(absolute_line(pos_.line)) + ": " + what);
}

bool DocumentReader::next_in_file(Document* doc) {
  doc->ids.clear();
  if (shard_) {
    const uint64_t n = shard_->shard.documents();
    if (pos_.offset >= std::min(n, end_)) return false;
    doc->offset = pos_.offset;
    doc->line = 0;
    doc->text.clear();
    shard_->shard.document(pos_.offset, &doc->ids);
    pos_.offset += 1;
    bytes_read_ += doc->ids.size() * shard_->shard.header().token_bytes;
    return true;
  }
  const bool jsonl = !is_txt(files_[pos_.file]);
  std::string line;
  if (jsonl) {
    for (;;) {
      const uint64_t start = pos_.offset;
      if (start >= end_ || !read_line(&line)) return false;
      if (blank(line)) continue;
      doc->offset = start;
      doc->line = line_base_ < 0 ? 0 : line_base_ + pos_.line;
      if (!pending_error_.empty()) return true;  // bad bytes: not worth parsing
      json::Value v;
      std::string err;
      const json::Value* text = nullptr;
      if (!json::parse(line, &v, &err)) {
        bad_line("invalid JSON (" + err + ")");
      } else if (v.type != json::Value::Type::Object) {
        bad_line(std::string("expected a JSON object with a \"text\" field, not ") + json::type_name(v.type));
      } else if ((text = v.find("text")) == nullptr) {
        bad_line("record has no \"text\" field");
      } else if (text->type != json::Value::Type::String) {
        bad_line(std::string("\"text\" must be a string, not ") + json::type_name(text->type));
        text = nullptr;
      }
      if (text == nullptr) return true;
      doc->text = text->text;
      return true;
    }
  }
  // Plain text: skip blank lines, then take lines up to the next blank line or EOF.
  doc->text.clear();
  bool in_paragraph = false;
  for (;;) {
    const uint64_t start = pos_.offset;
    if (!in_paragraph && start >= end_) return false;
    if (!read_line(&line)) break;
    if (blank(line)) {
      if (in_paragraph) return true;
      continue;
    }
    if (!in_paragraph) {
      in_paragraph = true;
      doc->offset = start;
      doc->line = line_base_ < 0 ? 0 : line_base_ + pos_.line;
    } else {
      doc->text.push_back('\n');
    }
    doc->text += line;
  }
  return in_paragraph;
}

bool DocumentReader::next(Document* doc) {
  while (!done_ && open_current()) {
    const int64_t index = pos_.next_document;
    const size_t file = pos_.file;
    pending_error_.clear();
    if (next_in_file(doc)) {
      if (!pending_error_.empty()) doc->line = pending_line_;
      doc->error = std::move(pending_error_);
      pending_error_.clear();
      doc->index = index;
      doc->file = file;
      pos_.next_document += 1;
      return true;
    }
    close();
    if (!chain_) {
      done_ = true;  // this range is done
      return false;
    }
    pos_.file += 1;
    pos_.offset = 0;
    pos_.line = 0;
    line_base_ = 0;
    line_origin_ = 0;
  }
  return false;
}

}  // namespace ctitan
