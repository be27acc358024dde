// Mixtral (sparse mixture-of-experts Llama) model arguments, flavors and analytic sizes.
// Plain C++ (no LibTorch), like models/llama/args.h, so config code and the FLOP/MFU
// accounting can use it.
//
// Legend: D = dim, L = n_layers, H = n_heads, KV = n_kv_heads, hd = D / H,
// E = num_experts, k = top_k, F = moe_hidden_dim (each expert's SwiGLU hidden size),
// V = vocab_size, T = sequence length, N = B·T tokens.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/decoder_args.h"

namespace ctitan::mixtral {

// The MoE feed-forward of every block (torchtitan's MoEArgs, Mixtral's choices).
struct MoEArgs {
  int64_t num_experts = 8;     // E
  int64_t top_k = 2;           // k experts per token
  int64_t hidden_dim = 14336;  // F: each expert's SwiGLU hidden size
  // Switch / Mixtral load-balancing auxiliary loss coefficient α: the training objective
  // is cross_entropy + α · Σ_layers E · Σ_e f_e · P_e (0: no auxiliary loss).
  double load_balance_loss_coeff = 0.01;
  // Multiplicative uniform jitter on the router input in training, x · U(1-ε, 1+ε)
  // (Switch Transformer; HF Mixtral's `router_jitter_noise`). 0: off.
  double router_jitter_noise = 0.0;
  // torchtitan's auxiliary-loss-free balancing (its `load_balance_coeff`): unset = off;
  // else after every step expert_bias += rate · sign(mean load − load) (centred), and the
  // bias is added to the router scores for the top-k choice only.
  std::optional<double> expert_bias_update_rate;
};

// The decoder's sizes (models/decoder_args.h) with Mixtral-8x7B's defaults, and the MoE.
struct TransformerModelArgs : DecoderArgs {
  MoEArgs moe;

  TransformerModelArgs() {
    dim = 4096;
    n_layers = 32;
    n_heads = 32;
    n_kv_heads = 8;
    vocab_size = 32000;
    rope_theta = 1e6;
    max_seq_len = 32768;
    family = "mixtral";
  }
};

// "debugmodel": dim 256, 6 layers, 16 heads, 8 experts (F 768), top-2, vocab 2048.
// "8x7B": Mixtral-8x7B (dim 4096, 32 layers, 32 heads, 8 kv heads, 8 experts of F 14336,
// top-2, vocab 32000, rope theta 1e6). Unknown name -> ctitan::UserError
//   unknown model.flavor "x" for mixtral; valid: debugmodel, 8x7B
TransformerModelArgs mixtral_flavor(const std::string& flavor);
std::vector<std::string> mixtral_flavor_names();

// Throws ctitan::UserError naming the offending values.
void validate(const TransformerModelArgs& args);

struct ParamCounts {
  int64_t total = 0;      // every parameter
  int64_t embedding = 0;  // tok_embeddings only (as llama::count_params)
  int64_t active = 0;     // parameters one token uses: all but E - k experts per block
};
// From the shapes, without allocating anything.
ParamCounts count_params(const TransformerModelArgs& args);

// 6 (N_active − N_embedding) + 12 L H hd T: only the k experts a token visits count.
double flops_per_token(const TransformerModelArgs& args, int64_t seq_len);

}  // namespace ctitan::mixtral
