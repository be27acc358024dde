// Work plans, the dataloader state and redistribution; see sharding.h.
#include "datasets/sharding.h"

#include <algorithm>
#include <tuple>

#include "config/errors.h"
#include "util/json.h"

namespace ctitan {
namespace {

constexpr const char* kFormat = "ctitan.dataloader";

using u128 = unsigned __int128;

// Size of what a unit still holds, in bytes (estimated for shards, .gz and strided units).
uint64_t weight(const WorkUnit& u, const std::vector<SourceFile>& files) {
  u128 w = 0;
  for (uint64_t f = u.file; f < files.size(); ++f) {
    const SourceFile& sf = files[f];
    // A .gz file's extent is its compressed size, its positions uncompressed offsets: only the
    // whole file's size says anything there.
    const uint64_t b = f == u.file && sf.splittable ? std::min(u.begin, sf.extent) : 0;
    const uint64_t e = f == u.file && !u.chain ? std::min(u.end, sf.extent) : sf.extent;
    if (e > b)
      w += static_cast<u128>(e - b) * sf.unit_weight;
    else if (!sf.splittable)
      w += 1;  // an empty .gz file: weightless but not done
    if (!u.chain) break;
  }
  const auto stride = static_cast<uint64_t>(std::max<int64_t>(1, u.stride));
  return static_cast<uint64_t>(w == 0 ? 0 : std::max<u128>(1, w / stride));
}

bool cuttable(const WorkUnit& u, const std::vector<SourceFile>& files) {
  return u.stride == 1 && !u.chain && u.file < files.size() && files[u.file].splittable;
}

}  // namespace

bool WorkUnit::operator==(const WorkUnit& o) const {
  return std::tie(file, begin, end, stride, phase, ordinal, chain) ==
         std::tie(o.file, o.begin, o.end, o.stride, o.phase, o.ordinal, o.chain);
}

std::vector<WorkUnit> plan_pass(const std::vector<SourceFile>& files, int64_t rank, int64_t world,
                                std::vector<std::string>* shared_gz) {
  std::vector<WorkUnit> out;
  const auto F = static_cast<int64_t>(files.size());
  if (F >= world) {
    for (int64_t f = rank; f < F; f += world) out.push_back({static_cast<uint64_t>(f)});
    return out;
  }
  const int64_t f = rank % F, j = rank / F;
  const int64_t k = world / F + (f < world % F ? 1 : 0);  // ranks sharing file f
  const SourceFile& sf = files[static_cast<size_t>(f)];
  WorkUnit u;
  u.file = static_cast<uint64_t>(f);
  if (sf.splittable) {
    u.begin = static_cast<uint64_t>(static_cast<u128>(sf.extent) * j / k);
    u.end = static_cast<uint64_t>(static_cast<u128>(sf.extent) * (j + 1) / k);
  } else {
    u.stride = k;
    u.phase = j;
    if (shared_gz) shared_gz->push_back(sf.name + " (" + std::to_string(k) + " ranks)");
  }
  out.push_back(u);
  return out;
}

std::string to_json(const LoaderState& s) {
  std::string o;
  o.reserve(512 + s.buffer.size() * 6);
  o += "{\"format\":" + json::quote(kFormat) + ",\"version\":2";
  o += ",\"dp_rank\":" + std::to_string(s.dp_rank) + ",\"dp_world\":" + std::to_string(s.dp_world);
  o += ",\"seq_len\":" + std::to_string(s.seq_len) + ",\"vocab_size\":" + std::to_string(s.vocab_size);
  o += ",\"epoch\":" + std::to_string(s.epoch) + ",\"windows_produced\":" + std::to_string(s.windows);
  o += ",\"skipped_documents\":" + std::to_string(s.skipped);
  o += ",\"files\":[";
  for (size_t i = 0; i < s.files.size(); ++i) o += (i ? "," : "") + json::quote(s.files[i]);
  o += "],\"work\":[";
  for (size_t i = 0; i < s.work.size(); ++i) {
    const WorkUnit& u = s.work[i];
    o += (i ? ",[" : "[") + std::to_string(u.file) + "," + std::to_string(u.begin) + "," +
         (u.end == WorkUnit::kToEnd ? std::string("-1") : std::to_string(u.end)) + "," + std::to_string(u.stride) +
         "," + std::to_string(u.phase) + "," + std::to_string(u.ordinal) + "," + (u.chain ? "1" : "0") + "]";
  }
  o += "],\"buffer\":[";
  for (size_t i = 0; i < s.buffer.size(); ++i) {
    if (i) o += ',';
    o += std::to_string(s.buffer[i]);
  }
  o += "]}";
  return o;
}

LoaderState parse_loader_state(const std::string& text, const std::vector<SourceFile>& files, int64_t vocab_size,
                               const std::string& where) {
  json::Value root;
  std::string err;
  if (!json::parse(text, &root, &err)) throw UserError(where + " is corrupt: invalid JSON (" + err + ")");
  if (root.type != json::Value::Type::Object) throw UserError(where + " is corrupt: expected a JSON object");
  auto int_of = [&](const json::Value* v, const std::string& what, int64_t min) {
    int64_t out = 0;
    if (v == nullptr) throw UserError(where + " is corrupt: missing " + what);
    if (!v->as_int64(&out) || out < min)
      throw UserError(where + " is corrupt: " + what + " is not an integer >= " + std::to_string(min));
    return out;
  };
  auto get = [&](const char* key, int64_t min) { return int_of(root.find(key), "\"" + std::string(key) + "\"", min); };
  const json::Value* format = root.find("format");
  if (format == nullptr || format->type != json::Value::Type::String || format->text != kFormat)
    throw UserError(where + " is corrupt: \"format\" is not \"" + kFormat + "\"");
  LoaderState s;
  s.version = get("version", 0);
  if (s.version != 1 && s.version != 2)
    throw UserError(where + " has version " + std::to_string(s.version) + "; this build reads 1 and 2");
  s.dp_rank = get("dp_rank", 0);
  s.dp_world = get("dp_world", 1);
  if (s.dp_rank >= s.dp_world) throw UserError(where + " is corrupt: dp_rank is not below dp_world");
  s.seq_len = get("seq_len", 1);
  s.vocab_size = get("vocab_size", 1);
  if (s.vocab_size != vocab_size)
    throw UserError(where + " was saved with a tokenizer of vocab_size " + std::to_string(s.vocab_size) +
                    ", this tokenizer has " + std::to_string(vocab_size));
  s.epoch = get("epoch", 0);
  s.windows = get("windows_produced", 0);
  s.skipped = root.find("skipped_documents") ? get("skipped_documents", 0) : 0;
  const json::Value* buf = root.find("buffer");
  if (buf == nullptr || buf->type != json::Value::Type::Array)
    throw UserError(where + " is corrupt: missing \"buffer\" array");
  s.buffer.reserve(buf->items.size());
  for (const auto& item : buf->items) {
    int64_t id = 0;
    if (!item.as_int64(&id) || id < 0 || id >= s.vocab_size)
      throw UserError(where + " is corrupt: \"buffer\" holds a value that is not a token id");
    s.buffer.push_back(id);
  }
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(f.name);
  if (s.version == 1) {
    const int64_t next = get("next_document", 0);
    const auto file = static_cast<uint64_t>(get("file_index", 0));
    const auto offset = static_cast<uint64_t>(get("file_offset", 0));
    const json::Value* name = root.find("file_name");
    if (name == nullptr || name->type != json::Value::Type::String)
      throw UserError(where + " is corrupt: missing \"file_name\"");
    if (file > files.size() || (file == files.size() && offset != 0))
      throw UserError(where + ": position (file " + std::to_string(file) + ", document " + std::to_string(next) +
                      ") does not fit the corpus (" + std::to_string(files.size()) + " files)");
    if (file < files.size() && name->text != files[file].name)
      throw UserError(where + " points into " + name->text + " but file " + std::to_string(file) + " is " +
                      files[file].name + " (different corpus?)");
    if (file < files.size() && files[file].splittable && offset > files[file].extent)
      throw UserError(where + ": byte offset " + std::to_string(offset) + " is past the end of " + files[file].name +
                      " (the file changed since the position was saved?)");
    s.files = names;
    if (file < files.size()) s.work.push_back({file, offset, WorkUnit::kToEnd, s.dp_world, s.dp_rank, next, true});
    return s;
  }
  const json::Value* fl = root.find("files");
  if (fl == nullptr || fl->type != json::Value::Type::Array) throw UserError(where + " is corrupt: missing \"files\"");
  for (const auto& f : fl->items) {
    if (f.type != json::Value::Type::String) throw UserError(where + " is corrupt: \"files\" holds a non-string");
    s.files.push_back(f.text);
  }
  if (s.files != names) {
    size_t i = 0;
    while (i < s.files.size() && i < names.size() && s.files[i] == names[i]) ++i;
    throw UserError(where + " was saved over " + std::to_string(s.files.size()) + " files, this corpus has " +
                    std::to_string(names.size()) + "; file " + std::to_string(i) + " is " +
                    (i < s.files.size() ? s.files[i] : std::string("(none)")) + " there and " +
                    (i < names.size() ? names[i] : std::string("(none)")) + " here (different corpus?)");
  }
  const json::Value* work = root.find("work");
  if (work == nullptr || work->type != json::Value::Type::Array)
    throw UserError(where + " is corrupt: missing \"work\"");
  for (size_t i = 0; i < work->items.size(); ++i) {
    const json::Value& w = work->items[i];
    const std::string what = "\"work\"[" + std::to_string(i) + "]";
    if (w.type != json::Value::Type::Array || w.items.size() != 7)
      throw UserError(where + " is corrupt: " + what + " is not [file,begin,end,stride,phase,ordinal,chain]");
    WorkUnit u;
    u.file = static_cast<uint64_t>(int_of(&w.items[0], what + " file", 0));
    u.begin = static_cast<uint64_t>(int_of(&w.items[1], what + " begin", 0));
    const int64_t end = int_of(&w.items[2], what + " end", -1);
    u.end = end < 0 ? WorkUnit::kToEnd : static_cast<uint64_t>(end);
    u.stride = int_of(&w.items[3], what + " stride", 1);
    u.phase = int_of(&w.items[4], what + " phase", 0);
    u.ordinal = int_of(&w.items[5], what + " ordinal", 0);
    u.chain = int_of(&w.items[6], what + " chain", 0) != 0;
    if (u.file >= files.size() || u.phase >= u.stride ||
        (u.end != WorkUnit::kToEnd && files[u.file].splittable && u.end > files[u.file].extent) ||
        (files[u.file].splittable && u.begin > files[u.file].extent))
      throw UserError(where + " is corrupt: " + what + " does not fit the corpus (file " + std::to_string(u.file) +
                      " of " + std::to_string(files.size()) + ", range " + std::to_string(u.begin) + ".." +
                      std::to_string(end) + ")");
    s.work.push_back(u);
  }
  return s;
}

LoaderState redistribute(const std::vector<LoaderState>& saved, const std::vector<SourceFile>& files, int64_t rank,
                         int64_t world) {
  LoaderState out;
  out.dp_rank = rank;
  out.dp_world = world;
  out.files.clear();
  for (const auto& f : files) out.files.push_back(f.name);
  std::vector<WorkUnit> pieces;
  for (const LoaderState& s : saved) {
    out.epoch = std::max(out.epoch, s.epoch);
    out.seq_len = s.seq_len;
    out.vocab_size = s.vocab_size;
    for (const WorkUnit& u : s.work)
      if (weight(u, files) > 0) pieces.push_back(u);
  }
  for (size_t r = static_cast<size_t>(rank); r < saved.size(); r += static_cast<size_t>(world)) {
    out.buffer.insert(out.buffer.end(), saved[r].buffer.begin(), saved[r].buffer.end());
    out.windows += saved[r].windows;
    out.skipped += saved[r].skipped;
  }
  u128 total = 0;
  for (const WorkUnit& u : pieces) total += weight(u, files);
  if (total == 0) return out;
  // Part j covers [total·j/world, total·(j+1)/world) of the pieces laid end to end.
  auto cut = [&](int64_t j) { return total * static_cast<u128>(j) / static_cast<u128>(world); };
  const u128 lo = cut(rank), hi = cut(rank + 1);
  u128 acc = 0;
  for (const WorkUnit& u : pieces) {
    const u128 w = weight(u, files);
    const u128 a = acc, b = acc + w;
    acc = b;
    if (!cuttable(u, files)) {
      const u128 mid = a + w / 2;  // whole, to the part holding its middle
      if (mid >= lo && mid < hi) out.work.push_back(u);
      continue;
    }
    if (b <= lo || a >= hi) continue;
    // The unit's extent positions at weight points: begin + (point - a) / w · length.
    const uint64_t end = std::min(u.end, files[u.file].extent);
    const u128 len = end - u.begin;
    auto at = [&](u128 point) {
      if (point <= a) return u.begin;
      if (point >= b) return end;
      return static_cast<uint64_t>(u.begin + (point - a) * len / w);
    };
    WorkUnit part = u;
    part.begin = at(lo);
    part.end = at(hi);
    if (part.end > part.begin) out.work.push_back(part);
  }
  return out;
}

}  // namespace ctitan
