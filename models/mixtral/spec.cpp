#include "models/mixtral/spec.h"

#include "config/errors.h"
#include "models/hf_names.h"
#include "models/mixtral/model.h"

namespace ctitan::mixtral {
namespace {

TransformerModelArgs training_args(const std::string& flavor, int64_t seq_len) {
  TransformerModelArgs a = mixtral_flavor(flavor);
  a.max_seq_len = seq_len;
  validate(a);
  return a;
}

ModelSizes sizes_of(const TransformerModelArgs& a, int64_t seq_len) {
  ModelSizes s;
  s.vocab_size = a.vocab_size;
  s.dim = a.dim;
  s.n_layers = a.n_layers;
  s.head_dim = a.head_dim();
  s.kv_dim = a.n_kv_heads * a.head_dim();
  s.ffn = a.moe.hidden_dim * a.moe.top_k;
  const ParamCounts c = count_params(a);
  s.total_params = c.total;
  s.embedding_params = c.embedding;
  s.flops_per_token = flops_per_token(a, seq_len);
  return s;
}

TrainModel build(const std::string& flavor, int64_t seq_len, ModelInit init) {
  const TransformerModelArgs a = training_args(flavor, seq_len);
  Transformer model(a);
  TrainModel m = decoder_train_model(model.ptr(), init);
  const ModelSizes z = sizes_of(a, seq_len);
  m.total_params = z.total_params;
  m.embedding_params = z.embedding_params;
  m.flops_per_token = z.flops_per_token;
  m.set_aux_loss_scale = [model](double s) mutable { model->set_aux_loss_scale(s); };
  m.load_balance_loss = [model] { return model->load_balance_loss(); };
  m.aux_loss = [model] { return model->aux_loss(); };
  m.tokens_per_expert = [model] { return model->tokens_per_expert(); };
  m.step_load_balance = [model](const torch::Tensor& load) mutable { model->step_load_balance(load); };
  return m;
}

InferenceNet build_inference(const std::string& flavor, int64_t vocab_size, int64_t max_seq_len,
                             const HFModelConfig* hf) {
  if (hf && hf->rope_scaling)
    throw UserError(
        "checkpoint tool: rope_scaling in a Mixtral config.json is not supported (ctitan's Mixtral has none)");
  TransformerModelArgs a = mixtral_flavor(flavor);
  a.vocab_size = vocab_size;
  a.max_seq_len = max_seq_len;
  if (hf) {  // what config.json says beyond the structure
    a.norm_eps = hf->rms_norm_eps;
    a.rope_theta = hf->rope_theta;
  }
  return decoder_inference_net(Transformer(a).ptr());
}

HFModelConfig hf_config(const std::string& flavor, int64_t vocab_size) {
  const TransformerModelArgs a = mixtral_flavor(flavor);
  HFModelConfig c;
  c.architecture = "MixtralForCausalLM";
  c.hidden_size = a.dim;
  c.intermediate_size = a.moe.hidden_dim;
  c.num_attention_heads = a.n_heads;
  c.num_key_value_heads = a.n_kv_heads;
  c.num_hidden_layers = a.n_layers;
  c.max_position_embeddings = a.max_seq_len;
  c.rms_norm_eps = a.norm_eps;
  c.rope_theta = a.rope_theta;
  c.num_local_experts = a.moe.num_experts;
  c.num_experts_per_tok = a.moe.top_k;
  c.router_aux_loss_coef = a.moe.load_balance_loss_coeff;
  c.vocab_size = vocab_size;
  return c;
}

}  // namespace

ModelSpec mixtral_spec() {
  ModelSpec s;
  s.name = "mixtral";
  s.flavors = mixtral_flavor_names();
  s.moe = true;
  s.sizes = [](const std::string& flavor, int64_t seq_len) {
    return sizes_of(training_args(flavor, seq_len), seq_len);
  };
  s.max_seq_len = [](const std::string& flavor) { return mixtral_flavor(flavor).max_seq_len; };
  s.build = build;
  s.build_inference = build_inference;
  s.hf_architecture = "MixtralForCausalLM";
  s.hf_model_type = "mixtral";
  s.hf_config = hf_config;
  s.hf_params = [](const HFModelConfig& c) { return decoder_params(c, /*moe=*/true); };
  s.hf_pieces = decoder_hf_pieces;
  return s;
}

}  // namespace ctitan::mixtral
