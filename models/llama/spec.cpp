#include "models/llama/spec.h"

#include "models/hf_names.h"
#include "models/llama/model.h"

namespace ctitan::llama {
namespace {

using FlavorArgs = std::function<TransformerModelArgs(const std::string&)>;

ModelSizes sizes_of(const TransformerModelArgs& a, int64_t seq_len) {
  ModelSizes s;
  s.vocab_size = a.vocab_size;
  s.dim = a.dim;
  s.n_layers = a.n_layers;
  s.head_dim = a.head_dim();
  s.kv_dim = a.kv_heads() * a.head_dim();
  s.ffn = ffn_hidden_dim(a);
  const ParamCounts c = count_params(a);
  s.total_params = c.total;
  s.embedding_params = c.embedding;
  s.flops_per_token = flops_per_token(a, seq_len);
  return s;
}

HFModelConfig hf_config_of(const TransformerModelArgs& a, int64_t vocab_size) {
  HFModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.hidden_size = a.dim;
  c.intermediate_size = ffn_hidden_dim(a);
  c.num_attention_heads = a.n_heads;
  c.num_key_value_heads = a.kv_heads();
  c.num_hidden_layers = a.n_layers;
  c.max_position_embeddings = a.max_seq_len;
  c.rms_norm_eps = a.norm_eps;
  c.rope_theta = a.rope_theta;
  if (a.rope_scaling) c.rope_scaling = to_hf(*a.rope_scaling);
  c.vocab_size = vocab_size;
  return c;
}

// The flavor's args for training: max_seq_len = seq_len (torchtitan's update_from_config).
TransformerModelArgs training_args(const FlavorArgs& flavor_args, const std::string& name, const std::string& flavor,
                                   int64_t seq_len) {
  TransformerModelArgs a = flavor_args(flavor);
  a.max_seq_len = seq_len;
  validate(a, name);
  return a;
}

InferenceNet build_inference(const TransformerModelArgs& flavor_args, const std::string& name, int64_t vocab_size,
                             int64_t max_seq_len, const HFModelConfig* hf) {
  TransformerModelArgs a = flavor_args;
  a.vocab_size = vocab_size;
  a.max_seq_len = max_seq_len;
  if (hf) {  // what config.json says beyond the structure
    a.norm_eps = hf->rms_norm_eps;
    a.rope_theta = hf->rope_theta;
    a.rope_scaling = hf->rope_scaling ? std::optional(from_hf(*hf->rope_scaling)) : std::nullopt;
  }
  return decoder_inference_net(Transformer(a, name).ptr());
}

}  // namespace

ModelSpec dense_spec(const std::string& name, const std::vector<std::string>& flavors, const FlavorArgs& flavor_args) {
  ModelSpec s;
  s.name = name;
  s.flavors = flavors;
  s.sizes = [=](const std::string& flavor, int64_t seq_len) {
    return sizes_of(training_args(flavor_args, name, flavor, seq_len), seq_len);
  };
  s.max_seq_len = [=](const std::string& flavor) { return flavor_args(flavor).max_seq_len; };
  s.build = [=](const std::string& flavor, int64_t seq_len, ModelInit init) {
    const TransformerModelArgs a = training_args(flavor_args, name, flavor, seq_len);
    TrainModel m = decoder_train_model(Transformer(a, name).ptr(), init);
    const ModelSizes z = sizes_of(a, seq_len);
    m.total_params = z.total_params;
    m.embedding_params = z.embedding_params;
    m.flops_per_token = z.flops_per_token;
    return m;
  };
  s.build_inference = [=](const std::string& flavor, int64_t vocab_size, int64_t max_seq_len, const HFModelConfig* hf) {
    return build_inference(flavor_args(flavor), name, vocab_size, max_seq_len, hf);
  };
  s.hf_architecture = "LlamaForCausalLM";
  s.hf_model_type = "llama";
  s.hf_config = [=](const std::string& flavor, int64_t vocab_size) {
    return hf_config_of(flavor_args(flavor), vocab_size);
  };
  s.hf_params = [](const HFModelConfig& c) { return decoder_params(c, /*moe=*/false); };
  s.hf_pieces = decoder_hf_pieces;
  return s;
}

ModelSpec llama3_spec() { return dense_spec("llama3", llama3_flavor_names(), llama3_flavor); }

}  // namespace ctitan::llama
