// The llama3 family's ModelSpec (models/model_spec.h), and the dense Llama-shaped spec any
// family with llama's args (models/llama/args.h) builds from its flavor table.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "models/llama/args.h"
#include "models/model_spec.h"

namespace ctitan::llama {

ModelSpec llama3_spec();

// A family of the dense decoder (models/llama/model.h) whose flavors flavor_args gives
// (UserError for an unknown one); HF: LlamaForCausalLM, model_type "llama".
ModelSpec dense_spec(const std::string& name, const std::vector<std::string>& flavors,
                     const std::function<TransformerModelArgs(const std::string& flavor)>& flavor_args);

}  // namespace ctitan::llama
