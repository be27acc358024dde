// Llama 3 decoder as in torchtitan v0.2.x (torchtitan/models/llama3/model/model.py): the
// shared decoder (models/decoder.h) with a dense SwiGLU feed-forward in every block.
//   tokens [B, T] -> tok_embeddings -> L x TransformerBlock -> norm -> output -> logits [B, T, V]
// TransformerBlock: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)).
//
// Parameter names are torchtitan's: tok_embeddings.weight, layers.{i}.attention.{wq,wk,wv,wo}
// .weight, layers.{i}.attention_norm.weight, layers.{i}.feed_forward.{w1,w2,w3}.weight,
// layers.{i}.ffn_norm.weight, norm.weight, output.weight. The RoPE table is the buffer
// "freqs_cis" (not a parameter).
//
// Hugging Face (LlamaForCausalLM; HF ← ctitan, models/hf_names.cpp):
//   model.embed_tokens.weight                       tok_embeddings.weight
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.attention.{wq,wk,wv,wo}.weight
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight  layers.{i}.feed_forward.{w1,w3,w2}.weight
//   model.layers.{i}.input_layernorm.weight          layers.{i}.attention_norm.weight
//   model.layers.{i}.post_attention_layernorm.weight layers.{i}.ffn_norm.weight
//   model.norm.weight, lm_head.weight                norm.weight, output.weight
// q_proj / k_proj hold wq / wk in HF's rotary row order (see checkpoint/hf_config.h).
//
// The model knows nothing about distribution. Parallelisms act from outside: blocks are
// reachable (block(i)), each block's forward is a pure function of (x, freqs_cis), and an
// optional UnitWrapper lets the owner run code around every unit call (FSDP all-gather,
// activation checkpointing) without the model including parallelisms/.
#pragma once
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/decoder.h"
#include "models/layers.h"
#include "models/llama/args.h"
#include "models/unit_runner.h"

namespace ctitan::llama {

// The decoder's sizes of these args; `family` names them in shape checks.
DecoderArgs decoder_args(const TransformerModelArgs& args, const std::string& family = "llama3");

class TransformerBlockImpl : public DecoderBlockImpl {
 public:
  TransformerBlockImpl(int64_t layer_id, const TransformerModelArgs& args);
  TransformerBlockImpl(int64_t layer_id, const DecoderArgs& dargs, int64_t ffn_hidden_dim);

  FeedForward feed_forward{nullptr};  // registered as "feed_forward" (DecoderBlockImpl)

 protected:
  torch::Tensor ffn_forward(const torch::Tensor& x) override { return feed_forward->forward(x); }
  void ffn_init_weights(double init_std) override { feed_forward->init_weights(init_std); }
  // Megatron's SwiGLU split: w1, w3 column-wise (each rank its share of the hidden units), w2
  // row-wise; the input gathered over the sequence first.
  std::optional<TPPlan> ffn_tp_plan(const std::string& prefix) override;
};
TORCH_MODULE(TransformerBlock);

using ctitan::UnitFn;
using ctitan::UnitWrapper;

class TransformerImpl : public DecoderImpl {
 public:
  // Allocates parameters (uninitialised, norms excepted) and the RoPE table. Throws
  // ctitan::UserError if args are inconsistent (validate(args, family)). Call init_weights()
  // before training. family: the model.name these args come from (its errors name it).
  explicit TransformerImpl(const TransformerModelArgs& args, const std::string& family = "llama3");

  const TransformerModelArgs& args() const { return args_; }
  TransformerBlock block(int64_t i) const;

 private:
  TransformerModelArgs args_;
};
TORCH_MODULE(Transformer);

}  // namespace ctitan::llama
