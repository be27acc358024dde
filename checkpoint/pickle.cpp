// The restricted pickle reader; see pickle.h.
#include "checkpoint/pickle.h"

#include <cstdio>
#include <cstring>

namespace ctitan::pickle {

const Value* Value::get(const std::string& key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, v] : dict)
    if (k && k->kind == Kind::Str && k->s == key) return v.get();
  return nullptr;
}

namespace {

Ptr make(Value::Kind k) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  return v;
}

class Reader {
 public:
  Reader(const char* p, size_t n, const std::set<std::string>& allowed, const std::string& where)
      : p_(p), n_(n), allowed_(allowed), where_(where) {}

  Ptr run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = u8();
      if (op == '.') {  // STOP
        if (stack_.size() != 1 || !marks_.empty())
          fail("the stream ends with " + std::to_string(stack_.size()) + " values on its stack");
        return stack_.back();
      }
      if (op == 0x80) {  // PROTO
        u8();
        continue;
      }
      if (op == 0x95) {  // FRAME (a hint: frames are read as one stream)
        u64();
        continue;
      }
      if (stack_op(op) || scalar_op(op) || sequence_op(op) || mapping_op(op) || object_op(op)) continue;
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", op);
      fail(std::string("unsupported pickle opcode ") + hex + " at byte " + std::to_string(at) +
           " (not one a checkpoint pickle uses)");
    }
  }

  // Marks, pops and the memo; false for another opcode.
  bool stack_op(uint8_t op) {
    switch (op) {
      case '(': marks_.push_back(stack_.size()); break;  // MARK
      case '0': pop(); break;                            // POP
      case '1': pop_mark(); break;                       // POP_MARK
      case 0x94: memo_.push_back(top()); break;          // MEMOIZE
      case 'q': put(u8()); break;                        // BINPUT
      case 'r': put(u32()); break;                       // LONG_BINPUT
      case 'h': push(get(u8())); break;                  // BINGET
      case 'j': push(get(u32())); break;                 // LONG_BINGET
      default: return false;
    }
    return true;
  }

  // None, booleans, integers, floats, strings and bytes; false for another opcode.
  bool scalar_op(uint8_t op) {
    switch (op) {
      case 'N': push(make(Value::Kind::None)); break;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        auto v = make(Value::Kind::Bool);
        v->b = op == 0x88;
        push(v);
        break;
      }
      case 'J': push_int(static_cast<int32_t>(u32())); break;  // BININT
      case 'K': push_int(u8()); break;                         // BININT1
      case 'M': push_int(u16()); break;                        // BININT2
      case 0x8a: {                                             // LONG1: little-endian two's complement
        const size_t len = u8();
        if (len > 8) fail("an integer of " + std::to_string(len) + " bytes (more than 64 bits)");
        const char* b = take(len);
        uint64_t x = 0;
        for (size_t i = 0; i < len; ++i) x |= uint64_t(uint8_t(b[i])) << (8 * i);
        if (len > 0 && len < 8 && (uint8_t(b[len - 1]) & 0x80)) x |= ~uint64_t(0) << (8 * len);
        push_int(static_cast<int64_t>(x));
        break;
      }
      case 'G': {  // BINFLOAT, big endian
        const char* b = take(8);
        uint64_t x = 0;
        for (int i = 0; i < 8; ++i) x = (x << 8) | uint8_t(b[i]);
        auto v = make(Value::Kind::Float);
        std::memcpy(&v->f, &x, 8);
        push(v);
        break;
      }
      case 0x8c: push_str(Value::Kind::Str, u8()); break;     // SHORT_BINUNICODE
      case 'X': push_str(Value::Kind::Str, u32()); break;     // BINUNICODE
      case 0x8d: push_str(Value::Kind::Str, u64()); break;    // BINUNICODE8
      case 'C': push_str(Value::Kind::Bytes, u8()); break;    // SHORT_BINBYTES
      case 'B': push_str(Value::Kind::Bytes, u32()); break;   // BINBYTES
      case 0x8e: push_str(Value::Kind::Bytes, u64()); break;  // BINBYTES8
      default: return false;
    }
    return true;
  }

  // Tuples and lists; false for another opcode.
  bool sequence_op(uint8_t op) {
    switch (op) {
      case ')': push(make(Value::Kind::Tuple)); break;  // EMPTY_TUPLE
      case 't': {                                       // TUPLE
        auto v = make(Value::Kind::Tuple);
        v->items = pop_mark();
        push(v);
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        auto v = make(Value::Kind::Tuple);
        v->items.resize(op - 0x84);
        for (size_t i = v->items.size(); i-- > 0;) v->items[i] = pop();
        push(v);
        break;
      }
      case ']': push(make(Value::Kind::List)); break;  // EMPTY_LIST
      case 'l': {                                      // LIST
        auto v = make(Value::Kind::List);
        v->items = pop_mark();
        push(v);
        break;
      }
      case 'a': {  // APPEND
        auto x = pop();
        container(Value::Kind::List, "APPEND")->items.push_back(x);
        break;
      }
      case 'e': {  // APPENDS
        auto xs = pop_mark();
        auto& l = container(Value::Kind::List, "APPENDS")->items;
        l.insert(l.end(), xs.begin(), xs.end());
        break;
      }
      default: return false;
    }
    return true;
  }

  // Dicts and sets; false for another opcode.
  bool mapping_op(uint8_t op) {
    switch (op) {
      case '}': push(make(Value::Kind::Dict)); break;  // EMPTY_DICT
      case 'd': {                                      // DICT
        auto xs = pop_mark();
        auto v = make(Value::Kind::Dict);
        add_pairs(*v, xs);
        push(v);
        break;
      }
      case 's': {  // SETITEM
        auto val = pop();
        auto key = pop();
        container(Value::Kind::Dict, "SETITEM")->dict.emplace_back(key, val);
        break;
      }
      case 'u': {  // SETITEMS
        auto xs = pop_mark();
        add_pairs(*container(Value::Kind::Dict, "SETITEMS"), xs);
        break;
      }
      case 0x8f: push(make(Value::Kind::Set)); break;  // EMPTY_SET
      case 0x90: {                                     // ADDITEMS
        auto xs = pop_mark();
        auto& s = container(Value::Kind::Set, "ADDITEMS")->items;
        s.insert(s.end(), xs.begin(), xs.end());
        break;
      }
      default: return false;
    }
    return true;
  }

  // Globals, objects (recorded, never called) and persistent ids; false for another opcode.
  bool object_op(uint8_t op) {
    switch (op) {
      case 'c': {  // GLOBAL "module\nname\n"
        const std::string module = line(), name = line();
        push(global(module, name));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = pop(), module = pop();
        if (!module->is(Value::Kind::Str) || !name->is(Value::Kind::Str)) fail("STACK_GLOBAL on non-strings");
        push(global(module->s, name->s));
        break;
      }
      case 'R': {  // REDUCE: callable(*args), recorded only
        auto args = pop(), fn = pop();
        push(object(fn, args, "REDUCE"));
        break;
      }
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args), recorded only
        auto args = pop(), cls = pop();
        push(object(cls, args, "NEWOBJ"));
        break;
      }
      case 'b': {  // BUILD: state for the object below
        auto st = pop();
        auto obj = top();
        if (!obj->is(Value::Kind::Object)) fail("BUILD on a value that is no object");
        obj->state = st;
        break;
      }
      case 'Q': {  // BINPERSID
        auto v = make(Value::Kind::PersistentId);
        v->items.push_back(pop());
        push(v);
        break;
      }
      default: return false;
    }
    return true;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw PickleError(where_ + ": " + what); }
  const char* take(size_t k) {
    if (k > n_ - pos_)
      fail("the pickle ends early (byte " + std::to_string(n_) + ", " + std::to_string(k) +
           " more needed; truncated?)");
    const char* r = p_ + pos_;
    pos_ += k;
    return r;
  }
  uint64_t le(size_t k) {
    const char* b = take(k);
    uint64_t x = 0;
    for (size_t i = 0; i < k; ++i) x |= uint64_t(uint8_t(b[i])) << (8 * i);
    return x;
  }
  uint8_t u8() { return static_cast<uint8_t>(le(1)); }
  uint16_t u16() { return static_cast<uint16_t>(le(2)); }
  uint32_t u32() { return static_cast<uint32_t>(le(4)); }
  uint64_t u64() { return le(8); }
  std::string line() {
    const void* nl = std::memchr(p_ + pos_, '\n', n_ - pos_);
    if (!nl) fail("a GLOBAL without its newline (truncated?)");
    const size_t len = static_cast<const char*>(nl) - (p_ + pos_);
    std::string s(p_ + pos_, len);
    pos_ += len + 1;
    return s;
  }
  void push(Ptr v) { stack_.push_back(std::move(v)); }
  void push_int(int64_t x) {
    auto v = make(Value::Kind::Int);
    v->i = x;
    push(v);
  }
  void push_str(Value::Kind k, uint64_t len) {
    if (len > n_ - pos_)
      fail("a string of " + std::to_string(len) + " bytes runs past the end of the pickle (truncated?)");
    auto v = make(k);
    v->s.assign(take(len), len);
    push(v);
  }
  Ptr pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      fail("stack underflow at byte " + std::to_string(pos_));
    Ptr v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Ptr top() {
    if (stack_.empty()) fail("stack underflow at byte " + std::to_string(pos_));
    return stack_.back();
  }
  std::vector<Ptr> pop_mark() {
    if (marks_.empty()) fail("no MARK at byte " + std::to_string(pos_));
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Ptr> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  Ptr container(Value::Kind k, const char* op) {
    auto c = top();
    if (!c->is(k)) fail(std::string(op) + " on the wrong kind of value");
    return c;
  }
  void add_pairs(Value& d, const std::vector<Ptr>& xs) {
    if (xs.size() % 2) fail("a dict with an odd number of keys and values");
    for (size_t i = 0; i < xs.size(); i += 2) d.dict.emplace_back(xs[i], xs[i + 1]);
  }
  void put(uint32_t idx) {
    if (idx > memo_.size() + (1u << 20)) fail("memo index " + std::to_string(idx) + " out of range");
    if (memo_.size() <= idx) memo_.resize(idx + 1);
    memo_[idx] = top();
  }
  Ptr get(uint32_t idx) {
    if (idx >= memo_.size() || !memo_[idx]) fail("memo index " + std::to_string(idx) + " was never stored");
    return memo_[idx];
  }
  Ptr global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    if (!allowed_.count(full))
      fail("refuses the pickled global " + full +
           " (not a class this checkpoint format uses; nothing in the file was run)");
    auto v = make(Value::Kind::Global);
    v->s = full;
    return v;
  }
  Ptr object(const Ptr& cls, const Ptr& args, const char* op) {
    if (!cls->is(Value::Kind::Global)) fail(std::string(op) + " on a value that is no allowed global");
    if (!args->is(Value::Kind::Tuple)) fail(std::string(op) + " of " + cls->s + " without an argument tuple");
    auto v = make(Value::Kind::Object);
    v->s = cls->s;
    v->items = args->items;
    return v;
  }

  const char* p_;
  size_t n_, pos_ = 0;
  const std::set<std::string>& allowed_;
  std::string where_;
  std::vector<Ptr> stack_, memo_;
  std::vector<size_t> marks_;
};

}  // namespace

Ptr load(const char* data, size_t n, const std::set<std::string>& allowed, const std::string& where) {
  return Reader(data, n, allowed, where).run();
}

std::string describe(const Value& v, int depth) {
  using K = Value::Kind;
  auto seq = [&](const std::vector<Ptr>& xs, const char* open, const char* close) {
    std::string o = open;
    for (size_t i = 0; i < xs.size() && i < 8; ++i)
      o += (i ? ", " : "") + (depth > 0 ? describe(*xs[i], depth - 1) : "…");
    if (xs.size() > 8) o += ", …";
    return o + close;
  };
  switch (v.kind) {
    case K::None: return "None";
    case K::Bool: return v.b ? "True" : "False";
    case K::Int: return std::to_string(v.i);
    case K::Float: return std::to_string(v.f);
    case K::Str: return "'" + v.s + "'";
    case K::Bytes: return "b<" + std::to_string(v.s.size()) + " bytes>";
    case K::Tuple: return seq(v.items, "(", ")");
    case K::List: return seq(v.items, "[", "]");
    case K::Set: return seq(v.items, "{", "}");
    case K::Dict: return "{" + std::to_string(v.dict.size()) + " items}";
    case K::Global: return v.s;
    case K::Object: return v.s + seq(v.items, "(", ")");
    case K::PersistentId: return "persistent_id" + seq(v.items, "(", ")");
  }
  return "?";
}

}  // namespace ctitan::pickle
