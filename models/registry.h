// The registered model families (models/registry.cpp, one line each), looked up by
// model.name or by a Hugging Face config.json's architecture.
#pragma once
#include <string>
#include <vector>

#include "models/model_spec.h"

namespace ctitan {

// UserError "model.name = \"x\" is not one of: <registered names>" when unknown.
const ModelSpec& model_spec(const std::string& name);
const ModelSpec* find_model_spec(const std::string& name);  // nullptr when unknown
std::vector<std::string> model_names();                     // registration order

// The family that loads an HF config.json of this architecture when the user names none:
// the first registered with it, so the choice is deterministic (LlamaForCausalLM: llama3,
// never llama2, whose debugmodel has another structure and whose larger flavors would be
// told apart only by rope_theta and rope_scaling; name llama2 to get it). nullptr if none.
const ModelSpec* find_model_spec_for_hf(const std::string& architecture);
// The architecture whose model_type this is ("" when none): for config.json files without
// "architectures".
std::string hf_architecture_of_model_type(const std::string& model_type);
std::vector<std::string> hf_architectures();  // each once, registration order

}  // namespace ctitan
