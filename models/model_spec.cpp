#include "models/model_spec.h"

#include "models/decoder.h"

namespace ctitan {

ModelSizes decoder_sizes(const DecoderArgs& a, int64_t ffn, int64_t total_params, int64_t embedding_params,
                         double flops_per_token) {
  ModelSizes s;
  s.vocab_size = a.vocab_size;
  s.dim = a.dim;
  s.n_layers = a.n_layers;
  s.head_dim = a.head_dim();
  s.kv_dim = a.kv_heads() * a.head_dim();
  s.ffn = ffn;
  s.n_heads = a.n_heads;
  s.n_kv_heads = a.kv_heads();
  s.ffn_hidden = ffn;  // dense: the width one token goes through is the whole FFN's
  s.total_params = total_params;
  s.embedding_params = embedding_params;
  s.flops_per_token = flops_per_token;
  return s;
}

TrainModel decoder_train_model(const std::shared_ptr<DecoderImpl>& model, ModelInit init, const ModelSizes& sizes) {
  if (init == ModelInit::Full) model->init_weights();
  model->train();
  TrainModel m;
  m.init_unit = [model](size_t i) { model->init_unit(i); };
  m.module = model;
  m.forward = [model](const torch::Tensor& t) { return model->forward(t); };
  m.units = [model] { return model->units(); };
  m.set_unit_wrapper = [model](UnitWrapper w) { model->set_unit_wrapper(std::move(w)); };
  m.tp_plan = [model] { return model->tp_plan(); };
  m.n_layers = model->n_layers();
  m.total_params = sizes.total_params;
  m.embedding_params = sizes.embedding_params;
  m.flops_per_token = sizes.flops_per_token;
  return m;
}

InferenceNet decoder_inference_net(const std::shared_ptr<DecoderImpl>& model) {
  InferenceNet n;
  n.module = model;
  n.forward = [model](const torch::Tensor& x) { return model->forward(x); };
  n.forward_cached = [model](const torch::Tensor& x, KVCache& c) { return model->forward_cached(x, c); };
  n.new_cache = [model](int64_t b, int64_t cap) { return model->new_cache(b, cap, torch::kFloat); };
  return n;
}

}  // namespace ctitan
