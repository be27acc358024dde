// Llama 2 (Touvron et al. 2023; torchtitan's former llama2 folder): the dense decoder of
// models/llama/ with Llama 2's choices: plain multi-head attention in the small flavors
// (n_kv_heads = n_heads; grouped-query attention only in 70B), rope_theta 10000 without
// frequency scaling, SwiGLU width rounded to a multiple of 256, a 4096-token context, the
// 32000-token sentencepiece vocabulary. Hugging Face: LlamaForCausalLM (model_type "llama"),
// names as models/llama/model.h.
//
// Flavors: "debugmodel" (dim 256, 8 layers, 16 heads, vocab 2048: trains on the default
// Moby-Dick tokenizer), "7B", "13B", "70B" (Meta's shapes).
#pragma once
#include <string>
#include <vector>

#include "models/llama/args.h"
#include "models/model_spec.h"

namespace ctitan::llama2 {

// UserError for an unknown flavor: unknown model.flavor "x" for llama2; valid: …
llama::TransformerModelArgs llama2_flavor(const std::string& flavor);
std::vector<std::string> llama2_flavor_names();

ModelSpec llama2_spec();

}  // namespace ctitan::llama2
