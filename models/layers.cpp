#include "models/layers.h"

#include <cmath>
#include <limits>

#include "kernels/flash_attention.h"
#include "kernels/fused_ops.h"
#include "models/init.h"
#include "models/recompute.h"

namespace ctitan {

namespace {
constexpr double kPi = 3.141592653589793;  // Python's math.pi / torch.pi

// Dtype the numerically sensitive parts (norm statistics, rotation, softmax) run in:
// float32 for the 16-bit types, the input dtype otherwise.
torch::ScalarType compute_dtype(const torch::Tensor& x) {
  const auto t = x.scalar_type();
  return (t == torch::kBFloat16 || t == torch::kHalf) ? torch::kFloat : t;
}
}  // namespace

// ---------------------------------------------------------------------------------------
LinearImpl::LinearImpl(int64_t in, int64_t out) : in_features(in), out_features(out) {
  weight = register_parameter("weight", new_parameter({out, in}));
}

// Through recompute::linear: op-level selective activation checkpointing may keep and
// reuse this matmul's output (a plain torch::linear otherwise).
torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  return tp_hooks.post(x, recompute::linear(tp_hooks.pre(x), weight));
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim) {
  weight = register_parameter("weight", new_parameter({num_embeddings, embedding_dim}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  return tp_hooks.post(tokens, torch::embedding(weight, tp_hooks.pre(tokens)));
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  auto w = new_parameter({dim});
  if (w.storage().nbytes() > 0) w.fill_(1.0);
  weight = register_parameter("weight", w);
}

void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(1.0);
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // One fused pass (kernels/fused_ops.h) computing the formula in the header.
  return fused_rms_norm(x, weight, eps);
}

// ---------------------------------------------------------------------------------------
torch::Tensor precompute_freqs_cis(int64_t head_dim, int64_t end, double theta,
                                   const std::optional<RoPEScalingArgs>& scaling) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "[models] RoPE head_dim must be even, got ", head_dim);
  TORCH_CHECK(end > 0, "[models] RoPE table length must be positive, got ", end);
  torch::NoGradGuard no_grad;
  // f_i = 1 / theta^(2i/hd), i < hd/2, in float32 as torchtitan computes it.
  const auto exponents = torch::arange(0, head_dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(head_dim);
  auto freqs = 1.0 / torch::pow(theta, exponents);
  if (scaling) {
    // Llama 3.1: wavelengths longer than orig/low_freq_factor are slowed by scaling_factor,
    // those shorter than orig/high_freq_factor kept, the band between interpolated.
    const auto& s = *scaling;
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = orig / s.low_freq_factor;
    const double high_freq_wavelen = orig / s.high_freq_factor;
    const auto wavelen = (2.0 * kPi) / freqs;
    const auto new_freqs = torch::where(wavelen > low_freq_wavelen, freqs / s.scaling_factor, freqs);
    const auto smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const auto in_band = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    freqs = torch::where(in_band, (1 - smooth) * new_freqs / s.scaling_factor + smooth * new_freqs, new_freqs);
  }
  // angle[t, i] = t * f_i (float32 product, like torch.outer(t, freqs).float()).
  const auto positions = torch::arange(end, torch::kLong).to(torch::kFloat);
  const auto angles = torch::outer(positions, freqs);
  return torch::stack({torch::cos(angles), torch::sin(angles)}, -1).contiguous();
}

torch::Tensor apply_rotary_emb(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  return fused_rotary_emb(x, freqs_cis);  // one pass, float32 rotation, same formula
}

torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t B = x.size(0), T = x.size(1), KV = x.size(2), hd = x.size(3);
  return x.unsqueeze(3).expand({B, T, KV, n_rep, hd}).reshape({B, T, KV * n_rep, hd});
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = q.size(2), hd = q.size(3);
  // [B, H, T, T]; entry (t, s) is query t against key s.
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  auto scores = torch::matmul(q * scale, k.transpose(-2, -1));
  const auto future = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const auto probs = torch::softmax(scores, -1, compute_dtype(scores)).to(v.scalar_type());
  return torch::matmul(probs, v);
}

// ---------------------------------------------------------------------------------------
KVCache KVCache::allocate(int64_t n_layers, int64_t batch, int64_t capacity, int64_t n_kv_heads, int64_t head_dim,
                          torch::TensorOptions options) {
  KVCache c;
  for (int64_t i = 0; i < n_layers; ++i) {
    c.k.push_back(torch::zeros({batch, n_kv_heads, capacity, head_dim}, options));
    c.v.push_back(torch::zeros({batch, n_kv_heads, capacity, head_dim}, options));
  }
  return c;
}

AttentionImpl::AttentionImpl(int64_t dim, int64_t n_heads_, int64_t n_kv_heads_)
    : n_heads(n_heads_), n_kv_heads(n_kv_heads_), head_dim(dim / n_heads_) {
  TORCH_CHECK(dim % n_heads == 0 && n_heads % n_kv_heads == 0, "[models] Attention: dim=", dim, " n_heads=", n_heads,
              " n_kv_heads=", n_kv_heads);
  wq = register_module("wq", Linear(dim, n_heads * head_dim));
  wk = register_module("wk", Linear(dim, n_kv_heads * head_dim));
  wv = register_module("wv", Linear(dim, n_kv_heads * head_dim));
  wo = register_module("wo", Linear(n_heads * head_dim, dim));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x_in, const torch::Tensor& freqs_cis) {
  const torch::Tensor x = tp_hooks.pre(x_in);  // tensor parallelism: the whole sequence
  const int64_t B = x.size(0), T = x.size(1);
  // -1 heads: the local head count follows the projection sizes.
  auto xq = wq(x).view({B, T, -1, head_dim});  // [B, T, H, hd]
  auto xk = wk(x).view({B, T, -1, head_dim});  // [B, T, KV, hd]
  auto xv = wv(x).view({B, T, -1, head_dim});  // [B, T, KV, hd]
  xq = apply_rotary_emb(xq, freqs_cis);
  xk = apply_rotary_emb(xk, freqs_cis);
  // Fused block-wise causal attention; GQA reads each kv head once (no repeat_kv copy).
  const auto out = flash_causal_attention(xq, xk, xv);  // [B, T, H, hd]
  return tp_hooks.post(x_in, wo(out.reshape({B, T, -1})));
}

torch::Tensor AttentionImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& freqs_cis, int64_t start,
                                            torch::Tensor& k_cache, torch::Tensor& v_cache) {
  const int64_t B = x.size(0), T = x.size(1), S = start + T;
  TORCH_CHECK(k_cache.defined() && k_cache.size(0) == B && k_cache.size(2) >= S && freqs_cis.size(0) >= S,
              "[models] KV cache holds ", k_cache.defined() ? k_cache.size(2) : 0, " positions, RoPE table ",
              freqs_cis.size(0), "; ", S, " needed");
  auto xq = wq(x).view({B, T, -1, head_dim});  // [B, T, H, hd]
  auto xk = wk(x).view({B, T, -1, head_dim});  // [B, T, KV, hd]
  auto xv = wv(x).view({B, T, -1, head_dim});
  const auto freqs = freqs_cis.narrow(0, start, T);  // the rows of positions start .. S-1
  xq = apply_rotary_emb(xq, freqs);
  xk = apply_rotary_emb(xk, freqs);
  k_cache.narrow(2, start, T).copy_(xk.transpose(1, 2));
  v_cache.narrow(2, start, T).copy_(xv.transpose(1, 2));
  const int64_t H = xq.size(2), KV = k_cache.size(1), rep = H / KV;
  const auto cdt = compute_dtype(x);
  // Query head h reads kv head h / rep: the rep query heads of a kv head and their T positions
  // are one [rep·T, hd] matrix against that head's [S, hd] keys (no copy of the cache).
  const auto q =
      xq.view({B, T, KV, rep, head_dim}).permute({0, 2, 3, 1, 4}).reshape({B, KV, rep * T, head_dim}).to(cdt);
  const auto k = k_cache.narrow(2, 0, S).to(cdt);  // [B, KV, S, hd]
  const auto v = v_cache.narrow(2, 0, S).to(cdt);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  // Query t sits at position start + t and sees keys 0 .. start + t.
  const auto key_pos = torch::arange(S, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
  const auto query_pos = torch::arange(start, S, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
  const auto future = key_pos.unsqueeze(0) > query_pos.unsqueeze(1);  // [T, S]
  scores = scores.view({B, KV, rep, T, S}).masked_fill(future, -std::numeric_limits<double>::infinity());
  const auto out = torch::matmul(torch::softmax(scores, -1).view({B, KV, rep * T, S}), v);  // [B, KV, rep·T, hd]
  return wo(out.view({B, KV, rep, T, head_dim}).permute({0, 3, 1, 2, 4}).reshape({B, T, -1}).to(x.scalar_type()));
}

void AttentionImpl::init_weights(double init_std) {
  for (auto* lin : {&wq, &wk, &wv}) trunc_normal_((*lin)->weight, 0.0, 0.02);
  trunc_normal_(wo->weight, 0.0, init_std);
}

// ---------------------------------------------------------------------------------------
FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim) {
  w1 = register_module("w1", Linear(dim, hidden_dim));
  w2 = register_module("w2", Linear(hidden_dim, dim));
  w3 = register_module("w3", Linear(dim, hidden_dim));
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  const torch::Tensor h = tp_hooks.pre(x);
  return tp_hooks.post(x, w2(fused_swiglu(w1(h), w3(h))));  // one pass forward and one backward (fused_ops.h)
}

void FeedForwardImpl::init_weights(double init_std) {
  trunc_normal_(w1->weight, 0.0, 0.02);
  trunc_normal_(w2->weight, 0.0, init_std);
  trunc_normal_(w3->weight, 0.0, init_std);
}

}  // namespace ctitan
