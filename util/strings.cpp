#include "util/strings.h"

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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace ctitan
