#include "config/config_value.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ctitan::config_detail {
namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// Splits on `sep`, trims each item and drops empty ones.
std::vector<std::string> split_items(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    std::string item = trim(s.substr(start, end - start));
    if (!item.empty()) out.push_back(item);
    start = end + 1;
  }
  return out;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_none_text(const std::string& s) {
  const std::string t = lower(trim(s));
  return t.empty() || t == "none" || t == "null";
}

template <class List>
std::string render_list(const List& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += render(v[i]);
  }
  return out + "]";
}

}  // namespace

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string format_double(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  // The shortest %g form that reads back as the same double: exact and readable.
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // TOML float, not integer
  return s;
}

std::string render(bool v) { return v ? "true" : "false"; }
std::string render(int64_t v) { return std::to_string(v); }
std::string render(double v) { return format_double(v); }
std::string render(const std::string& v) { return quote(v); }
std::string render(const StrList& v) { return render_list(v); }
std::string render(const IntList& v) { return render_list(v); }
std::string render(const StrListList& v) { return render_list(v); }

bool parse_text(const std::string& s, bool& out) {
  const std::string t = lower(trim(s));
  if (t == "true" || t == "1") {
    out = true;
    return true;
  }
  if (t == "false" || t == "0") {
    out = false;
    return true;
  }
  return false;
}

bool parse_text(const std::string& s, int64_t& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == ERANGE || end != s.c_str() + s.size()) return false;
  out = static_cast<int64_t>(v);
  return true;
}

bool parse_text(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno == ERANGE || end != s.c_str() + s.size()) return false;
  out = v;
  return true;
}

bool parse_text(const std::string& s, std::string& out) {
  out = s;
  return true;
}

bool parse_text(const std::string& s, StrList& out) {
  out = split_items(s, ',');
  return true;
}

bool parse_text(const std::string& s, IntList& out) {
  IntList v;
  for (const std::string& item : split_items(s, ',')) {
    int64_t x = 0;
    if (!parse_text(item, x)) return false;
    v.push_back(x);
  }
  out = std::move(v);
  return true;
}

bool parse_text(const std::string& s, StrListList& out) {
  StrListList v;
  for (const std::string& group : split_items(s, ';')) v.push_back(split_items(group, ','));
  out = std::move(v);
  return true;
}

bool parse_text(const std::string& s, std::optional<int64_t>& out) {
  if (is_none_text(s)) {
    out.reset();
    return true;
  }
  int64_t v = 0;
  if (!parse_text(s, v)) return false;
  out = v;
  return true;
}

bool parse_text(const std::string& s, std::optional<double>& out) {
  if (is_none_text(s)) {
    out.reset();
    return true;
  }
  double v = 0;
  if (!parse_text(s, v)) return false;
  out = v;
  return true;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t subst = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace ctitan::config_detail
