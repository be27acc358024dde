#include "models/llama2/spec.h"

#include "models/llama/spec.h"

namespace ctitan::llama2 {
namespace {

llama::TransformerModelArgs make(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t vocab_size) {
  llama::TransformerModelArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;  // n_kv_heads unset: as many kv heads
  a.vocab_size = vocab_size;
  a.multiple_of = 256;
  a.norm_eps = 1e-5;
  a.rope_theta = 10000;
  a.rope_scaling = std::nullopt;
  a.max_seq_len = 4096;
  return a;
}

}  // namespace

std::vector<std::string> llama2_flavor_names() { return {"debugmodel", "7B", "13B", "70B"}; }

llama::TransformerModelArgs llama2_flavor(const std::string& flavor) {
  if (flavor == "debugmodel") return make(256, 8, 16, 2048);
  if (flavor == "7B") return make(4096, 32, 32, 32000);
  if (flavor == "13B") return make(5120, 40, 40, 32000);
  if (flavor == "70B") {
    auto a = make(8192, 80, 64, 32000);
    a.n_kv_heads = 8;
    a.ffn_dim_multiplier = 1.3;
    a.multiple_of = 4096;
    return a;
  }
  throw_unknown_flavor("llama2", flavor, llama2_flavor_names());
}

ModelSpec llama2_spec() { return llama::dense_spec("llama2", llama2_flavor_names(), llama2_flavor); }

}  // namespace ctitan::llama2
