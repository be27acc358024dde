#include "models/flash_attention.h"
#include "models/gemm.h"
#include "models/kernel_math.h"

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
using kernel::narrow_to;
using kernel::widen;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Grouped layout used inside: q as [B·KV, T·rep, hd] with row t·rep + r (query head
// kv·rep + r at position t), k and v as [B·KV, T, hd]. A query block of positions
// [q0, q0 + n) is then the contiguous row range [q0·rep, (q0 + n)·rep).
struct Tile {
  int64_t q0, nq;  // query positions
  int64_t k0, nk;  // key positions
};

// ---- Fused tile kernels ------------------------------------------------------------------
// The softmax part of a tile in one pass over its scores (the ATen version took ~9 kernels:
// cast, mask, max, maximum, sub, exp, sum, cast, ...). Loops are written so the compiler
// vectorises them (this file is built with -O3 -fno-trapping-math, as LibTorch's kernels).

// Keys visible to row `row` of tile t: positions k0 .. min(q, k0 + nk - 1) → a count.
inline int64_t visible_keys(const Tile& t, int64_t row, int64_t rep) {
  const int64_t q = t.q0 + row / rep;
  return std::max<int64_t>(0, std::min<int64_t>(t.nk, q - t.k0 + 1));
}

// Forward, one tile of one batch item: scores s [rows, nk] (accumulator dtype, already
// scaled) → p = exp(s − m_new) in the input dtype (0 on future keys); m (running max), l
// (running sum) updated in place; alpha = e^(m_old − m_new) for rescaling the accumulator
// (first tile: m starts at -inf, l at 0).
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_tile_forward_rows(const acc_t* S, scalar_t* P, acc_t* M, acc_t* L, acc_t* A, int64_t rows,
                                             int64_t nk, Tile t, int64_t rep) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t vis = visible_keys(t, i, rep);
    const acc_t* __restrict__ sr = S + i * nk;
    scalar_t* __restrict__ pr = P + i * nk;
    const acc_t mx = kernel::lane_max<acc_t>(vis, -std::numeric_limits<acc_t>::infinity(),
                                             [&](int64_t j) { return widen(sr[j]); });
    const acc_t m_old = M[i], m_new = std::max(m_old, mx);
    const acc_t sum = kernel::lane_sum<acc_t>(vis, [&](int64_t j) {
      const acc_t v = exp_fast(widen(sr[j]) - m_new);
      pr[j] = narrow_to<scalar_t>(v);
      return v;
    });
    for (int64_t j = vis; j < nk; ++j) pr[j] = scalar_t(0);
    const acc_t a = m_old == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : exp_fast(m_old - m_new);
    A[i] = a;
    L[i] = L[i] * a + sum;
    M[i] = m_new;
  }
}

// Backward, one strip of one batch item: scores s and dp [rows, nk] (accumulator dtype),
// lse [rows] → p = e^(s − lse) and dS = p ∘ (dp − D) with D = Σ p ∘ dp (the same dp both
// times, as autograd's softmax backward), both in the input dtype, 0 on future keys.
// prob: nk scratch values.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_strip_backward_rows(const acc_t* S, const acc_t* DP, const acc_t* LSE, scalar_t* P,
                                               scalar_t* DS, acc_t* prob, int64_t rows, int64_t nk, Tile t,
                                               int64_t rep) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t vis = visible_keys(t, i, rep);
    const acc_t* __restrict__ sr = S + i * nk;
    const acc_t* __restrict__ dpr = DP + i * nk;
    scalar_t* __restrict__ pr = P + i * nk;
    scalar_t* __restrict__ dsr = DS + i * nk;
    acc_t* __restrict__ pb = prob;
    const acc_t lse_i = LSE[i];
    const acc_t D = kernel::lane_sum<acc_t>(vis, [&](int64_t j) {
      const acc_t v = exp_fast(widen(sr[j]) - lse_i);
      pb[j] = v;
      pr[j] = narrow_to<scalar_t>(v);
      return v * widen(dpr[j]);
    });
    for (int64_t j = 0; j < vis; ++j) dsr[j] = narrow_to<scalar_t>(pb[j] * (widen(dpr[j]) - D));
    for (int64_t j = vis; j < nk; ++j) pr[j] = dsr[j] = scalar_t(0);
  }
}

// Every product goes through gemm::gemm on the raw rows of one batch item: q, k and v are
// read in place (a key strip is the first rows of the item's k, no copy), the softmax scale
// rides in alpha, and dK/dV accumulate over the query blocks in the accumulator dtype with
// beta = 1. Scores S = QKᵀ and dP = dO Vᵀ come out in the accumulator dtype (fp32 for bf16
// inputs: one rounding fewer than a bf16 matmul); P and dS are rounded to the input dtype
// before they are multiplied again, as in the naive formula.
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

// Forward of one query block [q0, q0 + nq) of one batch item over its key tiles.
template <class scalar_t, class acc_t>
struct ForwardBlock {
  const scalar_t *Q, *K, *V;  // the item's [T·rep, hd], [T, hd], [T, hd]
  scalar_t* O;                // [T·rep, hd]
  acc_t* LSE;                 // [T·rep]
  int64_t hd, rep, block_k;
  double scale;

  void operator()(int64_t q0, int64_t nq, acc_t* S, scalar_t* P, acc_t* acc, acc_t* M, acc_t* L, acc_t* A) const {
    constexpr auto type = gemm_type<scalar_t>();
    const int64_t rows = nq * rep, kend = q0 + nq;
    const scalar_t* q = Q + q0 * rep * hd;
    std::fill(M, M + rows, -std::numeric_limits<acc_t>::infinity());
    std::fill(L, L + rows, acc_t(0));
    for (int64_t k0 = 0; k0 < kend; k0 += block_k) {
      const Tile t{q0, nq, k0, std::min(block_k, kend - k0)};
      gemm::gemm(type, rows, t.nk, hd, scale, rows_of(q, hd), transposed(K + k0 * hd, hd), 0.0, S, t.nk);
      softmax_tile_forward_rows<scalar_t, acc_t>(S, P, M, L, A, rows, t.nk, t, rep);
      if (k0 > 0)  // online softmax: the rows' earlier sums were taken against a smaller max
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t d = 0; d < hd; ++d) acc[i * hd + d] *= A[i];
      gemm::gemm(type, rows, hd, t.nk, 1.0, rows_of(P, t.nk), rows_of(V + k0 * hd, hd), k0 > 0 ? 1.0 : 0.0, acc, hd);
    }
    scalar_t* o = O + q0 * rep * hd;
    acc_t* lse = LSE + q0 * rep;
    for (int64_t i = 0; i < rows; ++i) {
      const acc_t inv = acc_t(1) / L[i];
      for (int64_t d = 0; d < hd; ++d) o[i * hd + d] = narrow_to<scalar_t>(acc[i * hd + d] * inv);
      lse[i] = M[i] + std::log(L[i]);
    }
  }
};

class FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& qg_in, const Tensor& kg_in, const Tensor& vg_in,
                        int64_t rep, int64_t block_q, int64_t block_k) {
    RECORD_FUNCTION("ctitan::flash_attention_forward", std::vector<c10::IValue>());
    const auto qg = qg_in.contiguous(), kg = kg_in.contiguous(), vg = vg_in.contiguous();
    const int64_t BKV = qg.size(0), T = kg.size(1), hd = kg.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto st = kernel::acc_dtype(qg.scalar_type());
    auto out = torch::empty_like(qg);
    auto lse = torch::empty({BKV, qg.size(1)}, qg.options().dtype(st));
    const int64_t nblocks = (T + block_q - 1) / block_q;
    const int64_t bq = std::min(block_q, T), bk = std::min(block_k, T);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qg.scalar_type(), "ctitan_flash_forward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t *Q = qg.data_ptr<scalar_t>(), *K = kg.data_ptr<scalar_t>(), *V = vg.data_ptr<scalar_t>();
      scalar_t* O = out.data_ptr<scalar_t>();
      acc_t* LSE = lse.data_ptr<acc_t>();
      // Tasks: (item, query block), item-major, so two halves of the range do equal work.
      at::parallel_for(0, BKV * nblocks, 1, [&](int64_t begin, int64_t end) {
        const int64_t rows = bq * rep;
        Tensor k1, k2, k3, k4;
        acc_t* S = scratch<acc_t>(k1, rows * bk, st);
        scalar_t* P = scratch<scalar_t>(k2, rows * bk, qg.scalar_type());
        acc_t* acc = scratch<acc_t>(k3, rows * hd, st);
        acc_t* stats = scratch<acc_t>(k4, 3 * rows, st);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / nblocks, q0 = (task % nblocks) * block_q;
          const ForwardBlock<scalar_t, acc_t> fb{Q + b * T * rep * hd, K + b * T * hd, V + b * T * hd,
                                                 O + b * T * rep * hd, LSE + b * T * rep, hd, rep, bk, scale};
          fb(q0, std::min(block_q, T - q0), S, P, acc, stats, stats + rows, stats + 2 * rows);
        }
      });
    });
    ctx->save_for_backward({qg, kg, vg, lse});
    ctx->saved_data["rep"] = rep;
    ctx->saved_data["block_q"] = block_q;
    return out;
  }

  // Backward, one query block (a strip of rows × all keys up to the diagonal) at a time,
  // the items spread over the threads (an item's dK, dV collect all its strips):
  //   S = QKᵀ/√hd;  P = e^(S − lse);  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(P ∘ dP));
  //   dV += Pᵀ dO;  dQ = dS K/√hd;  dK += dSᵀ Q/√hd.
  // D = rowsum(P ∘ dP) is taken from the same dP that dS uses, as autograd's softmax
  // backward does. (D = rowsum(dO ∘ O) is equal in exact arithmetic but, with bf16 O,
  // leaves a rounding bias in dS that is not there in the naive formula's gradients.)
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("ctitan::flash_attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const Tensor &qg = saved[0], &kg = saved[1], &vg = saved[2], &lse = saved[3];
    const int64_t rep = ctx->saved_data["rep"].toInt();
    const int64_t block_q = ctx->saved_data["block_q"].toInt();
    const auto dt = qg.scalar_type(), st = lse.scalar_type();
    const int64_t BKV = qg.size(0), T = kg.size(1), hd = kg.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto dout = grads[0].to(dt).contiguous();
    auto dq = torch::empty(qg.sizes(), qg.options().dtype(st));
    auto dk = torch::zeros(kg.sizes(), kg.options().dtype(st));
    auto dv = torch::zeros(vg.sizes(), vg.options().dtype(st));
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "ctitan_flash_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      constexpr auto type = gemm_type<scalar_t>();
      const scalar_t *Q = qg.data_ptr<scalar_t>(), *K = kg.data_ptr<scalar_t>(), *V = vg.data_ptr<scalar_t>(),
                     *DO = dout.data_ptr<scalar_t>();
      const acc_t* LSE = lse.data_ptr<acc_t>();
      acc_t *DQ = dq.data_ptr<acc_t>(), *DK = dk.data_ptr<acc_t>(), *DV = dv.data_ptr<acc_t>();
      at::parallel_for(0, BKV, 1, [&](int64_t begin, int64_t end) {
        const int64_t rows = std::min(block_q, T) * rep, strip = rows * T;
        Tensor k1, k2, k3, k4, k5;
        acc_t* S = scratch<acc_t>(k1, strip, st);
        acc_t* DP = scratch<acc_t>(k2, strip, st);
        scalar_t* P = scratch<scalar_t>(k3, strip, dt);
        scalar_t* DS = scratch<scalar_t>(k4, strip, dt);
        acc_t* prob = scratch<acc_t>(k5, T, st);
        for (int64_t b = begin; b < end; ++b) {
          const scalar_t *q = Q + b * T * rep * hd, *k = K + b * T * hd, *v = V + b * T * hd,
                         *dO = DO + b * T * rep * hd;
          acc_t *dQ = DQ + b * T * rep * hd, *dK = DK + b * T * hd, *dV = DV + b * T * hd;
          for (int64_t q0 = 0; q0 < T; q0 += block_q) {
            const int64_t nq = std::min(block_q, T - q0), r = nq * rep, nk = q0 + nq, off = q0 * rep * hd;
            const Tile t{q0, nq, 0, nk};
            gemm::gemm(type, r, nk, hd, scale, rows_of(q + off, hd), transposed(k, hd), 0.0, S, nk);
            gemm::gemm(type, r, nk, hd, 1.0, rows_of(dO + off, hd), transposed(v, hd), 0.0, DP, nk);
            softmax_strip_backward_rows<scalar_t, acc_t>(S, DP, LSE + b * T * rep + q0 * rep, P, DS, prob, r, nk,
                                                         t, rep);
            gemm::gemm(type, nk, hd, r, 1.0, transposed(P, nk), rows_of(dO + off, hd), 1.0, dV, hd);
            gemm::gemm(type, r, hd, nk, scale, rows_of(DS, nk), rows_of(k, hd), 0.0, dQ + off, hd);
            gemm::gemm(type, nk, hd, r, scale, transposed(DS, nk), rows_of(q + off, hd), 1.0, dK, hd);
          }
        }
      });
    });
    return {dq.to(dt), dk.to(dt), dv.to(dt), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

torch::Tensor flash_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, FlashAttentionBlocks blocks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "[models] flash_causal_attention expects q [B, T, H, hd] and k, v [B, T, KV, hd], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), KV = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == T && k.size(3) == hd && KV > 0 && H % KV == 0,
              "[models] flash_causal_attention: q ", q.sizes(), " and k ", k.sizes(), " do not fit");
  TORCH_CHECK(blocks.q > 0 && blocks.k > 0, "[models] flash_causal_attention: block sizes must be positive");
  const int64_t rep = H / KV;
  // [B, T, KV, rep, hd] → [B, KV, T, rep, hd]: the heads sharing a kv head become rows.
  const auto qg = q.reshape({B, T, KV, rep, hd}).permute({0, 2, 1, 3, 4}).reshape({B * KV, T * rep, hd});
  const auto kg = k.permute({0, 2, 1, 3}).reshape({B * KV, T, hd});
  const auto vg = v.permute({0, 2, 1, 3}).reshape({B * KV, T, hd});
  const auto out = FlashAttentionFn::apply(qg, kg, vg, rep, blocks.q, blocks.k);
  return out.view({B, KV, T, rep, hd}).permute({0, 2, 1, 3, 4}).reshape({B, T, H, hd});
}

}  // namespace ctitan
