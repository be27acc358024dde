// Mixtral-style sparse mixture-of-experts decoder (torchtitan's MoE naming):
//   tokens [B, T] -> tok_embeddings -> L x TransformerBlock -> norm -> output -> logits [B, T, V]
// TransformerBlock: h = x + attention(attention_norm(x)); out = h + moe(ffn_norm(h)).
// MoE (token choice, Mixtral): scores = softmax(router.gate(x)) [N, E]; each token goes to
// its top-k experts (chosen on scores + expert_bias when the bias is on), weighted by its
// top-k scores renormalised to sum 1; no capacity limit, no token is dropped.
//
// Parameter names: tok_embeddings.weight, layers.{i}.attention.{wq,wk,wv,wo}.weight,
// layers.{i}.moe.router.gate.weight [E, D], layers.{i}.moe.experts.{w1,w3} [E, F, D],
// layers.{i}.moe.experts.w2 [E, D, F], layers.{i}.{attention_norm,ffn_norm}.weight,
// norm.weight, output.weight. Buffers: freqs_cis, layers.{i}.moe.expert_bias [E] and
// layers.{i}.moe.tokens_per_expert [E] (float32, as torchtitan).
//
// Hugging Face (MixtralForCausalLM, models/hf_names.cpp): the attention and norms as Llama's
// (models/llama/model.h), and per block
//   model.layers.{i}.block_sparse_moe.gate.weight           layers.{i}.moe.router.gate.weight
//   model.layers.{i}.block_sparse_moe.experts.{j}.w{1,2,3}.weight  row j of
//                                                            layers.{i}.moe.experts.w{1,2,3}
// (ctitan's grouped [E, ...] expert tensors are split into E HF tensors). ctitan's
// expert_bias (auxiliary-loss-free balancing) has no HF counterpart and is not exported; with
// moe.expert_bias_update_rate unset, as in the shipped configs, it is zero anyway.
//
// Activation checkpointing (models/recompute.h): the routing decision (the gate logits'
// values, top-k indices, tokens per expert, the permutation) is made through
// recompute::decide_all, so a recompute reuses it; the routing weights and the auxiliary
// loss are recomputed (differentiable) from the recompute's own logits pinned to the
// forward's values, so logits that differ in the last bit during a recompute change
// neither the routing nor, bit for bit, the gradients. Load counters and the recorded loss value are updated
// through recompute::unless_recomputing (once per forward). The router jitter draws from
// the default generator of the model's device, which AC replays.
//
// On a GPU: the experts' split needs the counts on the host, so the routing copies them
// there once per block (a synchronisation, decided: a recompute reuses the copy); the
// counters and the aux value stay on the device, and load_balance_loss() reads every
// block's aux in one copy.
//
// The load-balancing auxiliary loss (Switch / Mixtral) of each block,
//   aux = E · Σ_e f_e · P_e,  f_e = tokens_per_expert_e / (N·k), P_e = mean_t scores[t, e],
// is 1 when balanced (per block; the lb_loss metric sums it over the blocks). It joins the training objective inside the block's backward: the
// block output passes through an identity autograd node whose backward also feeds
// d(objective)/d(aux) = load_balance_loss_coeff · aux_loss_scale into aux. So
// loss.backward() on the cross-entropy alone trains cross_entropy + coeff · Σ aux, with
// or without AC and FSDP; aux_loss() gives the value to add for reporting.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/decoder.h"
#include "models/layers.h"
#include "models/mixtral/args.h"
#include "models/unit_runner.h"

namespace ctitan::mixtral {

// Linear gate only (torchtitan: moe.router.gate).
class RouterImpl : public torch::nn::Module {
 public:
  RouterImpl(int64_t dim, int64_t num_experts);
  Linear gate{nullptr};  // weight [E, D]
};
TORCH_MODULE(Router);

// E SwiGLU experts stored as 3-D parameters: expert e computes w2[e](silu(w1[e] x) * w3[e] x).
class GroupedExpertsImpl : public torch::nn::Module {
 public:
  GroupedExpertsImpl(int64_t dim, int64_t hidden_dim, int64_t num_experts);
  // x [N·k, D] sorted by expert, counts [E] int64 (sum N·k) -> [N·k, D]: one matmul chain
  // per expert over its contiguous rows (experts with no token are skipped).
  torch::Tensor forward(const torch::Tensor& x, const std::vector<int64_t>& counts);
  torch::Tensor w1, w2, w3;  // [E, F, D], [E, D, F], [E, F, D]
};
TORCH_MODULE(GroupedExperts);

// What one MoE forward decided (for tests and statistics).
struct Routing {
  torch::Tensor scores;       // float [N, E] softmax of the gate logits (differentiable)
  torch::Tensor indices;      // int64 [N, k] chosen experts per token
  torch::Tensor weights;      // float [N, k] renormalised top-k scores (differentiable)
  torch::Tensor counts;       // int64 [E] tokens per expert (sums to N·k)
  torch::Tensor counts_host;  // the same counts on the host (the same tensor on the CPU), for
                              // the experts' split: on a GPU the one copy the routing makes
  torch::Tensor order;        // int64 [N·k] slot (t·k + j) of each row of the expert-sorted input
  torch::Tensor inverse;      // int64 [N·k] row of slot s in the expert-sorted input
};

class MoEImpl : public torch::nn::Module {
 public:
  MoEImpl(int64_t dim, const MoEArgs& args);
  // x [B, T, D] -> [B, T, D]
  torch::Tensor forward(const torch::Tensor& x);
  // The routing of x [N, D] (jitter applied in training mode).
  Routing route(const torch::Tensor& x);
  // torchtitan: experts (w1 ~ trunc_normal(0.02), w2, w3 ~ trunc_normal(init_std)), then
  // router.gate ~ trunc_normal(init_std); expert_bias and tokens_per_expert zeroed.
  void init_weights(double init_std);

  MoEArgs args;
  // Test hooks (empty = none): a function of the gate logits [N, E] applied before the
  // softmax, and an observer of every routing route() returns.
  std::function<torch::Tensor(const torch::Tensor&)> logits_hook;
  std::function<void(const Routing&)> routing_observer;
  double aux_loss_scale = 1.0;  // gradient of the objective w.r.t. (coeff · aux); 1/micro-batches
  // This process's share of that gradient: 1/tp under tensor parallelism, where every tp rank
  // computes aux over the whole sequence and the gradients are summed over the tp ranks.
  double aux_grad_share = 1.0;
  LayerHooks tp_hooks;  // tensor parallelism: the sequence gathered in, partial sums scattered out
  Router router{nullptr};
  GroupedExperts experts{nullptr};
  torch::Tensor expert_bias;        // float [E], buffer
  torch::Tensor tokens_per_expert;  // float [E], buffer: tokens routed since the last reset
  // aux of the last forward (unscaled), a float32 scalar where the model is (undefined before
  // the first forward); last_aux_loss() reads it to the host.
  torch::Tensor last_aux;
  double last_aux_loss() const;
};
TORCH_MODULE(MoE);

// The shared decoder's block (models/decoder.h) with the MoE as its feed-forward ("moe").
class TransformerBlockImpl : public DecoderBlockImpl {
 public:
  TransformerBlockImpl(int64_t layer_id, const TransformerModelArgs& args);

  MoE moe{nullptr};

 protected:
  torch::Tensor ffn_forward(const torch::Tensor& x) override { return moe->forward(x); }
  void ffn_init_weights(double init_std) override { moe->init_weights(init_std); }
  // The router replicated (every tp rank routes the whole sequence alike), each expert split as
  // the dense FFN is (w1, w3 over their hidden units, w2 over its inputs), the MoE's input
  // gathered over the sequence and its partial output reduce-scattered.
  std::optional<TPPlan> ffn_tp_plan(const std::string& prefix) override;
};
TORCH_MODULE(TransformerBlock);

// The shared decoder (forward, forward_cached, units, init) with MoE blocks, and the
// MoE bookkeeping the trainer's step hooks call (models/mixtral/spec.cpp).
class TransformerImpl : public DecoderImpl {
 public:
  explicit TransformerImpl(const TransformerModelArgs& args);  // UserError on bad args

  const TransformerModelArgs& args() const { return args_; }
  TransformerBlock block(int64_t i) const;

  // Σ over blocks of the last forward's aux (unscaled).
  double load_balance_loss() const;
  // load_balance_loss_coeff · load_balance_loss(): what the objective adds to the CE.
  double aux_loss() const;
  // Tokens routed to each expert since the last step_load_balance(): float [L, E].
  torch::Tensor tokens_per_expert() const;
  // After the optimizer step: with expert_bias_update_rate set, expert_bias += rate ·
  // sign(mean(load) − load), centred (torchtitan); then the counters are zeroed. load
  // [L, E]: tokens_per_expert(), summed over data-parallel ranks by the caller.
  void step_load_balance(const torch::Tensor& load);
  // Scale of the aux gradient (1 / gradient-accumulation steps).
  void set_aux_loss_scale(double s);
  // Zeroes every block's tokens_per_expert (after forwards that are not training's).
  void zero_tokens_per_expert();

 private:
  TransformerModelArgs args_;
};
TORCH_MODULE(Transformer);

}  // namespace ctitan::mixtral
