// The plain functions of the HF format's types; see hf_config.h.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "hf_types/hf_config.h"

namespace ctitan {

std::string structure_difference(const HFModelConfig& a, const HFModelConfig& b) {
  auto d = [](const char* k, int64_t x, int64_t y) {
    return x == y ? std::string() : std::string(k) + ": " + std::to_string(x) + " vs " + std::to_string(y);
  };
  if (a.architecture != b.architecture) return "architecture: " + a.architecture + " vs " + b.architecture;
  for (const std::string& s :
       {d("hidden_size", a.hidden_size, b.hidden_size),
        d("intermediate_size", a.intermediate_size, b.intermediate_size),
        d("num_attention_heads", a.num_attention_heads, b.num_attention_heads),
        d("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads),
        d("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers), d("vocab_size", a.vocab_size, b.vocab_size),
        d("num_local_experts", a.num_local_experts, b.num_local_experts),
        d("num_experts_per_tok", a.num_experts_per_tok, b.num_experts_per_tok)})
    if (!s.empty()) return s;
  return "";
}

std::string hf_json_number(double v) {
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.1f", v);  // 500000.0, as HF writes integral floats
    return buf;
  }
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // a float, as HF writes it
  return s;
}

}  // namespace ctitan
