// Small text helpers shared by the config, datasets and the error channel (header-only:
// config/ and datasets/ are separate libraries that do not link each other).
#pragma once
#include <cstdio>
#include <cstdint>
#include <string>

namespace ctitan {

// Offset of the first byte that does not belong to well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), or npos.
inline size_t invalid_utf8_at(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = b[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (b[i + 1] < lo || b[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (b[i + k] < 0x80 || b[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string::npos;
}

// Appends code point `cp` (at most U+10FFFF, not a surrogate: the callers check) as UTF-8.
inline void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// `s` as one printable line: \n, \r, \t and other control characters, and bytes that are not
// UTF-8, written as escapes (\n, \x01, \xff), so that an error quoting user input stays one
// line of text whatever the input held.
inline std::string printable_line(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const std::string rest = s.substr(i, 4);
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t bad = c >= 0x80 ? invalid_utf8_at(rest) : std::string::npos;
    if (c >= 0x80 && bad != 0) {  // the start of a well-formed multi-byte character
      const size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      out.append(s, i, len);
      i += len;
      continue;
    }
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c >= 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
    ++i;
  }
  return out;
}

}  // namespace ctitan
