#include "tools/inference_model.h"

#include "models/registry.h"

namespace ctitan {

InferenceModel load_inference_model(const ModelTensors& m, int64_t max_seq_len) {
  InferenceModel im;
  im.name = m.model_name;
  im.flavor = m.flavor;
  im.vocab_size = m.vocab_size();
  im.max_seq_len = max_seq_len;
  const InferenceNet net =
      model_spec(m.model_name)
          .build_inference(m.flavor, im.vocab_size, max_seq_len, m.hf_config ? &*m.hf_config : nullptr);
  im.module = net.module;
  im.forward = net.forward;
  im.forward_cached = net.forward_cached;
  im.new_cache = net.new_cache;
  im.module->eval();
  torch::NoGradGuard no_grad;
  for (auto& kv : im.module->named_parameters()) kv.value().copy_(m.read(kv.key()));
  return im;
}

}  // namespace ctitan
