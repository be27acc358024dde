#include "models/flash_attention.h"

#include <cmath>
#include <limits>

namespace ctitan {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Softmax statistics and accumulators: float32 for 16- and 32-bit inputs, float64 for float64.
torch::ScalarType stat_dtype(const Tensor& t) {
  return t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Grouped layout used inside: q as [B·KV, T·rep, hd] with row t·rep + r (query head
// kv·rep + r at position t), k and v as [B·KV, T, hd]. A query block of positions
// [q0, q0 + n) is then the contiguous row range [q0·rep, (q0 + n)·rep).
struct Tile {
  int64_t q0, nq;  // query positions
  int64_t k0, nk;  // key positions
};

// True where the key lies in the future of the row's query position.
Tensor future_mask(const Tile& t, int64_t rep) {
  const auto opts = torch::TensorOptions().dtype(torch::kLong);
  const auto qpos = torch::arange(t.nq * rep, opts).div(rep, "floor") + t.q0;  // [rows]
  const auto kpos = torch::arange(t.nk, opts) + t.k0;                          // [nk]
  return kpos.unsqueeze(0) > qpos.unsqueeze(1);                                // [rows, nk]
}

// Float32 scores of one tile, future keys at -inf. qs: the tile's (scaled) query rows.
Tensor tile_scores(const Tensor& qs, const Tensor& kg, const Tile& t, int64_t rep) {
  auto s = at::bmm(qs, kg.narrow(1, t.k0, t.nk).transpose(1, 2)).to(stat_dtype(qs));
  if (t.k0 + t.nk - 1 > t.q0) s.masked_fill_(future_mask(t, rep), kNegInf);
  return s;  // [B·KV, nq·rep, nk]
}

class FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& qg, const Tensor& kg, const Tensor& vg,
                        int64_t rep, int64_t block_q, int64_t block_k) {
    const int64_t T = kg.size(1), hd = kg.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto st = stat_dtype(qg);
    auto out = torch::empty_like(qg);
    auto lse = torch::empty({qg.size(0), qg.size(1)}, qg.options().dtype(st));
    for (int64_t q0 = 0; q0 < T; q0 += block_q) {
      const int64_t nq = std::min(block_q, T - q0), kend = q0 + nq;
      const auto qs = qg.narrow(1, q0 * rep, nq * rep) * scale;
      Tensor m, l, acc;  // running max, sum of exp, unnormalised output (float32)
      for (int64_t k0 = 0; k0 < kend; k0 += block_k) {
        const Tile t{q0, nq, k0, std::min(block_k, kend - k0)};
        auto s = tile_scores(qs, kg, t, rep);
        const auto vblk = vg.narrow(1, t.k0, t.nk);
        if (!m.defined()) {  // key 0 is visible to every row: m is finite from here on
          m = std::get<0>(s.max(-1));
          auto p = s.sub_(m.unsqueeze(-1)).exp_();
          l = p.sum(-1);
          acc = at::bmm(p.to(vg.scalar_type()), vblk).to(st);
        } else {
          const auto m_new = torch::maximum(m, std::get<0>(s.max(-1)));
          const auto alpha = (m - m_new).exp_();
          auto p = s.sub_(m_new.unsqueeze(-1)).exp_();
          l = l.mul_(alpha).add_(p.sum(-1));
          acc = acc.mul_(alpha.unsqueeze(-1)).add_(at::bmm(p.to(vg.scalar_type()), vblk));
          m = m_new;
        }
      }
      out.narrow(1, q0 * rep, nq * rep).copy_(acc.div_(l.unsqueeze(-1)));
      lse.narrow(1, q0 * rep, nq * rep).copy_(m.add_(l.log_()));
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
      const int64_t nq = std::min(block_q, T - q0);
      const Tile t{q0, nq, 0, q0 + nq};
      const auto qblk = qg.narrow(1, q0 * rep, nq * rep);
      const auto dob = dout.narrow(1, q0 * rep, nq * rep);
      const auto kstrip = kg.narrow(1, 0, t.nk), vstrip = vg.narrow(1, 0, t.nk);
      const auto p = tile_scores(qblk * scale, kg, t, rep)
                         .sub_(lse.narrow(1, q0 * rep, nq * rep).unsqueeze(-1))
                         .exp_();  // [B·KV, rows, keys]
      dv.narrow(1, 0, t.nk).add_(at::bmm(p.to(dt).transpose(1, 2), dob));
      const auto dp = at::bmm(dob, vstrip.transpose(1, 2)).to(st);
      const auto D = (p * dp).sum(-1, /*keepdim=*/true);
      const auto ds = p.mul_(dp.sub_(D)).to(dt);  // dS (p no longer needed)
      dq.narrow(1, q0 * rep, nq * rep).copy_(at::bmm(ds, kstrip));
      dk.narrow(1, 0, t.nk).add_(at::bmm(ds.transpose(1, 2), qblk));
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
