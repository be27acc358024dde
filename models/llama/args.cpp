#include "models/llama/args.h"

#include <sstream>

#include "config/errors.h"
#include "models/transformer_math.h"

namespace ctitan::llama {

namespace {

TransformerModelArgs make_debugmodel() {
  TransformerModelArgs a;
  a.dim = 256;
  a.n_layers = 6;
  a.n_heads = 16;  // n_kv_heads unset: 16 kv heads
  a.vocab_size = 2048;
  a.rope_theta = 500000;
  return a;
}

TransformerModelArgs make_large(int64_t dim, int64_t n_layers, int64_t n_heads, double ffn_dim_multiplier,
                                int64_t multiple_of) {
  TransformerModelArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = 8;
  a.ffn_dim_multiplier = ffn_dim_multiplier;
  a.multiple_of = multiple_of;
  a.rope_theta = 500000;
  return a;
}

// ctitan's CPU-sized flavors (not torchtitan's): "33M" is the model the performance
// benchmark compares with PyTorch eager; "150M" is big enough that parameters, gradients
// and optimizer state dominate memory (the FSDP memory benchmark). Vocabulary 8192; a
// tokenizer with another vocabulary overrides it.
TransformerModelArgs make_small(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads) {
  TransformerModelArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.vocab_size = 8192;
  a.rope_theta = 500000;
  return a;
}

}  // namespace

std::vector<std::string> llama3_flavor_names() {
  return {"debugmodel", "debugmodel_gqa", "33M", "150M", "8B", "70B", "405B"};
}

TransformerModelArgs llama3_flavor(const std::string& flavor) {
  if (flavor == "debugmodel") return make_debugmodel();
  if (flavor == "debugmodel_gqa") {  // ctitan's: debugmodel with 8 kv heads (the perf bench's model)
    auto a = make_debugmodel();
    a.n_kv_heads = 8;
    return a;
  }
  if (flavor == "33M") return make_small(512, 8, 8, 4);
  if (flavor == "150M") return make_small(1024, 12, 16, 8);
  if (flavor == "8B") return make_large(4096, 32, 32, 1.3, 1024);
  // "8B_<n>L": the 8B shape with n of its 32 layers (scripts/gpu_check.sh's benchmark: as many
  // as fit one GPU with AdamW).
  if (flavor.size() > 4 && flavor.compare(0, 3, "8B_") == 0 && flavor.back() == 'L') {
    const std::string n = flavor.substr(3, flavor.size() - 4);
    if (!n.empty() && n.size() <= 2 && n.find_first_not_of("0123456789") == std::string::npos && std::stoi(n) >= 1 &&
        std::stoi(n) <= 32)
      return make_large(4096, std::stoi(n), 32, 1.3, 1024);
  }
  if (flavor == "70B") return make_large(8192, 80, 64, 1.3, 4096);
  if (flavor == "405B") return make_large(16384, 126, 128, 1.2, 4096);
  std::ostringstream msg;
  msg << "unknown model.flavor \"" << flavor << "\" for llama3; valid: ";
  const auto names = llama3_flavor_names();
  for (size_t i = 0; i < names.size(); ++i) msg << (i ? ", " : "") << names[i];
  throw UserError(msg.str());
}

void validate(const TransformerModelArgs& a, const std::string& family) {
  auto fail = [&family](const std::string& what) { throw UserError("[" + family + "] " + what); };
  if (a.dim <= 0 || a.n_layers <= 0 || a.n_heads <= 0)
    fail("dim, n_layers and n_heads must be positive (dim=" + std::to_string(a.dim) +
         ", n_layers=" + std::to_string(a.n_layers) + ", n_heads=" + std::to_string(a.n_heads) + ")");
  if (a.dim % a.n_heads != 0)
    fail("dim=" + std::to_string(a.dim) + " is not divisible by n_heads=" + std::to_string(a.n_heads));
  if (a.head_dim() % 2 != 0)
    fail("head_dim=dim/n_heads=" + std::to_string(a.head_dim()) + " must be even for rotary embeddings");
  if (a.kv_heads() <= 0 || a.n_heads % a.kv_heads() != 0)
    fail("n_heads=" + std::to_string(a.n_heads) + " is not a multiple of n_kv_heads=" + std::to_string(a.kv_heads()));
  if (a.vocab_size <= 0) fail("vocab_size=" + std::to_string(a.vocab_size) + " must be positive");
  if (a.multiple_of <= 0) fail("multiple_of=" + std::to_string(a.multiple_of) + " must be positive");
  if (a.max_seq_len <= 0) fail("max_seq_len=" + std::to_string(a.max_seq_len) + " must be positive");
  if (a.ffn_dim_multiplier && !(*a.ffn_dim_multiplier > 0))
    fail("ffn_dim_multiplier=" + std::to_string(*a.ffn_dim_multiplier) + " must be positive");
  if (!(a.norm_eps > 0)) fail("norm_eps=" + std::to_string(a.norm_eps) + " must be positive");
  if (!(a.rope_theta > 0)) fail("rope_theta=" + std::to_string(a.rope_theta) + " must be positive");
}

int64_t ffn_hidden_dim(const TransformerModelArgs& a) {
  int64_t hidden = 4 * a.dim;
  // Python int(2 * hidden / 3): float division then truncation. 2h/3 is never within float
  // error of an integer unless exact, so integer division gives the same value.
  hidden = (2 * hidden) / 3;
  if (a.ffn_dim_multiplier) {
    // Same IEEE double product as Python's float * int, then truncation like int().
    hidden = static_cast<int64_t>(*a.ffn_dim_multiplier * static_cast<double>(hidden));
  }
  return a.multiple_of * ((hidden + a.multiple_of - 1) / a.multiple_of);
}

ParamCounts count_params(const TransformerModelArgs& a) {
  const int64_t D = a.dim, hd = a.head_dim(), H = a.n_heads, KV = a.kv_heads();
  const int64_t F = ffn_hidden_dim(a), V = a.vocab_size;
  const int64_t attention = D * (H * hd) + 2 * D * (KV * hd) + (H * hd) * D;  // wq, wk+wv, wo
  const int64_t feed_forward = 3 * D * F;                                     // w1, w2, w3
  const int64_t norms = 2 * D;                                                // attention_norm, ffn_norm
  const int64_t per_block = attention + feed_forward + norms;
  ParamCounts c;
  c.embedding = V * D;
  c.total = c.embedding + a.n_layers * per_block + D /* norm */ + V * D /* output */;
  return c;
}

double flops_per_token(const TransformerModelArgs& a, int64_t seq_len) {
  const ParamCounts c = count_params(a);
  return transformer_flops_per_token(c.total - c.embedding, a.n_layers, a.n_heads, a.head_dim(), seq_len);
}

}  // namespace ctitan::llama
