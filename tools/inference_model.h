// A checkpoint's model built for inference in one process (float32, eval mode), from any form
// checkpoint/model_source.h opens: what checkpoint_tool's logits and `generate` run.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "checkpoint/model_source.h"
#include "models/layers.h"

namespace ctitan {

// The model of `m` in float32, eval mode, every parameter loaded: the flavor's structure with
// the checkpoint's vocabulary and, from an HF folder's config.json, its rope_theta,
// rope_scaling and rms_norm_eps. max_seq_len: the RoPE table length.
struct InferenceModel {
  std::string name, flavor;
  int64_t vocab_size = 0, max_seq_len = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;                   // tokens [B, T] -> logits
  std::function<at::Tensor(const at::Tensor&, KVCache&)> forward_cached;  // DecoderImpl::forward_cached
  std::function<KVCache(int64_t batch, int64_t capacity)> new_cache;      // float32
};
InferenceModel load_inference_model(const ModelTensors& m, int64_t max_seq_len);

}  // namespace ctitan
