#include "models/model_spec.h"

#include "models/decoder.h"

namespace ctitan {

TrainModel decoder_train_model(const std::shared_ptr<DecoderImpl>& model, ModelInit init) {
  if (init == ModelInit::Full) model->init_weights();
  model->train();
  TrainModel m;
  m.init_unit = [model](size_t i) { model->init_unit(i); };
  m.module = model;
  m.forward = [model](const torch::Tensor& t) { return model->forward(t); };
  m.units = [model] { return model->units(); };
  m.set_unit_wrapper = [model](UnitWrapper w) { model->set_unit_wrapper(std::move(w)); };
  m.n_layers = model->n_layers();
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
