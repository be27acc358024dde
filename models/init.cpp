#include "models/init.h"

#include <cmath>

namespace ctitan {

namespace {
// Standard normal CDF.
double norm_cdf(double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); }
}  // namespace

void trunc_normal_(const torch::Tensor& t, double mean, double std, double a, double b) {
  TORCH_CHECK(std > 0, "[models] trunc_normal_: std must be positive, got ", std);
  TORCH_CHECK(a < b, "[models] trunc_normal_: need a < b, got a=", a, " b=", b);
  torch::NoGradGuard no_grad;
  const double lo = norm_cdf((a - mean) / std);
  const double hi = norm_cdf((b - mean) / std);
  // u ~ U[2lo-1, 2hi-1]; erfinv(u) * sqrt(2) is a standard normal restricted to the bounds.
  t.uniform_(2.0 * lo - 1.0, 2.0 * hi - 1.0);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0));
  t.add_(mean);
  t.clamp_(a, b);  // erfinv(+-1) = +-inf and rounding can step past the bounds
}

void normal_(const torch::Tensor& t, double mean, double std) {
  torch::NoGradGuard no_grad;
  t.normal_(mean, std);
}

namespace {
thread_local bool deferred_parameters = false;
}  // namespace

DeferredParameters::DeferredParameters() : previous_(deferred_parameters) { deferred_parameters = true; }
DeferredParameters::~DeferredParameters() { deferred_parameters = previous_; }
bool DeferredParameters::active() { return deferred_parameters; }

torch::Tensor new_parameter(at::IntArrayRef shape) {
  if (!deferred_parameters) return torch::empty(shape);
  // A CPU tensor of that shape over an empty storage: no bytes until someone resizes the
  // storage (FSDP does, one unit at a time). Reading it before that is a bug.
  auto t = torch::empty({0});
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

}  // namespace ctitan
