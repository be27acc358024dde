#include "kernels/sdpa_choice.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>

namespace ctitan {

namespace {

SdpaChoice& sdpa_state() {
  static SdpaChoice c;  // set once at start-up, before any forward; read by every GPU forward
  return c;
}

// ATen's priority order with `first` in front and the rest in ATen's default order.
std::vector<int64_t> order_with_first(at::SDPBackend first) {
  std::vector<int64_t> order{static_cast<int64_t>(first)};
  for (auto b : {at::SDPBackend::flash_attention, at::SDPBackend::efficient_attention, at::SDPBackend::math,
                 at::SDPBackend::cudnn_attention, at::SDPBackend::overrideable})
    if (b != first) order.push_back(static_cast<int64_t>(b));
  return order;
}

// A deterministic, non-constant fill in [-0.5, 0.5): no generator is drawn from, so the
// measurement leaves the run's random streams as they were.
at::Tensor pattern(at::IntArrayRef sizes, const SdpaShape& s, double step) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(s.device);
  int64_t n = 1;
  for (auto d : sizes) n *= d;
  return at::arange(n, opts).mul_(step).frac_().sub_(0.5).view(sizes).to(s.dtype);
}

struct Operands {
  at::Tensor q, k, v;
};

// k or v [B, KV, T, hd] with each kv head repeated for the `groups` query heads that share it.
at::Tensor repeat_heads(const at::Tensor& kv, int64_t groups) {
  return groups > 1 ? kv.repeat_interleave(groups, 1) : kv;
}

// One forward + backward as flash_causal_attention's GPU route runs it.
void attention_step(const Operands& o, bool repeat_kv) {
  auto out = sdpa_causal(o.q, o.k, o.v, repeat_kv);
  out.backward(at::ones_like(out));
}

void wait_host(const Operands& o) {  // a host read waits for the queued work
  if (o.q.grad().defined()) o.q.grad().flatten()[0].item<double>();
}

double time_ms(const Operands& o, bool repeat_kv, int reps) {
  attention_step(o, repeat_kv);  // warm-up: kernel selection, cuDNN's plan
  wait_host(o);
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    attention_step(o, repeat_kv);
    wait_host(o);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

std::string sdpa_backend_name(at::SDPBackend b) {
  switch (b) {
    case at::SDPBackend::cudnn_attention: return "cudnn";
    case at::SDPBackend::flash_attention: return "flash";
    case at::SDPBackend::efficient_attention: return "efficient";
    case at::SDPBackend::math: return "math";
    default: return "other";
  }
}

std::string SdpaChoice::name() const { return sdpa_backend_name(backend) + (repeat_kv ? " (kv repeated)" : ""); }

std::string SdpaChoice::summary() const {
  std::string s;
  for (const auto& t : tried) {
    if (!s.empty()) s += ", ";
    s += t.usable ? fmt::format("{} {:.2f} ms", t.name, t.ms) : t.name + ": not usable";
  }
  return s;
}

SdpaChoice choose_sdpa(const SdpaShape& s, const std::vector<at::SDPBackend>& candidates, int reps) {
  auto& ctx = at::globalContext();
  const auto saved_order = ctx.sDPPriorityOrder();
  const int64_t groups = s.kv_heads > 0 ? s.heads / s.kv_heads : 1;
  Operands o;
  o.q = pattern({s.batch, s.heads, s.seq, s.head_dim}, s, 0.618).requires_grad_();
  o.k = pattern({s.batch, s.kv_heads, s.seq, s.head_dim}, s, 0.414).requires_grad_();
  o.v = pattern({s.batch, s.kv_heads, s.seq, s.head_dim}, s, 0.732).requires_grad_();
  SdpaChoice best;
  bool chosen = false;
  for (const auto b : candidates) {
    ctx.setSDPPriorityOrder(order_with_first(b));
    for (const bool repeat : {false, true}) {
      if (repeat && (b != at::SDPBackend::cudnn_attention || groups == 1)) continue;
      const at::Tensor k = repeat ? repeat_heads(o.k.detach(), groups) : o.k;
      const at::Tensor v = repeat ? repeat_heads(o.v.detach(), groups) : o.v;
      const auto picked = static_cast<at::SDPBackend>(at::_fused_sdp_choice(
          o.q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/!repeat && groups > 1));
      SdpaTry t{sdpa_backend_name(b) + (repeat ? " (kv repeated)" : ""), picked == b, 0.0};
      if (t.usable) {
        t.ms = time_ms(o, repeat, reps);
        o.q.mutable_grad() = at::Tensor();
        o.k.mutable_grad() = at::Tensor();
        o.v.mutable_grad() = at::Tensor();
        if (!chosen) {
          chosen = true;
          best.backend = b;
          best.repeat_kv = repeat;
        }
      }
      best.tried.push_back(t);
      if (t.usable) break;  // grouped-query attention taken as it is: no repeated variant
    }
  }
  std::vector<int64_t> restore;
  for (auto b : saved_order) restore.push_back(static_cast<int64_t>(b));
  ctx.setSDPPriorityOrder(restore);
  return best;
}

at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool repeat_kv) {
  const int64_t groups = q.size(1) / k.size(1);
  const bool repeat = repeat_kv && groups > 1;
  return at::scaled_dot_product_attention(q, repeat ? repeat_heads(k, groups) : k, repeat ? repeat_heads(v, groups) : v,
                                          {}, 0.0, /*is_causal=*/true, std::nullopt,
                                          /*enable_gqa=*/groups > 1 && !repeat);
}

void use_sdpa(const SdpaChoice& c) {
  at::globalContext().setSDPPriorityOrder(order_with_first(c.backend));
  sdpa_state() = c;
}

const SdpaChoice& current_sdpa() { return sdpa_state(); }

}  // namespace ctitan
