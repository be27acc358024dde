// Small string and time helpers used across the rooms (one definition each).
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ctitan {

// items joined by sep: join({"a", "b"}, ", ") == "a, b".
std::string join(const std::vector<std::string>& items, const std::string& sep);
// A tensor shape as "[2, 3]" (sep between the sizes; "[]" for a scalar).
std::string shape_str(const std::vector<int64_t>& shape, const std::string& sep = ", ");
// The whole of s as a decimal int64 ("-12", " 7" and "+7" too, as std::stoll reads them);
// nullopt when s is empty, has anything after the number, or does not fit in 64 bits.
std::optional<int64_t> parse_int64(const std::string& s);
// Seconds elapsed on the steady clock since t0.
double seconds_since(std::chrono::steady_clock::time_point t0);

}  // namespace ctitan
