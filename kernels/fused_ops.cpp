#include "kernels/fused_ops.h"
#include "kernels/device_route.h"
#include "kernels/fused_cuda.h"
#include "kernels/kernel_math.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace ctitan {
namespace {

using kernel::acc_dtype;
using kernel::exp_fast;
using kernel::ld;
using kernel::narrow_to;
using kernel::st;
using kernel::widen;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per work item: fixed, so per-chunk partial sums (RMSNorm's weight gradient) are
// added in the same order whatever the number of threads — results are reproducible.
int64_t rows_per_chunk(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

// Elements per work item of the element-wise loops (SwiGLU).
constexpr int64_t kElemChunk = 1 << 14;

// ---- RMSNorm ----------------------------------------------------------------------------
// Rows [b, e) of y = (x · r) rounded, times w, with r = rsqrt(mean(x²) + eps) stored in R.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void rms_norm_rows(const scalar_t* X, const scalar_t* W, scalar_t* Y, acc_t* R, int64_t D, double eps,
                                 int64_t b, int64_t e) {
  for (int64_t n = b; n < e; ++n) {
    const scalar_t* __restrict__ xr = X + n * D;
    // float64 sum (in 8 lanes): the statistic is then exact to float32 rounding.
    const double ss = kernel::lane_sum<double>(D, [&](int64_t d) {
      const double v = static_cast<double>(widen(xr[d]));
      return v * v;
    });
    const acc_t r = static_cast<acc_t>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    R[n] = r;
    scalar_t* __restrict__ yr = Y + n * D;
    for (int64_t d = 0; d < D; ++d) {
      const acc_t normed = widen(narrow_to<scalar_t>(widen(xr[d]) * r));
      yr[d] = narrow_to<scalar_t>(normed * widen(W[d]));
    }
  }
}

// Rows [row_b, row_e) of the backward: dx, and the rows' weight-gradient terms added to pw.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void rms_norm_backward_rows(const scalar_t* X, const scalar_t* W, const scalar_t* DY, const acc_t* R,
                                          scalar_t* DX, acc_t* pw, int64_t D, int64_t row_b, int64_t row_e) {
  for (int64_t n = row_b; n < row_e; ++n) {
    const scalar_t* __restrict__ xr = X + n * D, * __restrict__ gr = DY + n * D;
    const acc_t r = R[n];
    for (int64_t d = 0; d < D; ++d) pw[d] += widen(gr[d]) * widen(narrow_to<scalar_t>(widen(xr[d]) * r));
    // Σ dxhat · xhat
    const acc_t dot = kernel::lane_sum<acc_t>(D, [&](auto d) { return ld(gr, d) * ld(W, d) * (ld(xr, d) * r); });
    const acc_t mean_dot = dot / static_cast<acc_t>(D);
    scalar_t* __restrict__ dxr = DX + n * D;
    for (int64_t d = 0; d < D; ++d) {
      const acc_t xhat = widen(xr[d]) * r;
      const acc_t dxhat = widen(gr[d]) * widen(W[d]);
      dxr[d] = narrow_to<scalar_t>(r * (dxhat - xhat * mean_dot));
    }
  }
}

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x_in, const Tensor& w, double eps) {
    RECORD_FUNCTION("ctitan::rms_norm_forward", std::vector<c10::IValue>());
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
      at::parallel_for(0, N, rows_per_chunk(D),
                       [&](int64_t b, int64_t e) { rms_norm_rows<scalar_t, acc_t>(X, W, Y, R, D, eps, b, e); });
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
        for (int64_t c = cb; c < ce; ++c)
          rms_norm_backward_rows<scalar_t, acc_t>(X, W, DY, R, DX, P + c * D, D, c * rows, std::min(N, (c + 1) * rows));
      });
    });
    const auto dw = partial.sum(0).to(static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt()));
    return {dx, dw, Tensor()};
  }
};

// ---- RoPE -------------------------------------------------------------------------------
// Positions·batch rows [b, e) of [B·T, H, hd]: each pair rotated by (cos, sin·sign) of row % T.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void rotate_rows(const scalar_t* X, const acc_t* C, scalar_t* O, int64_t T, int64_t H, int64_t hd,
                               acc_t sg, int64_t b, int64_t e) {
  const int64_t half = hd / 2;
  for (int64_t bt = b; bt < e; ++bt) {
    const acc_t* cs = C + (bt % T) * hd;  // [half, 2] of position t
    for (int64_t h = 0; h < H; ++h) {
      const scalar_t* __restrict__ xr = X + (bt * H + h) * hd;
      scalar_t* __restrict__ orow = O + (bt * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const acc_t c = cs[2 * i], s = sg * cs[2 * i + 1];
        const acc_t a = widen(xr[2 * i]), v = widen(xr[2 * i + 1]);
        orow[2 * i] = narrow_to<scalar_t>(a * c - v * s);
        orow[2 * i + 1] = narrow_to<scalar_t>(a * s + v * c);
      }
    }
  }
}

// out = rotate(x, sign · angle): sign +1 forward, −1 for the gradient (the inverse rotation).
Tensor rotate_pairs(const Tensor& x, const Tensor& table, int64_t sign) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = x.size(3);
  auto out = torch::empty_like(x);
  const auto tab = table.narrow(0, 0, T).to(acc_dtype(x.scalar_type())).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "ctitan_rotary", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* X = x.data_ptr<scalar_t>();
    const acc_t* C = tab.data_ptr<acc_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    const acc_t sg = static_cast<acc_t>(sign);
    at::parallel_for(0, B * T, rows_per_chunk(H * hd),
                     [&](int64_t b, int64_t e) { rotate_rows<scalar_t, acc_t>(X, C, O, T, H, hd, sg, b, e); });
  });
  return out;
}

class RotaryFn : public torch::autograd::Function<RotaryFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& table) {
    RECORD_FUNCTION("ctitan::rotary_forward", std::vector<c10::IValue>());
    ctx->save_for_backward({table});
    return rotate_pairs(x.contiguous(), table, +1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto table = ctx->get_saved_variables()[0];
    return {rotate_pairs(grads[0].contiguous(), table, -1), Tensor()};
  }
};

// ---- SwiGLU -----------------------------------------------------------------------------
template <class scalar_t, class acc_t>
CTITAN_KERNEL void swiglu_range(const scalar_t* A, const scalar_t* Bv, scalar_t* Y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const acc_t x = widen(A[i]);
    const acc_t h = widen(narrow_to<scalar_t>(x / (acc_t(1) + exp_fast(-x))));
    Y[i] = narrow_to<scalar_t>(h * widen(Bv[i]));
  }
}

template <class scalar_t, class acc_t>
CTITAN_KERNEL void swiglu_backward_range(const scalar_t* A, const scalar_t* Bv, const scalar_t* DY, scalar_t* DA,
                                         scalar_t* DB, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const acc_t x = widen(A[i]), g = widen(DY[i]);
    const acc_t sig = acc_t(1) / (acc_t(1) + exp_fast(-x));
    const acc_t h = widen(narrow_to<scalar_t>(x * sig));
    DB[i] = narrow_to<scalar_t>(g * h);
    const acc_t dh = widen(narrow_to<scalar_t>(g * widen(Bv[i])));
    DA[i] = narrow_to<scalar_t>(dh * sig * (acc_t(1) + x * (acc_t(1) - sig)));
  }
}

// y = silu(a) · b with silu(a) = a · σ(a) rounded to the input dtype before the product, as
// torch.silu then torch.mul round. Saves a and b only (ATen's pair also keeps silu(a)).
class SwiGLUFn : public torch::autograd::Function<SwiGLUFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& a_in, const Tensor& b_in) {
    RECORD_FUNCTION("ctitan::swiglu_forward", std::vector<c10::IValue>());
    const auto a = a_in.contiguous(), b = b_in.contiguous();
    auto y = torch::empty_like(a);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, a.scalar_type(), "ctitan_swiglu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* __restrict__ A = a.data_ptr<scalar_t>();
      const scalar_t* __restrict__ Bv = b.data_ptr<scalar_t>();
      scalar_t* __restrict__ Y = y.data_ptr<scalar_t>();
      at::parallel_for(0, a.numel(), kElemChunk,
                       [&](int64_t begin, int64_t end) { swiglu_range<scalar_t, acc_t>(A, Bv, Y, begin, end); });
    });
    ctx->save_for_backward({a, b});
    return y;
  }

  // db = dy · silu(a); da = (dy · b) · σ(a) · (1 + a · (1 − σ(a))), each product rounded to
  // the input dtype where autograd's mul and silu backward round it.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &b = saved[1];
    const auto dy = grads[0].to(a.scalar_type()).contiguous();
    auto da = torch::empty_like(a), db = torch::empty_like(b);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, a.scalar_type(), "ctitan_swiglu_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* __restrict__ A = a.data_ptr<scalar_t>();
      const scalar_t* __restrict__ Bv = b.data_ptr<scalar_t>();
      const scalar_t* __restrict__ DY = dy.data_ptr<scalar_t>();
      scalar_t* __restrict__ DA = da.data_ptr<scalar_t>();
      scalar_t* __restrict__ DB = db.data_ptr<scalar_t>();
      at::parallel_for(0, a.numel(), kElemChunk, [&](int64_t begin, int64_t end) {
        swiglu_backward_range<scalar_t, acc_t>(A, Bv, DY, DA, DB, begin, end);
      });
    });
    return {da, db};
  }
};

// ---- Cross-entropy ----------------------------------------------------------------------
// Rows [b, e): LSE[n] = logsumexp(x_n), RL[n] = LSE[n] − x_n[label].
template <class scalar_t, class acc_t>
CTITAN_KERNEL void cross_entropy_rows(const scalar_t* X, const int64_t* Lb, acc_t* LSE, double* RL, int64_t V,
                                      int64_t b, int64_t e) {
  for (int64_t n = b; n < e; ++n) {
    const scalar_t* __restrict__ xr = X + n * V;
    const acc_t mx =
        kernel::lane_max<acc_t>(V, -std::numeric_limits<acc_t>::infinity(), [&](auto j) { return ld(xr, j); });
    const acc_t sum = kernel::lane_sum<acc_t>(V, [&](auto j) { return exp_fast(ld(xr, j) - mx); });
    const acc_t l = mx + std::log(sum);
    LSE[n] = l;
    RL[n] = static_cast<double>(l) - static_cast<double>(widen(xr[Lb[n]]));
  }
}

// Rows [b, e) of the gradient: (softmax − one-hot) · c.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void cross_entropy_backward_rows(const scalar_t* X, const acc_t* LSE, const int64_t* Lb, scalar_t* DX,
                                               acc_t c, int64_t V, int64_t b, int64_t e) {
  for (int64_t n = b; n < e; ++n) {
    const scalar_t* __restrict__ xr = X + n * V;
    scalar_t* __restrict__ dr = DX + n * V;
    const acc_t l = LSE[n];
    kernel::for_lanes<acc_t>(V, [&](auto j) { st(dr, j, exp_fast(ld(xr, j) - l) * c); });
    const int64_t y = Lb[n];
    dr[y] = narrow_to<scalar_t>((exp_fast(widen(xr[y]) - l) - acc_t(1)) * c);
  }
}

class CrossEntropyFn : public torch::autograd::Function<CrossEntropyFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& logits_in, const Tensor& labels_in, double scale) {
    RECORD_FUNCTION("ctitan::cross_entropy_forward", std::vector<c10::IValue>());
    const auto logits = logits_in.contiguous();
    const auto labels = labels_in.to(torch::kLong).contiguous();
    const int64_t N = logits.size(0), V = logits.size(1);
    auto lse = torch::empty({N}, logits.options().dtype(acc_dtype(logits.scalar_type())));
    auto row_loss = torch::empty({N}, logits.options().dtype(torch::kDouble));
    const int64_t* Lb = labels.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(Lb[n] >= 0 && Lb[n] < V, "[models] cross-entropy: label ", Lb[n], " of row ", n,
                  " is outside the vocabulary [0, ", V, ")");
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "ctitan_cross_entropy", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* X = logits.data_ptr<scalar_t>();
      acc_t* LSE = lse.data_ptr<acc_t>();
      double* RL = row_loss.data_ptr<double>();
      at::parallel_for(0, N, 1,
                       [&](int64_t b, int64_t e) { cross_entropy_rows<scalar_t, acc_t>(X, Lb, LSE, RL, V, b, e); });
    });
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["scale"] = scale;
    // Rows summed in index order: the loss does not depend on the thread count.
    return (row_loss.sum() * scale).to(torch::kFloat);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2];
    const double coef = ctx->saved_data["scale"].toDouble() * grads[0].item<double>();
    const int64_t N = logits.size(0), V = logits.size(1);
    auto dx = torch::empty_like(logits);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "ctitan_cross_entropy_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* X = logits.data_ptr<scalar_t>();
      const acc_t* LSE = lse.data_ptr<acc_t>();
      const int64_t* Lb = labels.data_ptr<int64_t>();
      scalar_t* DX = dx.data_ptr<scalar_t>();
      const acc_t c = static_cast<acc_t>(coef);
      at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
        cross_entropy_backward_rows<scalar_t, acc_t>(X, LSE, Lb, DX, c, V, b, e);
      });
    });
    return {dx, Tensor(), Tensor()};
  }
};

// torchtitan's loss on a GPU (cross-entropy of the float32-cast logits, summed) in chunks of
// rows, in ATen ops: the forward keeps only the logits the output projection made, and the
// backward recomputes each chunk's softmax from them. The whole-size float32 copies of [N, V]
// (the cast, log_softmax's saved output and both their gradients: 4 GiB each for Llama 3 8B's
// 128,256 × 8,192) never exist, only one chunk's. No host read: the upstream gradient stays a
// device tensor.
class ChunkedCrossEntropyFn : public torch::autograd::Function<ChunkedCrossEntropyFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels_in, double scale,
                        int64_t rows) {
    RECORD_FUNCTION("ctitan::chunked_cross_entropy_forward", std::vector<c10::IValue>());
    const auto labels = labels_in.to(torch::kLong).unsqueeze(1);
    const int64_t N = logits.size(0);
    auto total = at::zeros({}, logits.options().dtype(at::kDouble));
    for (int64_t r = 0; r < N; r += rows) {
      const int64_t n = std::min(rows, N - r);
      const auto log_p = at::log_softmax(logits.narrow(0, r, n), 1, at::kFloat);
      total.sub_(log_p.gather(1, labels.narrow(0, r, n)).sum().to(at::kDouble));  // − Σ log p(label)
    }
    ctx->save_for_backward({logits, labels});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["rows"] = rows;
    return (total * scale).to(at::kFloat);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &logits = saved[0], &labels = saved[1];
    const int64_t rows = ctx->saved_data["rows"].toInt(), N = logits.size(0);
    const auto coef = grads[0].to(at::kFloat) * ctx->saved_data["scale"].toDouble();  // on the device
    auto dx = at::empty_like(logits);
    for (int64_t r = 0; r < N; r += rows) {
      const int64_t n = std::min(rows, N - r);
      // softmax, minus 1 at the label, times the upstream gradient, written in the logits'
      // dtype by the multiply itself
      auto p = at::softmax(logits.narrow(0, r, n), 1, at::kFloat);
      // one element per row: a 1-D scatter, which ATen keeps deterministic on a GPU under
      // debug.deterministic (a 2-D one it refuses there)
      const auto at_label = at::arange(n, labels.options()).mul_(logits.size(1)).add_(labels.narrow(0, r, n).view(-1));
      p.view(-1).scatter_add_(0, at_label, at::full({n}, -1.0, p.options()));
      auto out = dx.narrow(0, r, n);
      at::mul_out(out, p, coef);
    }
    return {dx, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "[models] fused_rms_norm: weight ",
              weight.sizes(), " does not fit x ", x.sizes());
  if (on_gpu(x)) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  return RMSNormFn::apply(x, weight, eps);
}

torch::Tensor fused_rotary_emb(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  TORCH_CHECK(x.dim() == 4, "[models] rotary embedding expects x [B, T, h, hd], got ", x.sizes());
  const int64_t T = x.size(1), hd = x.size(3);
  TORCH_CHECK(freqs_cis.dim() == 3 && freqs_cis.size(0) >= T && freqs_cis.size(1) * 2 == hd && freqs_cis.size(2) == 2,
              "[models] freqs_cis ", freqs_cis.sizes(), " does not fit x ", x.sizes());
  if (on_gpu(x)) {
#ifdef CTITAN_WITH_CUDA
    if (own_gpu_kernel_for(x)) return rotary_emb_cuda(x, freqs_cis);
#endif
    return rotary_emb_aten(x, freqs_cis);
  }
  return RotaryFn::apply(x, freqs_cis);
}

torch::Tensor rotary_emb_aten(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  // The pairs (a, b) as complex numbers a + ib times cos + i sin: one complex multiply in
  // float32 between the two casts (3 kernels forward; the pairs written out as real
  // arithmetic took 9), as torchtitan's apply_rotary_emb does.
  const int64_t B = x.size(0), T = x.size(1), h = x.size(2), hd = x.size(3);
  const auto f =
      at::view_as_complex(freqs_cis.narrow(0, 0, T).to(x.device(), at::kFloat).contiguous()).view({1, T, 1, hd / 2});
  const auto xc = at::view_as_complex(x.to(at::kFloat).contiguous().view({B, T, h, hd / 2, 2}));
  return at::view_as_real(xc * f).flatten(3).to(x.scalar_type());
}

torch::Tensor fused_swiglu(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "[models] fused_swiglu: a ", a.sizes(),
              " and b ", b.sizes(), " differ in shape or dtype");
  if (on_gpu(a)) {
#ifdef CTITAN_WITH_CUDA
    if (own_gpu_kernel_for(a)) return swiglu_cuda(a, b);
#endif
    return at::silu(a) * b;
  }
  return SwiGLUFn::apply(a, b);
}

torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, double scale) {
  TORCH_CHECK(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0),
              "[models] cross-entropy expects logits [N, V] and labels [N], got ", logits.sizes(), " and ",
              labels.sizes());
  if (on_gpu(logits)) {
#ifdef CTITAN_WITH_CUDA
    if (own_gpu_kernel_for(logits)) return cross_entropy_cuda(logits, labels, scale);
#endif
    return chunked_cross_entropy(logits, labels, scale);
  }
  return CrossEntropyFn::apply(logits, labels, scale);
}

torch::Tensor chunked_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, double scale,
                                    int64_t rows) {
  if (rows <= 0)  // a float32 chunk of about 256 MiB
    rows = std::max<int64_t>(1, (int64_t{256} << 20) / (4 * std::max<int64_t>(1, logits.size(1))));
  return ChunkedCrossEntropyFn::apply(logits, labels, scale, rows);
}

}  // namespace ctitan
