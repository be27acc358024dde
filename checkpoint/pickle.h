// A restricted pickle reader: builds a tree of plain values from a pickle stream and never
// runs anything. Classes are not imported or called: a GLOBAL / STACK_GLOBAL must name one
// of the caller's allowed "module.name" strings, and REDUCE / NEWOBJ / BUILD on it only
// record the class, its arguments and its state (an Object node) for the caller to
// interpret. Any other global is refused with one line naming it, before anything after it
// in the stream is read. Plain C++, no LibTorch.
//
// Opcodes read (protocols 2 to 5, as Python's pickler writes them for dicts, lists, tuples,
// numbers, strings, bytes and objects; torch.distributed.checkpoint's .metadata is protocol 4
// with frames, torch.save's data.pkl protocol 2): PROTO FRAME STOP MARK POP POP_MARK
// NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1 BINFLOAT SHORT_BINUNICODE BINUNICODE
// BINUNICODE8 SHORT_BINBYTES BINBYTES BINBYTES8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
// EMPTY_LIST LIST APPEND APPENDS EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET ADDITEMS
// MEMOIZE BINPUT LONG_BINPUT BINGET LONG_BINGET GLOBAL STACK_GLOBAL REDUCE NEWOBJ BUILD
// BINPERSID. Anything else is refused naming the opcode and its byte offset.
#pragma once
#include <cstdint>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ctitan::pickle {

struct Value;
using Ptr = std::shared_ptr<Value>;

struct Value {
  enum class Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Set, Global, Object, PersistentId };
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                          // Str, Bytes; Global and Object: the class as "module.name"
  std::vector<Ptr> items;                 // Tuple, List, Set; Object: constructor / REDUCE arguments;
                                          // PersistentId: [the id]
  std::vector<std::pair<Ptr, Ptr>> dict;  // Dict, in insertion order
  Ptr state;                              // Object: what BUILD gave it (nullptr when none)

  bool is(Kind k) const { return kind == k; }
  // Dict lookup by string key; nullptr when absent (or this is no dict).
  const Value* get(const std::string& key) const;
};

// Why a pickle was refused: "<where>: <problem>" on one line.
struct PickleError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reads one pickle from data[0, n). allowed: the globals it may name ("module.name").
// Throws PickleError on a refused global, an unknown opcode, or a malformed stream.
Ptr load(const char* data, size_t n, const std::set<std::string>& allowed, const std::string& where);

// "Metadata(state_dict_metadata=..., ...)"-like one-line rendering, for errors and tests.
std::string describe(const Value& v, int depth = 2);

}  // namespace ctitan::pickle
