// Formulas every decoder-only model here shares (plain C++, no LibTorch).
#pragma once
#include <cmath>
#include <cstdint>

namespace ctitan {

// torchtitan's FLOPs per token: 6 per non-embedding parameter (forward + backward
// matmuls; for MoE only the active experts count) + 12·L·H·head_dim·T for the two
// attention matmuls (causal sparsity not discounted).
inline double transformer_flops_per_token(int64_t non_embedding_params, int64_t n_layers, int64_t n_heads,
                                          int64_t head_dim, int64_t seq_len) {
  return 6.0 * static_cast<double>(non_embedding_params) +
         12.0 * static_cast<double>(n_layers) * static_cast<double>(n_heads) * static_cast<double>(head_dim) *
             static_cast<double>(seq_len);
}

// Init std of block `layer_id`'s output projections (torchtitan): 0.02 / sqrt(2·depth),
// depth = layer_id + 1 with depth_init, else the number of layers.
inline double block_init_std(int64_t layer_id, int64_t n_layers, bool depth_init) {
  const double depth = depth_init ? static_cast<double>(layer_id + 1) : static_cast<double>(n_layers);
  return 0.02 / std::pow(2.0 * depth, 0.5);  // as Python: 0.02 / (2 * depth) ** 0.5
}

}  // namespace ctitan
