// The references ctitan's own CUDA kernels (kernels/fused_cuda.h) are checked against, in plain
// ATen on any device: bench/gpu_kernel_check.cpp uses them on a GPU, and
// tests/test_cuda_kernels_on_host.cpp on the CPU (the kernels' source compiled for the host).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
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

// ---- AdamW ------------------------------------------------------------------------------
// One step's coefficients as components/optimizer.cpp's FusedAdamW::update computes them: in
// float64 from the step count, each rounded to float32.
struct AdamWCoefficients {
  float decay, b1, b2, c1, c2, sqrt_bc2, eps, step_size;
};

inline AdamWCoefficients adamw_coefficients(double lr, double beta1, double beta2, double eps, double weight_decay,
                                            double step) {
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  return {static_cast<float>(1.0 - lr * weight_decay),
          static_cast<float>(beta1),
          static_cast<float>(beta2),
          static_cast<float>(1.0 - beta1),
          static_cast<float>(1.0 - beta2),
          static_cast<float>(std::sqrt(bc2)),
          static_cast<float>(eps),
          static_cast<float>(lr / bc1)};
}

// The same update as adamw_range there, written out again in float32: in place on CPU tensors
// (p, m, v float32 contiguous; g float32 or bf16), each operation rounded on its own, in its
// order; grad_scale 0: none, else each gradient divided by it in float32 first (as the kernel
// and ATen's fused AdamW divide). Returns bf16(p), the parameter copy.
inline at::Tensor adamw_float32(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v,
                                const AdamWCoefficients& k, float grad_scale) {
  const auto gf = g.to(at::kFloat).contiguous();
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float* G = gf.data_ptr<float>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    const float gi = grad_scale != 0 ? G[i] / grad_scale : G[i];
    const float pi = P[i] * k.decay;
    const float mi = M[i] * k.b1 + gi * k.c1;
    const float vi = V[i] * k.b2 + gi * gi * k.c2;
    M[i] = mi;
    V[i] = vi;
    P[i] = pi - k.step_size * (mi / (std::sqrt(vi) / k.sqrt_bc2 + k.eps));
  }
  return p.to(at::kBFloat16);
}

// The update in float64 with the coefficients' float32 values, without rounding between
// operations (any device; grad_scale 0: none, else g = G / grad_scale exactly), and the size of
// the terms each result is made of, which its error is measured against:
//   exp_avg: |β1·M| + |(1 − β1)·g| (the two may cancel); exp_avg_sq: v itself (no cancellation);
//   param: |P·decay| + step_size · (|β1·M| + |(1 − β1)·g|) / (√v / √bc2 + eps).
struct AdamWRef {
  at::Tensor param, exp_avg, exp_avg_sq;
  at::Tensor param_scale, exp_avg_scale, exp_avg_sq_scale;
};

inline AdamWRef adamw_ref64(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const AdamWCoefficients& k, float grad_scale) {
  auto g = grad.to(at::kDouble);
  if (grad_scale != 0) g = g / static_cast<double>(grad_scale);
  const auto p = param.to(at::kDouble) * static_cast<double>(k.decay);
  const auto mb = exp_avg.to(at::kDouble) * static_cast<double>(k.b1), gc = g * static_cast<double>(k.c1);
  const auto m = mb + gc, m_scale = mb.abs() + gc.abs();
  const auto v = exp_avg_sq.to(at::kDouble) * static_cast<double>(k.b2) + g * g * static_cast<double>(k.c2);
  const auto d = v.sqrt() / static_cast<double>(k.sqrt_bc2) + static_cast<double>(k.eps);
  const double step = k.step_size;
  return {p - step * (m / d), m, v, p.abs() + step * m_scale / d, m_scale, v};
}

// The bounds on max_scaled_error(kernel, AdamWRef's value, its scale), in units of u = 2^-24
// (float32's relative rounding error). Each float32 operation adds at most u of its result; to
// first order in u:
//   g = G / S: u (0 without a grad_scale, or with a bf16 or float32 gradient alone: exact);
//   m = fl(fl(M·b1) + fl(g·c1)): 2u of |M·b1| and 3u of |g·c1| → 3u of the terms; 4u allowed;
//   v = fl(fl(V·b2) + fl(fl(g·g)·c2)): 2u of V·b2 and 5u of g²·c2, all ≥ 0 → 5u of v; 6u allowed;
//   d = √v / √bc2 + eps: v's 5u halved by the root, + the root's, the division's and the sum's
//     roundings → 5.5u of d (eps > 0: no cancellation);
//   update = step_size · (m / d): m's 3u of its terms, d's 5.5u, the division's and the product's
//     u each → 10.5u of step_size · (terms of m) / d; and p = P·decay within u of |P·decay|;
//   param = fl(p − update): those, plus u of the result → at most 11.5u of the terms; 14u allowed,
//     which also covers step_size and √bc2 each one float32 ulp away from the reference's (a
//     device pow a last bit off glibc's moving a rounding): u of the update each.
// The second-order terms (~10^2 u^2) and the float64 reference's own error (~2^-50 of the terms)
// are far below the half u of slack.
struct AdamWBounds {
  static constexpr double u = 1.0 / (1 << 24);
  double exp_avg = 4 * u, exp_avg_sq = 6 * u, param = 14 * u;
};

}  // namespace ctitan::kernel_reference
