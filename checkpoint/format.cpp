// Checkpoint files: CRC-32, durable writes, the metadata text, folder scanning.
#include "checkpoint/format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "config/errors.h"
#include "util/crc.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan::ckpt {
namespace {

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw RuntimeFailure("checkpoint: cannot " + what + " " + path + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail("write", path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  if (shape.empty()) return "scalar";
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s;
}

}  // namespace

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) io_fail("open folder", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) io_fail("fsync folder", dir);
}

void write_file_durable(const std::string& path, const std::string& data) {
  DurableFileWriter w(path);
  w.append(data.data(), data.size());
  w.commit();
}

std::string read_whole_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) io_fail("read", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

DiskSpace disk_space(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  while (!p.empty() && !fs::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  struct statvfs sv {};
  struct stat st {};
  if (p.empty() || ::statvfs(p.c_str(), &sv) != 0 || ::stat(p.c_str(), &st) != 0) return {};
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  DiskSpace d;
  d.free = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  d.id = std::string(host) + ":" + std::to_string(static_cast<uint64_t>(st.st_dev));
  for (char& c : d.id)
    if (c == ' ') c = '_';
  return d;
}

std::string bytes_text(uint64_t bytes) {
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.1f", static_cast<double>(bytes) / (1 << 20));
  return std::to_string(bytes) + " bytes (" + mib + " MiB)";
}

DurableFileWriter::DurableFileWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) io_fail("create", tmp_);
}

DurableFileWriter::~DurableFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

uint64_t DurableFileWriter::append(const void* data, size_t n) { return append(data, n, crc::crc32(data, n)); }

uint64_t DurableFileWriter::append(const void* data, size_t n, uint32_t crc_of_data) {
  const uint64_t at = size_;
  write_all(fd_, data, n, tmp_);
  crc_ = crc::crc32_combine(crc_, crc_of_data, n);
  size_ += n;
  return at;
}

void DurableFileWriter::commit() {
  if (::fsync(fd_) != 0) io_fail("fsync", tmp_);
  if (::close(fd_) != 0) {
    fd_ = -1;
    io_fail("close", tmp_);
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) io_fail("rename into place", path_);
  committed_ = true;
  const fs::path parent = fs::path(path_).parent_path();  // "" for a bare file name
  fsync_dir(parent.empty() ? "." : parent.string());
}

const char* rule_name(Rule r) {
  switch (r) {
    case Rule::Sharded: return "sharded";
    case Rule::Replicated: return "replicated";
    case Rule::PerRank: return "per_rank";
  }
  return "?";
}

size_t dtype_size(const std::string& d) {
  if (d == "float32" || d == "int32") return 4;
  if (d == "bfloat16" || d == "float16") return 2;
  if (d == "float64" || d == "int64") return 8;
  if (d == "uint8") return 1;
  return 0;
}

int64_t EntryMeta::row_numel() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::string chunk_lines(const std::vector<EntryMeta>& entries) {
  std::string s;
  for (const auto& e : entries)
    for (const auto& c : e.chunks)
      s += "chunk " + e.key + " " + c.file + " " + std::to_string(c.offset) + " " + std::to_string(c.nbytes) + " " +
           std::to_string(c.row_begin) + " " + std::to_string(c.row_end) + " " + hex32(c.crc) + "\n";
  return s;
}

std::string Metadata::to_text() const {
  std::string s = "ctitan-checkpoint " + std::to_string(version) + "\n";
  s += "step " + std::to_string(step) + "\n";
  s += "world_size " + std::to_string(world_size) + "\n";
  s += "dp " + std::to_string(dp_replicate) + " " + std::to_string(dp_shard) + "\n";
  s += "model " + model_name + " " + model_flavor + "\n";
  s += std::string("model_only ") + (model_only ? "1" : "0") + "\n";
  for (const auto& f : files) s += "file " + f.name + " " + std::to_string(f.size) + " " + hex32(f.crc) + "\n";
  for (const auto& [key, e] : entries) {
    if (e.is_bytes)
      s += "entry " + key + " bytes " + rule_name(e.rule) + "\n";
    else
      s += "entry " + key + " tensor " + rule_name(e.rule) + " " + e.dtype + " " + shape_text(e.shape) + "\n";
  }
  std::vector<EntryMeta> all;
  for (const auto& kv : entries) all.push_back(kv.second);
  s += chunk_lines(all);
  s += "end\n";
  return s;
}

namespace {

// Reads a metadata file's records, one line at a time; every error names the line.
class MetadataParser {
 public:
  explicit MetadataParser(const std::string& where) : where_(where) {}
  Metadata parse(const std::string& text);

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw RuntimeFailure(where_ + ": " + what + " (line " + std::to_string(n_) + ")");
  }
  int64_t to_i64(const std::string& s) const;
  uint32_t to_crc(const std::string& s) const;
  Rule to_rule(const std::string& s) const;
  void header(const std::vector<std::string>& f);
  void record(const std::vector<std::string>& f);
  void entry(const std::vector<std::string>& f);
  void chunk(const std::vector<std::string>& f);

  const std::string& where_;
  Metadata m_;
  int64_t n_ = 0;  // the line being read, from 1
  bool ended_ = false, header_ = false;
  std::set<std::string> file_names_;
};

Metadata MetadataParser::parse(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    ++n_;
    if (ended_) bad("text after 'end'");
    std::istringstream ls(line);
    std::vector<std::string> f;
    for (std::string w; ls >> w;) f.push_back(w);
    if (f.empty()) bad("empty line");
    if (!header_)
      header(f);
    else
      record(f);
  }
  if (!header_) throw RuntimeFailure(where_ + ": empty metadata file");
  if (!ended_) throw RuntimeFailure(where_ + ": truncated (no 'end' record)");
  return std::move(m_);
}

int64_t MetadataParser::to_i64(const std::string& s) const {
  const auto v = parse_int64(s);
  if (!v) bad("not an integer: " + s);
  return *v;
}

uint32_t MetadataParser::to_crc(const std::string& s) const {
  if (s.size() != 8 || s.find_first_not_of("0123456789abcdef") != std::string::npos) bad("bad CRC " + s);
  return static_cast<uint32_t>(std::stoul(s, nullptr, 16));
}

Rule MetadataParser::to_rule(const std::string& s) const {
  if (s == "sharded") return Rule::Sharded;
  if (s == "replicated") return Rule::Replicated;
  if (s == "per_rank") return Rule::PerRank;
  bad("unknown rule " + s);
}

void MetadataParser::header(const std::vector<std::string>& f) {
  if (f[0] != "ctitan-checkpoint" || f.size() != 2) bad("not a ctitan checkpoint metadata file");
  m_.version = to_i64(f[1]);
  if (m_.version != kFormatVersion)
    bad("format version " + f[1] + "; this build reads version " + std::to_string(kFormatVersion));
  header_ = true;
}

void MetadataParser::record(const std::vector<std::string>& f) {
  const std::string& k = f[0];
  if (k == "step" && f.size() == 2) {
    m_.step = to_i64(f[1]);
  } else if (k == "world_size" && f.size() == 2) {
    m_.world_size = to_i64(f[1]);
  } else if (k == "dp" && f.size() == 3) {
    m_.dp_replicate = to_i64(f[1]);
    m_.dp_shard = to_i64(f[2]);
  } else if (k == "model" && f.size() == 3) {
    m_.model_name = f[1];
    m_.model_flavor = f[2];
  } else if (k == "model_only" && f.size() == 2) {
    m_.model_only = f[1] == "1";
  } else if (k == "file" && f.size() == 4) {
    FileMeta fm{f[1], static_cast<uint64_t>(to_i64(f[2])), to_crc(f[3])};
    if (f[1].find('/') != std::string::npos || !file_names_.insert(f[1]).second) bad("bad file name " + f[1]);
    m_.files.push_back(fm);
  } else if (k == "entry" && (f.size() == 4 || f.size() == 6)) {
    entry(f);
  } else if (k == "chunk" && f.size() == 8) {
    chunk(f);
  } else if (k == "end" && f.size() == 1) {
    ended_ = true;
  } else {
    bad("unexpected record '" + k + "'");
  }
}

void MetadataParser::entry(const std::vector<std::string>& f) {
  EntryMeta e;
  e.key = f[1];
  e.is_bytes = f[2] == "bytes";
  if (!e.is_bytes && f[2] != "tensor") bad("unknown entry kind " + f[2]);
  if (e.is_bytes != (f.size() == 4)) bad("malformed entry " + e.key);
  e.rule = to_rule(f[3]);
  if (!e.is_bytes) {
    e.dtype = f[4];
    if (dtype_size(e.dtype) == 0) bad("unknown dtype " + e.dtype);
    if (f[5] != "scalar")
      for (const auto& d : split(f[5], ',')) {
        const int64_t v = to_i64(d);
        if (v < 0) bad("negative dimension in " + e.key);
        e.shape.push_back(v);
      }
  }
  if (!m_.entries.emplace(e.key, e).second) bad("duplicate entry " + e.key);
}

void MetadataParser::chunk(const std::vector<std::string>& f) {
  auto it = m_.entries.find(f[1]);
  if (it == m_.entries.end()) bad("chunk of undeclared entry " + f[1]);
  ChunkMeta c;
  c.file = f[2];
  c.offset = static_cast<uint64_t>(to_i64(f[3]));
  c.nbytes = static_cast<uint64_t>(to_i64(f[4]));
  c.row_begin = to_i64(f[5]);
  c.row_end = to_i64(f[6]);
  c.crc = to_crc(f[7]);
  if (!file_names_.count(c.file)) bad("chunk in unlisted file " + c.file);
  it->second.chunks.push_back(c);
}

// Consistency: every chunk inside its file, tensor chunks the size of their rows, sharded
// chunks covering each row exactly once (sorted by row).
void check_consistency(Metadata& m, const std::string& where) {
  std::map<std::string, uint64_t> sizes;
  for (const auto& f : m.files) sizes[f.name] = f.size;
  for (auto& [key, e] : m.entries) {
    if (e.chunks.empty()) throw RuntimeFailure(where + ": entry " + key + " has no data");
    for (const auto& c : e.chunks) {
      if (c.offset + c.nbytes > sizes[c.file])
        throw RuntimeFailure(where + ": chunk of " + key + " lies outside " + c.file);
      if (!e.is_bytes) {
        const uint64_t want = static_cast<uint64_t>((c.row_end - c.row_begin) * e.row_numel()) * dtype_size(e.dtype);
        if (c.row_begin < 0 || c.row_end < c.row_begin || c.row_end > e.rows() || c.nbytes != want)
          throw RuntimeFailure(where + ": chunk of " + key + " has inconsistent rows or size");
      }
    }
    if (e.is_bytes || e.rule != Rule::Sharded) {
      if (e.chunks.size() != 1) throw RuntimeFailure(where + ": entry " + key + " must have one chunk");
      if (!e.is_bytes && (e.chunks[0].row_begin != 0 || e.chunks[0].row_end != e.rows()))
        throw RuntimeFailure(where + ": entry " + key + " does not cover all rows");
      continue;
    }
    std::sort(e.chunks.begin(), e.chunks.end(),
              [](const ChunkMeta& a, const ChunkMeta& b) { return a.row_begin < b.row_begin; });
    int64_t next = 0;
    for (const auto& c : e.chunks) {
      if (c.row_begin != next)
        throw RuntimeFailure(where + ": rows of " + key + " are not covered exactly once (at row " +
                             std::to_string(next) + ")");
      next = c.row_end;
    }
    if (next != e.rows())
      throw RuntimeFailure(where + ": rows of " + key + " end at " + std::to_string(next) + " of " +
                           std::to_string(e.rows()));
  }
}

}  // namespace

Metadata Metadata::parse(const std::string& text, const std::string& where) {
  Metadata m = MetadataParser(where).parse(text);
  check_consistency(m, where);
  return m;
}

std::string step_dir(const std::string& folder, int64_t step) {
  return (fs::path(folder) / ("step-" + std::to_string(step))).string();
}

std::string staging_dir(const std::string& folder, int64_t step) {
  return (fs::path(folder) / ("step-" + std::to_string(step) + ".partial")).string();
}

std::string complete_marker_text(int64_t step, const std::string& metadata_text) {
  return "ctitan-checkpoint-complete step " + std::to_string(step) + " metadata " +
         std::to_string(metadata_text.size()) + " " + hex32(crc::crc32(metadata_text.data(), metadata_text.size())) +
         "\n";
}

std::string hf_complete_marker_text(int64_t step, const std::string& index_text) {
  return "ctitan-hf-complete step " + std::to_string(step) + " index " + std::to_string(index_text.size()) + " " +
         hex32(crc::crc32(index_text.data(), index_text.size())) + "\n";
}

std::string dcp_complete_marker_text(int64_t step, const std::string& metadata_bytes) {
  return "ctitan-dcp-complete step " + std::to_string(step) + " metadata " + std::to_string(metadata_bytes.size()) +
         " " + hex32(crc::crc32(metadata_bytes.data(), metadata_bytes.size())) + "\n";
}

bool is_hf_step(const std::string& step_path) {
  std::error_code ec;
  const fs::path marker = fs::path(step_path) / "COMPLETE";
  if (!fs::exists(marker, ec)) return false;
  std::ifstream f(marker);
  std::string head(18, '\0');
  f.read(head.data(), 18);
  return f && head == "ctitan-hf-complete";
}

std::string incomplete_reason(const std::string& step_path, int64_t step) {
  const fs::path p(step_path);
  std::error_code ec;
  // A DCP folder PyTorch (torchtitan) wrote: its own commit is .metadata, written last (through a
  // temporary name). ctitan's DCP saves write .metadata inside step-<N>.partial, so a step folder
  // with .metadata and no marker is never a half-finished ctitan save.
  if (!fs::exists(p / "COMPLETE", ec) && fs::exists(p / ".metadata", ec) && !fs::exists(p / "metadata", ec)) return "";
  if (!fs::exists(p / "COMPLETE", ec)) return "no COMPLETE marker (the save did not finish)";
  if (is_hf_step(step_path)) {
    const fs::path index = p / "model.safetensors.index.json";
    if (!fs::exists(index, ec)) return "the HF index model.safetensors.index.json is missing";
    try {
      if (read_whole_file((p / "COMPLETE").string()) != hf_complete_marker_text(step, read_whole_file(index.string())))
        return "model.safetensors.index.json does not match the COMPLETE marker (modified or truncated)";
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  if (!fs::exists(p / "metadata", ec) && fs::exists(p / ".metadata", ec)) {  // checkpoint.format = "dcp"
    try {
      if (read_whole_file((p / "COMPLETE").string()) !=
          dcp_complete_marker_text(step, read_whole_file((p / ".metadata").string())))
        return "the .metadata file does not match the COMPLETE marker (modified or truncated)";
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  if (!fs::exists(p / "metadata", ec)) return "the metadata file is missing";
  try {
    const std::string meta = read_whole_file((p / "metadata").string());
    const std::string marker = read_whole_file((p / "COMPLETE").string());
    if (marker != complete_marker_text(step, meta))
      return "the metadata file does not match the COMPLETE marker (modified or truncated)";
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

FolderScan scan_folder(const std::string& folder) {
  FolderScan s;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return s;
  static const std::regex step_re("step-([0-9]+)");
  static const std::regex staging_re("step-([0-9]+)\\.partial");
  for (const auto& de : fs::directory_iterator(folder, ec)) {
    if (!de.is_directory()) continue;
    const std::string name = de.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, staging_re)) {
      s.staging.push_back(de.path().string());
    } else if (std::regex_match(name, m, step_re)) {
      const int64_t step = std::stoll(m[1]);
      const std::string why = incomplete_reason(de.path().string(), step);
      if (why.empty())
        s.complete.push_back(step);
      else
        s.incomplete.emplace_back(de.path().string(), why);
    }
  }
  std::sort(s.complete.begin(), s.complete.end());
  std::sort(s.incomplete.begin(), s.incomplete.end());
  std::sort(s.staging.begin(), s.staging.end());
  return s;
}

}  // namespace ctitan::ckpt
