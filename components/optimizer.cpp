#include "components/optimizer.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "config/errors.h"
#include "kernels/device_route.h"
#include "kernels/fused_cuda.h"
#include "kernels/kernel_math.h"

namespace ctitan {

namespace {

// Elements per work item of the fused loops: fixed (not derived from the thread count), so
// reductions add the same partial sums in the same order whatever the threads.
constexpr int64_t kChunk = 1 << 16;

struct AdamWCoefs {
  float decay, b1, b2, c1, c2, sqrt_bc2, eps, step_size;
  float grad_coef;  // the clip's factor, read with each gradient (1: none; g · 1 is g, bitwise)
};

// One AdamW update of elements [begin, end) (formula above the class below). Grad: float, or
// c10::BFloat16 (FSDP over one rank keeps the compute dtype's gradient; widening it is exact,
// so the update is bitwise the one from its float32 cast).
template <class Grad>
CTITAN_KERNEL void adamw_range(float* P, const Grad* G, float* M, float* V, AdamWCoefs k, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = static_cast<float>(G[i]) * k.grad_coef;
    const float pi = P[i] * k.decay;
    const float mi = M[i] * k.b1 + gi * k.c1;
    const float vi = V[i] * k.b2 + gi * gi * k.c2;
    M[i] = mi;
    V[i] = vi;
    P[i] = pi - k.step_size * (mi / (std::sqrt(vi) / k.sqrt_bc2 + k.eps));
  }
}

// f(gradient) for every defined gradient of opt's parameters.
template <class F>
void for_each_gradient(torch::optim::Optimizer& opt, F f) {
  torch::NoGradGuard no_grad;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined()) f(p.mutable_grad());
}

// Every gradient of opt's parameters divided by the 0-d `scale` (where the gradients are).
void divide_gradients(torch::optim::Optimizer& opt, const torch::Tensor& scale) {
  for_each_gradient(opt, [&](torch::Tensor& g) { g.div_(scale.to(g.device())); });
}

// torch::optim::AdamW's update in one pass over (param, grad, exp_avg, exp_avg_sq) instead
// of ~ten: same state objects and keys (checkpoints cannot tell them apart), same formula
// in the same order of operations, float32 arithmetic per element:
//   p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²;
//   p ← p − (lr / bc1) · m / (√v / √bc2 + eps),  bc_i = 1 − β_i^step.
// The eleven-pass version reads and writes 33M-parameter state ~14 times per step; on a
// memory-bound CPU that is a measurable share of a step.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(closure == nullptr, "[optimizer] FusedAdamW takes no closure");
    step_unless(torch::Tensor());
    return {};
  }

  // The step, skipped when `skip` (a bool 0-d tensor on the parameters' device, or undefined:
  // never) is true. On the CPU `skip` is host memory, read here; on a GPU torch's fused kernel
  // takes it as its found_inf and skips on the device, so the host never waits for it.
  // grad_scale (a float32 0-d tensor, or undefined): the gradients are divided by it first; on
  // a GPU inside torch's fused kernel (its grad_scale, made for AMP's unscaling), saving a
  // separate pass over them. cpu_grad_coef: CPU gradients are multiplied by it as the update
  // reads them (the clip, without a pass of its own; the gradients themselves stay as they are).
  void step_unless(const torch::Tensor& skip, const torch::Tensor& grad_scale = {}, double cpu_grad_coef = 1.0) {
    RECORD_FUNCTION("ctitan::fused_adamw_step", std::vector<c10::IValue>());
    torch::NoGradGuard no_grad;
    const bool cpu_skip = skip.defined() && !on_gpu(skip) && skip.item<bool>();
    if (grad_scale.defined() && !on_gpu(grad_scale) && !cpu_skip) divide_gradients(*this, grad_scale);
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      TORCH_CHECK(!o.amsgrad(), "[optimizer] FusedAdamW does not implement amsgrad");
      if (!group.params().empty() && on_gpu(group.params().front())) {
        step_on_gpu(group, o, skip, grad_scale);
        continue;
      }
      if (cpu_skip) continue;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto gt = p.grad().scalar_type();
        TORCH_CHECK(p.scalar_type() == torch::kFloat && p.is_contiguous() && p.grad().is_contiguous() &&
                        (gt == torch::kFloat || gt == torch::kBFloat16),
                    "[optimizer] FusedAdamW needs contiguous float32 parameters and float32 or bfloat16 gradients");
        auto& st = state_for(p);
        st.step(st.step() + 1);
        update(p, p.grad(), st.exp_avg(), st.exp_avg_sq(), o, st.step(), cpu_grad_coef);
      }
    }
  }

  // training.cuda_graphs: GPU steps read the learning rate from `lr` (a float64 0-d tensor on the
  // parameters' device that the caller fills before each step) with ctitan's AdamW kernel, so a
  // captured step replays with each step's rate. Undefined: the rate is passed by value.
  void read_lr_from(torch::Tensor lr) { lr_on_device_ = std::move(lr); }

  // A replayed CUDA graph of a step ran the device step counts on by one without this object's
  // host code: the host counts (what checkpoints store) follow, as step_on_gpu raises them (for
  // the parameters with a gradient, the ones the captured step updates).
  void note_replayed_step() { move_host_steps(+1, /*with_grads_only=*/true); }

  // `n` steps the GPU kernel skipped (found when the caller read the flags back): their host
  // step counts, raised by step_unless, go back down. CPU steps were skipped on the host.
  void note_skipped_on_gpu(int64_t n) { move_host_steps(-n, /*with_grads_only=*/false); }

 private:
  // Parameters on a GPU: torch's fused AdamW (one multi-tensor kernel over the group; its
  // formula is the one above), with the same state objects and step counts as on the CPU.
  // Each parameter's step count also lives on the device (the kernel's bias correction reads
  // it there): raised by one before the kernel, lowered by `skip` after it, so a skipped step
  // does not count, as on the CPU. The host count (what checkpoints store) is raised here and
  // lowered by note_skipped_on_gpu once the caller knows; a host count that differs from the
  // device copy's (a checkpoint was loaded) makes the device copy anew.
  void step_on_gpu(torch::optim::OptimizerParamGroup& group, const torch::optim::AdamWOptions& o,
                   const torch::Tensor& skip, const torch::Tensor& grad_scale) {
    std::vector<torch::Tensor> ps, gs, ms, vs, steps;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& st = state_for(p);
      DeviceStep& d = gpu_steps_[p.unsafeGetTensorImpl()];
      if (!d.count.defined() || d.host_step != st.step())
        d.count = torch::full({}, static_cast<double>(st.step()), p.options().dtype(torch::kFloat));
      st.step(st.step() + 1);
      d.host_step = st.step();
      ps.push_back(p);
      gs.push_back(p.grad());
      ms.push_back(st.exp_avg());
      vs.push_back(st.exp_avg_sq());
      steps.push_back(d.count);
    }
    if (ps.empty()) return;
    at::_foreach_add_(steps, 1.0);
    const std::optional<at::Tensor> found_inf =
        skip.defined() ? std::optional<at::Tensor>(skip.to(torch::kFloat)) : std::nullopt;
    const std::optional<at::Tensor> scale = grad_scale.defined() ? std::optional<at::Tensor>(grad_scale) : std::nullopt;
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
#ifdef CTITAN_WITH_CUDA
    // ctitan's AdamW kernel (the CPU's formula, kernels/fused_cuda.h): with CTITAN_GPU_KERNELS=ctitan,
    // for bf16 gradients (FSDP over one rank keeps them then), which torch's kernel does not take,
    // and for a rate read on the device (training.cuda_graphs; torch's kernel reads a float32 one).
    const bool bf16_grads =
        std::any_of(gs.begin(), gs.end(), [](const at::Tensor& g) { return g.scalar_type() != torch::kFloat; });
    if (own_gpu_kernels() || bf16_grads || lr_on_device_.defined()) {
      adamw_cuda(ps, gs, ms, vs, /*param_copies=*/{}, steps, o.lr(), b1, b2, o.eps(), o.weight_decay(), scale,
                 found_inf, lr_on_device_.defined() ? std::optional<at::Tensor>(lr_on_device_) : std::nullopt);
    } else
#endif
      at::_fused_adamw_(ps, gs, ms, vs, {}, steps, o.lr(), b1, b2, o.weight_decay(), o.eps(), /*amsgrad=*/false,
                        /*maximize=*/false, scale, found_inf);
    if (found_inf) at::_foreach_sub_(steps, std::vector<at::Tensor>(steps.size(), *found_inf));
  }

  struct DeviceStep {
    torch::Tensor count;    // float32 0-d on the parameter's device
    int64_t host_step = 0;  // the host count it was last in step with
  };
  std::unordered_map<void*, DeviceStep> gpu_steps_;
  torch::Tensor lr_on_device_;  // read_lr_from's

  // The host step count of each GPU parameter that has a device count moved by `by`, and the
  // device count's record of it kept in step (so step_on_gpu does not make the count anew).
  void move_host_steps(int64_t by, bool with_grads_only) {
    for (auto& group : param_groups_)
      for (auto& p : group.params()) {
        auto it = gpu_steps_.find(p.unsafeGetTensorImpl());
        if (!on_gpu(p) || it == gpu_steps_.end() || (with_grads_only && !p.grad().defined())) continue;
        auto& st = state_for(p);
        st.step(st.step() + by);
        it->second.host_step = st.step();
      }
  }

  torch::optim::AdamWParamState& state_for(const torch::Tensor& p) {
    void* const key = p.unsafeGetTensorImpl();  // the key LibTorch files state under
    auto it = state_.find(key);
    if (it == state_.end()) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(0);
      s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      it = state_.emplace(key, std::move(s)).first;
    }
    return static_cast<torch::optim::AdamWParamState&>(*it->second);
  }

  static void update(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
                     const torch::optim::AdamWOptions& o, int64_t step, double grad_coef) {
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    const float decay = static_cast<float>(1.0 - o.lr() * o.weight_decay());
    const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
    const float c1 = static_cast<float>(1.0 - b1), c2 = static_cast<float>(1.0 - b2);
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
    const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
    const float eps = static_cast<float>(o.eps());
    const float step_size = static_cast<float>(o.lr() / bc1);
    float* P = p.data_ptr<float>();
    float* M = m.data_ptr<float>();
    float* V = v.data_ptr<float>();
    // float(grad_coef), as ATen's mul_(double) on a float32 tensor rounds it: the same bits as
    // clipping the gradient in place before the update.
    const AdamWCoefs k{decay, fb1, fb2, c1, c2, sqrt_bc2, eps, step_size, static_cast<float>(grad_coef)};
    auto over = [&](const auto* G) {
      at::parallel_for(0, p.numel(), kChunk, [&](int64_t b, int64_t e) { adamw_range(P, G, M, V, k, b, e); });
    };
    if (g.scalar_type() == torch::kBFloat16)
      over(g.data_ptr<c10::BFloat16>());
    else
      over(g.data_ptr<float>());
  }
};

// Σ x² of x[begin, end) in float64, in 8 lanes (a single chain waits on every add). X: float or
// c10::BFloat16 (widened exactly: a bf16 gradient's sum is bitwise its float32 cast's).
template <class X>
CTITAN_KERNEL double sum_of_squares_range(const X* x, int64_t begin, int64_t end) {
  return kernel::lane_sum<double>(end - begin, [&](int64_t i) {
    const double v = static_cast<float>(x[begin + i]);
    return v * v;
  });
}

// Σ x² of x[0, n) in float64, one pass: fixed-size chunks summed in index order.
template <class X>
double sum_of_squares_of(const X* x, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      partial[k] = sum_of_squares_range(x, k * kChunk, std::min(n, (k + 1) * kChunk));
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

// Σ x² of a float32 or bf16 tensor in float64 (the same sum for a bf16 tensor and its float32
// cast); other dtypes through a float64 copy.
double sum_of_squares(const torch::Tensor& t) {
  const auto c = t.contiguous();
  if (c.scalar_type() == torch::kFloat) return sum_of_squares_of(c.data_ptr<float>(), c.numel());
  if (c.scalar_type() == torch::kBFloat16) return sum_of_squares_of(c.data_ptr<c10::BFloat16>(), c.numel());
  return c.to(torch::kFloat64).pow(2).sum().item<double>();
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> build_optimizer(std::vector<torch::Tensor> params, const OptimizerSpec& s) {
  if (s.name == "AdamW") {
    auto o = torch::optim::AdamWOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay);
    return std::make_unique<FusedAdamW>(std::move(params), o);
  }
  if (s.name == "Adam") {
    auto o = torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay);
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

namespace {

// clip_grad_norm_tensor and grad_norm_for_step: with `apply` false the gradients are left as
// they are and the clip is returned instead: the factor to divide GPU gradients by, or the one
// to multiply CPU gradients by (as the fused AdamW reads them).
GradNorm grad_norm_impl(const std::vector<torch::Tensor>& params, double max_norm, const SumOverRanks& all_reduce_sum,
                        bool apply, const std::vector<torch::Tensor>& counted_elsewhere = {}) {
  RECORD_FUNCTION("ctitan::clip_grad_norm", std::vector<c10::IValue>());
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> skip;
  for (const auto& p : counted_elsewhere) skip.insert(p.unsafeGetTensorImpl());
  // Sum of squares in fp64 so the norm does not depend on how the sum is split (shards).
  double sq = 0.0;
  // GPU gradients: each tensor's norm where it is (no float64 copy of a gradient on the device;
  // one multi-tensor kernel for all of them), squared and summed in float64 on the device.
  std::vector<torch::Tensor> gpu_grads, gpu_counted;
  for (const auto& p : params)
    if (p.grad().defined()) {
      const bool counted = skip.count(p.unsafeGetTensorImpl()) == 0;
      if (on_gpu(p.grad())) {
        gpu_grads.push_back(p.grad());
        if (counted) gpu_counted.push_back(p.grad());
      } else if (counted) {
        sq += sum_of_squares(p.grad());
      }
    }
  if (gpu_grads.empty()) {  // the CPU: the sum is host memory already
    if (all_reduce_sum) {
      auto t = torch::tensor({sq}, torch::kFloat64);
      all_reduce_sum(t);
      sq = t.item<double>();
    }
    const double norm = std::sqrt(sq);
    GradNorm out{torch::tensor(norm, torch::kFloat64), torch::Tensor()};
    if (max_norm > 0 && std::isfinite(norm)) {
      const double coef = max_norm / (norm + 1e-6);
      if (coef < 1.0 && !apply) {
        out.cpu_grad_coef = coef;  // applied inside the optimizer's pass
      } else if (coef < 1.0) {
        for (const auto& p : params)
          if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
    return out;
  }
  // Norms of bf16 gradients (FSDP over one rank keeps them) are taken in float32, not rounded to bf16.
  const bool all_float = std::all_of(gpu_counted.begin(), gpu_counted.end(),
                                     [](const torch::Tensor& g) { return g.scalar_type() == torch::kFloat; });
  const std::optional<at::ScalarType> norm_dtype = all_float ? std::nullopt : std::optional(at::kFloat);
  auto sq_dev =
      gpu_counted.empty()
          ? torch::zeros({1}, gpu_grads[0].options().dtype(torch::kFloat64))
          : at::stack(at::_foreach_norm(gpu_counted, 2, norm_dtype)).to(torch::kFloat64).square().sum().view({1});
  if (sq != 0.0) sq_dev.add_(sq);  // CPU gradients beside GPU ones
  // The other shards' squares, added on the device (NCCL; nothing is read back here).
  if (all_reduce_sum) all_reduce_sum(sq_dev);
  GradNorm out{sq_dev.view({}).sqrt(), torch::Tensor()};
  if (max_norm > 0) {
    // Decided on the device: the gradients shrink by max_norm / (norm + 1e-6) when that is below
    // 1 and the norm is finite, else stay (x · 1 = x).
    const auto& norm = out.norm;
    const auto finite = norm.isfinite();
    if (apply) {
      const auto coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
      at::_foreach_mul_(gpu_grads, at::where(finite, coef, at::ones_like(coef)).to(torch::kFloat));
    } else {
      const auto scale = ((norm + 1e-6) / max_norm).clamp_min(1.0);
      out.grad_scale = at::where(finite, scale, at::ones_like(scale)).to(torch::kFloat);
    }
  }
  return out;
}

}  // namespace

torch::Tensor clip_grad_norm_tensor(const std::vector<torch::Tensor>& params, double max_norm,
                                    const SumOverRanks& all_reduce_sum) {
  return grad_norm_impl(params, max_norm, all_reduce_sum, /*apply=*/true).norm;
}

GradNorm grad_norm_for_step(const std::vector<torch::Tensor>& params, double max_norm,
                            const SumOverRanks& all_reduce_sum, const std::vector<torch::Tensor>& counted_elsewhere) {
  return grad_norm_impl(params, max_norm, all_reduce_sum, /*apply=*/false, counted_elsewhere);
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm, const SumOverRanks& all_reduce_sum) {
  return read_to_host(clip_grad_norm_tensor(params, max_norm, all_reduce_sum)).item<double>();
}

void step_unless(torch::optim::Optimizer& opt, const torch::Tensor& skip, const torch::Tensor& grad_scale,
                 double cpu_grad_coef) {
  if (auto* fused = dynamic_cast<FusedAdamW*>(&opt)) return fused->step_unless(skip, grad_scale, cpu_grad_coef);
  // torch::optim's other optimizers decide on the host: one read of the flag.
  if (skip.defined() && read_to_host(skip).item<bool>()) return;
  if (grad_scale.defined()) divide_gradients(opt, grad_scale);
  if (cpu_grad_coef != 1.0)
    for_each_gradient(opt, [&](torch::Tensor& g) {
      if (!on_gpu(g)) g.mul_(cpu_grad_coef);
    });
  opt.step();
}

void note_skipped_steps(torch::optim::Optimizer& opt, int64_t n) {
  if (auto* fused = dynamic_cast<FusedAdamW*>(&opt)) fused->note_skipped_on_gpu(n);
}

bool read_lr_from_device(torch::optim::Optimizer& opt, const torch::Tensor& lr) {
  auto* fused = dynamic_cast<FusedAdamW*>(&opt);
  if (fused) fused->read_lr_from(lr);
  return fused != nullptr;
}

void note_replayed_step(torch::optim::Optimizer& opt) {
  if (auto* fused = dynamic_cast<FusedAdamW*>(&opt)) fused->note_replayed_step();
}

}  // namespace ctitan
