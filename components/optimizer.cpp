#include "components/optimizer.h"

#include <torch/torch.h>

#include "config/errors.h"

namespace ctitan {

std::unique_ptr<torch::optim::Optimizer> build_optimizer(std::vector<torch::Tensor> params,
                                                         const OptimizerSpec& s) {
  if (s.name == "AdamW") {
    auto o = torch::optim::AdamWOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(
        s.weight_decay);
    return std::make_unique<torch::optim::AdamW>(std::move(params), o);
  }
  if (s.name == "Adam") {
    auto o = torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(
        s.weight_decay);
    return std::make_unique<torch::optim::Adam>(std::move(params), o);
  }
  throw UserError("config error: optimizer.name = \"" + s.name + "\" is not one of: AdamW, Adam");
}

void set_learning_rate(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

TrainingStateBytes training_state_bytes(torch::optim::Optimizer& opt) {
  TrainingStateBytes b;
  auto bytes = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; };
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      b.params += bytes(p);
      b.grads += bytes(p.grad());
    }
  for (auto& kv : opt.state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(kv.second.get())) {
      b.optimizer += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) + bytes(s->max_exp_avg_sq());
    } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(kv.second.get())) {
      b.optimizer += bytes(a->exp_avg()) + bytes(a->exp_avg_sq()) + bytes(a->max_exp_avg_sq());
    }
  }
  return b;
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const std::function<double(double)>& all_reduce_sum) {
  torch::NoGradGuard no_grad;
  // Sum of squares in fp64 so the norm does not depend on how the sum is split (shards).
  auto total = torch::zeros({}, torch::kFloat64);
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (g.defined()) total += g.to(torch::kFloat64).pow(2).sum();
  }
  double sq = total.item<double>();
  if (all_reduce_sum) sq = all_reduce_sum(sq);
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && std::isfinite(norm)) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (const auto& p : params)
        if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

}  // namespace ctitan
