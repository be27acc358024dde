// Llama 3 decoder as in torchtitan v0.2.x (torchtitan/models/llama3/model/model.py):
//   tokens [B, T] -> tok_embeddings -> L x TransformerBlock -> norm -> output -> logits [B, T, V]
// TransformerBlock: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)).
//
// Parameter names are torchtitan's: tok_embeddings.weight, layers.{i}.attention.{wq,wk,wv,wo}
// .weight, layers.{i}.attention_norm.weight, layers.{i}.feed_forward.{w1,w2,w3}.weight,
// layers.{i}.ffn_norm.weight, norm.weight, output.weight. The RoPE table is the buffer
// "freqs_cis" (not a parameter).
//
// The model knows nothing about distribution. Parallelisms act from outside: blocks are
// reachable (block(i)), each block's forward is a pure function of (x, freqs_cis), and an
// optional UnitWrapper lets the owner run code around every unit call (FSDP all-gather,
// activation checkpointing) without the model including parallelisms/.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/unit_runner.h"

#include "models/layers.h"
#include "models/llama/args.h"

namespace ctitan::llama {

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t layer_id, const TransformerModelArgs& args);
  // x [B, T, D], freqs_cis float [>= T, hd/2, 2] -> [B, T, D]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& freqs_cis);
  // Incremental decoding: x holds positions [start, start + T), attention through the
  // layer's KV cache (AttentionImpl::forward_cached); freqs_cis is the whole table.
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& freqs_cis, int64_t start,
                               torch::Tensor& k_cache, torch::Tensor& v_cache);
  // Norms to ones, then attention (wq, wk, wv, wo), then feed_forward (w1, w2, w3): the order
  // in which torchtitan draws from the RNG.
  void init_weights();

  int64_t layer_id;
  double weight_init_std;  // 0.02/sqrt(2(layer_id+1)) with depth_init, else 0.02/sqrt(2L)
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
  RMSNorm attention_norm{nullptr};
  RMSNorm ffn_norm{nullptr};
};
TORCH_MODULE(TransformerBlock);

using ctitan::UnitFn;
using ctitan::UnitWrapper;

class TransformerImpl : public torch::nn::Module {
 public:
  // Allocates parameters (uninitialised, norms excepted) and the RoPE table. Throws
  // ctitan::UserError if args are inconsistent. Call init_weights() before training.
  explicit TransformerImpl(const TransformerModelArgs& args);

  // tokens int64 [B, T] (T <= max_seq_len) -> logits [B, T, V] in the parameters' dtype.
  torch::Tensor forward(const torch::Tensor& tokens);
  // Generation: tokens [B, T] at positions [cache.pos, cache.pos + T) -> logits [B, T, V];
  // their keys and values go into `cache` (KVCache::allocate with n_layers() layers) and
  // cache.pos advances by T. The same layers and parameters as forward(), without the unit
  // wrapper (no FSDP / AC: one process holding the whole model); forward() is untouched.
  // Use under torch::NoGradGuard. A full forward's logits at those positions, to rounding.
  torch::Tensor forward_cached(const torch::Tensor& tokens, KVCache& cache);
  // A cache for `batch` sequences of up to `capacity` positions (<= max_seq_len), in `dtype`.
  KVCache new_cache(int64_t batch, int64_t capacity, torch::ScalarType dtype) const;

  // torchtitan's init, drawing from the default CPU generator in its order:
  // freqs_cis recomputed; tok_embeddings ~ N(0, 1); blocks 0..L-1 (see
  // TransformerBlockImpl::init_weights); norm <- 1; output ~ N(0, D^-1) truncated at
  // +-3 D^-0.5. With the same torch::manual_seed two inits are bitwise identical.
  void init_weights();

  const TransformerModelArgs& args() const { return args_; }
  int64_t n_layers() const { return static_cast<int64_t>(blocks_.size()); }
  TransformerBlock block(int64_t i) const { return blocks_.at(static_cast<size_t>(i)); }
  torch::nn::ModuleList layers() const { return layers_; }
  const torch::Tensor& freqs_cis() const { return freqs_cis_; }  // float [max_seq_len, hd/2, 2]

  // Empty function: plain calls (the default).
  void set_unit_wrapper(UnitWrapper wrapper) { unit_wrapper_ = std::move(wrapper); }
  // The units in forward order with their parameters (names as named_parameters()):
  // tok_embeddings, layers.0 … layers.{L-1}, output (norm + output projection).
  std::vector<ModelUnit> units() const;
  // Initialises unit i of units() alone (its parameters need storage): init_weights() is
  // the RoPE table and init_unit(0 … units().size() - 1) in order.
  void init_unit(size_t i);

  Embedding tok_embeddings{nullptr};
  RMSNorm norm{nullptr};
  Linear output{nullptr};

 private:
  torch::Tensor run_unit(const std::string& unit, const UnitFn& fn, const torch::Tensor& input);

  TransformerModelArgs args_;
  torch::Tensor freqs_cis_;
  torch::nn::ModuleList layers_{nullptr};
  std::vector<TransformerBlock> blocks_;  // the same modules as layers_, typed
  UnitWrapper unit_wrapper_;
};
TORCH_MODULE(Transformer);

}  // namespace ctitan::llama
