#include "models/llama/spec.h"

#include "models/hf_names.h"
#include "models/llama/model.h"

namespace ctitan::llama {
namespace {

using FlavorArgs = std::function<TransformerModelArgs(const std::string&)>;

ModelSizes sizes_of(const TransformerModelArgs& a, int64_t seq_len) {
  const ParamCounts c = count_params(a);
  return decoder_sizes(a, ffn_hidden_dim(a), c.total, c.embedding, flops_per_token(a, seq_len));
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
  apply_hf_overrides(a, hf);
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
    return decoder_train_model(Transformer(a, name).ptr(), init, sizes_of(a, seq_len));
  };
  s.build_inference = [=](const std::string& flavor, int64_t vocab_size, int64_t max_seq_len, const HFModelConfig* hf) {
    return build_inference(flavor_args(flavor), name, vocab_size, max_seq_len, hf);
  };
  s.hf_architecture = "LlamaForCausalLM";
  s.hf_model_type = "llama";
  s.hf_config = [=](const std::string& flavor, int64_t vocab_size) {
    const TransformerModelArgs a = flavor_args(flavor);
    return decoder_hf_config(a, "LlamaForCausalLM", ffn_hidden_dim(a), vocab_size);
  };
  s.hf_params = [](const HFModelConfig& c) { return decoder_params(c, /*moe=*/false); };
  s.hf_pieces = decoder_hf_pieces;
  return s;
}

ModelSpec llama3_spec() { return dense_spec("llama3", llama3_flavor_names(), llama3_flavor); }

}  // namespace ctitan::llama
