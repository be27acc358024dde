#include "models/fused_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace ctitan {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per work item: fixed, so per-chunk partial sums (RMSNorm's weight gradient) are
// added in the same order whatever the number of threads — results are reproducible.
int64_t rows_per_chunk(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

torch::ScalarType acc_dtype(torch::ScalarType t) { return t == torch::kDouble ? torch::kDouble : torch::kFloat; }

// Branch-free bf16 conversions, so the compiler can vectorise the loops below (c10's
// BFloat16 constructor branches on NaN).
inline float widen(c10::BFloat16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(float f) { return f; }
inline double widen(double d) { return d; }

template <class T>
inline T narrow_to(float f);
template <>
inline float narrow_to<float>(float f) { return f; }
template <>
inline c10::BFloat16 narrow_to<c10::BFloat16>(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
template <class T>
inline T narrow_to(double d);
template <>
inline double narrow_to<double>(double d) { return d; }


// ---- RMSNorm ----------------------------------------------------------------------------
class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x_in, const Tensor& w, double eps) {
    const auto x = x_in.contiguous();
    const int64_t D = x.size(-1), N = x.numel() / D;
    auto y = torch::empty_like(x);
    auto rstd = torch::empty({N}, x.options().dtype(acc_dtype(x.scalar_type())));
    const auto wc = w.to(x.scalar_type()).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "ctitan_rms_norm", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* X = x.data_ptr<scalar_t>();
      const scalar_t* W = wc.data_ptr<scalar_t>();
      scalar_t* Y = y.data_ptr<scalar_t>();
      acc_t* R = rstd.data_ptr<acc_t>();
      at::parallel_for(0, N, rows_per_chunk(D), [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n) {
          const scalar_t* xr = X + n * D;
          double ss = 0;  // float64 sum: the statistic is then exact to float32 rounding
          for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(widen(xr[d])) * static_cast<double>(widen(xr[d]));
          const acc_t r = static_cast<acc_t>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
          R[n] = r;
          scalar_t* yr = Y + n * D;
          for (int64_t d = 0; d < D; ++d) {
            const acc_t normed = widen(narrow_to<scalar_t>(widen(xr[d]) * r));
            yr[d] = narrow_to<scalar_t>(normed * widen(W[d]));
          }
        }
      });
    });
    ctx->save_for_backward({x, wc, rstd});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(w.scalar_type());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const auto dy = grads[0].to(x.scalar_type()).contiguous();
    const int64_t D = x.size(-1), N = x.numel() / D, rows = rows_per_chunk(D);
    const int64_t chunks = (N + rows - 1) / rows;
    auto dx = torch::empty_like(x);
    auto partial = torch::zeros({chunks, D}, rstd.options());  // per-chunk weight gradients
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "ctitan_rms_norm_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* X = x.data_ptr<scalar_t>();
      const scalar_t* W = w.data_ptr<scalar_t>();
      const scalar_t* DY = dy.data_ptr<scalar_t>();
      const acc_t* R = rstd.data_ptr<acc_t>();
      scalar_t* DX = dx.data_ptr<scalar_t>();
      acc_t* P = partial.data_ptr<acc_t>();
      at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          acc_t* pw = P + c * D;
          for (int64_t n = c * rows, end = std::min(N, (c + 1) * rows); n < end; ++n) {
            const scalar_t *xr = X + n * D, *gr = DY + n * D;
            const acc_t r = R[n];
            acc_t dot = 0;  // Σ dxhat · xhat
            for (int64_t d = 0; d < D; ++d) {
              const acc_t xhat = widen(xr[d]) * r;
              const acc_t g = widen(gr[d]);
              pw[d] += g * widen(narrow_to<scalar_t>(xhat));
              dot += g * widen(W[d]) * xhat;
            }
            const acc_t mean_dot = dot / static_cast<acc_t>(D);
            scalar_t* dxr = DX + n * D;
            for (int64_t d = 0; d < D; ++d) {
              const acc_t xhat = widen(xr[d]) * r;
              const acc_t dxhat = widen(gr[d]) * widen(W[d]);
              dxr[d] = narrow_to<scalar_t>(r * (dxhat - xhat * mean_dot));
            }
          }
        }
      });
    });
    const auto dw = partial.sum(0).to(static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt()));
    return {dx, dw, Tensor()};
  }
};

// ---- RoPE -------------------------------------------------------------------------------
// out = rotate(x, sign · angle): sign +1 forward, −1 for the gradient (the inverse rotation).
Tensor rotate_pairs(const Tensor& x, const Tensor& table, int64_t sign) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = x.size(3), half = hd / 2;
  auto out = torch::empty_like(x);
  const auto tab = table.narrow(0, 0, T).to(acc_dtype(x.scalar_type())).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "ctitan_rotary", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* X = x.data_ptr<scalar_t>();
    const acc_t* C = tab.data_ptr<acc_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    const acc_t sg = static_cast<acc_t>(sign);
    at::parallel_for(0, B * T, rows_per_chunk(H * hd), [&](int64_t b, int64_t e) {
      for (int64_t bt = b; bt < e; ++bt) {
        const acc_t* cs = C + (bt % T) * hd;  // [half, 2] of position t
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* xr = X + (bt * H + h) * hd;
          scalar_t* orow = O + (bt * H + h) * hd;
          for (int64_t i = 0; i < half; ++i) {
            const acc_t c = cs[2 * i], s = sg * cs[2 * i + 1];
            const acc_t a = widen(xr[2 * i]), v = widen(xr[2 * i + 1]);
            orow[2 * i] = narrow_to<scalar_t>(a * c - v * s);
            orow[2 * i + 1] = narrow_to<scalar_t>(a * s + v * c);
          }
        }
      }
    });
  });
  return out;
}

class RotaryFn : public torch::autograd::Function<RotaryFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& table) {
    ctx->save_for_backward({table});
    return rotate_pairs(x.contiguous(), table, +1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto table = ctx->get_saved_variables()[0];
    return {rotate_pairs(grads[0].contiguous(), table, -1), Tensor()};
  }
};

}  // namespace

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "[models] fused_rms_norm: weight ", weight.sizes(), " does not fit x ", x.sizes());
  return RMSNormFn::apply(x, weight, eps);
}

torch::Tensor fused_rotary_emb(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  TORCH_CHECK(x.dim() == 4, "[models] rotary embedding expects x [B, T, h, hd], got ", x.sizes());
  const int64_t T = x.size(1), hd = x.size(3);
  TORCH_CHECK(freqs_cis.dim() == 3 && freqs_cis.size(0) >= T && freqs_cis.size(1) * 2 == hd &&
                  freqs_cis.size(2) == 2,
              "[models] freqs_cis ", freqs_cis.sizes(), " does not fit x ", x.sizes());
  return RotaryFn::apply(x, freqs_cis);
}

}  // namespace ctitan
