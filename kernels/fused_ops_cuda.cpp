// CUDA build: the autograd functions over ctitan's own CUDA kernels (kernels/fused_cuda.h).
// The CPU build compiles this file as well, with CTITAN_CUDA_ON_HOST, into the library that
// runs the kernels on the CPU under tests/cuda_host/'s model of CUDA (cmake/cuda_on_host.cmake):
// there the tensors are CPU tensors, there is no device to guard and no stream, and the rest of
// the file is the same code the GPU runs.
#include <torch/torch.h>
#include <ATen/record_function.h>
#ifdef CTITAN_CUDA_ON_HOST
#include <cuda_runtime.h>  // tests/cuda_host's
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <stdexcept>
#include <string>

#include "kernels/fused_cuda.h"
#include "util/env.h"

namespace ctitan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#ifdef CTITAN_CUDA_ON_HOST
struct DeviceGuard {
  explicit DeviceGuard(at::Device) {}
};
bool on_kernel_device(const at::Tensor& t) { return t.is_cpu(); }
void* stream_of(const at::Tensor&) { return nullptr; }
#else
using DeviceGuard = c10::cuda::CUDAGuard;
bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
// The current stream of t's device: the kernels queue where ATen's ops would.
void* stream_of(const at::Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

gpu::Elem elem_of(const at::Tensor& t) {
  TORCH_CHECK(on_kernel_device(t) && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "[kernels] ctitan's CUDA kernels take float32 or bfloat16 tensors on a GPU, got ", t.scalar_type(),
              " on ", t.device());
  return t.scalar_type() == at::kBFloat16 ? gpu::Elem::BFloat16 : gpu::Elem::Float32;
}

void launched(int rc, const char* what) {
  TORCH_CHECK(rc == 0, "[kernels] ", what,
              ": CUDA kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

class SwiGLUCudaFn : public torch::autograd::Function<SwiGLUCudaFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a_in, const at::Tensor& b_in) {
    RECORD_FUNCTION("ctitan::swiglu_forward_cuda", std::vector<c10::IValue>());
    const DeviceGuard device_guard(a_in.device());
    const auto a = a_in.contiguous(), b = b_in.contiguous();
    auto y = at::empty_like(a);
    launched(gpu::swiglu_forward(elem_of(a), a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel(), stream_of(a)),
             "swiglu forward");
    ctx->save_for_backward({a, b});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("ctitan::swiglu_backward_cuda", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const DeviceGuard device_guard(a.device());
    const auto dy = grads[0].to(a.scalar_type()).contiguous();
    auto da = at::empty_like(a), db = at::empty_like(b);
    launched(gpu::swiglu_backward(elem_of(a), a.data_ptr(), b.data_ptr(), dy.data_ptr(), da.data_ptr(), db.data_ptr(),
                                  a.numel(), stream_of(a)),
             "swiglu backward");
    return {da, db};
  }
};

// RoPE: the rotation forward, the conjugate rotation of the incoming gradient backward; only
// the table is saved.
class RotaryCudaFn : public torch::autograd::Function<RotaryCudaFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& freqs_cis) {
    RECORD_FUNCTION("ctitan::rotary_emb_forward_cuda", std::vector<c10::IValue>());
    const DeviceGuard device_guard(x_in.device());
    TORCH_CHECK(x_in.dim() == 4 && x_in.size(3) % 2 == 0 && freqs_cis.size(0) >= x_in.size(1),
                "[kernels] rotary_emb_cuda: x ", x_in.sizes(), " and freqs_cis ", freqs_cis.sizes(), " do not match");
    const auto x = x_in.contiguous();
    const auto f = freqs_cis.narrow(0, 0, x.size(1)).to(x.device(), at::kFloat).contiguous();
    auto y = at::empty_like(x);
    launch(x, f, y, /*conjugate=*/false);
    ctx->save_for_backward({f});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("ctitan::rotary_emb_backward_cuda", std::vector<c10::IValue>());
    const auto f = ctx->get_saved_variables()[0];
    const DeviceGuard device_guard(f.device());
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const auto dy = grads[0].to(dtype).contiguous();
    auto dx = at::empty_like(dy);
    launch(dy, f, dx, /*conjugate=*/true);
    return {dx, at::Tensor()};
  }

 private:
  static void launch(const at::Tensor& x, const at::Tensor& f, at::Tensor& y, bool conjugate) {
    const int64_t heads = x.size(2), hd = x.size(3);
    launched(gpu::rope(elem_of(x), conjugate, x.data_ptr(), f.data_ptr<float>(), y.data_ptr(), x.numel() / hd, hd,
                       heads, x.size(1), stream_of(x)),
             conjugate ? "rotary embedding backward" : "rotary embedding forward");
  }
};

// The loss: Σ rows (lse − x[label]) in float64 on the device, times scale, as float32. The
// backward reads the upstream gradient on the device (no host read).
class CrossEntropyCudaFn : public torch::autograd::Function<CrossEntropyCudaFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_in, const at::Tensor& labels_in,
                            double scale) {
    RECORD_FUNCTION("ctitan::cross_entropy_forward_cuda", std::vector<c10::IValue>());
    const DeviceGuard device_guard(logits_in.device());
    const auto logits = logits_in.contiguous();
    const auto labels = labels_in.to(logits.device(), at::kLong).contiguous();
    const int64_t N = logits.size(0), V = logits.size(1);
    const auto f32 = logits.options().dtype(at::kFloat);
    auto lse = at::empty({N}, f32), row_loss = at::empty({N}, f32);
    launched(gpu::cross_entropy_forward(elem_of(logits), logits.data_ptr(), labels.data_ptr<int64_t>(), N, V,
                                        lse.data_ptr<float>(), row_loss.data_ptr<float>(), stream_of(logits)),
             "cross-entropy forward");
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["scale"] = scale;
    return (row_loss.sum(at::kDouble) * scale).to(at::kFloat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("ctitan::cross_entropy_backward_cuda", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2];
    const DeviceGuard device_guard(logits.device());
    const auto coef = (grads[0].to(logits.device(), at::kFloat) * ctx->saved_data["scale"].toDouble()).contiguous();
    auto dx = at::empty_like(logits);
    launched(gpu::cross_entropy_backward(elem_of(logits), logits.data_ptr(), labels.data_ptr<int64_t>(),
                                         lse.data_ptr<float>(), coef.data_ptr<float>(), logits.size(0), logits.size(1),
                                         dx.data_ptr(), stream_of(logits)),
             "cross-entropy backward");
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool own_gpu_kernels() {
  static const bool on = [] {
    const std::string& want = runtime_env().gpu_kernels;
    if (!want.empty() && want != "aten" && want != "ctitan")
      throw std::runtime_error("CTITAN_GPU_KERNELS=" + want + " is not one of: aten, ctitan");
    return want == "ctitan";
  }();
  return on;
}

bool own_gpu_kernel_for(const at::Tensor& t) {
  return own_gpu_kernels() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

at::Tensor swiglu_cuda(const at::Tensor& a, const at::Tensor& b) { return SwiGLUCudaFn::apply(a, b); }

at::Tensor rotary_emb_cuda(const at::Tensor& x, const at::Tensor& freqs_cis) {
  return RotaryCudaFn::apply(x, freqs_cis);
}

at::Tensor cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& labels, double scale) {
  return CrossEntropyCudaFn::apply(logits, labels, scale);
}

void adamw_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& param_copies, const std::vector<at::Tensor>& steps, double lr,
                double beta1, double beta2, double eps, double weight_decay,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& lr_on_device) {
  RECORD_FUNCTION("ctitan::adamw_cuda", std::vector<c10::IValue>());
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (param_copies.empty() || param_copies.size() == n),
              "[kernels] adamw_cuda: ", n, " params, ", grads.size(), " grads, ", exp_avgs.size(), " exp_avgs, ",
              exp_avg_sqs.size(), " exp_avg_sqs, ", param_copies.size(), " param_copies (none or one per param), ",
              steps.size(), " steps");
  if (n == 0) return;
  TORCH_CHECK(params[0].defined() && on_kernel_device(params[0]),
              "[kernels] adamw_cuda: the tensors must be on a GPU, got params[0] ",
              params[0].defined() ? params[0].device().str() : std::string("undefined"));
  const at::Device device = params[0].device();
  // t (named `what`): defined, on the parameters' device, one of the dtypes, contiguous.
  auto check = [&](const at::Tensor& t, const std::string& what, at::ScalarType a,
                   std::optional<at::ScalarType> b = std::nullopt) {
    TORCH_CHECK(t.defined(), "[kernels] adamw_cuda: ", what, " is undefined");
    TORCH_CHECK(t.device() == device, "[kernels] adamw_cuda: ", what, " is on ", t.device(), ", the params on ",
                device);
    TORCH_CHECK(t.scalar_type() == a || (b && t.scalar_type() == *b), "[kernels] adamw_cuda: ", what, " is ",
                t.scalar_type(), ", not ", a, b ? std::string(" or ") + c10::toString(*b) : std::string());
    TORCH_CHECK(t.is_contiguous(), "[kernels] adamw_cuda: ", what, " is not contiguous");
  };
  auto check_numel = [](const at::Tensor& t, const std::string& what, int64_t numel, size_t i) {
    TORCH_CHECK(t.numel() == numel, "[kernels] adamw_cuda: ", what, " has ", t.numel(), " elements, params[", i, "] ",
                numel);
  };
  auto check_0d = [&](const at::Tensor& t, const std::string& what) {
    check(t, what, at::kFloat);
    TORCH_CHECK(t.dim() == 0, "[kernels] adamw_cuda: ", what, " must be 0-d, got ", t.sizes());
  };
  auto scalar = [&](const std::optional<at::Tensor>& t, const char* what) -> const float* {
    if (!t) return nullptr;
    check_0d(*t, what);
    return t->data_ptr<float>();
  };
  std::vector<gpu::AdamWTensor> by_dtype[2];  // float32 gradients, bf16 gradients
  for (size_t i = 0; i < n; ++i) {
    const auto name = [i](const char* list) { return std::string(list) + "[" + std::to_string(i) + "]"; };
    const at::Tensor& p = params[i];
    check(p, name("params"), at::kFloat);
    const int64_t numel = p.numel();
    check(grads[i], name("grads"), at::kFloat, at::kBFloat16);
    check_numel(grads[i], name("grads"), numel, i);
    check(exp_avgs[i], name("exp_avgs"), at::kFloat);
    check_numel(exp_avgs[i], name("exp_avgs"), numel, i);
    check(exp_avg_sqs[i], name("exp_avg_sqs"), at::kFloat);
    check_numel(exp_avg_sqs[i], name("exp_avg_sqs"), numel, i);
    check_0d(steps[i], name("steps"));
    void* copy = nullptr;
    if (!param_copies.empty() && param_copies[i].defined()) {
      check(param_copies[i], name("param_copies"), at::kBFloat16);
      check_numel(param_copies[i], name("param_copies"), numel, i);
      copy = param_copies[i].data_ptr();
    }
    const bool bf16 = grads[i].scalar_type() == at::kBFloat16;
    by_dtype[bf16].push_back({p.data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                              exp_avg_sqs[i].data_ptr<float>(), copy, steps[i].data_ptr<float>(), numel});
  }
  const float* scale = scalar(grad_scale, "grad_scale");
  const float* inf = scalar(found_inf, "found_inf");
  const double* lr_ptr = nullptr;
  if (lr_on_device) {
    check(*lr_on_device, "lr_on_device", at::kDouble);
    TORCH_CHECK(lr_on_device->dim() == 0, "[kernels] adamw_cuda: lr_on_device must be 0-d, got ",
                lr_on_device->sizes());
    lr_ptr = lr_on_device->data_ptr<double>();
  }
  const DeviceGuard device_guard(device);
  const gpu::AdamWHyper h{lr, beta1, beta2, eps, weight_decay};
  for (const auto e : {gpu::Elem::Float32, gpu::Elem::BFloat16}) {
    const auto& list = by_dtype[e == gpu::Elem::BFloat16];
    if (list.empty()) continue;
    launched(gpu::adamw(e, list.data(), static_cast<int64_t>(list.size()), h, scale, inf, stream_of(params[0]), lr_ptr),
             "adamw");
  }
}

}  // namespace ctitan
