// Llama 3.1 "scaled RoPE" parameters (plain C++, no LibTorch: config code may use it).
// torchtitan v0.2.x applies this scaling to every llama3 flavor by default.
#pragma once
#include <cstdint>

namespace ctitan {

struct RoPEScalingArgs {
  double scaling_factor = 8.0;    // low frequencies are divided by this
  double low_freq_factor = 1.0;   // wavelengths above original/low_freq_factor: fully scaled
  double high_freq_factor = 4.0;  // wavelengths below original/high_freq_factor: unchanged
  int64_t original_max_position_embeddings = 8192;
};

}  // namespace ctitan
