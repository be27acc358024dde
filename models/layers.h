// Layers shared by the decoder-only models (Llama 3, Mixtral): bias-free Linear, Embedding,
// RMSNorm, rotary embeddings (Meta's interleaved-pair convention), grouped-query causal
// attention and the SwiGLU feed-forward.
//
// Legend: B batch, T sequence, D model dim, H query heads, KV key/value heads, hd head dim,
// F feed-forward hidden dim, V vocabulary.
//
// Parameters are allocated with torch::empty (uninitialised) except RMSNorm weights (ones):
// construction is separate from initialisation so that a model can be built, wrapped and
// sharded before its (RNG-ordered) init_weights() runs.
#pragma once
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "models/rope_args.h"
#include "models/tp_plan.h"

namespace ctitan {

// y = x W^T with W [out, in]; no bias (all projections of these models are bias-free).
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features);
  torch::Tensor forward(const torch::Tensor& x);  // [..., in] -> [..., out]
  int64_t in_features, out_features;
  torch::Tensor weight;  // [out, in]
  LayerHooks tp_hooks;   // tensor parallelism's collectives around forward (models/tp_plan.h)
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  torch::Tensor forward(const torch::Tensor& tokens);  // int64 [B, T] -> [B, T, D]
  torch::Tensor weight;                                // [V, D]
  LayerHooks tp_hooks;
};
TORCH_MODULE(Embedding);

// y = x * rsqrt(mean(x^2, -1) + eps) * weight. The normalisation runs in float32 for
// bf16/fp16 inputs (in the input dtype for float32/float64) and is cast back before the
// weight multiply, as torch.nn.RMSNorm does.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);  // [..., D] -> [..., D]
  void reset_parameters();                        // weight <- 1
  double eps;
  torch::Tensor weight;  // [D]
};
TORCH_MODULE(RMSNorm);

// RoPE table: float32 [end, head_dim/2, 2], last axis (cos, sin) of pos * f_i with
// f_i = theta^(-2i/head_dim), optionally rescaled as Llama 3.1 does (torchtitan
// apply_scaling). Computed with the same float32 op sequence as torchtitan's
// precompute_freqs_cis (which returns the same numbers as complex64 polar(1, angle)).
torch::Tensor precompute_freqs_cis(int64_t head_dim, int64_t end, double theta,
                                   const std::optional<RoPEScalingArgs>& scaling = std::nullopt);

// Rotates each interleaved pair (x[2i], x[2i+1]) of every head by the angle of position t:
// (a, b) -> (a cos - b sin, a sin + b cos), i.e. complex multiply by cis(angle).
// x [B, T, h, hd], freqs_cis [>= T, hd/2, 2] (rows 0..T-1 used) -> [B, T, h, hd], x's dtype.
// bf16/fp16 inputs are rotated in float32, like torchtitan's x.float() view_as_complex path.
torch::Tensor apply_rotary_emb(const torch::Tensor& x, const torch::Tensor& freqs_cis);

// [B, T, KV, hd] -> [B, T, KV*n_rep, hd]; query head h reads kv head h / n_rep.
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep);

// softmax(q k^T / sqrt(hd) with future positions masked) v.
// q, k, v [B, H, T, hd] -> [B, H, T, hd]. Softmax in float32 for bf16/fp16 inputs.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// Keys and values of the positions decoded so far, every layer's, for incremental decoding
// (generation; training's forward keeps none). Layer i's k[i] / v[i] are [B, KV, capacity, hd]
// (post-RoPE keys; head-major, so that attention reads each head's keys in place), positions
// [0, pos) filled.
struct KVCache {
  std::vector<torch::Tensor> k, v;
  int64_t pos = 0;  // positions filled: the next token's position
  int64_t capacity() const { return k.empty() ? 0 : k[0].size(2); }
  // Zeroed tensors for n_layers layers.
  static KVCache allocate(int64_t n_layers, int64_t batch, int64_t capacity, int64_t n_kv_heads, int64_t head_dim,
                          torch::TensorOptions options);
};

// Grouped-query self-attention with RoPE; the attention itself is flash_causal_attention
// (kernels/flash_attention.h), numerically the formula of causal_attention above. Parameters: wq [H*hd, D], wk/wv [KV*hd, D],
// wo [D, H*hd].
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(int64_t dim, int64_t n_heads, int64_t n_kv_heads);
  // x [B, T, D], freqs_cis [>= T, hd/2, 2] -> [B, T, D]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& freqs_cis);
  // Incremental decoding: x [B, T, D] holds positions [start, start + T); their keys and
  // values are written into k_cache / v_cache [B, KV, >= start + T, hd] and the queries
  // attend to cached positions [0, start + T) causally. Plain ATen math (float32 scores and
  // softmax for 16-bit inputs), no autograd use intended; freqs_cis is the whole table.
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& freqs_cis, int64_t start,
                               torch::Tensor& k_cache, torch::Tensor& v_cache);
  // torchtitan: wq, wk, wv ~ trunc_normal(0.02); wo ~ trunc_normal(init_std) (in that order).
  void init_weights(double init_std);
  int64_t n_heads, n_kv_heads, head_dim;  // the model's; under tensor parallelism a rank runs 1/tp of the heads
  Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  LayerHooks tp_hooks;  // around forward (the training path; forward_cached runs in one process)
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x). w1/w3 [F, D], w2 [D, F].
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden_dim);
  torch::Tensor forward(const torch::Tensor& x);  // [..., D] -> [..., D]
  // torchtitan: w1 ~ trunc_normal(0.02); w2, w3 ~ trunc_normal(init_std) (in that order).
  void init_weights(double init_std);
  Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
  LayerHooks tp_hooks;
};
TORCH_MODULE(FeedForward);

}  // namespace ctitan
