#include "util/strings.h"

#include <stdexcept>

namespace ctitan {

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string shape_str(const std::vector<int64_t>& shape, const std::string& sep) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? sep : "") + std::to_string(shape[i]);
  return out + "]";
}

std::optional<int64_t> parse_int64(const std::string& s) {
  size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &pos);
  } catch (const std::logic_error&) {  // invalid_argument, out_of_range
    return std::nullopt;
  }
  if (pos != s.size()) return std::nullopt;
  return static_cast<int64_t>(v);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace ctitan
