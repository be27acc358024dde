// safetensors files: strict header reading, positioned reads, a durable writer.
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "checkpoint/format.h"
#include "config/errors.h"
#include "util/json.h"

namespace fs = std::filesystem;

namespace ctitan::safetensors {
namespace {

// The reference implementation refuses headers above 100 MB.
constexpr uint64_t kMaxHeader = 100'000'000;

[[noreturn]] void fail(const std::string& file, const std::string& what, const std::string& tensor = "") {
  throw RuntimeFailure("safetensors " + file + ": " + what + (tensor.empty() ? "" : " (tensor " + tensor + ")"));
}

void pread_all(int fd, void* dst, uint64_t n, uint64_t at, const std::string& file, const std::string& what) {
  auto* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(at + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(file, "cannot read " + what + ": " + std::strerror(errno));
    if (r == 0) fail(file, "file ends inside " + what + " (truncated?)");
    done += static_cast<uint64_t>(r);
  }
}

struct Fd {
  int fd;
  Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  }
  ~Fd() { ::close(fd); }
};

// A non-negative integer JSON number, or a failure naming the field.
uint64_t as_u64(const json::Value& v, const std::string& file, const std::string& field, const std::string& tensor) {
  int64_t x = 0;
  if (v.type != json::Value::Type::Number || !v.as_int64(&x) || x < 0)
    fail(file, field + " must hold non-negative integers", tensor);
  return static_cast<uint64_t>(x);
}

}  // namespace

size_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorInfo* Header::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// One tensor's header entry: dtype, shape and data_offsets, its bytes within the data and
// the size its dtype and shape need.
TensorInfo tensor_entry(const std::string& path, const std::string& name, const json::Value& v, uint64_t data_size) {
  if (v.type != json::Value::Type::Object) fail(path, "entry is not an object", name);
  const json::Value *dt = nullptr, *shape = nullptr, *off = nullptr;
  for (const auto& [k, x] : v.members) {
    if (k == "dtype" && !dt)
      dt = &x;
    else if (k == "shape" && !shape)
      shape = &x;
    else if (k == "data_offsets" && !off)
      off = &x;
    else
      fail(path, "unexpected or repeated field \"" + k + "\"", name);
  }
  if (!dt || !shape || !off) fail(path, "entry lacks dtype, shape or data_offsets", name);
  TensorInfo t;
  t.name = name;
  if (dt->type != json::Value::Type::String || dtype_size(dt->text) == 0)
    fail(path, "unknown dtype " + (dt->type == json::Value::Type::String ? dt->text : std::string("(not a string)")),
         name);
  t.dtype = dt->text;
  if (shape->type != json::Value::Type::Array) fail(path, "shape is not an array", name);
  uint64_t numel = 1;
  for (const auto& d : shape->items) {
    const uint64_t x = as_u64(d, path, "shape", name);
    if (x != 0 && numel > (uint64_t{1} << 62) / x) fail(path, "shape is too large", name);
    numel *= x;
    t.shape.push_back(static_cast<int64_t>(x));
  }
  if (off->type != json::Value::Type::Array || off->items.size() != 2)
    fail(path, "data_offsets is not a [begin, end] pair", name);
  t.begin = as_u64(off->items[0], path, "data_offsets", name);
  t.end = as_u64(off->items[1], path, "data_offsets", name);
  if (t.end < t.begin) fail(path, "data_offsets end before they begin", name);
  if (t.end > data_size)
    fail(path,
         "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
             ") run past the end of the data (" + std::to_string(data_size) + " bytes; truncated?)",
         name);
  const uint64_t want = numel * dtype_size(t.dtype);
  if (t.end - t.begin != want)
    fail(path,
         "holds " + std::to_string(t.end - t.begin) + " bytes but its dtype and shape need " + std::to_string(want),
         name);
  return t;
}

// The tensors, sorted by offset, cover the data exactly: no overlap, no gap, nothing after.
void check_coverage(Header& h, uint64_t data_size) {
  const std::string& path = h.file;
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  uint64_t next = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < next) fail(path, "data_offsets overlap the previous tensor's", t.name);
    if (t.begin > next) fail(path, "a gap of " + std::to_string(t.begin - next) + " bytes precedes its data", t.name);
    next = t.end;
  }
  if (next != data_size) fail(path, std::to_string(data_size - next) + " bytes after the last tensor belong to none");
}

}  // namespace

Header read_header(const std::string& path) {
  Header h;
  h.file = path;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail(path, "not a file");
  h.file_size = fs::file_size(path, ec);
  if (ec) fail(path, "cannot read its size: " + ec.message());
  if (h.file_size < 8) fail(path, "shorter than the 8-byte header length (" + std::to_string(h.file_size) + " bytes)");
  Fd f(path);
  unsigned char len[8];
  pread_all(f.fd, len, 8, 0, path, "the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > kMaxHeader)
    fail(path, "header length " + std::to_string(n) + " is above the 100 MB limit (not a safetensors file?)");
  if (n > h.file_size - 8)
    fail(path, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(h.file_size) +
                   " bytes; truncated?)");
  h.data_start = 8 + n;
  std::string text(n, '\0');
  pread_all(f.fd, text.data(), n, 8, path, "the header");
  if (text.empty() || text[0] != '{') fail(path, "the header is not a JSON object");
  json::Value root;
  std::string err;
  if (!json::parse(text, &root, &err)) fail(path, "the header is not valid JSON: " + err);
  if (root.type != json::Value::Type::Object) fail(path, "the header is not a JSON object");

  std::set<std::string> seen;
  const uint64_t data_size = h.file_size - h.data_start;
  for (const auto& [name, v] : root.members) {
    if (!seen.insert(name).second) fail(path, "duplicate key in the header", name);
    if (name == "__metadata__") {
      if (v.type != json::Value::Type::Object) fail(path, "__metadata__ is not an object");
      for (const auto& [k, s] : v.members) {
        if (s.type != json::Value::Type::String) fail(path, "__metadata__ value of \"" + k + "\" is not a string");
        h.metadata[k] = s.text;
      }
      continue;
    }
    h.tensors.push_back(tensor_entry(path, name, v, data_size));
  }
  check_coverage(h, data_size);
  return h;
}

void read_bytes(const Header& h, const TensorInfo& t, uint64_t begin, uint64_t end, void* dst) {
  if (begin > end || end > t.end - t.begin) fail(h.file, "read outside the tensor's bytes", t.name);
  Fd f(h.file);
  pread_all(f.fd, dst, end - begin, h.data_start + t.begin + begin, h.file, "the data of " + t.name);
}

// ---- writer -----------------------------------------------------------------------------------

Writer::Writer(std::string path, std::vector<TensorSpec> tensors, std::map<std::string, std::string> metadata)
    : path_(std::move(path)), order_(std::move(tensors)) {
  std::stable_sort(order_.begin(), order_.end(),
                   [](const TensorSpec& a, const TensorSpec& b) { return dtype_size(a.dtype) > dtype_size(b.dtype); });
  std::set<std::string> names;
  std::string json = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    json += std::string(first ? "" : ",") + json::quote(k) + ":" + json::quote(v);
    first = false;
  }
  json += "}";
  uint64_t at = 0;
  for (const auto& t : order_) {
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      throw std::invalid_argument("[safetensors] duplicate or reserved tensor name " + t.name);
    const size_t es = dtype_size(t.dtype);
    if (es == 0) throw std::invalid_argument("[safetensors] unknown dtype " + t.dtype + " of " + t.name);
    uint64_t n = es;
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (t.shape[i] < 0) throw std::invalid_argument("[safetensors] negative dimension in " + t.name);
      n *= static_cast<uint64_t>(t.shape[i]);
      shape += (i ? "," : "") + std::to_string(t.shape[i]);
    }
    json += "," + json::quote(t.name) + ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
            std::to_string(at) + "," + std::to_string(at + n) + "]}";
    sizes_.push_back(n);
    at += n;
  }
  json += "}";
  while ((8 + json.size()) % 8 != 0) json += ' ';
  out_ = std::make_unique<ckpt::DurableFileWriter>(path_);
  unsigned char len[8];
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
  out_->append(len, 8);
  out_->append(json.data(), json.size());
}

Writer::~Writer() = default;

void Writer::write(const std::string& name, const void* data, size_t nbytes) {
  if (next_ >= order_.size() || order_[next_].name != name)
    throw std::logic_error("[safetensors] " + path_ + ": wrote " + name + " but expected " +
                           (next_ < order_.size() ? order_[next_].name : std::string("nothing more")));
  if (nbytes != sizes_[next_])
    throw std::logic_error("[safetensors] " + path_ + ": " + name + " has " + std::to_string(nbytes) +
                           " bytes, its header says " + std::to_string(sizes_[next_]));
  out_->append(data, nbytes);
  ++next_;
}

void Writer::commit() {
  if (next_ != order_.size())
    throw std::logic_error("[safetensors] " + path_ + ": committed after " + std::to_string(next_) + " of " +
                           std::to_string(order_.size()) + " tensors");
  out_->commit();
}

uint64_t Writer::size() const { return out_->size(); }

}  // namespace ctitan::safetensors
