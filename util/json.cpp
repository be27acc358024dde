// Strict recursive-descent JSON parser; see json.h for what it accepts.
#include "util/json.h"

#include "util/text.h"

#include <cerrno>
#include <cstdlib>

namespace ctitan::json {
namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  bool run(Value* out, std::string* error) {
    skip_ws();
    if (!value(out, 0)) return fail_out(error);
    skip_ws();
    if (pos_ != s_.size()) {
      err_ = "unexpected trailing characters";
      return fail_out(error);
    }
    return true;
  }

 private:
  bool fail_out(std::string* error) {
    if (error) *error = err_ + " at byte " + std::to_string(pos_);
    return false;
  }
  bool fail(const char* what) {
    err_ = what;
    return false;
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return s_[pos_]; }
  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) {
      ++pos_;
    }
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return fail("invalid literal");
    pos_ += word.size();
    return true;
  }

  bool value(Value* out, int depth) {
    if (depth > kMaxDepth) return fail("nesting deeper than 64 levels");
    if (at_end()) return fail("unexpected end of input, expected a value");
    switch (peek()) {
      case '{': return object(out, depth);
      case '[': return array(out, depth);
      case '"': out->type = Value::Type::String; return string(&out->text);
      case 't':
        out->type = Value::Type::Bool;
        out->boolean = true;
        return literal("true");
      case 'f':
        out->type = Value::Type::Bool;
        out->boolean = false;
        return literal("false");
      case 'n': out->type = Value::Type::Null; return literal("null");
      default: out->type = Value::Type::Number; return number(&out->text);
    }
  }

  bool object(Value* out, int depth) {
    out->type = Value::Type::Object;
    ++pos_;  // '{'
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return true;
    }
    while (true) {
      skip_ws();
      if (at_end() || peek() != '"') return fail("expected a string key");
      std::string key;
      if (!string(&key)) return false;
      skip_ws();
      if (at_end() || peek() != ':') return fail("expected ':'");
      ++pos_;
      skip_ws();
      out->members.emplace_back(std::move(key), Value());
      if (!value(&out->members.back().second, depth + 1)) return false;
      skip_ws();
      if (at_end()) return fail("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return true;
      }
      return fail("expected ',' or '}'");
    }
  }

  bool array(Value* out, int depth) {
    out->type = Value::Type::Array;
    ++pos_;  // '['
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return true;
    }
    while (true) {
      skip_ws();
      out->items.emplace_back();
      if (!value(&out->items.back(), depth + 1)) return false;
      skip_ws();
      if (at_end()) return fail("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return true;
      }
      return fail("expected ',' or ']'");
    }
  }

  bool hex4(uint32_t* out) {
    if (pos_ + 4 > s_.size()) return fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<uint32_t>(c - 'A' + 10);
      else
        return fail("invalid hex digit in \\u escape");
    }
    *out = v;
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      // Copy the run of plain bytes in one go (JSONL texts are long).
      const size_t start = pos_;
      while (!at_end() && peek() != '"' && peek() != '\\' && static_cast<unsigned char>(peek()) >= 0x20) {
        ++pos_;
      }
      out->append(s_.data() + start, pos_ - start);
      if (at_end()) return fail("unterminated string");
      const char c = peek();
      if (c == '"') {
        ++pos_;
        return true;
      }
      if (c != '\\') return fail("raw control character in string (must be escaped)");
      ++pos_;
      if (at_end()) return fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (!hex4(&cp)) return false;
          if (cp >= 0xDC00 && cp <= 0xDFFF) return fail("lone low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.substr(pos_, 2) != "\\u") return fail("high surrogate not followed by \\u");
            pos_ += 2;
            uint32_t lo = 0;
            if (!hex4(&lo)) return false;
            if (lo < 0xDC00 || lo > 0xDFFF) return fail("high surrogate not followed by a low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_; return fail("invalid escape");
      }
    }
  }

  bool number(std::string* out) {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t d = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      return pos_ - d;
    };
    if (!at_end() && peek() == '-') ++pos_;
    if (at_end()) return fail("invalid number");
    if (peek() == '0') {
      ++pos_;
    } else if (digits() == 0) {
      return fail("unexpected character, expected a value");
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (digits() == 0) return fail("invalid number: no digits after '.'");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) return fail("invalid number: no digits in exponent");
    }
    out->assign(s_.data() + start, pos_ - start);
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
  std::string err_;
};

}  // namespace

const Value* Value::find(std::string_view key) const {
  for (auto it = members.rbegin(); it != members.rend(); ++it) {
    if (it->first == key) return &it->second;
  }
  return nullptr;
}

bool Value::as_int64(int64_t* out) const {
  if (type != Type::Number || text.find_first_of(".eE") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE || end != text.c_str() + text.size()) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

const char* type_name(Value::Type t) {
  switch (t) {
    case Value::Type::Null: return "null";
    case Value::Type::Bool: return "boolean";
    case Value::Type::Number: return "number";
    case Value::Type::String: return "string";
    case Value::Type::Array: return "array";
    case Value::Type::Object: return "object";
  }
  return "?";
}

bool parse(std::string_view text, Value* out, std::string* error) {
  *out = Value();
  return Parser(text).run(out, error);
}

std::string quote(std::string_view s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(hex[c >> 4]);
          out.push_back(hex[c & 0xF]);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace ctitan::json
