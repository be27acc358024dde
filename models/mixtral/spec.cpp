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
  const ParamCounts c = count_params(a);
  ModelSizes s = decoder_sizes(a, a.moe.hidden_dim * a.moe.top_k, c.total, c.embedding, flops_per_token(a, seq_len));
  s.ffn_hidden = a.moe.hidden_dim;  // each expert's width: what tensor parallelism would split
  return s;
}

// The step's MoE work (models/train_model.h: StepHooks), over the state the hooks share.
struct MoEStep {
  Transformer model;
  double micro_batches = 1;
  double lb_sum = 0;   // load-balance loss of the step being trained, mean over its micro-batches
  double lb_last = 0;  // ... of the last finished step
  torch::Tensor load;  // [L, E] tokens per expert of the last finished step, summed over ranks
};

StepHooks moe_step_hooks(const Transformer& model) {
  auto st = std::make_shared<MoEStep>(MoEStep{model, 1, 0, 0, torch::Tensor()});
  StepHooks h;
  h.set_micro_batches = [st](int64_t n) {
    st->micro_batches = static_cast<double>(n);
    st->model->set_aux_loss_scale(1.0 / st->micro_batches);  // scaled like the cross-entropy
  };
  h.extra_loss = [st] {  // the objective is CE + coeff · load-balance loss
    st->lb_sum += st->model->load_balance_loss() / st->micro_batches;
    return torch::tensor(st->model->aux_loss() / st->micro_batches, torch::kFloat64);
  };
  h.after_optimizer_step = [st](const WorldSumFn& world_sum) {  // expert bias from every rank's load
    st->load = st->model->tokens_per_expert();
    world_sum(st->load, "expert_load");
    st->model->step_load_balance(st->load);
    st->lb_last = st->lb_sum;
    st->lb_sum = 0;
  };
  h.reset_step_counters = [st] { st->model->zero_tokens_per_expert(); };
  h.metrics = [st](const WorldMeanFn& world_mean) {
    // The load-balance loss (Σ over layers; mean over ranks) and the tokens-per-expert spread
    // of the last step: max / mean load of the most unbalanced layer.
    std::vector<std::pair<std::string, double>> m;
    m.emplace_back("lb_loss", world_mean(st->lb_last, "lb_loss"));
    const auto spread = std::get<0>(st->load.max(1)) / st->load.mean(1);
    m.emplace_back("expert_spread", spread.max().item<double>());
    return m;
  };
  return h;
}

TrainModel build(const std::string& flavor, int64_t seq_len, ModelInit init) {
  const TransformerModelArgs a = training_args(flavor, seq_len);
  Transformer model(a);
  TrainModel m = decoder_train_model(model.ptr(), init, sizes_of(a, seq_len));
  m.step = moe_step_hooks(model);
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
  apply_hf_overrides(a, hf);  // no rope_scaling (refused above)
  return decoder_inference_net(Transformer(a).ptr());
}

HFModelConfig hf_config(const std::string& flavor, int64_t vocab_size) {
  const TransformerModelArgs a = mixtral_flavor(flavor);
  HFModelConfig c = decoder_hf_config(a, "MixtralForCausalLM", a.moe.hidden_dim, vocab_size);
  c.num_local_experts = a.moe.num_experts;
  c.num_experts_per_tok = a.moe.top_k;
  c.router_aux_loss_coef = a.moe.load_balance_loss_coeff;
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
