// DCP folders: .metadata and items, read and written; see dcp.h.
#include "checkpoint/dcp.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "checkpoint/format.h"
#include "checkpoint/torch_save.h"
#include "config/errors.h"

namespace fs = std::filesystem;

namespace ctitan::dcp {

using pickle::Ptr;
using pickle::Value;
using K = pickle::Value::Kind;

namespace {

const std::string kMd = "torch.distributed.checkpoint.metadata.";

// torch dtypes as Python names them, and ctitan's names; storage classes of torch.save.
const std::map<std::string, std::string>& dtype_names() {
  static const std::map<std::string, std::string> m = {
      {"float32", "float32"},   {"float", "float32"},   {"float64", "float64"}, {"double", "float64"},
      {"bfloat16", "bfloat16"}, {"float16", "float16"}, {"half", "float16"},    {"int64", "int64"},
      {"long", "int64"},        {"int32", "int32"},     {"int", "int32"},       {"uint8", "uint8"}};
  return m;
}
const std::map<std::string, std::string>& storage_dtypes() {
  static const std::map<std::string, std::string> m = {
      {"torch.FloatStorage", "float32"}, {"torch.DoubleStorage", "float64"}, {"torch.BFloat16Storage", "bfloat16"},
      {"torch.HalfStorage", "float16"},  {"torch.LongStorage", "int64"},     {"torch.IntStorage", "int32"},
      {"torch.ByteStorage", "uint8"}};
  return m;
}

// The classes and functions torch.distributed.checkpoint's .metadata names (PyTorch 2.x).
const std::set<std::string>& metadata_globals() {
  static const std::set<std::string> s = [] {
    std::set<std::string> g = {kMd + "Metadata",
                               kMd + "TensorStorageMetadata",
                               kMd + "BytesStorageMetadata",
                               kMd + "ChunkStorageMetadata",
                               kMd + "TensorProperties",
                               kMd + "MetadataIndex",
                               kMd + "StorageMeta",
                               kMd + "_MEM_FORMAT_ENCODING",
                               "torch.distributed.checkpoint.filesystem._StorageInfo",
                               "torch.Size",
                               "torch.serialization._get_layout",
                               "pathlib.PosixPath",
                               "pathlib.PurePosixPath",
                               "collections.OrderedDict"};
    for (const auto& [py, c] : dtype_names()) g.insert("torch." + py);
    return g;
  }();
  return s;
}

// What torch.save's data.pkl names for one tensor, or for a plain Python object.
const std::set<std::string>& tensor_globals() {
  static const std::set<std::string> s = [] {
    std::set<std::string> g = {"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"};
    for (const auto& [cls, d] : storage_dtypes()) g.insert(cls);
    return g;
  }();
  return s;
}
const std::set<std::string>& object_globals() {
  static const std::set<std::string> s = {"_codecs.encode", "collections.OrderedDict"};
  return s;
}

[[noreturn]] void bad(const std::string& where, const std::string& what) { throw RuntimeFailure(where + ": " + what); }

// A dataclass instance as pickled: NEWOBJ(cls) then BUILD with its __dict__.
const Value& object_of(const Value& v, const std::string& cls, const std::string& where) {
  if (!v.is(K::Object) || v.s != cls) bad(where, "expected a " + cls + ", found " + pickle::describe(v));
  return v;
}
const Value* field(const Value& obj, const std::string& name) { return obj.state ? obj.state->get(name) : nullptr; }
const Value& need(const Value& obj, const std::string& name, const std::string& where) {
  const Value* f = field(obj, name);
  if (!f) bad(where, obj.s + " has no field " + name);
  return *f;
}

// torch.Size((d0, d1, ...)) → the dims.
std::vector<int64_t> size_of(const Value& v, const std::string& where) {
  if (!v.is(K::Object) || v.s != "torch.Size" || v.items.size() != 1 || !v.items[0]->is(K::Tuple))
    bad(where, "expected a torch.Size, found " + pickle::describe(v));
  std::vector<int64_t> out;
  for (const auto& d : v.items[0]->items) {
    if (!d->is(K::Int) || d->i < 0) bad(where, "a torch.Size holds " + pickle::describe(*d));
    out.push_back(d->i);
  }
  return out;
}

std::string dtype_of(const Value& props, const std::string& where) {
  // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory).
  if (!props.state || !props.state->is(K::Tuple) || props.state->items.empty())
    bad(where, "TensorProperties without its state tuple");
  const Value& d = *props.state->items[0];
  if (!d.is(K::Global)) bad(where, "TensorProperties dtype is " + pickle::describe(d));
  auto it = dtype_names().find(d.s.substr(6));
  if (d.s.rfind("torch.", 0) != 0 || it == dtype_names().end()) bad(where, "unsupported dtype " + d.s);
  if (props.state->items.size() > 1) {
    const Value& layout = *props.state->items[1];
    if (!(layout.is(K::Object) && layout.items.size() == 1 && layout.items[0]->is(K::Str) &&
          layout.items[0]->s == "torch.strided") &&
        !layout.is(K::None))
      bad(where, "a tensor layout other than torch.strided (" + pickle::describe(layout) + ")");
  }
  return it->second;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// The zip archive of one item, checked; returns (data.pkl, records).
std::vector<torch_save::Record> open_archive(const std::string& archive, const std::string& where, std::string* pkl) {
  std::vector<torch_save::Record> recs;
  try {
    recs = torch_save::check_archive(archive.data(), archive.size(), where);
  } catch (const UserError& e) {
    throw RuntimeFailure(e.what());
  }
  for (const auto& r : recs)
    if (r.name == "data.pkl") {
      pkl->assign(archive.data() + r.data_offset, r.size);
      return recs;
    }
  bad(where, "the item's archive has no data.pkl record");
}

std::string utf8_to_latin1(const std::string& s, const std::string& where) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size() && c <= 0xC3) {
      out.push_back(static_cast<char>(((c & 0x1F) << 6) | (static_cast<unsigned char>(s[++i]) & 0x3F)));
    } else {
      bad(where, "a latin-1 byte string holds a character above U+00FF");
    }
  }
  return out;
}

// _codecs.encode(text, 'latin1') → Bytes, everywhere in the tree (how protocol 2 pickles bytes).
Ptr resolve_bytes(const Ptr& v, const std::string& where, int depth = 0) {
  // A pickle can nest (or, through its memo, loop) without bound: plain objects here are shallow.
  if (depth > 32) bad(where, "the stored object nests deeper than 32 levels");
  if (v->is(K::Object) && v->s == "_codecs.encode") {
    if (v->items.size() != 2 || !v->items[0]->is(K::Str) || !v->items[1]->is(K::Str) || v->items[1]->s != "latin1")
      bad(where, "_codecs.encode with arguments other than (text, 'latin1')");
    auto b = std::make_shared<Value>();
    b->kind = K::Bytes;
    b->s = utf8_to_latin1(v->items[0]->s, where);
    return b;
  }
  for (auto& x : v->items) x = resolve_bytes(x, where, depth + 1);
  for (auto& kv : v->dict) kv.second = resolve_bytes(kv.second, where, depth + 1);
  return v;
}

// ---- the .metadata writer: Python's pickler at protocol 2 for the same objects --------------

class Out {
 public:
  std::string s = std::string("\x80\x02", 2);
  void global(const std::string& module, const std::string& name) { s += 'c' + module + '\n' + name + '\n'; }
  void str(const std::string& v) {
    s += 'X';
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v.size() >> (8 * i)) & 0xff));
    s += v;
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      s += 'K';
      s.push_back(static_cast<char>(v));
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      s += 'J';
      for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((static_cast<uint32_t>(v) >> (8 * i)) & 0xff));
    } else {
      s += '\x8a';
      s.push_back(8);
      for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
    }
  }
  void torch_size(const std::vector<int64_t>& d) {
    global("torch", "Size");
    s += '(';
    for (int64_t x : d) integer(x);
    s += "t\x85R";  // ((d0, ...),) then REDUCE
  }
  // NEWOBJ of a class of DCP's metadata module, no arguments.
  void dataclass(const std::string& module, const std::string& name) {
    global(module, name);
    s += ")\x81";
  }
};

}  // namespace

bool is_dcp_folder(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kMetadataFile, ec);
}

namespace {

// A TensorStorageMetadata: the tensor's dtype, size and chunks (offsets and sizes).
void read_tensor_metadata(const Value& v, const std::string& where, Item& it) {
  const std::string key_where = where + " (" + it.key + ")";
  const Value& t = object_of(v, kMd + "TensorStorageMetadata", key_where);
  it.dtype = dtype_of(object_of(need(t, "properties", where), kMd + "TensorProperties", where), key_where);
  it.size = size_of(need(t, "size", where), key_where);
  const Value& chunks = need(t, "chunks", where);
  if (!chunks.is(K::List)) bad(where, it.key + ": chunks is not a list");
  for (const auto& c : chunks.items) {
    const Value& cm = object_of(*c, kMd + "ChunkStorageMetadata", key_where);
    Chunk ch;
    ch.offsets = size_of(need(cm, "offsets", where), where);
    ch.sizes = size_of(need(cm, "sizes", where), where);
    if (ch.offsets.size() != it.size.size() || ch.sizes.size() != it.size.size())
      bad(where, it.key + ": a chunk of rank " + std::to_string(ch.sizes.size()) + " in a tensor of rank " +
                     std::to_string(it.size.size()));
    for (size_t d = 0; d < it.size.size(); ++d)
      if (ch.offsets[d] + ch.sizes[d] > it.size[d]) bad(where, it.key + ": a chunk lies outside the tensor");
    it.chunks.push_back(std::move(ch));
  }
}

// One storage_data record (MetadataIndex → _StorageInfo): where a chunk of an item lives, which
// must lie within its file (a truncated file is reported here, by name). file_sizes caches the
// sizes of the files seen.
void locate_chunk(const Value& k, const Value& v, const std::string& dir, Metadata& out,
                  std::map<std::string, uint64_t>& file_sizes) {
  const std::string where = (fs::path(dir) / kMetadataFile).string();
  const Value& idx = object_of(k, kMd + "MetadataIndex", where);
  const Value& info = object_of(v, "torch.distributed.checkpoint.filesystem._StorageInfo", where);
  const Value& fqn = need(idx, "fqn", where);
  if (!fqn.is(K::Str)) bad(where, "a MetadataIndex fqn is " + pickle::describe(fqn));
  auto it = out.items.find(fqn.s);
  if (it == out.items.end()) bad(where, "storage_data names " + fqn.s + ", which state_dict_metadata lacks");
  const std::string key_where = where + " (" + fqn.s + ")";
  if (const Value* td = field(info, "transform_descriptors"); td && !td->is(K::None) && !td->items.empty())
    bad(key_where, "stored with transforms " + pickle::describe(*td) + " (compression extensions are not supported)");
  const Value& rel = need(info, "relative_path", key_where);
  const Value& off = need(info, "offset", key_where);
  const Value& len = need(info, "length", key_where);
  if (!rel.is(K::Str) || !off.is(K::Int) || !len.is(K::Int) || off.i < 0 || len.i <= 0)
    bad(key_where,
        "a _StorageInfo of " + pickle::describe(rel) + ", " + pickle::describe(off) + ", " + pickle::describe(len));
  if (rel.s.find('/') != std::string::npos || rel.s == ".." || rel.s.empty())
    bad(key_where, "a storage file outside the folder: " + rel.s);
  Chunk* target = nullptr;
  Item& item = it->second;
  if (item.is_bytes) {
    if (item.chunks.empty()) item.chunks.emplace_back();
    target = &item.chunks[0];
  } else {
    const Value* o = field(idx, "offset");
    if (!o || o->is(K::None)) bad(key_where, "a tensor's MetadataIndex without chunk offsets");
    const std::vector<int64_t> offs = size_of(*o, key_where);
    for (auto& c : item.chunks)
      if (c.offsets == offs) target = &c;
    if (!target) bad(key_where, "storage_data names a chunk the tensor does not have");
  }
  if (!target->file.empty()) bad(key_where, "two storage entries for one chunk");
  target->file = rel.s;
  target->offset = static_cast<uint64_t>(off.i);
  target->length = static_cast<uint64_t>(len.i);
  // The item must lie within its file (a truncated file is reported here, by name).
  auto fsz = file_sizes.find(rel.s);
  if (fsz == file_sizes.end()) {
    std::error_code ec;
    const fs::path fp = fs::path(dir) / rel.s;
    if (!fs::exists(fp, ec))
      bad("checkpoint " + dir + " is corrupt", rel.s + " is missing (named by .metadata for " + fqn.s + ")");
    fsz = file_sizes.emplace(rel.s, fs::file_size(fp, ec)).first;
  }
  if (target->offset + target->length > fsz->second)
    bad("checkpoint " + dir + " is corrupt", rel.s + " has " + std::to_string(fsz->second) + " bytes, but " + fqn.s +
                                                 " is stored at bytes [" + std::to_string(target->offset) + ", " +
                                                 std::to_string(target->offset + target->length) + ") (truncated?)");
}

}  // namespace

Metadata read_metadata(const std::string& dir) {
  const std::string path = (fs::path(dir) / kMetadataFile).string();
  const std::string where = path;
  const std::string bytes = ckpt::read_whole_file(path);
  Ptr root;
  try {
    root = pickle::load(bytes.data(), bytes.size(), metadata_globals(), where);
  } catch (const pickle::PickleError& e) {
    throw RuntimeFailure(e.what());
  }
  const Value& md = object_of(*root, kMd + "Metadata", where);
  Metadata out;
  if (const Value* v = field(md, "version"); v && v->is(K::Str)) out.version = v->s;
  const Value& sdm = need(md, "state_dict_metadata", where);
  if (!sdm.is(K::Dict)) bad(where, "state_dict_metadata is not a dict");
  for (const auto& [k, v] : sdm.dict) {
    if (!k->is(K::Str)) bad(where, "a state_dict_metadata key is " + pickle::describe(*k));
    Item it;
    it.key = k->s;
    if (v->is(K::Object) && v->s == kMd + "BytesStorageMetadata") {
      it.is_bytes = true;
    } else {
      read_tensor_metadata(*v, where, it);
    }
    out.items.emplace(it.key, std::move(it));
  }
  // storage_data: where each (key, chunk offsets) lives.
  const Value& sd = need(md, "storage_data", where);
  if (!sd.is(K::Dict)) bad(where, "storage_data is not a dict");
  std::map<std::string, uint64_t> file_sizes;
  size_t located = 0;
  for (const auto& [k, v] : sd.dict) {
    locate_chunk(*k, *v, dir, out, file_sizes);
    ++located;
  }
  for (const auto& [key, item] : out.items) {
    if (item.chunks.empty() && !item.is_bytes && numel(item.size) > 0) bad(where, key + " has no chunks");
    for (const auto& c : item.chunks)
      if (c.file.empty()) bad(where, key + ": a chunk without a storage location");
  }
  (void)located;
  return out;
}

namespace {

// A TensorStorageMetadata dataclass: properties (dtype, layout, requires_grad, memory format,
// pin_memory), size, chunks.
void pickle_tensor_metadata(Out& o, const std::string& md, const Item& it) {
  o.dataclass(md, "TensorStorageMetadata");
  o.s += "}(";
  o.str("properties");
  o.dataclass(md, "TensorProperties");
  o.s += '(';  // state tuple: dtype, layout, requires_grad, memory format, pin_memory
  o.global("torch", it.dtype);
  o.global("torch.serialization", "_get_layout");
  o.str("torch.strided");
  o.s += "\x85R";
  o.s += '\x89';
  o.global(md, "_MEM_FORMAT_ENCODING");
  o.integer(0);  // TORCH_CONTIGUOUS_FORMAT
  o.s += "\x85R";
  o.s += '\x89';
  o.s += "tb";
  o.str("size");
  o.torch_size(it.size);
  o.str("chunks");
  o.s += "](";
  for (const auto& c : it.chunks) {
    o.dataclass(md, "ChunkStorageMetadata");
    o.s += "}(";
    o.str("offsets");
    o.torch_size(c.offsets);
    o.str("sizes");
    o.torch_size(c.sizes);
    o.s += "ub";
  }
  o.s += "e";  // APPENDS
  o.s += "ub";
}

// The storage_data records of one item: per chunk, its MetadataIndex and its _StorageInfo.
void pickle_storage_data(Out& o, const std::string& md, const std::string& key, const Item& it) {
  for (size_t i = 0; i < it.chunks.size(); ++i) {
    const Chunk& c = it.chunks[i];
    o.dataclass(md, "MetadataIndex");
    o.s += "}(";
    o.str("fqn");
    o.str(key);
    o.str("offset");
    if (it.is_bytes)
      o.s += 'N';
    else
      o.torch_size(c.offsets);
    o.str("index");
    if (it.is_bytes)
      o.s += 'N';
    else
      o.integer(static_cast<int64_t>(i));
    o.s += "ub";
    o.dataclass("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    o.s += "}(";
    o.str("relative_path");
    o.str(c.file);
    o.str("offset");
    o.integer(static_cast<int64_t>(c.offset));
    o.str("length");
    o.integer(static_cast<int64_t>(c.length));
    o.s += "ub";
  }
}

}  // namespace

std::string metadata_pickle(const Metadata& m) {
  const std::string md = "torch.distributed.checkpoint.metadata";
  Out o;
  o.dataclass(md, "Metadata");
  o.s += "}(";  // its __dict__: EMPTY_DICT, MARK
  o.str("state_dict_metadata");
  o.s += "}(";
  for (const auto& [key, it] : m.items) {
    o.str(key);
    if (it.is_bytes) {
      o.dataclass(md, "BytesStorageMetadata");
      continue;
    }
    pickle_tensor_metadata(o, md, it);
  }
  o.s += 'u';
  o.str("planner_data");
  o.s += "}(";
  for (const auto& kv : m.items) {
    o.str(kv.first);
    o.str(kv.first);
    o.s += '\x85';
  }
  o.s += 'u';
  o.str("storage_data");
  o.s += "}(";
  for (const auto& [key, it] : m.items) pickle_storage_data(o, md, key, it);
  o.s += 'u';
  o.str("storage_meta");
  o.s += 'N';
  o.str("version");
  o.str(m.version.empty() ? "1.0.0" : m.version);
  o.s += "ub.";
  return o.s;
}

void read_tensor_item(const std::string& archive, const std::string& where, const std::string& dtype,
                      const std::vector<int64_t>& sizes, void* dst) {
  std::string pkl;
  const auto recs = open_archive(archive, where, &pkl);
  Ptr v;
  try {
    v = pickle::load(pkl.data(), pkl.size(), tensor_globals(), where + " data.pkl");
  } catch (const pickle::PickleError& e) {
    throw RuntimeFailure(e.what());
  }
  // _rebuild_tensor_v2(persistent id, storage offset, size, stride, requires_grad, hooks[, metadata])
  if (!v->is(K::Object) || v->s != "torch._utils._rebuild_tensor_v2" || v->items.size() < 4)
    bad(where, "the item is not a tensor (" + pickle::describe(*v) + ")");
  const Value& pid = *v->items[0];
  if (!pid.is(K::PersistentId) || !pid.items[0]->is(K::Tuple) || pid.items[0]->items.size() != 5)
    bad(where, "the tensor's storage is not a torch.save persistent id");
  const auto& p = pid.items[0]->items;
  if (!p[0]->is(K::Str) || p[0]->s != "storage" || !p[1]->is(K::Global) || !p[2]->is(K::Str) || !p[4]->is(K::Int))
    bad(where, "the tensor's storage id is " + pickle::describe(*pid.items[0]));
  const auto st = storage_dtypes().find(p[1]->s);
  if (st == storage_dtypes().end()) bad(where, "the tensor's storage class is " + p[1]->s);
  const std::string sdtype = st->second;
  if (sdtype != dtype) bad(where, "the tensor is " + sdtype + ", .metadata says " + dtype);
  auto ints = [&](const Value& t, const char* what) {
    if (!t.is(K::Tuple)) bad(where, std::string("the tensor's ") + what + " is " + pickle::describe(t));
    std::vector<int64_t> out;
    for (const auto& x : t.items) {
      if (!x->is(K::Int)) bad(where, std::string("the tensor's ") + what + " holds " + pickle::describe(*x));
      out.push_back(x->i);
    }
    return out;
  };
  if (!v->items[1]->is(K::Int) || v->items[1]->i < 0) bad(where, "the tensor's storage offset is invalid");
  const int64_t storage_offset = v->items[1]->i;
  const std::vector<int64_t> shape = ints(*v->items[2], "size"), stride = ints(*v->items[3], "stride");
  if (shape != sizes) {
    std::string a, b;
    for (int64_t d : shape) a += (a.empty() ? "" : ",") + std::to_string(d);
    for (int64_t d : sizes) b += (b.empty() ? "" : ",") + std::to_string(d);
    bad(where, "the stored tensor has shape [" + a + "], .metadata says [" + b + "]");
  }
  int64_t expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] > 1 && stride[d] != expect) bad(where, "the stored tensor is not contiguous");
    expect *= shape[d];
  }
  const size_t es = torch_save::dtype_size(dtype);
  const uint64_t need_bytes = static_cast<uint64_t>(storage_offset + numel(shape)) * es;
  const std::string rec = "data/" + p[2]->s;
  for (const auto& r : recs) {
    if (r.name != rec) continue;
    if (r.size < need_bytes || static_cast<uint64_t>(p[4]->i) * es != r.size)
      bad(where, "storage " + rec + " holds " + std::to_string(r.size) + " bytes, the tensor needs " +
                     std::to_string(need_bytes));
    std::memcpy(dst, archive.data() + r.data_offset + storage_offset * es, numel(shape) * es);
    return;
  }
  bad(where, "the item's archive has no record " + rec);
}

pickle::Ptr read_object_item(const std::string& archive, const std::string& where) {
  std::string pkl;
  open_archive(archive, where, &pkl);
  try {
    return resolve_bytes(pickle::load(pkl.data(), pkl.size(), object_globals(), where + " data.pkl"), where);
  } catch (const pickle::PickleError& e) {
    throw RuntimeFailure(e.what());
  }
}

std::string tensor_item(const std::string& dtype, const std::vector<int64_t>& sizes, const void* data, size_t nbytes) {
  std::string out;
  torch_save::TensorSpec spec{"0", dtype, sizes};
  torch_save::Writer w(&out, "archive", torch_save::pickle_tensor(spec), {spec});
  w.write("0", data, nbytes);
  w.commit();
  return out;
}

std::string int_item(int64_t v) {
  std::string out;
  torch_save::Writer w(&out, "archive", torch_save::pickle_int(v), {});
  w.commit();
  return out;
}

namespace {
// Protocol 2, no memo (a valid pickle: the memo only saves repeats).
void dump_value(const Value& v, std::string& o) {
  auto le = [&](uint64_t x, int n) {
    for (int i = 0; i < n; ++i) o.push_back(static_cast<char>((x >> (8 * i)) & 0xff));
  };
  switch (v.kind) {
    case K::None: o += 'N'; return;
    case K::Bool: o += v.b ? '\x88' : '\x89'; return;
    case K::Int:
      if (v.i >= 0 && v.i < 256) {
        o += 'K';
        le(static_cast<uint64_t>(v.i), 1);
      } else if (v.i >= INT32_MIN && v.i <= INT32_MAX) {
        o += 'J';
        le(static_cast<uint32_t>(static_cast<int32_t>(v.i)), 4);
      } else {
        o += "\x8a\x08";
        le(static_cast<uint64_t>(v.i), 8);
      }
      return;
    case K::Float: {
      uint64_t x;
      std::memcpy(&x, &v.f, 8);
      o += 'G';
      for (int i = 7; i >= 0; --i) o.push_back(static_cast<char>((x >> (8 * i)) & 0xff));  // big endian
      return;
    }
    case K::Str:
      o += 'X';
      le(v.s.size(), 4);
      o += v.s;
      return;
    case K::Tuple:
      if (v.items.empty()) {
        o += ')';
        return;
      }
      if (v.items.size() > 3) o += '(';
      for (const auto& x : v.items) dump_value(*x, o);
      o += v.items.size() == 1 ? '\x85' : v.items.size() == 2 ? '\x86' : v.items.size() == 3 ? '\x87' : 't';
      return;
    case K::List:
      o += ']';
      if (v.items.empty()) return;
      o += '(';
      for (const auto& x : v.items) dump_value(*x, o);
      o += 'e';
      return;
    default: throw std::logic_error("[dcp] object_item: cannot pickle " + pickle::describe(v));
  }
}
}  // namespace

std::string object_item(const pickle::Value& v) {
  std::string pkl("\x80\x02", 2);
  dump_value(v, pkl);
  pkl += '.';
  std::string out;
  torch_save::Writer w(&out, "archive", pkl, {});
  w.commit();
  return out;
}

std::string bytes_item(const std::string& b) {
  std::string out;
  torch_save::Writer w(&out, "archive", torch_save::pickle_bytes(b), {});
  w.commit();
  return out;
}

}  // namespace ctitan::dcp
