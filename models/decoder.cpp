#include "models/decoder.h"

#include <cmath>

#include "models/init.h"
#include "models/transformer_math.h"

namespace ctitan {

DecoderBlockImpl::DecoderBlockImpl(int64_t layer_id_, const DecoderArgs& a, const std::string& ffn_name,
                                   std::shared_ptr<torch::nn::Module> ffn)
    : layer_id(layer_id_), ffn_(std::move(ffn)), ffn_name_(ffn_name) {
  // Registration order = named_parameters() order = torchtitan's.
  attention = register_module("attention", Attention(a.dim, a.n_heads, a.kv_heads()));
  register_module(ffn_name, ffn_);
  attention_norm = register_module("attention_norm", RMSNorm(a.dim, a.norm_eps));
  ffn_norm = register_module("ffn_norm", RMSNorm(a.dim, a.norm_eps));
  weight_init_std = block_init_std(layer_id, a.n_layers, a.depth_init);
}

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  const auto h = x + attention->forward(attention_norm->forward(x), freqs_cis);
  return h + ffn_forward(ffn_norm->forward(h));
}

torch::Tensor DecoderBlockImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& freqs_cis, int64_t start,
                                               torch::Tensor& k_cache, torch::Tensor& v_cache) {
  const auto h = x + attention->forward_cached(attention_norm->forward(x), freqs_cis, start, k_cache, v_cache);
  return h + ffn_forward(ffn_norm->forward(h));
}

std::optional<TPPlan> DecoderBlockImpl::tp_plan(const std::string& prefix) {
  auto ffn = ffn_tp_plan(prefix + ffn_name_);
  if (!ffn) return std::nullopt;
  const std::string at = prefix + "attention";
  TPPlan plan = {
      {at, TPStyle::GatherInput, &attention->tp_hooks, {}},
      {at + ".wq", TPStyle::Colwise, &attention->wq->tp_hooks, {at + ".wq.weight"}},
      {at + ".wk", TPStyle::Colwise, &attention->wk->tp_hooks, {at + ".wk.weight"}},
      {at + ".wv", TPStyle::Colwise, &attention->wv->tp_hooks, {at + ".wv.weight"}},
      {at + ".wo", TPStyle::Rowwise, &attention->wo->tp_hooks, {at + ".wo.weight"}},
  };
  plan.insert(plan.end(), ffn->begin(), ffn->end());
  for (const char* norm : {"attention_norm", "ffn_norm"})
    plan.push_back({prefix + norm, TPStyle::Replicated, nullptr, {prefix + norm + ".weight"}});
  return plan;
}

void DecoderBlockImpl::init_weights() {
  attention_norm->reset_parameters();
  ffn_norm->reset_parameters();
  attention->init_weights(weight_init_std);
  ffn_init_weights(weight_init_std);
}

// -----------------------------------------------------------------------------------------
DecoderImpl::DecoderImpl(const DecoderArgs& a, const MakeBlock& make_block) : dargs_(a) {
  tok_embeddings = register_module("tok_embeddings", Embedding(a.vocab_size, a.dim));
  // A buffer, as in torchtitan: it follows the module across devices. Module::to(dtype)
  // converts it too, so keep the module's tensors float32 and cast activations/parameter
  // copies for mixed precision instead (the rotation itself always runs in >= float32).
  freqs_cis_ = register_buffer("freqs_cis", rope_table());
  layers_ = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < a.n_layers; ++i) {
    blocks_.push_back(make_block(i));
    layers_->push_back(blocks_.back());
  }
  norm = register_module("norm", RMSNorm(a.dim, a.norm_eps));
  output = register_module("output", Linear(a.dim, a.vocab_size));
}

torch::Tensor DecoderImpl::rope_table() const {
  return precompute_freqs_cis(dargs_.head_dim(), dargs_.max_seq_len, dargs_.rope_theta, dargs_.rope_scaling);
}

torch::Tensor DecoderImpl::run_unit(const std::string& unit, const UnitFn& fn, const torch::Tensor& input) {
  return unit_wrapper_ ? unit_wrapper_(unit, fn, input) : fn(input);
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "[models] ", dargs_.family, " forward expects tokens [B, T], got ", tokens.sizes());
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T <= dargs_.max_seq_len, "[models] sequence length ", T, " exceeds max_seq_len=", dargs_.max_seq_len,
              " (the RoPE table length)");
  // Each unit captures by value (module holders are shared pointers) so it can be re-run.
  const auto freqs = freqs_cis_.narrow(0, 0, T);
  // (mutable: a const ModuleHolder only hands out const modules.)
  auto emb = tok_embeddings;
  auto h = run_unit(
      "tok_embeddings", [emb](const torch::Tensor& t) mutable { return emb->forward(t); }, tokens);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    auto blk = blocks_[i];
    h = run_unit(
        "layers." + std::to_string(i), [blk, freqs](const torch::Tensor& x) { return blk->forward(x, freqs); }, h);
  }
  auto fin = norm;
  auto out = output;
  return run_unit(
      "output", [fin, out](const torch::Tensor& x) mutable { return out->forward(fin->forward(x)); }, h);
}

torch::Tensor DecoderImpl::forward_cached(const torch::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 2, "[models] forward_cached expects tokens [B, T], got ", tokens.sizes());
  const int64_t start = cache.pos, T = tokens.size(1);
  TORCH_CHECK(static_cast<int64_t>(cache.k.size()) == n_layers() && start + T <= cache.capacity() &&
                  start + T <= dargs_.max_seq_len,
              "[models] positions up to ", start + T, " exceed the KV cache (", cache.capacity(),
              " positions) or max_seq_len=", dargs_.max_seq_len);
  auto h = tok_embeddings->forward(tokens);
  for (size_t i = 0; i < blocks_.size(); ++i)
    h = blocks_[i]->forward_cached(h, freqs_cis_, start, cache.k[i], cache.v[i]);
  cache.pos = start + T;
  return output->forward(norm->forward(h));
}

KVCache DecoderImpl::new_cache(int64_t batch, int64_t capacity, torch::ScalarType dtype) const {
  TORCH_CHECK(capacity > 0 && capacity <= dargs_.max_seq_len, "[models] KV cache of ", capacity,
              " positions; max_seq_len=", dargs_.max_seq_len);
  return KVCache::allocate(n_layers(), batch, capacity, dargs_.kv_heads(), dargs_.head_dim(),
                           torch::TensorOptions().dtype(dtype).device(output->weight.device()));
}

void DecoderImpl::init_weights() {
  torch::NoGradGuard no_grad;
  freqs_cis_.copy_(rope_table());
  for (size_t i = 0; i < blocks_.size() + 2; ++i) init_unit(i);
}

// Unit i of units(): what init_weights() draws for it, in the same order. Called for
// i = 0, 1, … it consumes the generator exactly as the whole init does, which is what lets
// FSDP initialise one unit at a time and keep its rows (parallelisms/fsdp.h).
void DecoderImpl::init_unit(size_t i) {
  torch::NoGradGuard no_grad;
  if (i == 0) {
    normal_(tok_embeddings->weight, 0.0, 1.0);
  } else if (i <= blocks_.size()) {
    blocks_[i - 1]->init_weights();
  } else {
    TORCH_CHECK(i == blocks_.size() + 1, "[models] init_unit: unit ", i, " of ", blocks_.size() + 2);
    norm->reset_parameters();
    const double final_out_std = std::pow(static_cast<double>(dargs_.dim), -0.5);
    const double cutoff_factor = 3.0;
    trunc_normal_(output->weight, 0.0, final_out_std, -cutoff_factor * final_out_std, cutoff_factor * final_out_std);
  }
}

std::optional<TPPlan> DecoderImpl::tp_plan() {
  TPPlan plan = {{"tok_embeddings", TPStyle::VocabEmbedding, &tok_embeddings->tp_hooks, {"tok_embeddings.weight"}}};
  for (size_t i = 0; i < blocks_.size(); ++i) {
    auto block = blocks_[i]->tp_plan("layers." + std::to_string(i) + ".");
    if (!block) return std::nullopt;
    plan.insert(plan.end(), block->begin(), block->end());
  }
  plan.push_back({"norm", TPStyle::Replicated, nullptr, {"norm.weight"}});
  plan.push_back({"output", TPStyle::OutputColwise, &output->tp_hooks, {"output.weight"}});
  return plan;
}

std::vector<ModelUnit> DecoderImpl::units() const {
  auto unit_of = [](const std::string& name, const std::string& prefix, const torch::nn::Module& m) {
    ModelUnit u;
    u.name = name;
    for (const auto& kv : m.named_parameters(/*recurse=*/true)) u.params.emplace_back(prefix + kv.key(), kv.value());
    return u;
  };
  std::vector<ModelUnit> units;
  units.push_back(unit_of("tok_embeddings", "tok_embeddings.", *tok_embeddings));
  for (size_t i = 0; i < blocks_.size(); ++i)
    units.push_back(unit_of("layers." + std::to_string(i), "layers." + std::to_string(i) + ".", *blocks_[i]));
  ModelUnit last = unit_of("output", "norm.", *norm);
  for (auto& p : unit_of("output", "output.", *output).params) last.params.push_back(p);
  units.push_back(std::move(last));
  return units;
}

}  // namespace ctitan
