// A model's tensors under ctitan's names, whichever checkpoint form holds them (a ctitan or
// DCP step folder, a Hugging Face folder, a consolidated .pt): what checkpoint_tool's convert
// and logits and `generate` read (the model built from them: tools/inference_model.h).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <ATen/Tensor.h>

#include "checkpoint/hf.h"

namespace ctitan {

struct ModelTensors {
  std::string form;  // sharded | hf | consolidated
  std::string model_name, flavor;
  int64_t step = 0;
  ParamList params;                                         // ctitan names and global shapes, model order
  std::string dtype;                                        // dtype of tok_embeddings.weight as stored
  std::function<at::Tensor(const std::string&)> read;       // full tensor, stored dtype
  std::function<std::string(const std::string&)> dtype_of;  // that stored dtype, without reading
  std::optional<HFModelConfig> hf_config;                   // the source's own config.json (hf form)

  int64_t vocab_size() const;
};

// Opens `path` in whichever form it is. name / flavor: for sources that do not record them
// ("" = inferred from the tensor shapes, by the registered families of `families`). UserError for a missing path or an unknown form.
ModelTensors open_model(const std::string& path, const std::string& name, const std::string& flavor,
                        const HFAdapter& families);

}  // namespace ctitan
