// The shared decoder's sizes (models/decoder.h), plain C++ (no LibTorch) so that a family's
// args (models/<family>/args.h), which derive from them, stay usable by config code and the
// FLOP/MFU accounting. A family's args add what its blocks need besides (llama: the SwiGLU
// width rules; mixtral: the MoE) and set their own defaults in their constructor.
//
// Dimension legend: D = dim, L = n_layers, H = n_heads, KV = kv_heads(), hd = D / H.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "models/rope_args.h"

namespace ctitan {

struct DecoderArgs {
  int64_t dim = 0, n_layers = 0, n_heads = 0;
  std::optional<int64_t> n_kv_heads;  // unset: n_heads (plain multi-head attention)
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;  // RoPE table length; training sets it to training.seq_len
  double norm_eps = 1e-5, rope_theta = 10000;
  std::optional<RoPEScalingArgs> rope_scaling;  // Llama 3.1 frequency scaling, unset = none
  bool depth_init = true;  // block i's output projections use 0.02/sqrt(2(i+1)), else 0.02/sqrt(2L)
  std::string family;      // named in the forward's shape checks ("[models] <family> forward …")

  int64_t kv_heads() const { return n_kv_heads ? *n_kv_heads : n_heads; }
  int64_t head_dim() const { return dim / n_heads; }
};

}  // namespace ctitan
