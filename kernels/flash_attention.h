// Fused causal attention for CPU with its own backward: block-wise with an online softmax,
// so the T×T score matrix is never materialised (at most a [one query block] × [one key
// block] tile per worker thread), key blocks entirely in the future are skipped (half the
// FLOPs of the masked formula), and grouped-query attention reads the kv head each query
// head shares in place (no repeat_kv copies, nor any other copy of q, k, v: the tiles'
// GEMMs read the [B, T, heads, hd] tensors with their strides).
//
// Numerics follow the naive formula softmax(q kᵀ / √hd, causal) v: bf16 operands for bf16
// inputs, their products summed in float32 (scores and dP stay float32), the softmax
// statistics (running max, sum, log-sum-exp), the output accumulator and dQ/dK/dV sums in
// float32. Only q, k, v and the log-sum-exp are
// saved; the backward recomputes the probabilities one query block at a time (a strip of
// block.q rows × the keys up to the diagonal, still never T×T):
//   P = exp(S - lse);  dV += Pᵀ dO;  dP = dO Vᵀ;  D = rowsum(P ∘ dP);  dS = P ∘ (dP - D);
//   dQ = dS K / √hd;  dK += dSᵀ Q / √hd.
#pragma once
#include <torch/torch.h>

namespace ctitan {

struct FlashAttentionBlocks {
  int64_t q = 128;  // query positions per tile
  // Key positions per tile. The default covers every key up to the diagonal in one tile
  // (the strip the backward works on anyway): fewer, larger matmuls and no rescaling passes;
  // a smaller k bounds the forward's tile memory further (online softmax over the tiles).
  int64_t k = int64_t{1} << 30;
  // Which kernels run a float32 attention on the CPU: the tiles above, or the direct kernels
  // of kernels/attention_direct.h (no GEMM calls; head dims 16, 32 and 64 only). Rule: the
  // direct kernels where attention_direct::preferred says they measured faster; Direct and
  // Tiles force one (tests and bench/kernel_bench.cpp compare the two). Other dtypes: tiles.
  enum class Path { Rule, Direct, Tiles };
  Path path = Path::Rule;
  // The direct kernels' vector width (attention_direct::forward's `lanes`): 0 the CPU's (16
  // floats with AVX-512, else 8); 16 or 8 force one (tests run both on any CPU).
  int64_t direct_lanes = 0;
};

// q [B, T, H, hd], k and v [B, T, KV, hd] (H a multiple of KV; query head h reads kv head
// h / (H / KV)) → [B, T, H, hd] in q's dtype. Differentiable in q, k and v.
torch::Tensor flash_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     FlashAttentionBlocks blocks = {});

}  // namespace ctitan
