// A small strict JSON reader/writer (RFC 8259) for the two places datasets/ needs one:
// JSONL corpus records ({"text": "...", ...}) and the dataloader's state_dict.
//   - strings: all escapes, \uXXXX with surrogate pairs -> UTF-8; a lone surrogate, a raw
//     control character or a bad escape is an error; other bytes pass through unchanged;
//   - numbers are kept as their lexeme (validated against the JSON grammar);
//   - nesting is limited to 64 levels; trailing garbage is an error;
//   - duplicate object keys are kept; find() returns the last one (as Python's json does).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ctitan::json {

struct Value {
  enum class Type { Null, Bool, Number, String, Array, Object };
  Type type = Type::Null;
  bool boolean = false;
  std::string text;                                    // String: decoded content; Number: the lexeme
  std::vector<Value> items;                            // Array
  std::vector<std::pair<std::string, Value>> members;  // Object, in file order

  const Value* find(std::string_view key) const;  // Object member or nullptr
  // Number that is an integer fitting int64 (no fraction/exponent) -> true.
  bool as_int64(int64_t* out) const;
};

const char* type_name(Value::Type t);

// Parses exactly one value (whitespace around it allowed). On failure returns false and
// sets *error to "<what> at byte <offset>".
bool parse(std::string_view text, Value* out, std::string* error);

// s as a JSON string literal, quotes included; bytes >= 0x80 are written unchanged.
std::string quote(std::string_view s);

}  // namespace ctitan::json
