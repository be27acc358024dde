// Causal attention on the CPU for float32 heads of a few dozen dimensions, without GEMM calls:
// the kernels behind flash_causal_attention (kernels/flash_attention.h) when a head is too
// narrow for its tiles' GEMMs to run well. With head dim 16 (the debug model) the tile GEMMs
// have k = 16 or n = 16 and ran at ~20% of the fp32 peak; here a strip of query rows (eight
// with AVX-512, four with AVX2) takes its scores against a vector of keys at a time (sixteen
// or eight) straight from registers (keys transposed once per head), the softmax runs on that
// row strip, and the weighted sums of value (and, in the backward, key and query) rows
// accumulate in registers too.
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
// Where they run faster than the tiled GEMM path: while a backward task's working set (its
// head's keys and values transposed and their two gradient accumulators, 4 · hd · T floats)
// is within a limit set by the CPU's vectors and L2 (sysconf's; 1 MiB if it says nothing).
// bench/kernel_bench.cpp's second table, docs/performance.md:
// - AVX-512 (16-float vectors, eight query rows per register block), the Intel Xeon (2 MiB
//   L2): direct 1.06-1.5x faster up to 1 MiB (head dim 16 at 512-4096 positions, 32 at
//   512-2048, 64 at 512), and the wider the head, the sooner the tiles win beyond: at 2 MiB
//   1.40-1.44x (16 at 8192), 1.09x (32 at 4096), 0.84-0.96x (64 at 2048); at 4 MiB 1.26-1.29x
//   (16 at 16384), 0.94-0.95x (32 at 8192), 0.76-0.81x (64 at 4096). Limit: L2 · 32 / hd (two
//   L2s for head dim 16, one for 32, half for 64; half for all until 2026-12-08).
// - AVX2 (8-float vectors), an AMD EPYC of the Zen 3 generation (512 KiB L2), since the
//   eight-row backward (7352b4c): direct 1.04-2.8x faster up to 2 MiB; at 4 MiB 2.4-2.6x (head
//   dim 16 at 16384), 1.4-1.5x (32 at 8192), 0.95-1.09x (64 at 4096); at 8 MiB 0.6x (32 at
//   16384) and 0.41-0.53x (64 at 8192). Limit: eight times the L2 (four until the backward
//   of 7352b4c: before it, head dim 64 at 4096 ran at 0.7x).
// - Neither: no limit measured, so never.
int64_t l2_bytes();
int64_t working_set_bytes(int64_t head_dim, int64_t T);
bool wide_vectors();  // AVX-512 F/BW/DQ/VL: CTITAN_KERNEL's x86-64-v4 clone
bool avx2_vectors();  // AVX2 + FMA: its x86-64-v3 clone
int64_t working_set_limit_bytes(int64_t head_dim);
bool preferred(int64_t head_dim, int64_t T);

struct Shape {
  int64_t B, T, H, KV, hd;  // q [B, T, H, hd], k and v [B, T, KV, hd], all contiguous
};

// lanes: the kernels' vector width. 0 takes the CPU's: 16 floats (one zmm register) with
// AVX-512, else 8 (one ymm register, AVX2's: four query rows per register block instead of
// eight). 16 or 8 force one, on any CPU (the tests run both; the sums' order, and so the
// last bits, differ between the two).
// out like q; lse [B, H, T].
void forward(const Shape& s, double scale, const float* q, const float* k, const float* v, float* out, float* lse,
             int lanes = 0);

// dout like q; dq like q (written); dk and dv like k (added to: the caller zeroes them).
void backward(const Shape& s, double scale, const float* q, const float* k, const float* v, const float* dout,
              const float* lse, float* dq, float* dk, float* dv, int lanes = 0);

}  // namespace ctitan::attention_direct
