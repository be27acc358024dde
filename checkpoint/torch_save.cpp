// torch.save's .pt format, written and checked without LibTorch; see torch_save.h.
#include "checkpoint/torch_save.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <unordered_set>

#include "checkpoint/format.h"
#include "config/errors.h"
#include "util/crc.h"

namespace fs = std::filesystem;

namespace ctitan::torch_save {
namespace {

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the .pt writer records byteorder \"little\" and copies tensor bytes as they are in memory"
#endif

constexpr uint64_t kU32Max = 0xFFFFFFFFull;  // miniz's MZ_UINT32_MAX
constexpr uint64_t kAlignment = 64;          // torch.serialization's storage_alignment
constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kDescriptorSig = 0x08074b50, kEndSig = 0x06054b50,
                   kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr size_t kLocalHeaderSize = 30, kCentralHeaderSize = 46, kEndSize = 22, kZip64EndSize = 56,
                 kZip64LocatorSize = 20;
constexpr uint16_t kFlagDescriptor = 0x0008, kFlagUtf8 = 0x0800;

void le16(std::string& s, uint64_t v) {
  for (int i = 0; i < 2; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void le32(std::string& s, uint64_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void le64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t rd(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// c10::hash_combine, as PyTorch's writer combines record-name hashes and CRCs.
uint64_t hash_combine(uint64_t seed, uint64_t value) { return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2)); }

const char* storage_class(const std::string& dtype) {
  static const std::map<std::string, const char*> m = {{"float32", "FloatStorage"},     {"float64", "DoubleStorage"},
                                                       {"bfloat16", "BFloat16Storage"}, {"float16", "HalfStorage"},
                                                       {"int64", "LongStorage"},        {"int32", "IntStorage"},
                                                       {"uint8", "ByteStorage"}};
  auto it = m.find(dtype);
  if (it == m.end()) throw std::logic_error("[torch_save] dtype " + dtype + " has no torch storage class here");
  return it->second;
}

// Python's pickle.Pickler at protocol 2, for the objects a state dict holds.
class Pickler {
 public:
  std::string out = std::string("\x80\x02", 2);  // PROTO 2

  // Memo index of the object just written (BINPUT / LONG_BINPUT).
  uint32_t put() {
    const uint32_t i = memo_++;
    if (i < 256) {
      out += 'q';
      out.push_back(static_cast<char>(i));
    } else {
      out += 'r';
      le32(out, i);
    }
    return i;
  }
  void get(uint32_t i) {
    if (i < 256) {
      out += 'h';
      out.push_back(static_cast<char>(i));
    } else {
      out += 'j';
      le32(out, i);
    }
  }
  uint32_t str(const std::string& s) {  // BINUNICODE (the bytes are UTF-8 already)
    out += 'X';
    le32(out, s.size());
    out += s;
    return put();
  }
  // A string or global written once and referred to by memo afterwards, as Python does
  // for one object used again ('storage', 'cpu', the classes and functions).
  void shared_str(const std::string& s) {
    auto it = shared_.find("s:" + s);
    if (it != shared_.end()) return get(it->second);
    shared_["s:" + s] = str(s);
  }
  void global(const std::string& module, const std::string& name) {
    const std::string key = "g:" + module + " " + name;
    auto it = shared_.find(key);
    if (it != shared_.end()) return get(it->second);
    out += 'c' + module + '\n' + name + '\n';
    shared_[key] = put();
  }
  void integer(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      out += 'K';
      out.push_back(static_cast<char>(v));
    } else if (v >= 0 && v <= 0xffff) {
      out += 'M';
      le16(out, static_cast<uint64_t>(v));
    } else if (v >= -0x80000000LL && v <= 0x7fffffffLL) {
      out += 'J';
      le32(out, static_cast<uint64_t>(v));
    } else {  // LONG1, as pickle.encode_long: (bit_length / 8) + 1 little-endian bytes
      if (v < 0) throw std::logic_error("[torch_save] negative sizes are not pickled here");
      const uint64_t u = static_cast<uint64_t>(v);
      const int nbytes = (64 - __builtin_clzll(u)) / 8 + 1;
      out += '\x8a';
      out.push_back(static_cast<char>(nbytes));
      for (int i = 0; i < nbytes; ++i) out.push_back(static_cast<char>(i < 8 ? (u >> (8 * i)) & 0xff : 0));
    }
  }
  void int_tuple(const std::vector<int64_t>& v) {
    if (v.empty()) {
      out += ')';  // EMPTY_TUPLE: never memoised
      return;
    }
    if (v.size() > 3) out += '(';
    for (int64_t x : v) integer(x);
    out += v.size() == 1 ? '\x85' : v.size() == 2 ? '\x86' : v.size() == 3 ? '\x87' : 't';
    put();
  }

 private:
  uint32_t memo_ = 0;
  std::map<std::string, uint32_t> shared_;
};

// _rebuild_tensor_v2(persistent id, 0, size, stride, False, OrderedDict()) of storage key `key`.
void rebuild_tensor(Pickler& p, const TensorSpec& t, size_t key) {
  p.global("torch._utils", "_rebuild_tensor_v2");
  p.out += "((";  // MARK (args), MARK (persistent id)
  p.shared_str("storage");
  p.global("torch", storage_class(t.dtype));
  p.str(std::to_string(key));
  p.shared_str("cpu");
  p.integer(t.numel());
  p.out += 't';
  p.put();
  p.out += 'Q';  // BINPERSID
  p.integer(0);  // storage offset
  p.int_tuple(t.shape);
  std::vector<int64_t> stride(t.shape.size());
  int64_t s = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    stride[d] = s;
    s *= std::max<int64_t>(t.shape[d], 1);
  }
  p.int_tuple(stride);
  p.out += '\x89';  // requires_grad False
  p.global("collections", "OrderedDict");
  p.out += ")R";  // backward hooks: OrderedDict()
  p.put();
  p.out += 't';
  p.put();
  p.out += 'R';
  p.put();
}

}  // namespace

std::string pickle_tensor(const TensorSpec& t) {
  Pickler p;
  rebuild_tensor(p, t, 0);
  p.out += '.';
  return p.out;
}

std::string pickle_int(int64_t v) {
  Pickler p;
  if (v < 0) {
    if (v < INT32_MIN) throw std::logic_error("[torch_save] integer below int32 not pickled here");
    p.out += 'J';
    le32(p.out, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))));
  } else {
    p.integer(v);
  }
  p.out += '.';
  return p.out;
}

std::string pickle_bytes(const std::string& b) {
  // Protocol 2 has no bytes opcode: Python pickles bytes as _codecs.encode(<latin-1 text>, 'latin1').
  std::string utf8;
  for (unsigned char c : b) {
    if (c < 0x80) {
      utf8.push_back(static_cast<char>(c));
    } else {
      utf8.push_back(static_cast<char>(0xC0 | (c >> 6)));
      utf8.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  Pickler p;
  p.global("_codecs", "encode");
  p.str(utf8);
  p.str("latin1");
  p.out += '\x86';  // TUPLE2
  p.put();
  p.out += 'R';
  p.put();
  p.out += '.';
  return p.out;
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t dtype_size(const std::string& d) {
  if (d == "float64" || d == "int64") return 8;
  if (d == "float32" || d == "int32") return 4;
  if (d == "bfloat16" || d == "float16") return 2;
  if (d == "uint8") return 1;
  return 0;
}

std::string pickle_state_dict(const std::vector<TensorSpec>& tensors) {
  Pickler p;
  // A plain dict, as torch.save({...}) writes: LibTorch's unpickler (which ctitan reads .pt
  // files with) takes a top-level collections.OrderedDict for a tensor's hooks, i.e. None.
  p.out += '}';  // EMPTY_DICT
  p.put();
  // Python's batch_dict: batches of 1000 items, MARK ... SETITEMS; a batch of one is SETITEM.
  constexpr size_t kBatch = 1000;
  for (size_t b = 0; b < tensors.size(); b += kBatch) {
    const size_t e = std::min(tensors.size(), b + kBatch);
    if (e - b > 1) p.out += '(';
    for (size_t i = b; i < e; ++i) {
      p.str(tensors[i].name);
      rebuild_tensor(p, tensors[i], i);
    }
    p.out += e - b > 1 ? 'u' : 's';
  }
  p.out += '.';
  return p.out;
}

std::string archive_name(const std::string& path) {
  // caffe2::serialize's basename(): after the last '/' or '\\', before the last '.'.
  size_t start = 0;
  for (size_t i = 0; i < path.size(); ++i)
    if (path[i] == '/' || path[i] == '\\') start = i + 1;
  size_t end = path.size();
  for (size_t i = end; i > start; --i)
    if (path[i - 1] == '.') {
      end = i - 1;
      break;
    }
  const std::string name = start >= path.size() ? "" : path.substr(start, end - start);
  return name.empty() ? "archive" : name;
}

// ---- the writer ----------------------------------------------------------------------------

Writer::Writer(const std::string& path, std::vector<TensorSpec> tensors)
    : prefix_(archive_name(path) + "/"), tensors_(std::move(tensors)) {
  for (const auto& t : tensors_) {
    storage_class(t.dtype);  // validates
    for (int64_t d : t.shape)
      if (d < 0) throw std::logic_error("[torch_save] " + t.name + " has a negative dimension");
  }
  out_ = std::make_unique<ckpt::DurableFileWriter>(path);
  const std::string pkl = pickle_state_dict(tensors_);
  add_record("data.pkl", pkl.data(), pkl.size());
  add_record(".format_version", "1", 1);
  add_record(".storage_alignment", "64", 2);
  add_record("byteorder", "little", 6);
}

Writer::~Writer() = default;

uint64_t Writer::size() const { return mem_ ? mem_->size() - base_ : out_->size(); }

void Writer::emit(const void* data, size_t n) {
  if (mem_)
    mem_->append(static_cast<const char*>(data), n);
  else
    out_->append(data, n);
}

Writer::Writer(std::string* out, const std::string& archive, const std::string& data_pkl,
               std::vector<TensorSpec> tensors)
    : prefix_(archive + "/"), tensors_(std::move(tensors)), mem_(out), base_(out->size()) {
  for (const auto& t : tensors_) storage_class(t.dtype);  // validates
  add_record("data.pkl", data_pkl.data(), data_pkl.size());
  add_record(".format_version", "1", 1);
  add_record(".storage_alignment", "64", 2);
  add_record("byteorder", "little", 6);
}

void Writer::write(const std::string& name, const void* data, size_t nbytes) {
  if (next_ >= tensors_.size() || tensors_[next_].name != name)
    throw std::logic_error("[torch_save] " + name + " written out of the declared order");
  const TensorSpec& t = tensors_[next_];
  if (nbytes != static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype))
    throw std::logic_error("[torch_save] " + name + ": " + std::to_string(nbytes) + " bytes, declared " +
                           std::to_string(t.numel() * static_cast<int64_t>(dtype_size(t.dtype))));
  add_record("data/" + std::to_string(next_), data, nbytes);
  ++next_;
}

// miniz's mz_zip_writer_add_mem_ex_v2 as PyTorchStreamWriter::writeRecord calls it: stored,
// no time stamp, PyTorch's "FB" padding so the data starts at a multiple of 64.
void Writer::add_record(const std::string& record, const void* data, size_t n) {
  const std::string name = prefix_ + record;
  if (name.size() > 0xffff) throw UserError("torch_save: record name longer than a zip allows: " + name);
  const uint64_t ofs = size();
  const bool zip64 = n >= kU32Max || ofs >= kU32Max;
  std::string zip64_extra;
  auto make_zip64_extra = [&](uint64_t comp) {  // header id 1: sizes when large, then offset when far
    std::string x;
    le16(x, 1);
    le16(x, (n >= kU32Max ? 16 : 0) + (ofs >= kU32Max ? 8 : 0));
    if (n >= kU32Max) {
      le64(x, n);
      le64(x, comp);
    }
    if (ofs >= kU32Max) le64(x, ofs);
    return x;
  };
  if (zip64) zip64_extra = make_zip64_extra(0);  // the local header's holds compressed size 0
  const uint64_t start = ofs + kLocalHeaderSize + name.size() + zip64_extra.size() + 4;
  const uint64_t pad = (kAlignment - start % kAlignment) % kAlignment;
  std::string fb = "FB";
  le16(fb, pad);
  fb.append(pad, 'Z');

  const uint16_t flags = (n ? kFlagDescriptor : 0) | kFlagUtf8;
  std::string h;
  le32(h, kLocalSig);
  le16(h, 0);  // version needed (stored)
  le16(h, flags);
  le16(h, 0);  // method: stored
  le32(h, 0);  // time, date
  le32(h, 0);  // CRC, sizes: in the data descriptor
  le32(h, 0);
  le32(h, 0);
  le16(h, name.size());
  le16(h, zip64_extra.size() + fb.size());
  emit(h.data(), h.size());
  emit(name.data(), name.size());
  emit(zip64_extra.data(), zip64_extra.size());
  emit(fb.data(), fb.size());
  // PyTorch combines the CRC of every write that starts with a data descriptor's signature
  // into the serialization id; a name or data that happens to start so counts too.
  auto seen = [&](const char* p, size_t len) {
    if (len >= 8 && rd(p, 4) == kDescriptorSig) combined_crc_ = hash_combine(combined_crc_, rd(p + 4, 4));
  };
  seen(name.data(), name.size());
  const uint32_t crc = crc::crc32(data, n);
  if (n) {
    seen(static_cast<const char*>(data), n);
    if (mem_)
      mem_->append(static_cast<const char*>(data), n);
    else
      out_->append(data, n, crc);
    std::string d;
    le32(d, kDescriptorSig);
    le32(d, crc);
    if (zip64) {
      le64(d, n);
      le64(d, n);
    } else {
      le32(d, n);
      le32(d, n);
    }
    emit(d.data(), d.size());
    seen(d.data(), d.size());
  }
  entries_.push_back({name, ofs, n, crc});
  records_.push_back(record);
}

void Writer::commit() {
  if (next_ != tensors_.size())
    throw std::logic_error("[torch_save] commit after " + std::to_string(next_) + " of " +
                           std::to_string(tensors_.size()) + " tensors");
  add_record("version", "3\n", 2);
  // PyTorchStreamWriter::writeSerializationId: the hashes of the record names written so far,
  // combined in the iteration order of its std::unordered_set, then the combined CRCs.
  std::unordered_set<std::string> written;
  for (const auto& r : records_) written.insert(r);
  uint64_t names = 0;
  for (const auto& r : written) names = hash_combine(names, std::hash<std::string>{}(r));
  char id[48];
  std::snprintf(id, sizeof id, "%020" PRIu64 "%020" PRIu64, names, combined_crc_);
  add_record(".data/serialization_id", id, 40);

  // Central directory, then zip64 end record and locator, then the end record.
  const uint64_t cd_ofs = size();
  std::string cd;
  for (const auto& e : entries_) {
    const bool zip64 = e.size >= kU32Max || e.header_offset >= kU32Max;
    le32(cd, kCentralSig);
    le16(cd, 0);  // version made by
    le16(cd, 0);  // version needed
    le16(cd, (e.size ? kFlagDescriptor : 0) | kFlagUtf8);
    le16(cd, 0);  // method
    le32(cd, 0);  // time, date
    le32(cd, e.crc);
    le32(cd, std::min(e.size, kU32Max));
    le32(cd, std::min(e.size, kU32Max));
    le16(cd, e.name.size());
    std::string x;
    if (zip64) {
      le16(x, 1);
      le16(x, (e.size >= kU32Max ? 16 : 0) + (e.header_offset >= kU32Max ? 8 : 0));
      if (e.size >= kU32Max) {
        le64(x, e.size);
        le64(x, e.size);
      }
      if (e.header_offset >= kU32Max) le64(x, e.header_offset);
    }
    le16(cd, x.size());
    le16(cd, 0);  // comment
    le16(cd, 0);  // disk
    le16(cd, 0);  // internal attributes
    le32(cd, 0);  // external attributes
    le32(cd, std::min(e.header_offset, kU32Max));
    cd += e.name;
    cd += x;
  }
  emit(cd.data(), cd.size());
  const uint64_t end64 = size();
  std::string t;
  le32(t, kZip64EndSig);
  le64(t, kZip64EndSize - 12);
  le16(t, 0x031E);
  le16(t, 0x002D);
  le32(t, 0);
  le32(t, 0);
  le64(t, entries_.size());
  le64(t, entries_.size());
  le64(t, cd.size());
  le64(t, cd_ofs);
  le32(t, kZip64LocatorSig);
  le32(t, 0);
  le64(t, end64);
  le32(t, 1);
  le32(t, kEndSig);
  le16(t, 0);
  le16(t, 0);
  le16(t, std::min<uint64_t>(entries_.size(), 0xffff));
  le16(t, std::min<uint64_t>(entries_.size(), 0xffff));
  le32(t, std::min<uint64_t>(cd.size(), kU32Max));
  le32(t, std::min<uint64_t>(cd_ofs, kU32Max));
  le16(t, 0);
  emit(t.data(), t.size());
  if (!mem_) out_->commit();
}

// ---- the check -----------------------------------------------------------------------------

bool looks_like_zip(const char* data, size_t n) { return n >= 4 && rd(data, 4) == kLocalSig; }

namespace {

[[noreturn]] void zip_fail(const std::string& where, const std::string& what) { throw UserError(where + ": " + what); }

// Where the central directory is: its entry count, offset and size (zip64 when the end
// records say so), checked to end where the end records start.
struct CentralDirectory {
  uint64_t entries = 0, size = 0, ofs = 0;
};

CentralDirectory find_central_directory(const char* p, size_t n, const std::string& where) {
  auto fail = [&](const std::string& what) { zip_fail(where, what); };
  auto in_file = [&](uint64_t ofs, uint64_t len) { return ofs <= n && len <= n - ofs; };
  if (n < kEndSize) fail("too short for a zip archive (" + std::to_string(n) + " bytes)");
  // The end record: the last one whose comment reaches the end of the file exactly.
  uint64_t end = UINT64_MAX;
  for (uint64_t i = n - kEndSize + 1; i-- > 0 && n - i <= kEndSize + 0xffff;) {
    if (rd(p + i, 4) == kEndSig && i + kEndSize + rd(p + i + 20, 2) == n) {
      end = i;
      break;
    }
  }
  if (end == UINT64_MAX) fail("no zip end-of-central-directory record (truncated or not a zip archive)");
  CentralDirectory cd;
  cd.entries = rd(p + end + 10, 2), cd.size = rd(p + end + 12, 4), cd.ofs = rd(p + end + 16, 4);
  uint64_t cd_limit = end;  // the central directory ends before the end records
  if (rd(p + end + 4, 2) != 0 || rd(p + end + 6, 2) != 0 || rd(p + end + 8, 2) != cd.entries)
    fail("a multi-disk zip archive");
  if (end >= kZip64LocatorSize && rd(p + end - kZip64LocatorSize, 4) == kZip64LocatorSig) {
    const uint64_t z = rd(p + end - kZip64LocatorSize + 8, 8);
    if (!in_file(z, kZip64EndSize) || z + kZip64EndSize > end - kZip64LocatorSize || rd(p + z, 4) != kZip64EndSig)
      fail("the zip64 end-of-central-directory locator points outside the file or at no zip64 record");
    cd.entries = rd(p + z + 32, 8);
    cd.size = rd(p + z + 40, 8);
    cd.ofs = rd(p + z + 48, 8);
    cd_limit = z;
  } else if (cd.entries == 0xffff || cd.size == kU32Max || cd.ofs == kU32Max) {
    fail("zip64 sizes without a zip64 end-of-central-directory record");
  }
  if (cd.ofs > cd_limit || cd.size != cd_limit - cd.ofs)
    fail("the central directory (offset " + std::to_string(cd.ofs) + ", " + std::to_string(cd.size) +
         " bytes) does not end where the end records start (" + std::to_string(cd_limit) + "): truncated or damaged");
  if (cd.entries == 0) fail("an empty zip archive");
  return cd;
}

// zip64 extended information in the extra fields [x, x_end): the fields that are all ones,
// in the order the format gives.
void read_zip64_extra(const char* p, uint64_t x, uint64_t x_end, uint64_t& size, uint64_t& comp, uint64_t& local,
                      const std::string& where, const std::string& what) {
  while (x + 4 <= x_end) {
    const uint64_t id = rd(p + x, 2), len = rd(p + x + 2, 2);
    if (x + 4 + len > x_end) zip_fail(where, what + ": an extra field runs past its header");
    if (id == 1) {
      uint64_t f = x + 4;
      auto take = [&](uint64_t& v) {
        if (v != kU32Max) return;
        if (f + 8 > x + 4 + len) zip_fail(where, what + ": its zip64 extra field is too short");
        v = rd(p + f, 8);
        f += 8;
      };
      take(size);
      take(comp);
      take(local);
    }
    x += 4 + len;
  }
}

// Central directory entry k at offset c: checked against its local header and, when stored,
// its CRC-32; returns its record (name within the archive's folder `prefix`, set by entry 0)
// and moves c to the next entry.
Record check_entry(const char* p, size_t n, const CentralDirectory& cd, uint64_t k, uint64_t& c, std::string& prefix,
                   const std::string& where) {
  auto in_file = [&](uint64_t ofs, uint64_t len) { return ofs <= n && len <= n - ofs; };
  const std::string which = "zip entry " + std::to_string(k);
  if (c + kCentralHeaderSize > cd.ofs + cd.size || rd(p + c, 4) != kCentralSig)
    zip_fail(where, which + ": no central directory header where one should be");
  const uint64_t flags = rd(p + c + 8, 2), method = rd(p + c + 10, 2);
  const uint32_t crc = static_cast<uint32_t>(rd(p + c + 16, 4));
  uint64_t comp = rd(p + c + 20, 4), size = rd(p + c + 24, 4);
  const uint64_t nlen = rd(p + c + 28, 2), xlen = rd(p + c + 30, 2), clen = rd(p + c + 32, 2);
  uint64_t local = rd(p + c + 42, 4);
  if (c + kCentralHeaderSize + nlen + xlen + clen > cd.ofs + cd.size)
    zip_fail(where, which + ": its central directory header runs past the directory");
  const std::string name(p + c + kCentralHeaderSize, nlen);
  const std::string what = "zip entry " + name;
  read_zip64_extra(p, c + kCentralHeaderSize + nlen, c + kCentralHeaderSize + nlen + xlen, size, comp, local, where,
                   what);
  if (k == 0) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) zip_fail(where, what + " is not in a folder, as every record of a .pt file is");
    prefix = name.substr(0, slash + 1);
  } else if (name.compare(0, prefix.size(), prefix) != 0) {
    zip_fail(where, what + " is not in the archive's folder " + prefix);
  }
  if (flags & 1) zip_fail(where, what + " is encrypted");
  if (!in_file(local, kLocalHeaderSize) || local + kLocalHeaderSize > cd.ofs || rd(p + local, 4) != kLocalSig)
    zip_fail(where, what + ": no local header at offset " + std::to_string(local) + " (damaged or truncated)");
  const uint64_t lnlen = rd(p + local + 26, 2), lxlen = rd(p + local + 28, 2);
  const uint64_t data = local + kLocalHeaderSize + lnlen + lxlen;
  if (lnlen != nlen || !in_file(local + kLocalHeaderSize, lnlen) ||
      std::memcmp(p + local + kLocalHeaderSize, name.data(), nlen) != 0)
    zip_fail(where, what + ": its local header names another file (damaged)");
  if (rd(p + local + 8, 2) != method) zip_fail(where, what + ": local and central headers disagree on the compression");
  if (data > cd.ofs || comp > cd.ofs - data)
    zip_fail(where, what + ": its " + std::to_string(comp) + " bytes at offset " + std::to_string(data) +
                        " run past the central directory (truncated or damaged)");
  if (method == 0) {
    if (comp != size) zip_fail(where, what + ": stored, but its sizes differ");
    if (crc != 0 && crc::crc32(p + data, size) != crc)
      zip_fail(where, what + ": its bytes do not match their CRC-32 (damaged)");
  }
  c += kCentralHeaderSize + nlen + xlen + clen;
  return {name.substr(prefix.size()), data, size};
}

}  // namespace

std::vector<Record> check_archive(const char* p, size_t n, const std::string& where) {
  const CentralDirectory cd = find_central_directory(p, n, where);
  std::vector<Record> out;
  std::string prefix;
  uint64_t c = cd.ofs;
  for (uint64_t k = 0; k < cd.entries; ++k) out.push_back(check_entry(p, n, cd, k, c, prefix, where));
  if (c != cd.ofs + cd.size)
    zip_fail(where, "the central directory holds more than its " + std::to_string(cd.entries) + " entries");
  return out;
}

}  // namespace ctitan::torch_save
