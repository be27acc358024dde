// Causal attention on the CPU for float32 heads of a few dozen dimensions, without GEMM calls:
// the kernels behind flash_causal_attention (kernels/flash_attention.h) when a head is too
// narrow for its tiles' GEMMs to run well. With head dim 16 (the debug model) the tile GEMMs
// have k = 16 or n = 16 and ran at ~20% of the fp32 peak; here eight query rows at a time
// take their scores against sixteen keys at a time straight from registers (keys transposed
// once per head), the softmax runs on that row strip, and the weighted sums of value (and, in
// the backward, key and query) rows accumulate in registers too.
//
// Same formula and the same statistics as the tiled kernels (flash_attention.cpp's comment):
//   forward:  S = q kᵀ·scale;  m = max S;  P = e^(S − m);  l = Σ P;  o = (P v) / l;
//             lse = m + log l (saved);
//   backward: P = e^(S − lse);  dP = dO vᵀ;  D = Σ P ∘ dP;  dS = P ∘ (dP − D);
//             dQ = dS k·scale;  dK += dSᵀ q·scale;  dV += Pᵀ dO.
// Sums are float32, in a fixed order (results do not depend on the thread count).
#pragma once
#include <cstdint>

namespace ctitan::attention_direct {

// The head sizes the direct kernels are built for (float32 only): 16, 32 and 64.
bool takes(int64_t head_dim);
// Where they run faster than the tiled GEMM path: a backward task's working set (its head's
// keys and values transposed and their two gradient accumulators, 4 · hd · T floats) within
// half of a core's L2 (sysconf's; 1 MiB if it says nothing). bench/kernel_bench.cpp's second
// table, on the Intel Xeon of docs/performance.md (2 MiB L2): direct 1.06-1.5x faster for
// working sets up to 1 MiB (head dim 16 at 512-4096 positions, 32 at 512-2048, 64 at 512),
// 0.84-0.9x at 2 MiB (head dim 64 at 2048: the whole L2).
// And only where the CPU has AVX-512 (CTITAN_KERNEL's x86-64-v4 clone): the kernels' register
// blocks are of 16-float vectors, 32 zmm registers' worth; on AVX2 (16 ymm registers) each
// vector is a pair and the blocks spill. On an AMD EPYC (Zen 3, AVX2 only) they ran at
// 0.15-0.4x the tiles (docs/performance.md).
int64_t l2_bytes();
int64_t working_set_bytes(int64_t head_dim, int64_t T);
bool wide_vectors();
bool preferred(int64_t head_dim, int64_t T);

struct Shape {
  int64_t B, T, H, KV, hd;  // q [B, T, H, hd], k and v [B, T, KV, hd], all contiguous
};

// out like q; lse [B, H, T].
void forward(const Shape& s, double scale, const float* q, const float* k, const float* v, float* out, float* lse);

// dout like q; dq like q (written); dk and dv like k (added to: the caller zeroes them).
void backward(const Shape& s, double scale, const float* q, const float* k, const float* v, const float* dout,
              const float* lse, float* dq, float* dk, float* dv);

}  // namespace ctitan::attention_direct
