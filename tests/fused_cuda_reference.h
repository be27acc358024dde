// The references ctitan's own CUDA kernels (kernels/fused_cuda.h) are checked against, in plain
// ATen on any device: bench/gpu_kernel_check.cpp uses them on a GPU, and
// tests/test_cuda_kernels_on_host.cpp on the CPU (the kernels' source compiled for the host).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace ctitan::kernel_reference {

// Largest |got − want| / (ulp of want in got's dtype): ≤ 1 means within one unit in the last place.
// NaN where either has a NaN (so a bound `<=` fails).
inline double max_ulps(const at::Tensor& got, const at::Tensor& want) {
  const auto w = want.to(at::kDouble), g = got.to(at::kDouble);
  const double mant = got.scalar_type() == at::kBFloat16 ? 7 : 23;  // stored mantissa bits
  // ulp(w) = 2^(floor(log2 |w|) − mant), floored at the smallest normal's ulp
  const auto e = at::floor(at::log2(w.abs().clamp_min(1e-38)));
  const auto ulp = at::pow(2.0, e - mant);
  return ((g - w).abs() / ulp).max().item<double>();
}

// Largest |got − ref| / |ref| over the elements (ref float64; 0 where both are 0).
inline double max_rel(const at::Tensor& got, const at::Tensor& ref) {
  const auto g = got.to(at::kDouble);
  return ((g - ref).abs() / ref.abs().clamp_min(1e-30)).max().item<double>();
}

// ---- SwiGLU -----------------------------------------------------------------------------
// silu(a) · b and its gradients under an upstream dy in float64, without the kernels' roundings:
// db = dy · silu(a), da = dy · b · σ(a) · (1 + a · (1 − σ(a))). The scales each element's error
// is measured against: |y| and |db| (products, no cancellation), and for da the size of its
// terms, |dy · b| · σ(a) · (1 + |a|), as 1 + a · (1 − σ(a)) cancels near a ≈ −1.28.
struct SwigluRef {
  at::Tensor y, da, db, da_scale;
};

inline SwigluRef swiglu_ref64(const at::Tensor& a, const at::Tensor& b, const at::Tensor& dy) {
  const auto x = a.to(at::kDouble), bd = b.to(at::kDouble), g = dy.to(at::kDouble);
  const auto sig = at::sigmoid(x), h = x * sig;
  return {h * bd, g * bd * sig * (1 + x * (1 - sig)), g * h, (g * bd).abs() * sig * (1 + x.abs())};
}

// Largest |got − ref| / scale (NaN where got is NaN, so a bound `<=` fails).
inline double max_scaled_error(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& scale) {
  return ((got.to(at::kDouble) - ref).abs() / scale.clamp_min(1e-30)).max().item<double>();
}

// SwiGLU's bound on max_scaled_error. float32: an exp, a sum, a division and a product or
// three, each within an ulp or so (2^-24 relative), far below 1e-6; bf16: silu(a) (or dy · b)
// rounded to bf16 before the product and the result rounded again, each up to 2^-8 relative
// (bf16 keeps 8 significant bits).
inline double swiglu_bound(at::ScalarType t) { return (t == at::kBFloat16 ? 2.0 / 256 : 0) + 1e-6; }

// ---- RoPE -------------------------------------------------------------------------------
// A table as the model's: row t, pair i → (cos, sin) of t · 500000^(−2i/hd), `extra` rows more
// than T (the route takes the first T); float32 [T + extra, hd/2, 2].
inline at::Tensor rope_table(int64_t T, int64_t hd, int64_t extra, at::Device device) {
  const auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
  const auto inv = at::pow(500000.0, -at::arange(0, hd, 2, opts) / static_cast<double>(hd));  // [hd/2]
  const auto angle = at::outer(at::arange(T + extra, opts), inv);                             // [T+extra, hd/2]
  return at::stack({at::cos(angle), at::sin(angle)}, -1).to(at::kFloat);
}

// The rotation in float64 of x [B, T, h, hd] by the table (its float32 values), or by its
// conjugate (the backward of the rotation).
inline at::Tensor rope_ref64(const at::Tensor& x, const at::Tensor& table, bool conjugate) {
  const int64_t B = x.size(0), T = x.size(1), h = x.size(2), hd = x.size(3);
  const auto xd = x.to(at::kDouble).view({B, T, h, hd / 2, 2});
  const auto f = table.narrow(0, 0, T).to(at::kDouble).view({1, T, 1, hd / 2, 2});
  const auto a = xd.select(-1, 0), b = xd.select(-1, 1), c = f.select(-1, 0), s = f.select(-1, 1);
  const auto out =
      conjugate ? at::stack({a * c + b * s, b * c - a * s}, -1) : at::stack({a * c - b * s, a * s + b * c}, -1);
  return out.view({B, T, h, hd});
}

// Largest |got − ref| over the length of the pair the element belongs to (a rotation keeps it).
inline double max_pair_error(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& input) {
  const auto sizes = input.sizes().vec();
  auto shape = sizes;
  shape.back() /= 2;
  shape.push_back(2);
  const auto norm = input.to(at::kDouble).view(shape).pow(2).sum(-1, true).sqrt().expand(shape).reshape(sizes);
  return ((got.to(at::kDouble) - ref).abs() / norm.clamp_min(1e-30)).max().item<double>();
}

// RoPE's bound on max_pair_error. float32: two products and a sum, each rounded (about
// 3 · 2^-24 of the pair's length); bf16: the one rounding to bf16 on top (at most 2^-8 of the
// element, itself ≤ the length).
inline double rope_bound(at::ScalarType t) { return (t == at::kBFloat16 ? 1.0 / 256 : 0) + 1e-6; }

// ---- Cross-entropy ----------------------------------------------------------------------
// The float64 reference of x [rows, V] with labels in [0, V), 1024 rows at a time: calls
// each(first_row, n, lse [n, 1], row_loss [n, 1], dx [n, V]) with dx = (softmax − one-hot) · coef,
// and returns the sum of the rows' losses.
inline double cross_entropy_ref64(
    const at::Tensor& x, const at::Tensor& labels, double coef,
    const std::function<void(int64_t, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&)>& each) {
  double loss = 0;
  const int64_t rows = x.size(0);
  for (int64_t r = 0; r < rows; r += 1024) {
    const int64_t n = std::min<int64_t>(1024, rows - r);
    const auto xd = x.narrow(0, r, n).to(at::kDouble);
    const auto lab = labels.narrow(0, r, n).unsqueeze(1);
    const auto lse = at::logsumexp(xd, {1}, true);
    const auto row_loss = lse - xd.gather(1, lab);
    loss += row_loss.sum().item<double>();
    auto dx = at::exp(xd - lse);
    dx.scatter_add_(1, lab, at::full({n, 1}, -1.0, dx.options()));
    dx.mul_(coef);
    each(r, n, lse, row_loss, dx);
  }
  return loss;
}

// The bound on each gradient element's relative error. float32: each thread sums up to ~250
// exps of a row in float32 (and a log-sum-exp ~25 has a float32 ulp of 2e-6); bf16: its
// rounding (2^-8 relative at most) on top of that. The loss's bound is 1e-5 relative.
inline double cross_entropy_grad_bound(at::ScalarType t) { return (t == at::kBFloat16 ? 1.0 / 256 : 0) + 3e-5; }

}  // namespace ctitan::kernel_reference
