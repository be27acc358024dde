#include "models/mixtral/args.h"

#include <sstream>

#include "config/errors.h"
#include "models/transformer_math.h"

namespace ctitan::mixtral {

std::vector<std::string> mixtral_flavor_names() { return {"debugmodel", "8x7B"}; }

TransformerModelArgs mixtral_flavor(const std::string& flavor) {
  TransformerModelArgs a;  // defaults are Mixtral-8x7B's
  if (flavor == "8x7B") return a;
  if (flavor == "debugmodel") {
    a.dim = 256;
    a.n_layers = 6;
    a.n_heads = 16;
    a.n_kv_heads = 16;
    a.vocab_size = 2048;
    a.moe.hidden_dim = 768;  // llama debugmodel's dense FFN size, per expert
    return a;
  }
  std::ostringstream msg;
  msg << "unknown model.flavor \"" << flavor << "\" for mixtral; valid: ";
  const auto names = mixtral_flavor_names();
  for (size_t i = 0; i < names.size(); ++i) msg << (i ? ", " : "") << names[i];
  throw UserError(msg.str());
}

void validate(const TransformerModelArgs& a) {
  auto fail = [](const std::string& what) { throw UserError("[mixtral] " + what); };
  auto s = [](auto v) { return std::to_string(v); };
  if (a.dim <= 0 || a.n_layers <= 0 || a.n_heads <= 0 || a.vocab_size <= 0 || a.max_seq_len <= 0)
    fail("dim, n_layers, n_heads, vocab_size and max_seq_len must be positive (dim=" + s(a.dim) +
         ", n_layers=" + s(a.n_layers) + ", n_heads=" + s(a.n_heads) + ", vocab_size=" + s(a.vocab_size) +
         ", max_seq_len=" + s(a.max_seq_len) + ")");
  if (a.dim % a.n_heads != 0) fail("dim=" + s(a.dim) + " is not divisible by n_heads=" + s(a.n_heads));
  if (a.head_dim() % 2 != 0) fail("head_dim=dim/n_heads=" + s(a.head_dim()) + " must be even for rotary embeddings");
  if (a.kv_heads() <= 0 || a.n_heads % a.kv_heads() != 0)
    fail("n_heads=" + s(a.n_heads) + " is not a multiple of n_kv_heads=" + s(a.kv_heads()));
  const auto& m = a.moe;
  if (m.num_experts <= 0 || m.hidden_dim <= 0)
    fail("num_experts=" + s(m.num_experts) + " and moe hidden_dim=" + s(m.hidden_dim) + " must be positive");
  if (m.top_k <= 0 || m.top_k > m.num_experts)
    fail("top_k=" + s(m.top_k) + " must be in [1, num_experts=" + s(m.num_experts) + "]");
  if (!(m.load_balance_loss_coeff >= 0))
    fail("load_balance_loss_coeff=" + s(m.load_balance_loss_coeff) + " must be >= 0");
  if (!(m.router_jitter_noise >= 0 && m.router_jitter_noise < 1))
    fail("router_jitter_noise=" + s(m.router_jitter_noise) + " must be in [0, 1)");
  if (m.expert_bias_update_rate && !(*m.expert_bias_update_rate > 0))
    fail("expert_bias_update_rate=" + s(*m.expert_bias_update_rate) + " must be positive");
  if (!(a.norm_eps > 0) || !(a.rope_theta > 0))
    fail("norm_eps=" + s(a.norm_eps) + " and rope_theta=" + s(a.rope_theta) + " must be positive");
}

ParamCounts count_params(const TransformerModelArgs& a) {
  const int64_t D = a.dim, hd = a.head_dim(), H = a.n_heads, KV = a.kv_heads(), V = a.vocab_size;
  const int64_t E = a.moe.num_experts, k = a.moe.top_k, F = a.moe.hidden_dim;
  const int64_t attention = D * (H * hd) + 2 * D * (KV * hd) + (H * hd) * D;  // wq, wk+wv, wo
  const int64_t expert = 3 * D * F;                                           // w1, w2, w3
  const int64_t gate = D * E;
  const int64_t norms = 2 * D;
  ParamCounts c;
  c.embedding = V * D;
  const int64_t outer = c.embedding + D /* norm */ + V * D /* output */;
  c.total = outer + a.n_layers * (attention + E * expert + gate + norms);
  c.active = outer + a.n_layers * (attention + k * expert + gate + norms);
  return c;
}

double flops_per_token(const TransformerModelArgs& a, int64_t seq_len) {
  const ParamCounts c = count_params(a);
  return transformer_flops_per_token(c.active - c.embedding, a.n_layers, a.n_heads, a.head_dim(), seq_len);
}

}  // namespace ctitan::mixtral
