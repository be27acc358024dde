// Llama 3 model arguments, flavors and analytic sizes (plain C++: no LibTorch, so config
// code and the FLOP/MFU accounting can use them without pulling torch headers).
//
// Mirrors torchtitan v0.2.x torchtitan/models/llama3/{model/args.py,__init__.py}.
// Dimension legend: D = dim, L = n_layers, H = n_heads, KV = n_kv_heads, hd = D / H,
// F = ffn_hidden_dim(args), V = vocab_size, T = sequence length.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/decoder_args.h"

namespace ctitan::llama {

// The decoder's sizes (models/decoder_args.h) with torchtitan's llama3 defaults, and the
// SwiGLU width rules.
struct TransformerModelArgs : DecoderArgs {
  int64_t multiple_of = 256;  // SwiGLU hidden size is rounded up to a multiple of this
  std::optional<double> ffn_dim_multiplier;

  TransformerModelArgs() {
    dim = 4096;
    n_layers = 32;
    n_heads = 32;  // n_kv_heads unset: n_heads
    // torchtitan's default (the Llama 3 tiktoken vocabulary); the 8B/70B/405B flavors rely on
    // it, debugmodel sets 2048. A tokenizer with another vocabulary overrides it.
    vocab_size = 128256;
    // Llama 3.1 frequency scaling; torchtitan v0.2.x enables it for all llama3 flavors.
    rope_scaling = RoPEScalingArgs{};
    max_seq_len = 131072;  // torchtitan sets it to training.seq_len (update_from_config)
    family = "llama3";
  }
};

// Flavors exactly as torchtitan v0.2.x: debugmodel, 8B, 70B, 405B; plus ctitan's CPU-sized
// 33M and 150M (benchmarks).
// Unknown name -> ctitan::UserError
//   unknown model.flavor "x" for llama3; valid: debugmodel, 33M, 150M, 8B, 70B, 405B
TransformerModelArgs llama3_flavor(const std::string& flavor);
std::vector<std::string> llama3_flavor_names();

// Throws ctitan::UserError "[<family>] …" naming the offending values (e.g. dim not
// divisible by n_heads); family: the model.name the args belong to.
void validate(const TransformerModelArgs& args, const std::string& family = "llama3");

// torchtitan FeedForward sizing: h = 4D; h = int(2h/3); h = int(multiplier*h) if set;
// round h up to a multiple of multiple_of.
int64_t ffn_hidden_dim(const TransformerModelArgs& args);

struct ParamCounts {
  int64_t total = 0;      // every parameter of the Transformer
  int64_t embedding = 0;  // tok_embeddings only (torchtitan counts nn.Embedding children only;
                          // the untied output projection is a non-embedding parameter)
};
// Computed from the shapes, without allocating anything.
ParamCounts count_params(const TransformerModelArgs& args);

// torchtitan get_dense_model_nparams_and_flops: 6 (N - N_embedding) + 12 L H hd T
// (6 per parameter for forward+backward matmuls; 12 L H hd T for the two attention matmuls,
// causal sparsity not discounted).
double flops_per_token(const TransformerModelArgs& args, int64_t seq_len);

}  // namespace ctitan::llama
