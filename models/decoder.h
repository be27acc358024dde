// The decoder every family shares (torchtitan's Llama skeleton), parameterised by the
// feed-forward of its blocks (dense SwiGLU or a mixture of experts):
//   tokens [B, T] -> tok_embeddings -> L x block -> norm -> output -> logits [B, T, V]
//   block: h = x + attention(attention_norm(x)); out = h + <ffn>(ffn_norm(h))
//
// Parameter names are torchtitan's: tok_embeddings.weight, layers.{i}.attention.{wq,wk,wv,wo}
// .weight, layers.{i}.<ffn name>.…, layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight,
// norm.weight, output.weight; the RoPE table is the buffer "freqs_cis". Registration order
// (tok_embeddings, freqs_cis, layers, norm, output; in a block attention, ffn, attention_norm,
// ffn_norm) is named_parameters() order, which checkpoints and HF exports follow.
//
// The model knows nothing about distribution: FSDP and AC act through units() and an
// optional UnitWrapper (models/unit_runner.h) around every unit call.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/decoder_args.h"
#include "models/layers.h"
#include "models/unit_runner.h"

namespace ctitan {

// One block. A family's block derives from it and supplies the feed-forward: its module
// (registered under `ffn_name` between attention and the norms), its forward and its init.
class DecoderBlockImpl : public torch::nn::Module {
 public:
  DecoderBlockImpl(int64_t layer_id, const DecoderArgs& args, const std::string& ffn_name,
                   std::shared_ptr<torch::nn::Module> ffn);
  // x [B, T, D], freqs_cis float [>= T, hd/2, 2] -> [B, T, D]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& freqs_cis);
  // Incremental decoding: x holds positions [start, start + T), attention through the
  // layer's KV cache (AttentionImpl::forward_cached); freqs_cis is the whole table.
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& freqs_cis, int64_t start,
                               torch::Tensor& k_cache, torch::Tensor& v_cache);
  // Norms to ones, then attention (wq, wk, wv, wo), then the feed-forward: the order in
  // which torchtitan draws from the RNG.
  void init_weights();

  int64_t layer_id;
  double weight_init_std;  // 0.02/sqrt(2(layer_id+1)) with depth_init, else 0.02/sqrt(2L)
  Attention attention{nullptr};
  RMSNorm attention_norm{nullptr};
  RMSNorm ffn_norm{nullptr};

  // Tensor parallelism's plan of this block (models/tp_plan.h), module names under `prefix`
  // ("layers.<i>."): attention and the norms here, the feed-forward's from ffn_tp_plan; nullopt
  // when the family's feed-forward has none (tensor parallelism is then refused).
  std::optional<TPPlan> tp_plan(const std::string& prefix);

 protected:
  std::shared_ptr<torch::nn::Module> ffn_module() const { return ffn_; }
  // The feed-forward's entries under `prefix` ("layers.<i>.<ffn name>"); nullopt: none.
  virtual std::optional<TPPlan> ffn_tp_plan(const std::string& /*prefix*/) { return std::nullopt; }
  virtual torch::Tensor ffn_forward(const torch::Tensor& x) = 0;  // [B, T, D] -> [B, T, D]
  virtual void ffn_init_weights(double init_std) = 0;

 private:
  std::shared_ptr<torch::nn::Module> ffn_;
  std::string ffn_name_;
};

class DecoderImpl : public torch::nn::Module {
 public:
  using MakeBlock = std::function<std::shared_ptr<DecoderBlockImpl>(int64_t layer_id)>;
  // Allocates parameters (uninitialised, norms excepted) and the RoPE table; make_block(i)
  // builds block i. Call init_weights() before training.
  DecoderImpl(const DecoderArgs& args, const MakeBlock& make_block);

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

  // torchtitan's init, drawing from the default CPU generator in its order: freqs_cis
  // recomputed; tok_embeddings ~ N(0, 1); blocks 0..L-1 (DecoderBlockImpl::init_weights);
  // norm <- 1; output ~ N(0, D^-1) truncated at +-3 D^-0.5. With the same torch::manual_seed
  // two inits are bitwise identical.
  void init_weights();
  // Initialises unit i of units() alone (its parameters need storage): init_weights() is
  // the RoPE table and init_unit(0 … units().size() - 1) in order.
  void init_unit(size_t i);

  int64_t n_layers() const { return static_cast<int64_t>(blocks_.size()); }
  torch::nn::ModuleList layers() const { return layers_; }
  const torch::Tensor& freqs_cis() const { return freqs_cis_; }  // float [max_seq_len, hd/2, 2]

  // Empty function: plain calls (the default).
  void set_unit_wrapper(UnitWrapper wrapper) { unit_wrapper_ = std::move(wrapper); }
  // The units in forward order with their parameters (names as named_parameters()):
  // tok_embeddings, layers.0 … layers.{L-1}, output (norm + output projection).
  std::vector<ModelUnit> units() const;
  // Tensor parallelism's plan of the whole model (torchtitan's apply_tp for Llama): the
  // embedding split over the vocabulary, every block's (DecoderBlockImpl::tp_plan), the final
  // norm replicated and the output split over the vocabulary. nullopt: some block has none.
  std::optional<TPPlan> tp_plan();

  Embedding tok_embeddings{nullptr};
  RMSNorm norm{nullptr};
  Linear output{nullptr};

 protected:
  const std::shared_ptr<DecoderBlockImpl>& decoder_block(size_t i) const { return blocks_.at(i); }

 private:
  torch::Tensor run_unit(const std::string& unit, const UnitFn& fn, const torch::Tensor& input);
  torch::Tensor rope_table() const;

  DecoderArgs dargs_;
  torch::Tensor freqs_cis_;
  torch::nn::ModuleList layers_{nullptr};
  std::vector<std::shared_ptr<DecoderBlockImpl>> blocks_;  // the same modules as layers_
  UnitWrapper unit_wrapper_;
};

}  // namespace ctitan
