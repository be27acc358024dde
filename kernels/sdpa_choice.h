// Which of ATen's fused attention kernels flash_causal_attention's GPU route runs (issue 33:
// "the fastest SDPA backend per shape, chosen by rule or start-up measurement, and logged").
// ATen's own order is flash, memory-efficient, math, cuDNN, so cuDNN's attention never runs
// unless asked for; on an H200 it took 3.7 ms against flash's 7.0 for the forward + backward of
// Llama 3 8B's attention (seq 8192) and 0.93 against 1.42 ms at seq 2048 (docs/gpus.md).
// The choice is a rule, not the timings: the first candidate ATen's checks accept for the
// run's shape and dtype (cuDNN, then flash, then memory-efficient for model.sdpa_backend auto).
// The timings are measured and logged beside it, but a choice that followed them could differ
// between two runs of one config (they vary by a few per cent, more at small shapes) and so
// change the run's numerics: gpu_check.sh (e) saw AC none and AC full pick different kernels.
// use_sdpa puts the choice first in ATen's priority order, the others after it as ATen's
// fall-backs (a shape the choice cannot take, e.g. validation's, still runs).
// ATen ops only: the CPU build compiles it (nothing calls it there; the CPU runs ctitan's own
// flash attention).
#pragma once
#include <string>
#include <vector>

#include <ATen/SDPBackend.h>
#include <ATen/core/Tensor.h>

namespace ctitan {

struct SdpaShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

struct SdpaTry {
  std::string name;     // "cudnn", "cudnn (kv repeated)", "flash", "efficient", "math"
  bool usable = false;  // ATen's checks accept the shape and dtype for this backend
  double ms = 0;        // forward + backward, best of the timed repetitions (usable only)
};

struct SdpaChoice {
  at::SDPBackend backend = at::SDPBackend::flash_attention;
  // cuDNN's attention without grouped-query support in this ATen: k and v repeated to all
  // query heads (repeat_interleave) before the call, which the timing includes.
  bool repeat_kv = false;
  std::vector<SdpaTry> tried;
  std::string name() const;
  std::string summary() const;  // "cudnn 3.21 ms, flash 4.80 ms, efficient: not usable"
};

std::string sdpa_backend_name(at::SDPBackend b);

// Each candidate's forward + backward on q [B, H, T, hd], k and v [B, KV, T, hd] with
// is_causal (operands filled without drawing from any generator), best of `reps` after one
// warm-up, each between host synchronisations. cuDNN, when ATen refuses it grouped-query
// attention, is tried again with k and v repeated. The choice is the first usable candidate in
// the order given; none usable: ATen's own order (backend flash_attention, tried all unusable).
SdpaChoice choose_sdpa(const SdpaShape& shape, const std::vector<at::SDPBackend>& candidates, int reps = 3);

// ATen's causal attention on q [B, H, T, hd], k and v [B, KV, T, hd] (scale 1/√hd): grouped-
// query attention taken as it is, or with k and v repeated to all H heads first when repeat_kv
// (a backend that does not take GQA). flash_causal_attention's GPU route and the timings of
// choose_sdpa both run this.
at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool repeat_kv);

// From now on flash_causal_attention's GPU route prefers c.backend (and repeats k and v when
// c.repeat_kv); the rest of ATen's backends stay enabled after it.
void use_sdpa(const SdpaChoice& c);
const SdpaChoice& current_sdpa();

}  // namespace ctitan
