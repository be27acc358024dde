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
//     the same way and printed beside it.
// Timings: forward + backward (torch::autograd::grad, nothing accumulated), CUDA events, median
// of 20 after 3 warm-ups, each route in turn; ratio = ATen's time / ctitan's.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
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
  std::printf("[gpu_kernel_check] %d checks, %s\n", g_checks,
              g_failed ? (std::to_string(g_failed) + " FAILED").c_str() : "all PASS");
  return g_failed ? 1 : 0;
}
