// The HF adapter of the registered families; see hf_adapter.h.
#include "models/hf_adapter.h"

#include <algorithm>

#include "config/errors.h"
#include "models/registry.h"

namespace ctitan {
namespace {

const ModelSpec* spec_of_architecture(const std::string& architecture) { return find_model_spec_for_hf(architecture); }

// config.json's fields beyond the shared decoder's: a mixture of experts' routing, or a dense
// feed-forward's biases (none).
std::vector<std::pair<std::string, std::string>> family_json(const HFModelConfig& c) {
  const ModelSpec* s = spec_of_architecture(c.architecture);
  if (s && s->moe)
    return {{"num_local_experts", std::to_string(c.num_local_experts)},
            {"num_experts_per_tok", std::to_string(c.num_experts_per_tok)},
            {"router_aux_loss_coef", hf_json_number(c.router_aux_loss_coef)},
            {"output_router_logits", "false"},
            {"sliding_window", "null"}};
  return {{"attention_bias", "false"}, {"mlp_bias", "false"}};
}

void read_family_json(HFModelConfig& c, const HFFieldReader& f) {
  const ModelSpec* s = spec_of_architecture(c.architecture);
  if (!s || !s->moe) return;
  c.num_local_experts = f.integer("num_local_experts", true, 0);
  c.num_experts_per_tok = f.integer("num_experts_per_tok", true, 0);
  c.router_aux_loss_coef = f.real("router_aux_loss_coef", 0);
}

std::string describe(const HFModelConfig& c) {
  const ModelSpec* s = spec_of_architecture(c.architecture);
  if (!s || !s->moe) return "";
  return ", experts " + std::to_string(c.num_local_experts) + " (top " + std::to_string(c.num_experts_per_tok) + ")";
}

// The family whose names c's architecture uses (the first registered with it).
const ModelSpec& names_of(const HFModelConfig& c) {
  const ModelSpec* spec = spec_of_architecture(c.architecture);
  if (!spec) throw UserError("HF interop: architecture \"" + c.architecture + "\" is not one ctitan loads");
  return *spec;
}

HFModelConfig config_for(const std::string& family, const std::string& flavor, int64_t vocab_size) {
  const ModelSpec* spec = find_model_spec(family);
  if (!spec) {
    std::string known;
    for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
    throw UserError("HF interop: model \"" + family + "\" is not one of: " + known);
  }
  return spec->hf_config(flavor, vocab_size);
}

// A mixture of experts' blocks hold their feed-forward under ".moe.": the first registered
// family of that kind.
std::string family_of_params(const std::vector<std::string>& fqns) {
  const bool moe =
      std::any_of(fqns.begin(), fqns.end(), [](const std::string& n) { return n.find(".moe.") != std::string::npos; });
  for (const auto& name : model_names())
    if (model_spec(name).moe == moe) return name;
  throw UserError("checkpoint tool: no registered model family has " + std::string(moe ? "MoE" : "dense") + " blocks");
}

HFAdapter build_adapter() {
  HFAdapter a;
  a.families = model_names();
  a.flavors = [](const std::string& family) { return model_spec(family).flavors; };
  a.config_for = config_for;
  a.architectures = hf_architectures();
  a.architecture_of = [](const std::string& family) { return model_spec(family).hf_architecture; };
  a.family_of = [](const std::string& architecture) {
    const ModelSpec* s = spec_of_architecture(architecture);
    return s ? s->name : std::string();
  };
  a.model_type_of = [](const std::string& architecture) {
    const ModelSpec* s = spec_of_architecture(architecture);
    return s ? s->hf_model_type : std::string();
  };
  a.architecture_of_type = hf_architecture_of_model_type;
  a.family_json = family_json;
  a.read_family_json = read_family_json;
  a.describe = describe;
  a.params = [](const HFModelConfig& c) { return names_of(c).hf_params(c); };
  a.pieces = [](const std::string& fqn, const std::vector<int64_t>& shape, const HFModelConfig& c) {
    return names_of(c).hf_pieces(fqn, shape, c);
  };
  a.family_of_params = family_of_params;
  return a;
}

}  // namespace

const HFAdapter& hf_adapter() {
  static const HFAdapter a = build_adapter();
  return a;
}

}  // namespace ctitan
