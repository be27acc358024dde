// Fused element-wise layers with hand-written forward and backward loops: each is one pass
// over its input where the ATen formula takes 6-15 kernels, casts and temporaries (the
// bf16 casts around the float32 math included). Numerics: float32 arithmetic for bf16 and
// float32 inputs (float64 for float64), results rounded once to the input dtype.
#pragma once
#include <torch/torch.h>

namespace ctitan {

// y = (x · rsqrt(mean(x², -1) + eps)) rounded to x's dtype, times weight (in x's dtype), as
// RMSNormImpl's formula. x [..., D], weight [D] (x's dtype) → [..., D].
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Rotates each interleaved pair (x[2i], x[2i+1]) at position t by the angle whose (cos, sin)
// is freqs_cis[t, i]: (a, b) → (a cos − b sin, a sin + b cos).
// x [B, T, h, hd], freqs_cis float32 [>= T, hd/2, 2] → [B, T, h, hd] in x's dtype.
torch::Tensor fused_rotary_emb(const torch::Tensor& x, const torch::Tensor& freqs_cis);

// silu(a) · b (SwiGLU's gate): silu(a) rounded to the dtype, then the product, as
// torch::silu(a) * b. a, b same shape and dtype → that shape and dtype.
torch::Tensor fused_swiglu(const torch::Tensor& a, const torch::Tensor& b);

// Σ_rows (logsumexp(logits_r) − logits_r[label_r]) · scale, in float64 accumulation of
// float32 row terms — the cross-entropy of float32-cast logits with reduction "sum" times
// scale, without the float32 copy of the logits: one pass forward, and one pass backward
// writing softmax − one-hot (× scale × upstream gradient) straight in the logits' dtype.
// logits [N, V] (bf16/fp32/fp64), labels int64 [N] in [0, V) → float32 scalar.
torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, double scale);

// The GPU routes of fused_rotary_emb and fused_cross_entropy, in ATen ops on any device (the
// CPU tests check them there against the plain formulas). rotary_emb_aten: the pairs as
// complex numbers times the table's cos + i sin, in float32. chunked_cross_entropy: the sum of
// −log softmax(float32(logits))[label], times scale, `rows` rows at a time (0: a float32 chunk
// of about 256 MiB), saving only the logits (the backward recomputes each chunk's softmax).
torch::Tensor rotary_emb_aten(const torch::Tensor& x, const torch::Tensor& freqs_cis);
torch::Tensor chunked_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, double scale,
                                    int64_t rows = 0);

}  // namespace ctitan
