#include "models/flash_attention.h"
#include "models/kernel_math.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <dlfcn.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace ctitan {
namespace {

using kernel::exp_fast;
using kernel::narrow_to;
using kernel::widen;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

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

// Forward, one tile: s [BKV, rows, nk] (input dtype) → p = exp(s − m_new) in the input dtype
// (0 on future keys); m (running max), l (running sum) updated in place; alpha = e^(m_old −
// m_new) for rescaling the accumulator (first tile: m starts at -inf, l at 0). Rows [b, e).
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_tile_forward_rows(const scalar_t* S, scalar_t* P, acc_t* M, acc_t* L, acc_t* A,
                                             int64_t rows, int64_t nk, Tile t, int64_t rep, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const int64_t vis = visible_keys(t, i % rows, rep);
    const scalar_t* __restrict__ sr = S + i * nk;
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

void softmax_tile_forward(const Tensor& s, Tensor& p, const Tensor& m, const Tensor& l, const Tensor& alpha,
                          const Tile& t, int64_t rep) {
  RECORD_FUNCTION("ctitan::softmax_tile_forward", std::vector<c10::IValue>());
  const int64_t BKV = s.size(0), rows = s.size(1), nk = s.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, s.scalar_type(), "ctitan_softmax_tile", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* S = s.data_ptr<scalar_t>();
    scalar_t* P = p.data_ptr<scalar_t>();
    acc_t *M = m.data_ptr<acc_t>(), *L = l.data_ptr<acc_t>(), *A = alpha.data_ptr<acc_t>();
    at::parallel_for(0, BKV * rows, 16, [&](int64_t b, int64_t e) {
      softmax_tile_forward_rows<scalar_t, acc_t>(S, P, M, L, A, rows, nk, t, rep, b, e);
    });
  });
}

// Backward, one strip: s and dp [BKV, rows, nk] (input dtype), lse [BKV·rows] → p = e^(s −
// lse) and dS = p ∘ (dp − D) with D = Σ p ∘ dp (the same rounded dp both times, as
// autograd's softmax backward), both in the input dtype, 0 on future keys. Rows [b, e);
// prob: nk scratch values.
template <class scalar_t, class acc_t>
CTITAN_KERNEL void softmax_strip_backward_rows(const scalar_t* S, const scalar_t* DP, const acc_t* LSE, scalar_t* P,
                                               scalar_t* DS, acc_t* prob, int64_t rows, int64_t nk, Tile t,
                                               int64_t rep, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const int64_t vis = visible_keys(t, i % rows, rep);
    const scalar_t* __restrict__ sr = S + i * nk;
    const scalar_t* __restrict__ dpr = DP + i * nk;
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

void softmax_strip_backward(const Tensor& s, const Tensor& dp, const Tensor& lse, Tensor& p, Tensor& ds,
                            const Tile& t, int64_t rep) {
  RECORD_FUNCTION("ctitan::softmax_strip_backward", std::vector<c10::IValue>());
  const int64_t BKV = s.size(0), rows = s.size(1), nk = s.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, s.scalar_type(), "ctitan_softmax_strip_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *S = s.data_ptr<scalar_t>(), *DP = dp.data_ptr<scalar_t>();
    const acc_t* LSE = lse.data_ptr<acc_t>();
    scalar_t *P = p.data_ptr<scalar_t>(), *DS = ds.data_ptr<scalar_t>();
    at::parallel_for(0, BKV * rows, 16, [&](int64_t b, int64_t e) {
      std::vector<acc_t> prob(nk);
      softmax_strip_backward_rows<scalar_t, acc_t>(S, DP, LSE, P, DS, prob.data(), rows, nk, t, rep, b, e);
    });
  });
}


// Batched matmul of the tiles. bf16 goes to at::bmm (one oneDNN call for the whole batch).
// For fp32/fp64, LibTorch 1.13 without MKL runs at::bmm as one BLAS call per batch item,
// each split over OpenBLAS's threads — for attention tiles (B·KV items of a few hundred
// rows × head_dim) the thread hand-off costs more than the arithmetic (measured: bmm was
// 75% of an fp32 debug-model step). Here the batch items are spread over LibTorch's
// threads instead, each item one single-threaded BLAS call.
using BlasSetThreads = void (*)(int);
BlasSetThreads openblas_threads_setter() {
  static const auto f = reinterpret_cast<BlasSetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  return f;
}
using BlasGetThreads = int (*)();
BlasGetThreads openblas_threads_getter() {
  static const auto f = reinterpret_cast<BlasGetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return f;
}

Tensor tile_bmm(const Tensor& a, const Tensor& b) {
  if (a.scalar_type() == torch::kBFloat16 || a.size(0) < 2) return at::bmm(a, b);
  auto out = torch::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  const auto set = openblas_threads_setter();
  const auto get = openblas_threads_getter();
  const int blas_threads = get ? get() : 1;
  if (set) set(1);
  // Worker threads start with autograd's thread-local grad mode on: operate on detached
  // operands with it off (an out= op refuses inputs that require grad).
  const auto ad = a.detach(), bd = b.detach();
  at::parallel_for(0, a.size(0), 1, [&](int64_t begin, int64_t end) {
    torch::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      auto o = out.select(0, i);
      at::mm_out(o, ad.select(0, i), bd.select(0, i));
    }
  });
  if (set) set(blas_threads);
  return out;
}

class FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& qg, const Tensor& kg, const Tensor& vg,
                        int64_t rep, int64_t block_q, int64_t block_k) {
    RECORD_FUNCTION("ctitan::flash_attention_forward", std::vector<c10::IValue>());
    const int64_t BKV = qg.size(0), T = kg.size(1), hd = kg.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto st = kernel::acc_dtype(qg.scalar_type());
    auto out = torch::empty_like(qg);
    auto lse = torch::empty({BKV, qg.size(1)}, qg.options().dtype(st));
    for (int64_t q0 = 0; q0 < T; q0 += block_q) {
      const int64_t nq = std::min(block_q, T - q0), kend = q0 + nq, rows = nq * rep;
      const auto qs = qg.narrow(1, q0 * rep, rows) * scale;
      auto m = torch::full({BKV, rows}, kNegInf, qg.options().dtype(st));
      auto l = torch::zeros({BKV, rows}, qg.options().dtype(st));
      auto alpha = torch::empty({BKV, rows}, qg.options().dtype(st));
      Tensor acc;  // unnormalised output, statistics dtype
      for (int64_t k0 = 0; k0 < kend; k0 += block_k) {
        const Tile t{q0, nq, k0, std::min(block_k, kend - k0)};
        // bmm operands are compact (or a transposed view of a compact tensor): a narrowed
        // batch (batch stride != rows·cols) sends bf16 bmm to a path ~7x slower.
        const auto kt = kg.narrow(1, t.k0, t.nk).contiguous();
        const auto s = tile_bmm(qs, kt.transpose(1, 2));  // [BKV, rows, nk]
        auto p = torch::empty_like(s);
        softmax_tile_forward(s, p, m, l, alpha, t, rep);
        const auto pv = tile_bmm(p, vg.narrow(1, t.k0, t.nk).contiguous());
        acc = acc.defined() ? acc.mul_(alpha.unsqueeze(-1)).add_(pv) : pv.to(st);
      }
      out.narrow(1, q0 * rep, rows).copy_(acc.div_(l.unsqueeze(-1)));
      lse.narrow(1, q0 * rep, rows).copy_(m.add_(l.log_()));
    }
    ctx->save_for_backward({qg, kg, vg, lse});
    ctx->saved_data["rep"] = rep;
    ctx->saved_data["block_q"] = block_q;
    return out;
  }

  // Backward, one query block (a strip of rows × all keys up to the diagonal) at a time:
  // the strip's probabilities come back from the saved log-sum-exp, and D = rowsum(P ∘ dP)
  // is taken from the same rounded dP that dS uses, as autograd's softmax backward does.
  // (D = rowsum(dO ∘ O) is equal in exact arithmetic but, with bf16 products, leaves a
  // rounding bias in dS that is not there in the naive formula's gradients.)
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &qg = saved[0], &kg = saved[1], &vg = saved[2], &lse = saved[3];
    const int64_t rep = ctx->saved_data["rep"].toInt();
    const int64_t block_q = ctx->saved_data["block_q"].toInt();
    const auto dt = qg.scalar_type(), st = lse.scalar_type();
    const int64_t T = kg.size(1), hd = kg.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto dout = grads[0].to(dt).contiguous();
    auto dq = torch::empty(qg.sizes(), qg.options().dtype(st));
    auto dk = torch::zeros(kg.sizes(), kg.options().dtype(st));
    auto dv = torch::zeros(vg.sizes(), vg.options().dtype(st));
    for (int64_t q0 = 0; q0 < T; q0 += block_q) {
      const int64_t nq = std::min(block_q, T - q0), rows = nq * rep;
      const Tile t{q0, nq, 0, q0 + nq};
      // Compact bmm operands, as in forward.
      const auto qblk = qg.narrow(1, q0 * rep, rows).contiguous();
      const auto dob = dout.narrow(1, q0 * rep, rows).contiguous();
      const auto kstrip = kg.narrow(1, 0, t.nk).contiguous(), vstrip = vg.narrow(1, 0, t.nk).contiguous();
      const auto s = tile_bmm(qblk * scale, kstrip.transpose(1, 2));  // [BKV, rows, keys]
      const auto dp = tile_bmm(dob, vstrip.transpose(1, 2));
      auto p = torch::empty_like(s), ds = torch::empty_like(s);
      softmax_strip_backward(s, dp, lse.narrow(1, q0 * rep, rows).contiguous(), p, ds, t, rep);
      dv.narrow(1, 0, t.nk).add_(tile_bmm(p.transpose(1, 2), dob));
      dq.narrow(1, q0 * rep, rows).copy_(tile_bmm(ds, kstrip));
      dk.narrow(1, 0, t.nk).add_(tile_bmm(ds.transpose(1, 2), qblk));
    }
    return {dq.mul_(scale).to(dt), dk.mul_(scale).to(dt), dv.to(dt), Tensor(), Tensor(), Tensor()};
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
