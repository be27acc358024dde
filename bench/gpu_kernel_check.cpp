// ctitan's own CUDA kernels (kernels/fused_cuda.h) against the ATen route they replace, on one
// GPU: each kernel checked forward and backward, then both routes timed on the shapes of issue
// 33's table. scripts/gpu_check.sh runs it as part (g); CUDA build only.
//   build-gpu/gpu_kernel_check          # exit 0: every check passed; 1: one failed; 2: no GPU
//
// Checks (float32 and bfloat16; small and odd shapes for the one-value paths, a misaligned
// view, the 150M and 8B shapes):
//   SwiGLU against at::silu(a) * b under autograd (y, da, db): every element within one unit in
//     the last place of the dtype (the formulas are ATen's; the line says whether all are
//     bitwise equal);
//   RoPE against a float64 rotation written here (y and dx): every element within 1e-6 of its
//     pair's length (float32 products), plus 2^-8 in bf16; ATen's route measured beside it;
//   the cross-entropy against a float64 reference written here (logsumexp, softmax, one-hot):
//     the loss within 1e-5 relative, each gradient element within 3e-5 relative of it (float32
//     sums), plus 2^-8 in bf16 (its rounding); ATen's route (chunked_cross_entropy) is measured
//     the same way and printed beside it;
//   AdamW (adamw_cuda; float32 and bf16 gradients, 68 tensors of 0 to 2^20 + 3 elements, more than
//     one launch's 48, step counts from 1 to 1000, grad_scale 1.7, bf16 copies) against the
//     float64 evaluation of ctitan's CPU formula (tests/fused_cuda_reference.h: within 14, 4 and
//     6 float32 units of the terms for param, exp_avg and exp_avg_sq), each copy bf16(param)
//     bitwise, and ATen's at::_fused_adamw_ on copies with float32 gradients (the bf16 ones
//     upcast): within 1e-5 of the terms (ATen's float32 bias corrections and fused multiply-adds
//     are the difference); the line also counts the elements that differ from the CPU's float32
//     update (expected none: the same operations, each rounded to nearest). found_inf 1: nothing
//     changes. The learning rate read on the device (lr_on_device, training.cuda_graphs): bitwise
//     the rate passed by value.
// Timings: forward + backward (torch::autograd::grad, nothing accumulated), CUDA events, median
// of 20 after 3 warm-ups, each route in turn; ratio = ATen's time / ctitan's. AdamW: one step
// over the 150M and 8B_8L models' parameter lists, bf16 gradients for ctitan's kernel, float32
// ones for ATen's (timed alone and after the cast from bf16 that today's route makes).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/fused_cuda.h"
#include "kernels/fused_ops.h"
#include "tests/fused_cuda_reference.h"

namespace {

using at::Tensor;
using namespace ctitan::kernel_reference;

int g_checks = 0, g_failed = 0;

void report(bool ok, const std::string& what, const std::string& numbers) {
  ++g_checks;
  if (!ok) ++g_failed;
  std::printf("[gpu_kernel_check] %s %s: %s\n", ok ? "PASS" : "FAIL", what.c_str(), numbers.c_str());
  std::fflush(stdout);
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const char* dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : "fp32"; }

Tensor random_tensor(at::IntArrayRef shape, at::ScalarType t, double scale) {
  return (at::randn(shape, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat)) * scale).to(t);
}

// random_tensor's values as a tensor of its own, or as a view starting one element into its
// storage (misaligned: its data pointer is not 16-byte aligned).
Tensor random_operand(at::IntArrayRef shape, at::ScalarType t, double scale, bool misaligned) {
  const int64_t n = c10::multiply_integers(shape);
  const auto base = random_tensor({n + 1}, t, scale);
  return misaligned ? base.narrow(0, 1, n).view(shape) : base.narrow(0, 0, n).view(shape).clone();
}

// ---- SwiGLU -----------------------------------------------------------------------------
struct Grads {
  Tensor y, da, db;
};

Grads swiglu_run(bool own, const Tensor& a0, const Tensor& b0, const Tensor& gy) {
  const auto a = a0.detach().requires_grad_(true), b = b0.detach().requires_grad_(true);
  const auto y = own ? ctitan::swiglu_cuda(a, b) : at::silu(a) * b;
  const auto g = torch::autograd::grad({y}, {a, b}, {gy});
  return {y.detach(), g[0], g[1]};
}

void check_swiglu(at::IntArrayRef shape, at::ScalarType t, bool misaligned) {
  const auto a = random_operand(shape, t, 3.0, misaligned), b = random_operand(shape, t, 1.0, misaligned),
             gy = random_operand(shape, t, 1.0, misaligned);
  const auto mine = swiglu_run(true, a, b, gy), ref = swiglu_run(false, a, b, gy);
  const double uy = max_ulps(mine.y, ref.y), ua = max_ulps(mine.da, ref.da), ub = max_ulps(mine.db, ref.db);
  const bool bitwise = at::equal(mine.y, ref.y) && at::equal(mine.da, ref.da) && at::equal(mine.db, ref.db);
  char buf[256];
  std::snprintf(buf, sizeof buf, "max ulps y %.2f, da %.2f, db %.2f; bitwise equal to ATen's: %s", uy, ua, ub,
                bitwise ? "yes" : "no");
  report(uy <= 1 && ua <= 1 && ub <= 1,
         std::string("swiglu ") + dtype_name(t) + " " + shape_str(shape) + (misaligned ? " misaligned" : ""), buf);
}

// ---- RoPE -------------------------------------------------------------------------------
Grads rope_run(bool own, const Tensor& x0, const Tensor& table, const Tensor& gy) {
  const auto x = x0.detach().requires_grad_(true);
  const auto y = own ? ctitan::rotary_emb_cuda(x, table) : ctitan::rotary_emb_aten(x, table);
  const auto g = torch::autograd::grad({y}, {x}, {gy});
  return {y.detach(), g[0], Tensor()};
}

void check_rope(at::IntArrayRef shape, at::ScalarType t, bool misaligned) {
  const auto x = random_operand(shape, t, 2.0, misaligned), gy = random_operand(shape, t, 2.0, misaligned);
  const auto table = rope_table(shape[1], shape[3], 3, at::kCUDA);
  const auto mine = rope_run(true, x, table, gy), aten = rope_run(false, x, table, gy);
  const auto y_ref = rope_ref64(x, table, false), dx_ref = rope_ref64(gy, table, true);
  const double ey = max_pair_error(mine.y, y_ref, x), edx = max_pair_error(mine.da, dx_ref, gy);
  const double ay = max_pair_error(aten.y, y_ref, x), adx = max_pair_error(aten.da, dx_ref, gy);
  const double bound = rope_bound(t);
  const bool bitwise = at::equal(mine.y, aten.y) && at::equal(mine.da, aten.da);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "max error / pair length: y %.2e, dx %.2e (ATen's route %.2e, %.2e; bound %.2e); bitwise equal to "
                "ATen's: %s",
                ey, edx, ay, adx, bound, bitwise ? "yes" : "no");
  report(ey <= bound && edx <= bound,
         std::string("rope ") + dtype_name(t) + " " + shape_str(shape) + (misaligned ? " misaligned" : ""), buf);
}

// ---- Cross-entropy ----------------------------------------------------------------------
struct LossRun {
  Tensor loss, dx;
};

LossRun ce_run(bool own, const Tensor& x0, const Tensor& labels, double scale, const Tensor& upstream) {
  const auto x = x0.detach().requires_grad_(true);
  const auto loss =
      own ? ctitan::cross_entropy_cuda(x, labels, scale) : ctitan::chunked_cross_entropy(x, labels, scale);
  const auto g = torch::autograd::grad({loss}, {x}, {upstream});
  return {loss.detach(), g[0]};
}

void check_cross_entropy(int64_t rows, int64_t V, at::ScalarType t) {
  auto x = random_tensor({rows, V}, t, 4.0);
  auto labels = at::randint(V, {rows}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  labels.index_put_({0}, 0);
  if (rows > 1) labels.index_put_({1}, V - 1);
  if (rows > 2 && V > 8) x.index_put_({2, labels[2].item<int64_t>() == 5 ? 6 : 5}, -INFINITY);
  const double scale = 1.0 / static_cast<double>(rows);
  const auto upstream = at::full({}, 0.75, x.options().dtype(at::kFloat));
  const auto mine = ce_run(true, x, labels, scale, upstream), aten = ce_run(false, x, labels, scale, upstream);
  // The float64 reference.
  double dx_mine = 0, dx_aten = 0;
  const double loss_ref =
      cross_entropy_ref64(x, labels, 0.75 * scale,
                          [&](int64_t r, int64_t n, const Tensor&, const Tensor&, const Tensor& ref) {
                            dx_mine = std::max(dx_mine, max_rel(mine.dx.narrow(0, r, n), ref));
                            dx_aten = std::max(dx_aten, max_rel(aten.dx.narrow(0, r, n), ref));
                          }) *
      scale;
  const double l_mine = std::abs(mine.loss.item<double>() - loss_ref) / std::abs(loss_ref);
  const double l_aten = std::abs(aten.loss.item<double>() - loss_ref) / std::abs(loss_ref);
  const double grad_bound = cross_entropy_grad_bound(t);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "loss rel. error %.2e (ATen's route %.2e; bound 1e-5), gradient max rel. error %.2e (ATen's route "
                "%.2e; bound %.2e)",
                l_mine, l_aten, dx_mine, dx_aten, grad_bound);
  report(l_mine <= 1e-5 && dx_mine <= grad_bound,
         std::string("cross-entropy ") + dtype_name(t) + " " + shape_str({rows, V}), buf);
}

// ---- Timing -----------------------------------------------------------------------------
double median_ms(const std::function<void()>& step) {
  for (int i = 0; i < 3; ++i) step();
  std::vector<double> ms;
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (int i = 0; i < 20; ++i) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record(stream);
    step();
    stop.record(stream);
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void time_pair(const std::string& what, const std::function<void()>& aten, const std::function<void()>& own) {
  const double a = median_ms(aten), o = median_ms(own);
  std::printf("[gpu_kernel_check] time %s forward + backward: ATen %.3f ms, ctitan %.3f ms: %.2fx\n", what.c_str(), a,
              o, a / o);
  std::fflush(stdout);
}

// ---- AdamW ------------------------------------------------------------------------------
// ctitan's defaults (OptimizerSpec) with a larger learning rate, as the host test's.
constexpr double kLr = 3e-3, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWd = 0.1;

struct AdamWLists {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, copies, steps;
};

std::vector<Tensor> clones(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const auto& t : list) out.push_back(t.clone());
  return out;
}

// Parameters ~ N(0, 1), gradients ~ N(0, 10^-4) in grad_dtype, exp_avg ~ N(0, 10^-4), exp_avg_sq
// the square of N(0, 10^-4) values; step counts 1 to 50, the fifth tensor's 1000; bf16 copies
// NaN until written (or none).
AdamWLists adamw_lists(const std::vector<int64_t>& sizes, at::ScalarType grad_dtype, bool copies) {
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  AdamWLists s;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    s.params.push_back(random_tensor({n}, at::kFloat, 1.0));
    s.grads.push_back(random_tensor({n}, grad_dtype, 1e-2));
    s.exp_avgs.push_back(random_tensor({n}, at::kFloat, 1e-2));
    s.exp_avg_sqs.push_back(random_tensor({n}, at::kFloat, 1e-2).square());
    s.copies.push_back(copies ? at::full({n}, NAN, f32.dtype(at::kBFloat16)) : Tensor());
    s.steps.push_back(at::full({}, i == 4 ? 1000.0 : 1.0 + static_cast<double>((i * 7) % 50), f32));
  }
  return s;
}

void check_adamw(at::ScalarType grad_dtype) {
  std::vector<int64_t> sizes = {1, 7, 1000, 256, 4096, 4097, 3 * 4096 + 17, (1 << 20) + 3};
  for (int64_t i = 0; i < 60; ++i) sizes.push_back((i * 677) % 4401);
  auto s = adamw_lists(sizes, grad_dtype, true);
  const auto p0 = clones(s.params), m0 = clones(s.exp_avgs), v0 = clones(s.exp_avg_sqs);
  // ATen's fused AdamW on copies, with float32 gradients (the bf16 ones upcast, as today's route
  // casts them; copies: ATen writes the unscaled gradients back).
  auto ap = clones(s.params), am = clones(s.exp_avgs), av = clones(s.exp_avg_sqs);
  std::vector<Tensor> ag;
  for (const auto& g : s.grads) ag.push_back(g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  const float scale_value = 1.7f;
  const auto scale = at::full({}, scale_value, s.steps[0].options());
  ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, s.copies, s.steps, kLr, kBeta1, kBeta2, kEps, kWd,
                     scale, std::nullopt);
  at::_fused_adamw_(ap, ag, am, av, {}, clones(s.steps), kLr, kBeta1, kBeta2, kWd, kEps, /*amsgrad=*/false,
                    /*maximize=*/false, scale, std::nullopt);
  const AdamWBounds bound;
  double ref_err[3] = {0, 0, 0}, aten_diff[3] = {0, 0, 0};
  int64_t differ = 0, elements = 0;
  bool copies_ok = true;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    const auto k = adamw_coefficients(kLr, kBeta1, kBeta2, kEps, kWd, s.steps[i].item<double>());
    const auto ref = adamw_ref64(p0[i], s.grads[i], m0[i], v0[i], k, scale_value);
    const Tensor got[3] = {s.params[i], s.exp_avgs[i], s.exp_avg_sqs[i]}, aten[3] = {ap[i], am[i], av[i]};
    const Tensor want[3] = {ref.param, ref.exp_avg, ref.exp_avg_sq};
    const Tensor terms[3] = {ref.param_scale, ref.exp_avg_scale, ref.exp_avg_sq_scale};
    for (int j = 0; j < 3; ++j) {
      ref_err[j] = std::max(ref_err[j], max_scaled_error(got[j], want[j], terms[j]) / bound.u);
      aten_diff[j] = std::max(aten_diff[j], max_scaled_error(aten[j], got[j].to(at::kDouble), terms[j]));
    }
    copies_ok = copies_ok && at::equal(s.copies[i], s.params[i].to(at::kBFloat16));
    // The CPU's float32 update of the same state.
    auto p = p0[i].cpu(), m = m0[i].cpu(), v = v0[i].cpu();
    adamw_float32(p, s.grads[i].cpu(), m, v, k, scale_value);
    differ += s.params[i].cpu().ne(p).sum().item<int64_t>() + s.exp_avgs[i].cpu().ne(m).sum().item<int64_t>() +
              s.exp_avg_sqs[i].cpu().ne(v).sum().item<int64_t>();
    elements += 3 * sizes[i];
  }
  const double aten_bound = 1e-5;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "max error / terms against float64, in float32 units: param %.2f, exp_avg %.2f, exp_avg_sq %.2f "
                "(bounds %.0f, %.0f, %.0f); against ATen's _fused_adamw_ (float32 gradients): %.2e, %.2e, %.2e "
                "(bound %.0e); copies bf16(param): %s; values differing from the CPU's float32 update: %lld of %lld",
                ref_err[0], ref_err[1], ref_err[2], bound.param / bound.u, bound.exp_avg / bound.u,
                bound.exp_avg_sq / bound.u, aten_diff[0], aten_diff[1], aten_diff[2], aten_bound,
                copies_ok ? "yes" : "NO", static_cast<long long>(differ), static_cast<long long>(elements));
  const bool ok = ref_err[0] <= bound.param / bound.u && ref_err[1] <= bound.exp_avg / bound.u &&
                  ref_err[2] <= bound.exp_avg_sq / bound.u && aten_diff[0] <= aten_bound &&
                  aten_diff[1] <= aten_bound && aten_diff[2] <= aten_bound && copies_ok;
  report(ok,
         std::string("adamw ") + dtype_name(grad_dtype) + " gradients, " + std::to_string(sizes.size()) +
             " tensors, grad_scale 1.7",
         buf);
}

// found_inf nonzero: no parameter, moment or copy changes.
void check_adamw_found_inf() {
  auto s = adamw_lists({1000, 4097, 3 * 4096 + 17}, at::kBFloat16, true);
  const auto p0 = clones(s.params), m0 = clones(s.exp_avgs), v0 = clones(s.exp_avg_sqs);
  ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, s.copies, s.steps, kLr, kBeta1, kBeta2, kEps, kWd,
                     std::nullopt, at::full({}, 1.0, s.steps[0].options()));
  bool same = true;
  for (size_t i = 0; i < s.params.size(); ++i)
    same = same && at::equal(s.params[i], p0[i]) && at::equal(s.exp_avgs[i], m0[i]) &&
           at::equal(s.exp_avg_sqs[i], v0[i]) && at::isnan(s.copies[i]).all().item<bool>();
  report(same, "adamw found_inf 1", same ? "nothing changed" : "something changed");
}

// The learning rate read on the device (training.cuda_graphs): the bits of the rate passed by
// value, with a wrong value passed beside it (0.0422164789…: a rate whose decay 1 − lr·wd in
// float32 arithmetic would round differently from the float64 one).
void check_adamw_lr_on_device() {
  bool same = true;
  for (const double lr : {kLr, 1e-4 / 3, 0.042216478926141915}) {
    auto a = adamw_lists({1000, 4097, 3 * 4096 + 17}, at::kBFloat16, true);
    AdamWLists b{clones(a.params),      clones(a.grads),  clones(a.exp_avgs),
                 clones(a.exp_avg_sqs), clones(a.copies), clones(a.steps)};
    ctitan::adamw_cuda(a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.copies, a.steps, lr, kBeta1, kBeta2, kEps, kWd,
                       std::nullopt, std::nullopt);
    ctitan::adamw_cuda(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.copies, b.steps, 0.5, kBeta1, kBeta2, kEps, kWd,
                       std::nullopt, std::nullopt, at::full({}, lr, a.steps[0].options().dtype(at::kDouble)));
    for (size_t i = 0; i < a.params.size(); ++i)
      same = same && at::equal(a.params[i], b.params[i]) && at::equal(a.exp_avgs[i], b.exp_avgs[i]) &&
             at::equal(a.exp_avg_sqs[i], b.exp_avg_sqs[i]) && at::equal(a.copies[i], b.copies[i]);
  }
  report(same, "adamw lr_on_device", same ? "bitwise the rate by value (3 rates)" : "differs from the rate by value");
}

// The parameters of a Llama model (as models/llama builds them): the embedding; per layer wq, wk,
// wv, wo, w1, w2, w3 and the two norms; the final norm and the output projection.
std::vector<int64_t> llama_param_sizes(int64_t dim, int64_t layers, int64_t kv_dim, int64_t hidden, int64_t vocab) {
  std::vector<int64_t> sizes = {vocab * dim};
  for (int64_t l = 0; l < layers; ++l)
    for (const int64_t n :
         {dim * dim, kv_dim * dim, kv_dim * dim, dim * dim, hidden * dim, dim * hidden, hidden * dim, dim, dim})
      sizes.push_back(n);
  sizes.push_back(dim);
  sizes.push_back(vocab * dim);
  return sizes;
}

void time_adamw(const std::string& name, const std::vector<int64_t>& sizes) {
  auto s = adamw_lists(sizes, at::kBFloat16, true);
  std::vector<Tensor> g32;
  int64_t elements = 0;
  for (const auto& g : s.grads) {
    g32.push_back(at::empty(g.sizes(), g.options().dtype(at::kFloat)));
    elements += g.numel();
  }
  at::_foreach_copy_(g32, s.grads);
  const auto aten = [&] {
    at::_fused_adamw_(s.params, g32, s.exp_avgs, s.exp_avg_sqs, {}, s.steps, kLr, kBeta1, kBeta2, kWd, kEps,
                      /*amsgrad=*/false, /*maximize=*/false, std::nullopt, std::nullopt);
  };
  const double a = median_ms(aten);
  const double a_cast = median_ms([&] {
    at::_foreach_copy_(g32, s.grads);
    aten();
  });
  const double o = median_ms([&] {
    ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, s.steps, kLr, kBeta1, kBeta2, kEps, kWd,
                       std::nullopt, std::nullopt);
  });
  const double o_copy = median_ms([&] {
    ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, s.copies, s.steps, kLr, kBeta1, kBeta2, kEps, kWd,
                       std::nullopt, std::nullopt);
  });
  std::printf(
      "[gpu_kernel_check] time adamw step %s (%zu tensors, %.1fM elements): ATen (float32 gradients) %.3f ms, "
      "after the cast from bf16 %.3f ms; ctitan (bf16 gradients) %.3f ms: %.2fx (%.2fx with the cast), writing bf16 "
      "copies %.3f ms\n",
      name.c_str(), sizes.size(), static_cast<double>(elements) / 1e6, a, a_cast, o, a / o, a_cast / o, o_copy);
  std::fflush(stdout);
}

}  // namespace

int main() {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "[gpu_kernel_check] no GPU visible: nothing checked\n");
    return 2;
  }
  torch::manual_seed(0);
  std::printf("[gpu_kernel_check] %s\n", at::cuda::getCurrentDeviceProperties()->name);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    check_swiglu({37, 91}, t, false);
    check_swiglu({64, 1024}, t, true);
    check_swiglu({16384, 2816}, t, false);  // 150M: 8 × 2048 tokens, hidden 2816
    check_swiglu({8192, 14336}, t, false);  // 8B: 8192 tokens, hidden 14336
    check_rope({2, 5, 3, 6}, t, false);     // hd 6: one pair per thread
    check_rope({2, 16, 4, 16}, t, true);    // misaligned: one pair per thread
    check_rope({2, 16, 4, 16}, t, false);
    check_rope({8, 2048, 16, 64}, t, false);   // 150M queries
    check_rope({1, 8192, 32, 128}, t, false);  // 8B queries
    check_cross_entropy(37, 2051, t);          // V not a multiple of 8: the one-value path
    check_cross_entropy(64, 2048, t);
    check_cross_entropy(16384, 8192, t);
    check_cross_entropy(8192, 128256, t);
  }
  // The misaligned cross-entropy path: logits starting one element into their storage.
  {
    const auto base = random_tensor({64 * 2048 + 1}, at::kBFloat16, 4.0);
    const auto x = base.narrow(0, 1, 64 * 2048).view({64, 2048});
    const auto labels = at::randint(2048, {64}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
    const auto one = at::full({}, 1.0, x.options().dtype(at::kFloat));
    const auto mine = ce_run(true, x, labels, 1.0, one), contiguous = ce_run(true, x.clone(), labels, 1.0, one);
    report(at::equal(mine.loss, contiguous.loss) && at::equal(mine.dx, contiguous.dx),
           "cross-entropy bf16 [64, 2048] misaligned",
           "the one-value path against the 16-byte path on a copy: bitwise equal");
  }
  check_adamw(at::kFloat);
  check_adamw(at::kBFloat16);
  check_adamw_found_inf();
  check_adamw_lr_on_device();

  for (const auto& [rows, hidden, vocab, name] : std::vector<std::tuple<int64_t, int64_t, int64_t, std::string>>{
           {16384, 2816, 8192, "150M"}, {8192, 14336, 128256, "8B"}}) {
    const auto a = random_tensor({rows, hidden}, at::kBFloat16, 3.0).requires_grad_(true);
    const auto b = random_tensor({rows, hidden}, at::kBFloat16, 1.0).requires_grad_(true);
    const auto gy = random_tensor({rows, hidden}, at::kBFloat16, 1.0);
    time_pair(
        "swiglu bf16 " + shape_str({rows, hidden}) + " (" + name + ")",
        [&] {
          torch::autograd::grad({at::silu(a) * b}, {a, b}, {gy});
        },
        [&] {
          torch::autograd::grad({ctitan::swiglu_cuda(a, b)}, {a, b}, {gy});
        });
    const int64_t B = rows / (name == "150M" ? 2048 : 8192), T = rows / B, heads = name == "150M" ? 16 : 32,
                  hd = name == "150M" ? 64 : 128;
    const auto q = random_tensor({B, T, heads, hd}, at::kBFloat16, 2.0).requires_grad_(true);
    const auto gq = random_tensor({B, T, heads, hd}, at::kBFloat16, 1.0);
    const auto table = rope_table(T, hd, 0, at::kCUDA);
    time_pair(
        "rope bf16 " + shape_str({B, T, heads, hd}) + " (" + name + " queries)",
        [&] { torch::autograd::grad({ctitan::rotary_emb_aten(q, table)}, {q}, {gq}); },
        [&] { torch::autograd::grad({ctitan::rotary_emb_cuda(q, table)}, {q}, {gq}); });
    const auto x = random_tensor({rows, vocab}, at::kBFloat16, 4.0).requires_grad_(true);
    const auto labels = at::randint(vocab, {rows}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
    const double s = 1.0 / static_cast<double>(rows);
    time_pair(
        "cross-entropy bf16 " + shape_str({rows, vocab}) + " (" + name + ")",
        [&] { torch::autograd::grad({ctitan::chunked_cross_entropy(x, labels, s)}, {x}); },
        [&] { torch::autograd::grad({ctitan::cross_entropy_cuda(x, labels, s)}, {x}); });
  }
  time_adamw("150M", llama_param_sizes(1024, 12, 512, 2816, 8192));
  time_adamw("8B_8L", llama_param_sizes(4096, 8, 1024, 14336, 128256));
  std::printf("[gpu_kernel_check] %d checks, %s\n", g_checks,
              g_failed ? (std::to_string(g_failed) + " FAILED").c_str() : "all PASS");
  return g_failed ? 1 : 0;
}
