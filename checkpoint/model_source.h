// A model's tensors under ctitan's names, whichever checkpoint form holds them (a ctitan or
// DCP step folder, a Hugging Face folder, a consolidated .pt), and that model built for
// inference in one process: what checkpoint_tool's convert / logits and `generate` share.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "checkpoint/hf.h"
#include "models/layers.h"

namespace ctitan {

struct ModelTensors {
  std::string form;  // sharded | hf | consolidated
  std::string model_name, flavor;
  int64_t step = 0;
  ParamList params;  // ctitan names and global shapes, model order
  std::string dtype;  // dtype of tok_embeddings.weight as stored
  std::function<at::Tensor(const std::string&)> read;  // full tensor, stored dtype
  std::function<std::string(const std::string&)> dtype_of;  // that stored dtype, without reading
  std::optional<HFModelConfig> hf_config;              // the source's own config.json (hf form)

  int64_t vocab_size() const;
};

// Opens `path` in whichever form it is. name / flavor: for sources that do not record them
// ("" = inferred from the tensor shapes). UserError for a missing path or an unknown form.
ModelTensors open_model(const std::string& path, const std::string& name, const std::string& flavor);

// The model of `m` in float32, eval mode, every parameter loaded: the flavor's structure with
// the checkpoint's vocabulary and, from an HF folder's config.json, its rope_theta,
// rope_scaling and rms_norm_eps. max_seq_len: the RoPE table length.
struct InferenceModel {
  std::string name, flavor;
  int64_t vocab_size = 0, max_seq_len = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;                     // tokens [B, T] -> logits
  std::function<at::Tensor(const at::Tensor&, KVCache&)> forward_cached;    // DecoderImpl::forward_cached
  std::function<KVCache(int64_t batch, int64_t capacity)> new_cache;        // float32
};
InferenceModel load_inference_model(const ModelTensors& m, int64_t max_seq_len);

}  // namespace ctitan
