#include "parallelisms/tensor_parallel.h"

#include <map>
#include <utility>

#include <torch/torch.h>

namespace ctitan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels to backward as its address: the Comm outlives every graph built while the
// model's hooks (which hold it) exist.
int64_t comm_handle(Comm& c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&c)); }
Comm& comm_of(AutogradContext* ctx) {
  return *reinterpret_cast<Comm*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}

// [B, T/N, ...] on each rank → [B, T, ...], rank r's rows at [r·T/N, (r+1)·T/N).
at::Tensor all_gather_dim1(const at::Tensor& x, Comm& c, const char* tag) {
  const auto xt = x.transpose(0, 1).contiguous();  // [T/N, B, ...]: a rank's block is contiguous
  auto sizes = xt.sizes().vec();
  sizes[0] *= c.size();
  auto out = at::empty(sizes, x.options());
  c.all_gather_flat(xt, out.view({-1}), tag).wait();
  return out.transpose(0, 1).contiguous();
}

// [B, T, ...] partial sums on each rank → rank r's rows [r·T/N, (r+1)·T/N) of the sum.
at::Tensor reduce_scatter_dim1(const at::Tensor& x, Comm& c, const char* tag) {
  const auto xt = x.transpose(0, 1).contiguous();  // [T, B, ...]
  auto sizes = xt.sizes().vec();
  TORCH_CHECK(sizes[0] % c.size() == 0, "[tp] sequence of ", sizes[0], " positions does not split over ", c.size(),
              " tp ranks");
  sizes[0] /= c.size();
  auto out = at::empty(sizes, x.options());
  c.reduce_scatter_sum(xt.view({-1}), out.view({-1}), tag).wait();
  return out.transpose(0, 1).contiguous();
}

class GatherSequenceFn : public torch::autograd::Function<GatherSequenceFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    Comm& c = comm_of(ctx);
    return all_gather_dim1(x, c, "tp_gather_sequence");
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {reduce_scatter_dim1(g[0], comm_of(ctx), "tp_gather_sequence_grad"), at::Tensor()};
  }
};

class ScatterSequenceFn : public torch::autograd::Function<ScatterSequenceFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return reduce_scatter_dim1(x, comm_of(ctx), "tp_scatter_sequence");
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_dim1(g[0], comm_of(ctx), "tp_scatter_sequence_grad"), at::Tensor()};
  }
};

class GatherVocabularyFn : public torch::autograd::Function<GatherVocabularyFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    Comm& c = comm_of(ctx);
    const int64_t Vl = x.size(-1);
    const auto rows = x.reshape({-1, Vl}).contiguous();  // [M, V/N]
    auto out = at::empty({c.size(), rows.size(0), Vl}, x.options());
    c.all_gather_flat(rows, out.view({-1}), "tp_gather_vocabulary").wait();
    auto sizes = x.sizes().vec();
    sizes.back() = Vl * c.size();
    return out.permute({1, 0, 2}).reshape(sizes);  // [..., N·V/N], rank r's columns at r·V/N
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    Comm& c = comm_of(ctx);
    const int64_t Vl = g[0].size(-1) / c.size();
    return {g[0].narrow(-1, c.rank() * Vl, Vl).contiguous(), at::Tensor()};
  }
};

class VocabParallelCrossEntropyFn : public torch::autograd::Function<VocabParallelCrossEntropyFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels, double scale,
                            int64_t comm) {
    ctx->saved_data["comm"] = comm;
    Comm& c = comm_of(ctx);
    const int64_t N = logits.size(0), Vl = logits.size(1), begin = c.rank() * Vl;
    const auto x = logits.to(at::kFloat);  // [N, V/tp]
    // Row maxima over every rank's columns: the ranks' maxima gathered, their maximum taken.
    auto maxima = at::empty({c.size() * N}, x.options());
    c.all_gather_flat(std::get<0>(x.max(1)).contiguous(), maxima, "tp_loss_max").wait();
    const auto m = std::get<0>(maxima.view({c.size(), N}).max(0));  // [N]
    auto sumexp = (x - m.unsqueeze(1)).exp_().sum(1);               // [N]
    // This rank's target logits (zero where a label is another rank's column), summed below.
    const auto local = labels - begin;
    const auto mine = local.ge(0).logical_and(local.lt(Vl));
    const auto idx = local.clamp(0, Vl - 1);
    auto target = x.gather(1, idx.unsqueeze(1)).squeeze(1).mul(mine.to(at::kFloat));
    auto both = at::stack({sumexp, target}).contiguous();  // one collective for the two sums
    c.all_reduce_sum(both, "tp_loss_sums").wait();
    const auto lse = m + both[0].log();  // [N]
    ctx->save_for_backward({logits, lse, idx, mine});
    ctx->saved_data["scale"] = scale;
    return ((lse - both[1]).to(at::kDouble).sum() * scale).to(at::kFloat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &lse = saved[1], &idx = saved[2], &mine = saved[3];
    const auto coef = g[0].to(at::kFloat) * ctx->saved_data["scale"].toDouble();
    auto p = (logits.to(at::kFloat) - lse.unsqueeze(1)).exp_();  // softmax over the whole row
    p.scatter_add_(1, idx.unsqueeze(1), mine.to(at::kFloat).neg().unsqueeze(1));
    return {p.mul_(coef).to(logits.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TensorParallel::TensorParallel(std::shared_ptr<Comm> group, TPOptions options)
    : group_(std::move(group)), opt_(options) {
  TORCH_CHECK(group_ != nullptr, "[tp] no tp group");
}

int64_t TensorParallel::split_dim(TPStyle style) {
  switch (style) {
    case TPStyle::Colwise:
    case TPStyle::VocabEmbedding:
    case TPStyle::OutputColwise: return 0;
    case TPStyle::Rowwise:
    case TPStyle::GroupedColwise: return 1;
    case TPStyle::GroupedRowwise: return 2;
    case TPStyle::GatherInput:
    case TPStyle::GatherInputScatterOutput:
    case TPStyle::Replicated: return -1;
  }
  return -1;
}

void TensorParallel::shard_parameter(TPStyle style, const at::Tensor& t) const {
  const int64_t dim = split_dim(style);
  if (dim < 0) return;
  TORCH_CHECK(t.size(dim) % degree() == 0, "[tp] a parameter of shape ", t.sizes(), " does not split over ", degree(),
              " tp ranks on dim ", dim);
  torch::NoGradGuard no_grad;
  const int64_t len = t.size(dim) / degree();
  if (t.numel() > 0 && t.storage().nbytes() == 0) {  // deferred and nothing drawn: a checkpoint fills it
    auto sizes = t.sizes().vec();
    sizes[dim] = len;
    t.set_data(at::zeros(sizes, t.options()));
    return;
  }
  t.set_data(share_of(style, t).clone());
}

at::Tensor TensorParallel::share_of(TPStyle style, const at::Tensor& whole) const {
  const int64_t dim = split_dim(style);
  if (dim < 0) return whole;
  const int64_t len = whole.size(dim) / degree();
  return whole.narrow(dim, rank() * len, len);
}

at::Tensor TensorParallel::gather_sequence(const at::Tensor& x) const {
  return GatherSequenceFn::apply(x, comm_handle(*group_));
}
at::Tensor TensorParallel::scatter_sequence(const at::Tensor& x) const {
  return ScatterSequenceFn::apply(x, comm_handle(*group_));
}
at::Tensor TensorParallel::gather_vocabulary(const at::Tensor& x) const {
  return GatherVocabularyFn::apply(x, comm_handle(*group_));
}

at::Tensor TensorParallel::vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                                        double scale) const {
  TORCH_CHECK(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0),
              "[tp] loss: logits [N, V/tp] and labels [N], got ", logits.sizes(), " and ", labels.sizes());
  return VocabParallelCrossEntropyFn::apply(logits, labels, scale, comm_handle(*group_));
}

void TensorParallel::apply(const std::vector<ModelUnit>& units, const TPPlan& plan,
                           const std::function<void(size_t)>& init_unit) {
  for (const TPEntry& e : plan)
    for (const std::string& fqn : e.params) style_[fqn] = e.style;
  int64_t vocab = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    bool deferred = false;
    for (const auto& [fqn, t] : units[i].params) deferred = deferred || (t.numel() > 0 && t.storage().nbytes() == 0);
    if (deferred && init_unit) {
      for (const auto& [fqn, t] : units[i].params) t.set_data(at::empty(t.sizes(), t.options()));
      init_unit(i);
    }
    for (const auto& [fqn, t] : units[i].params) {
      const auto it = style_.find(fqn);
      TORCH_CHECK(it != style_.end(), "[tp] parameter ", fqn, " is in no entry of the model's tensor-parallel plan");
      if (it->second == TPStyle::VocabEmbedding) vocab = t.size(0);
      shard_parameter(it->second, t);
    }
  }
  install(plan, vocab);
}

TPStyle TensorParallel::style(const std::string& fqn) const {
  const auto it = style_.find(fqn);
  return it == style_.end() ? TPStyle::Replicated : it->second;
}

at::Tensor TensorParallel::full_parameter(TPStyle style, const at::Tensor& local) const {
  const int64_t dim = split_dim(style);
  if (dim < 0) return local;
  torch::NoGradGuard no_grad;
  const auto moved = local.movedim(dim, 0).contiguous();  // the split dimension first
  auto sizes = moved.sizes().vec();
  sizes[0] *= degree();
  auto out = at::empty(sizes, local.options());
  group_->all_gather_flat(moved, out.view({-1}), "tp_full_parameter").wait();
  return out.movedim(0, dim).contiguous();
}

void TensorParallel::install(const TPPlan& plan, int64_t vocab_size) {
  // The hooks call this object, which must outlive the model's forwards (train and the tests
  // hold it beside the model), and keep its group alive: what the autograd collectives address.
  const auto group = group_;
  auto gather_seq = [this, group](const at::Tensor& x) { return gather_sequence(x); };
  auto scatter_seq = [this, group](const at::Tensor&, const at::Tensor& y) { return scatter_sequence(y); };
  for (const TPEntry& e : plan) {
    if (e.applied) e.applied(degree());
    if (e.style == TPStyle::Replicated) {
      replicated_.insert(e.params.begin(), e.params.end());
      continue;
    }
    const bool grouped = e.style == TPStyle::GroupedColwise || e.style == TPStyle::GroupedRowwise;
    TORCH_CHECK(grouped || e.hooks != nullptr, "[tp] ", e.module, ": no hooks to install");
    if (grouped) continue;  // their module (GatherInputScatterOutput) gathers and scatters
    LayerHooks& h = *e.hooks;
    switch (e.style) {
      case TPStyle::Colwise: break;  // input whole (gathered by its module), output this rank's units
      case TPStyle::Rowwise: h.output = scatter_seq; break;
      case TPStyle::GatherInput: h.input = gather_seq; break;
      case TPStyle::GatherInputScatterOutput:
        h.input = gather_seq;
        h.output = scatter_seq;
        break;
      case TPStyle::GroupedColwise:
      case TPStyle::GroupedRowwise:
      case TPStyle::Replicated: break;  // handled above
      case TPStyle::OutputColwise:
        h.input = gather_seq;
        if (!opt_.loss_parallel)
          h.output = [this, group](const at::Tensor&, const at::Tensor& y) { return gather_vocabulary(y); };
        break;
      case TPStyle::VocabEmbedding: {
        // Rank r's rows are ids [r·V/tp, (r+1)·V/tp): other ids look up row 0, zeroed after.
        const int64_t rows = vocab_size / degree(), begin = rank() * rows;
        auto others = [begin, rows](const at::Tensor& tokens) {
          return tokens.lt(begin).logical_or(tokens.ge(begin + rows));
        };
        h.input = [others, begin](const at::Tensor& tokens) { return (tokens - begin).masked_fill(others(tokens), 0); };
        h.output = [this, group, others](const at::Tensor& tokens, const at::Tensor& y) {
          return scatter_sequence(y.masked_fill(others(tokens).unsqueeze(-1), 0));
        };
        break;
      }
    }
  }
}

void TensorParallel::sum_gradients(const std::vector<at::Tensor>& params) const {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty() || degree() == 1) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape({-1}));
  auto buf = at::cat(flat);
  group_->all_reduce_sum(buf, "tp_replicated_grads").wait();
  int64_t off = 0;
  for (auto& g : grads) {
    g.copy_(buf.narrow(0, off, g.numel()).view_as(g));
    off += g.numel();
  }
}

}  // namespace ctitan
