#include "models/mixtral/model.h"

#include <cmath>

#include "kernels/fused_ops.h"
#include "models/init.h"
#include "models/transformer_math.h"
#include "models/recompute.h"

namespace ctitan::mixtral {

namespace {

// Identity on y whose backward also sends `scale` as the gradient of the scalar aux: adds
// scale · aux to the objective without aux being an output of the unit (so it works when
// activation checkpointing recomputes the unit in backward).
struct AddAuxiliaryLoss : public torch::autograd::Function<AddAuxiliaryLoss> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y, const torch::Tensor& aux,
                               double scale) {
    ctx->saved_data["scale"] = scale;
    return y;  // returned as a view of y with this node as its grad_fn
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    // aux is a float32 scalar.
    return {grads[0], torch::full({}, scale, torch::kFloat), torch::Tensor()};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
RouterImpl::RouterImpl(int64_t dim, int64_t num_experts) { gate = register_module("gate", Linear(dim, num_experts)); }

GroupedExpertsImpl::GroupedExpertsImpl(int64_t dim, int64_t hidden, int64_t E) {
  w1 = register_parameter("w1", new_parameter({E, hidden, dim}));
  w2 = register_parameter("w2", new_parameter({E, dim, hidden}));
  w3 = register_parameter("w3", new_parameter({E, hidden, dim}));
}

torch::Tensor GroupedExpertsImpl::forward(const torch::Tensor& x, const std::vector<int64_t>& counts) {
  std::vector<torch::Tensor> outs;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    const auto xe = x.narrow(0, row, counts[e]);  // [c_e, D]
    const int64_t i = static_cast<int64_t>(e);
    const auto h =
        fused_swiglu(recompute::linear(xe, w1.select(0, i)), recompute::linear(xe, w3.select(0, i)));  // [c_e, F]
    outs.push_back(recompute::linear(h, w2.select(0, i)));                                             // [c_e, D]
    row += counts[e];
  }
  TORCH_CHECK(row == x.size(0), "[mixtral] expert counts sum to ", row, " but ", x.size(0), " rows were routed");
  return torch::cat(outs, 0);
}

// ---------------------------------------------------------------------------------------
MoEImpl::MoEImpl(int64_t dim, const MoEArgs& a) : args(a) {
  router = register_module("router", Router(dim, a.num_experts));
  experts = register_module("experts", GroupedExperts(dim, a.hidden_dim, a.num_experts));
  expert_bias = register_buffer("expert_bias", torch::zeros({a.num_experts}));
  tokens_per_expert = register_buffer("tokens_per_expert", torch::zeros({a.num_experts}));
}

Routing MoEImpl::route(const torch::Tensor& x) {
  const int64_t E = args.num_experts, k = args.top_k, N = x.size(0);
  auto rin = x;
  if (is_training() && args.router_jitter_noise > 0) {
    const double eps = args.router_jitter_noise;
    rin = x * torch::empty_like(x).uniform_(1.0 - eps, 1.0 + eps);
  }
  auto logits = router->gate(rin);  // [N, E]
  if (logits_hook) logits = logits_hook(logits);
  const bool biased = args.expert_bias_update_rate.has_value();
  // Decided once, replayed by a recompute: the forward's logit values and, from them, the
  // choice of experts and the permutation (none of it differentiable).
  auto decided = recompute::decide_all([&] {
    torch::NoGradGuard no_grad;
    const auto values = logits.detach();
    auto sel = torch::softmax(values.to(torch::kFloat), -1);
    if (biased) sel = sel + expert_bias;
    auto idx = std::get<1>(sel.topk(k, -1));  // [N, k]
    auto flat = idx.reshape({-1});
    auto counts = torch::bincount(flat, {}, E);  // [E]
    auto order = std::get<1>(torch::sort(flat, /*stable=*/true, 0, /*descending=*/false));
    auto inverse = torch::empty_like(order).scatter_(0, order, torch::arange(N * k, order.options()));
    // The experts' split reads the counts on the host: on a GPU this copy synchronises
    // (once per block; a recompute reuses it), on the CPU it is the same tensor.
    auto counts_host = counts.to(torch::kCPU);
    return std::vector<torch::Tensor>{values, idx, counts, order, inverse, counts_host};
  });
  // Differentiate this pass's logits at the forward's values: x + (a − x) is exactly a
  // when a is within a factor 2 of x (Sterbenz), so a recompute whose logits differ in the
  // last bits still computes the forward's scores and weights, bit for bit, and the
  // gradients are those of training without AC. Without AC, a = x and this adds 0.
  const auto pinned = logits + (decided[0] - logits).detach();
  Routing r;
  r.scores = torch::softmax(pinned.to(torch::kFloat), -1);  // [N, E]
  r.indices = decided[1];
  r.counts = decided[2];
  r.order = decided[3];
  r.inverse = decided[4];
  r.counts_host = decided[5];
  // Mixtral: softmax over all experts, keep the top-k, renormalise (= softmax over the
  // top-k logits). Without the bias: the bias only chooses.
  const auto top = r.scores.gather(-1, r.indices);  // [N, k]
  r.weights = top / top.sum(-1, /*keepdim=*/true);
  if (routing_observer) routing_observer(r);
  return r;
}

torch::Tensor MoEImpl::forward(const torch::Tensor& x_in) {
  const torch::Tensor x = tp_hooks.pre(x_in);  // tensor parallelism: the whole sequence
  const int64_t D = x.size(-1), k = args.top_k, E = args.num_experts;
  const auto xf = x.reshape({-1, D});  // [N, D]
  const int64_t N = xf.size(0);
  const Routing r = route(xf);
  const auto cnt = r.counts_host.contiguous();
  TORCH_CHECK(cnt.device().is_cpu() && cnt.scalar_type() == torch::kLong && cnt.numel() == E,
              "[mixtral] unexpected expert counts: ", cnt.sizes(), " ", cnt.scalar_type(), " on ", cnt.device());
  const std::vector<int64_t> counts(cnt.data_ptr<int64_t>(), cnt.data_ptr<int64_t>() + E);
  // Permute: row j of xs is token order[j] / k, rows grouped by expert.
  const auto tok = torch::div(r.order, k, "floor");
  const auto xs = xf.index_select(0, tok);       // [N·k, D]
  const auto ys = experts->forward(xs, counts);  // [N·k, D]
  // Weight each row by its slot's routing weight, un-permute, sum the k slots of a token.
  const auto w = r.weights.reshape({-1}).index_select(0, r.order).to(ys.scalar_type()).unsqueeze(-1);
  auto out = (ys * w).index_select(0, r.inverse).view({N, k, D}).sum(1);  // [N, D]
  // Switch load-balancing loss: E · Σ f_e P_e with f from the (decided) counts.
  const auto counts_f = r.counts.to(torch::kFloat);  // exact: at most N·k per expert
  const auto f = counts_f / static_cast<double>(N * k);
  const auto P = r.scores.mean(0);
  const auto aux = (f * P).sum() * static_cast<double>(E);
  // Once per forward, on the model's device (no read back): the counter adds the exact
  // integer counts in float32, as torchtitan's buffer does.
  recompute::unless_recomputing([&] {
    torch::NoGradGuard no_grad;
    last_aux = aux.detach();
    tokens_per_expert.add_(counts_f);
  });
  // Applied with or without grad mode so the forward and the recompute run the same ops.
  const double scale = args.load_balance_loss_coeff * aux_loss_scale * aux_grad_share;
  if (scale != 0) out = AddAuxiliaryLoss::apply(out, aux, scale);
  return tp_hooks.post(x_in, out.view(x.sizes()));
}

void MoEImpl::init_weights(double init_std) {
  torch::NoGradGuard no_grad;
  trunc_normal_(experts->w1, 0.0, 0.02);
  trunc_normal_(experts->w2, 0.0, init_std);
  trunc_normal_(experts->w3, 0.0, init_std);
  trunc_normal_(router->gate->weight, 0.0, init_std);
  expert_bias.zero_();
  tokens_per_expert.zero_();
}

// ---------------------------------------------------------------------------------------
namespace {

DecoderArgs decoder_args(const TransformerModelArgs& a) {
  validate(a);  // before anything is allocated
  return a;     // the decoder's part of the args (family "mixtral")
}

}  // namespace

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id, const TransformerModelArgs& a)
    : DecoderBlockImpl(layer_id, decoder_args(a), "moe", MoE(a.dim, a.moe).ptr()) {
  moe = MoE(std::static_pointer_cast<MoEImpl>(ffn_module()));
}

std::optional<TPPlan> TransformerBlockImpl::ffn_tp_plan(const std::string& m) {
  MoEImpl* moe_ptr = moe.get();
  auto share = [moe_ptr](int64_t tp) { moe_ptr->aux_grad_share = 1.0 / static_cast<double>(tp); };
  return TPPlan{
      {m, TPStyle::GatherInputScatterOutput, &moe->tp_hooks, {}, share},
      {m + ".router", TPStyle::Replicated, nullptr, {m + ".router.gate.weight"}},
      {m + ".experts.w1", TPStyle::GroupedColwise, nullptr, {m + ".experts.w1"}},
      {m + ".experts.w2", TPStyle::GroupedRowwise, nullptr, {m + ".experts.w2"}},
      {m + ".experts.w3", TPStyle::GroupedColwise, nullptr, {m + ".experts.w3"}},
  };
}

TransformerImpl::TransformerImpl(const TransformerModelArgs& a)
    : DecoderImpl(decoder_args(a), [&a](int64_t i) { return std::make_shared<TransformerBlockImpl>(i, a); }),
      args_(a) {}

TransformerBlock TransformerImpl::block(int64_t i) const {
  return TransformerBlock(std::static_pointer_cast<TransformerBlockImpl>(decoder_block(static_cast<size_t>(i))));
}

double MoEImpl::last_aux_loss() const { return last_aux.defined() ? last_aux.item<double>() : 0.0; }

double TransformerImpl::load_balance_loss() const {
  // Every block's value in one copy to the host (one synchronisation on a GPU), summed there
  // in float64 in block order. A block that has not run a forward adds 0.
  std::vector<torch::Tensor> values;
  for (int64_t i = 0; i < n_layers(); ++i) {
    const auto& a = block(i)->moe->last_aux;
    if (a.defined()) values.push_back(a.to(torch::kFloat).reshape({1}));
  }
  if (values.empty()) return 0.0;
  const auto host = torch::cat(values).to(torch::kCPU).contiguous();
  const float* v = host.data_ptr<float>();
  double sum = 0;
  for (int64_t i = 0; i < host.numel(); ++i) sum += static_cast<double>(v[i]);
  return sum;
}

double TransformerImpl::aux_loss() const { return args_.moe.load_balance_loss_coeff * load_balance_loss(); }

torch::Tensor TransformerImpl::tokens_per_expert() const {
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < n_layers(); ++i) rows.push_back(block(i)->moe->tokens_per_expert);
  return torch::stack(rows).clone();
}

void TransformerImpl::step_load_balance(const torch::Tensor& load) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(load.dim() == 2 && load.size(0) == n_layers(), "[mixtral] load must be [L, E], got ", load.sizes());
  for (int64_t i = 0; i < n_layers(); ++i) {
    auto& moe = block(i)->moe;
    if (moe->args.expert_bias_update_rate) {
      const auto l = load[i].to(torch::kFloat);
      auto delta = torch::sign(l.mean() - l) * *moe->args.expert_bias_update_rate;
      moe->expert_bias.add_(delta - delta.mean());
    }
    moe->tokens_per_expert.zero_();
  }
}

void TransformerImpl::set_aux_loss_scale(double s) {
  for (int64_t i = 0; i < n_layers(); ++i) block(i)->moe->aux_loss_scale = s;
}

void TransformerImpl::zero_tokens_per_expert() {
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n_layers(); ++i) block(i)->moe->tokens_per_expert.zero_();
}

}  // namespace ctitan::mixtral
