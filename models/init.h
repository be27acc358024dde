// Parameter initialisers missing from LibTorch 1.13's C++ API, with PyTorch's semantics.
#pragma once
#include <torch/torch.h>

namespace ctitan {

// In place, like torch.nn.init.trunc_normal_: values from N(mean, std^2) restricted to
// [a, b]. NOTE: a and b are absolute bounds, not multiples of std (PyTorch's defaults
// -2, 2 therefore truncate nothing when std = 0.02).
// Inverse-CDF method, same op sequence as PyTorch: uniform_ on [2 cdf(a') - 1, 2 cdf(b') - 1]
// from the default generator, erfinv_, scale by std*sqrt(2), shift by mean, clamp to [a, b].
// Deterministic given torch::manual_seed; consumes the generator exactly like PyTorch.
void trunc_normal_(const torch::Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0, double b = 2.0);

// In place N(mean, std^2) from the default generator (torch.nn.init.normal_).
void normal_(const torch::Tensor& t, double mean = 0.0, double std = 1.0);

// Parameters created while a DeferredParameters scope is alive on this thread have their
// shape and dtype but no storage (0 bytes): a model of any size can be built this way, then
// sharded, and each unit given storage and initialised in turn (FSDP's per-unit
// initialisation, parallelisms/fsdp.h). Outside the scope new_parameter is torch::empty.
class DeferredParameters {
 public:
  DeferredParameters();
  ~DeferredParameters();
  DeferredParameters(const DeferredParameters&) = delete;
  DeferredParameters& operator=(const DeferredParameters&) = delete;
  static bool active();

 private:
  bool previous_;
};

// float32 [shape], uninitialised; storage-less inside a DeferredParameters scope.
torch::Tensor new_parameter(at::IntArrayRef shape);

}  // namespace ctitan
