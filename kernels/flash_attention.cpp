#include "kernels/flash_attention.h"
#include "kernels/attention_direct.h"
#include "kernels/device_route.h"
#include "kernels/gemm.h"
#include "kernels/kernel_math.h"
#include "kernels/sdpa_choice.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ctitan {
namespace {

using kernel::exp_fast;
using kernel::ld;
using kernel::narrow_to;
using kernel::st;
using kernel::widen;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The kernels work in the model's own layout, q [B, T, H, hd] and k, v [B, T, KV, hd]: the
// rows of one head (positions t = 0..T-1) are a matrix with leading dimension H·hd (KV·hd),
// which the GEMM reads in place, so no head is ever copied out (nor, for GQA, repeated).
// A tile is the scores of query positions [q0, q0 + nq) of one head against key positions
// [k0, k0 + nk) of its kv head.
struct Tile {
  int64_t q0, nq;  // query positions
  int64_t k0, nk;  // key positions
};

// ---- Fused tile kernels ------------------------------------------------------------------
// The softmax part of a tile in one pass over its scores (the ATen version took ~9 kernels:
// cast, mask, max, maximum, sub, exp, sum, cast, ...). Loops are written so the compiler
// vectorises them (this file is built with -O3 -fno-trapping-math, as LibTorch's kernels).

// Keys visible to row `row` (query position q0 + row) of tile t: positions k0 .. min(q,
// k0 + nk - 1) → a count.
inline int64_t visible_keys(const Tile& t, int64_t row) {
  return std::max<int64_t>(0, std::min<int64_t>(t.nk, t.q0 + row - t.k0 + 1));
}

// Forward, one tile of one head: scores s [rows, nk] (accumulator dtype, already
// scaled) → p = exp(s − m_new) in the input dtype (0 on future keys); m (running max), l
// (running sum) updated in place; alpha = e^(m_old − m_new) for rescaling the accumulator
// (first tile: m starts at -inf, l at 0).
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_tile_forward_rows(const acc_t* S, scalar_t* P, acc_t* M, acc_t* L, acc_t* A, int64_t rows,
                                             int64_t nk, Tile t) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t vis = visible_keys(t, i);
    const acc_t* __restrict__ sr = S + i * nk;
    scalar_t* __restrict__ pr = P + i * nk;
    const acc_t mx =
        kernel::lane_max<acc_t>(vis, -std::numeric_limits<acc_t>::infinity(), [&](auto j) { return ld(sr, j); });
    const acc_t m_old = M[i], m_new = std::max(m_old, mx);
    const acc_t sum = kernel::lane_sum<acc_t>(vis, [&](auto j) {
      const auto v = exp_fast(ld(sr, j) - m_new);
      st(pr, j, v);
      return v;
    });
    for (int64_t j = vis; j < nk; ++j) pr[j] = scalar_t(0);
    const acc_t a = m_old == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : exp_fast(m_old - m_new);
    A[i] = a;
    L[i] = L[i] * a + sum;
    M[i] = m_new;
  }
}

// Backward, one strip of one head: scores s and dp [rows, nk] (accumulator dtype),
// lse [rows] → p = e^(s − lse) and dS = p ∘ (dp − D) with D = Σ p ∘ dp (the same dp both
// times, as autograd's softmax backward), both in the input dtype, 0 on future keys.
// prob: nk scratch values.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_strip_backward_rows(const acc_t* S, const acc_t* DP, const acc_t* LSE, scalar_t* P,
                                               scalar_t* DS, acc_t* prob, int64_t rows, int64_t nk, Tile t) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t vis = visible_keys(t, i);
    const acc_t* __restrict__ sr = S + i * nk;
    const acc_t* __restrict__ dpr = DP + i * nk;
    scalar_t* __restrict__ pr = P + i * nk;
    scalar_t* __restrict__ dsr = DS + i * nk;
    acc_t* __restrict__ pb = prob;
    const acc_t lse_i = LSE[i];
    const acc_t D = kernel::lane_sum<acc_t>(vis, [&](auto j) {
      const auto v = exp_fast(ld(sr, j) - lse_i);
      st(pb, j, v);
      st(pr, j, v);
      return v * ld(dpr, j);
    });
    kernel::for_lanes<acc_t>(vis, [&](auto j) { st(dsr, j, ld(pb, j) * (ld(dpr, j) - D)); });
    for (int64_t j = vis; j < nk; ++j) pr[j] = dsr[j] = scalar_t(0);
  }
}

// Every product goes through gemm::gemm on the rows of one head: q, k and v are read in
// place (a key strip is the first rows of the head's k, no copy), the softmax scale rides
// in alpha, and dK/dV accumulate over the query blocks and the query heads sharing them in
// the accumulator dtype with beta = 1. Scores S = QKᵀ and dP = dO Vᵀ come out in the
// accumulator dtype (fp32 for bf16 inputs: one rounding fewer than a bf16 matmul); P and dS
// are rounded to the input dtype before they are multiplied again, as in the naive formula.
template <class scalar_t>
constexpr at::ScalarType gemm_type() {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return at::kBFloat16;
  if constexpr (std::is_same_v<scalar_t, float>) return at::kFloat;
  return at::kDouble;
}

gemm::Operand rows_of(const void* p, int64_t ld) { return gemm::Operand{p, ld, false}; }
gemm::Operand transposed(const void* p, int64_t ld) { return gemm::Operand{p, ld, true}; }

// Scratch of one worker: at::empty, so the caching CPU allocator serves it without faults.
template <class T>
T* scratch(Tensor& keep, int64_t n, at::ScalarType type) {
  keep = torch::empty({std::max<int64_t>(n, 1)}, torch::TensorOptions().dtype(type));
  return static_cast<T*>(keep.data_ptr());
}

// Forward of query positions [q0, q0 + nq) of one head over its key tiles.
template <class scalar_t, class acc_t>
struct ForwardBlock {
  const scalar_t *Q, *K, *V;  // the head's rows: Q, K, V at position t are Q + t·ldq, ...
  scalar_t* O;                // rows with leading dimension ldq
  acc_t* LSE;                 // [T]
  int64_t ldq, ldk, hd, block_k;
  double scale;

  void operator()(int64_t q0, int64_t nq, acc_t* S, scalar_t* P, acc_t* acc, acc_t* M, acc_t* L, acc_t* A) const {
    constexpr auto type = gemm_type<scalar_t>();
    const int64_t kend = q0 + nq;
    std::fill(M, M + nq, -std::numeric_limits<acc_t>::infinity());
    std::fill(L, L + nq, acc_t(0));
    for (int64_t k0 = 0; k0 < kend; k0 += block_k) {
      const Tile t{q0, nq, k0, std::min(block_k, kend - k0)};
      gemm::gemm(type, nq, t.nk, hd, scale, rows_of(Q + q0 * ldq, ldq), transposed(K + k0 * ldk, ldk), 0.0, S, t.nk);
      softmax_tile_forward_rows<scalar_t, acc_t>(S, P, M, L, A, nq, t.nk, t);
      if (k0 > 0)  // online softmax: the rows' earlier sums were taken against a smaller max
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t d = 0; d < hd; ++d) acc[i * hd + d] *= A[i];
      gemm::gemm(type, nq, hd, t.nk, 1.0, rows_of(P, t.nk), rows_of(V + k0 * ldk, ldk), k0 > 0 ? 1.0 : 0.0, acc, hd);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const acc_t inv = acc_t(1) / L[i];
      scalar_t* o = O + (q0 + i) * ldq;
      for (int64_t d = 0; d < hd; ++d) o[d] = narrow_to<scalar_t>(acc[i * hd + d] * inv);
      LSE[q0 + i] = M[i] + std::log(L[i]);
    }
  }
};

class FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
 public:
  // q [B, T, H, hd], k and v [B, T, KV, hd], all contiguous.
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t block_q,
                        int64_t block_k, int64_t path, int64_t direct_lanes) {
    RECORD_FUNCTION("ctitan::flash_attention_forward", std::vector<c10::IValue>());
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), KV = k.size(2), rep = H / KV;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto st = kernel::acc_dtype(q.scalar_type());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H, T}, q.options().dtype(st));
    using Path = FlashAttentionBlocks::Path;
    const bool direct = q.scalar_type() == at::kFloat && attention_direct::takes(hd) &&
                        (path == static_cast<int64_t>(Path::Direct) ||
                         (path == static_cast<int64_t>(Path::Rule) && attention_direct::preferred(hd, T)));
    ctx->save_for_backward({q, k, v, lse});
    ctx->saved_data["block_q"] = block_q;
    ctx->saved_data["direct"] = direct;
    ctx->saved_data["direct_lanes"] = direct_lanes;
    if (direct) {
      attention_direct::forward({B, T, H, KV, hd}, scale, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                out.data_ptr<float>(), lse.data_ptr<float>(), static_cast<int>(direct_lanes));
      return out;
    }
    const int64_t nblocks = (T + block_q - 1) / block_q;
    const int64_t bq = std::min(block_q, T), bk = std::min(block_k, T);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "ctitan_flash_forward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t *Q = q.data_ptr<scalar_t>(), *K = k.data_ptr<scalar_t>(), *V = v.data_ptr<scalar_t>();
      scalar_t* O = out.data_ptr<scalar_t>();
      acc_t* LSE = lse.data_ptr<acc_t>();
      // Tasks: (batch item, head, query block) in that order, so the halves of the range
      // given to two threads do equal work.
      at::parallel_for(0, B * H * nblocks, 1, [&](int64_t begin, int64_t end) {
        Tensor k1, k2, k3, k4;
        acc_t* S = scratch<acc_t>(k1, bq * bk, st);
        scalar_t* P = scratch<scalar_t>(k2, bq * bk, q.scalar_type());
        acc_t* acc = scratch<acc_t>(k3, bq * hd, st);
        acc_t* stats = scratch<acc_t>(k4, 3 * bq, st);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t bh = task / nblocks, b = bh / H, h = bh % H, q0 = (task % nblocks) * block_q;
          const int64_t qoff = (b * T * H + h) * hd, koff = (b * T * KV + h / rep) * hd;
          const ForwardBlock<scalar_t, acc_t> fb{Q + qoff, K + koff, V + koff, O + qoff, LSE + bh * T,
                                                 H * hd,   KV * hd,  hd,       bk,       scale};
          fb(q0, std::min(block_q, T - q0), S, P, acc, stats, stats + bq, stats + 2 * bq);
        }
      });
    });
    return out;
  }

  // Backward, one query block (a strip of rows × all keys up to the diagonal) of one head at
  // a time; a task is one (batch item, kv head) with every query head that reads it, so its
  // dK and dV collect all their strips on one thread:
  //   S = QKᵀ/√hd;  P = e^(S − lse);  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(P ∘ dP));
  //   dV += Pᵀ dO;  dQ = dS K/√hd;  dK += dSᵀ Q/√hd.
  // D = rowsum(P ∘ dP) is taken from the same dP that dS uses, as autograd's softmax
  // backward does. (D = rowsum(dO ∘ O) is equal in exact arithmetic but, with bf16 O,
  // leaves a rounding bias in dS that is not there in the naive formula's gradients.)
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("ctitan::flash_attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &lse = saved[3];
    const int64_t block_q = ctx->saved_data["block_q"].toInt();
    const auto dt = q.scalar_type(), st = lse.scalar_type();
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), KV = k.size(2), rep = H / KV;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto dout = grads[0].to(dt).contiguous();
    // Gradients in the accumulator dtype (for fp32 inputs: the outputs themselves).
    auto dq = torch::empty(q.sizes(), q.options().dtype(st));
    auto dk = torch::zeros(k.sizes(), k.options().dtype(st));
    auto dv = torch::zeros(v.sizes(), v.options().dtype(st));
    if (ctx->saved_data["direct"].toBool()) {
      attention_direct::backward({B, T, H, KV, hd}, scale, q.data_ptr<float>(), k.data_ptr<float>(),
                                 v.data_ptr<float>(), dout.data_ptr<float>(), lse.data_ptr<float>(),
                                 dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(),
                                 static_cast<int>(ctx->saved_data["direct_lanes"].toInt()));
      return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor()};
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "ctitan_flash_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      constexpr auto type = gemm_type<scalar_t>();
      const scalar_t *Q = q.data_ptr<scalar_t>(), *K = k.data_ptr<scalar_t>(), *V = v.data_ptr<scalar_t>(),
                     *DO = dout.data_ptr<scalar_t>();
      const acc_t* LSE = lse.data_ptr<acc_t>();
      acc_t *DQ = dq.data_ptr<acc_t>(), *DK = dk.data_ptr<acc_t>(), *DV = dv.data_ptr<acc_t>();
      const int64_t ldq = H * hd, ldk = KV * hd;
      at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
        const int64_t strip = std::min(block_q, T) * T;
        Tensor k1, k2, k3, k4, k5;
        acc_t* S = scratch<acc_t>(k1, strip, st);
        acc_t* DP = scratch<acc_t>(k2, strip, st);
        scalar_t* P = scratch<scalar_t>(k3, strip, dt);
        scalar_t* DS = scratch<scalar_t>(k4, strip, dt);
        acc_t* prob = scratch<acc_t>(k5, T, st);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / KV, kv = task % KV, koff = (b * T * KV + kv) * hd;
          const scalar_t *kk = K + koff, *vv = V + koff;
          acc_t *dK = DK + koff, *dV = DV + koff;
          for (int64_t h = kv * rep; h < (kv + 1) * rep; ++h) {
            const int64_t qoff = (b * T * H + h) * hd;
            for (int64_t q0 = 0; q0 < T; q0 += block_q) {
              const int64_t nq = std::min(block_q, T - q0), nk = q0 + nq, off = qoff + q0 * ldq;
              const Tile t{q0, nq, 0, nk};
              gemm::gemm(type, nq, nk, hd, scale, rows_of(Q + off, ldq), transposed(kk, ldk), 0.0, S, nk);
              gemm::gemm(type, nq, nk, hd, 1.0, rows_of(DO + off, ldq), transposed(vv, ldk), 0.0, DP, nk);
              softmax_strip_backward_rows<scalar_t, acc_t>(S, DP, LSE + (b * H + h) * T + q0, P, DS, prob, nq, nk, t);
              gemm::gemm(type, nk, hd, nq, 1.0, transposed(P, nk), rows_of(DO + off, ldq), 1.0, dV, ldk);
              gemm::gemm(type, nq, hd, nk, scale, rows_of(DS, nk), rows_of(kk, ldk), 0.0, DQ + off, ldq);
              gemm::gemm(type, nk, hd, nq, scale, transposed(DS, nk), rows_of(Q + off, ldq), 1.0, dK, ldk);
            }
          }
        }
      });
    });
    return {dq.to(dt), dk.to(dt), dv.to(dt), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

torch::Tensor flash_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     FlashAttentionBlocks blocks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "[models] flash_causal_attention expects q [B, T, H, hd] and k, v [B, T, KV, hd], got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), KV = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == T && k.size(3) == hd && KV > 0 && H % KV == 0,
              "[models] flash_causal_attention: q ", q.sizes(), " and k ", k.sizes(), " do not fit");
  TORCH_CHECK(blocks.q > 0 && blocks.k > 0, "[models] flash_causal_attention: block sizes must be positive");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "[models] flash_causal_attention: q, k and v must share a dtype");
  if (on_gpu(q)) {
    // ATen's fused kernel, the one model.sdpa_backend chose first (kernels/sdpa_choice.h);
    // GQA without a repeat_kv copy unless that backend needs one.
    return sdpa_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), current_sdpa().repeat_kv)
        .transpose(1, 2);  // [B, T, H, hd]
  }
  return FlashAttentionFn::apply(q.contiguous(), k.contiguous(), v.contiguous(), blocks.q, blocks.k,
                                 static_cast<int64_t>(blocks.path), blocks.direct_lanes);
}

}  // namespace ctitan
