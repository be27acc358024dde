// The Hugging Face format of a decoder (plain C++, no LibTorch, no model code): what
// config.json says about the model, and how ctitan's parameters map to HF's tensors. The room
// below models/ and checkpoint/: each family's ModelSpec (models/model_spec.h) fills an
// HFModelConfig from a flavor and names its parameters (models/hf_names.h); checkpoint/hf.cpp
// reads and writes the JSON text and the tensors, asking the families through an HFAdapter
// (hf_types/hf_adapter.h).
//
// Rotary embedding layout: ctitan (as torchtitan and the original checkpoints) rotates
// interleaved pairs (0,1), (2,3), ... of each head; HF's rotate_half pairs dimension i with
// i + hd/2. HF's q_proj / k_proj therefore hold wq / wk with each head's rows reordered:
//   HF row h·hd + j·hd/2 + i  =  ctitan row h·hd + 2i + j      (i < hd/2, j ∈ {0, 1})
// (torchtitan's _permute: view [H, hd/2, 2, D], swap dims 1 and 2); an HFPiece with
// rope_heads > 0 is stored that way, and loading reverses it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ctitan {

// The "rope_type" of RoPEScalingArgs' scaling in a Hugging Face config.json (and its name in
// messages).
inline constexpr const char* kHfRopeScalingType = "llama3";

// config.json's "rope_scaling" of rope_type kHfRopeScalingType (Llama 3.1's scaled RoPE; the
// defaults are Llama 3.1's values). Each family converts it to its model's own arguments.
struct HFRopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// What config.json says about the model (the fields ctitan writes and checks).
struct HFModelConfig {
  std::string architecture;  // "architectures"[0]: a registered family's hf_architecture
  int64_t hidden_size = 0, intermediate_size = 0, num_attention_heads = 0, num_key_value_heads = 0,
          num_hidden_layers = 0, vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-5, rope_theta = 10000;
  std::optional<HFRopeScaling> rope_scaling;               // rope_type kHfRopeScalingType
  int64_t num_local_experts = 0, num_experts_per_tok = 0;  // MoE families (written and read by them)
  double router_aux_loss_coef = 0;
  bool tie_word_embeddings = false;
  std::string torch_dtype = "float32";

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

// "" when a and b describe the same structure (architecture, sizes, heads, layers, experts,
// vocabulary), else the first difference: "num_hidden_layers: 6 vs 4".
std::string structure_difference(const HFModelConfig& a, const HFModelConfig& b);

// The shortest decimal that reads back as exactly v, as HF writes floats ("500000.0", "1e-05"):
// a number of config.json.
std::string hf_json_number(double v);

// ctitan's parameters (names and shapes), in the order of named_parameters().
using ParamList = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// One HF tensor holding rows [row_begin, row_end) of a ctitan parameter (dim 0): the whole
// parameter, or one expert of a grouped expert tensor. rope_heads > 0: the rows are stored
// in HF's rotary order for that many heads (q_proj, k_proj).
struct HFPiece {
  std::string key;
  std::vector<int64_t> shape;
  int64_t row_begin = 0, row_end = 0;
  int64_t rope_heads = 0;
};

}  // namespace ctitan
