#include "training/adapters.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

namespace ctitan {

namespace {

// A tp rank's share of a parameter in the whole parameter's coordinates (sharded_params).
void to_whole_parameter(ShardedParam& p, const TensorParallel& tp) {
  const TPStyle style = tp.style(p.fqn);
  const int64_t dim = TensorParallel::split_dim(style), n = tp.degree(), r = tp.rank();
  if (dim == 0) {  // this rank's rows are a block of the whole parameter's
    const int64_t rows = p.global_shape.at(0);
    p.global_shape[0] = rows * n;
    p.begin += r * rows;
    p.end += r * rows;
    return;
  }
  p.save_here = r == 0;  // the tp ranks hold (or gather) the same rows: one stores them
  if (dim < 1) return;
  const int64_t cols = p.global_shape.at(dim);
  p.global_shape[dim] = cols * n;
  const TensorParallel* g = &tp;
  p.whole_rows = [g, style](const at::Tensor& t) { return g->full_parameter(style, t); };
  p.own_columns = [g, style](const at::Tensor& whole) { return g->share_of(style, whole); };
}

}  // namespace

std::vector<ShardedParam> sharded_params(const torch::nn::Module& model, FSDP* fsdp, const TensorParallel* tp) {
  std::vector<ShardedParam> out;
  if (fsdp) {
    for (const auto& fqn : fsdp->fqns()) {
      const auto rows = fsdp->local_rows(fqn);
      out.push_back({fqn, fsdp->local_shard(fqn), fsdp->global_shape(fqn), rows.first, rows.second});
    }
  } else {
    for (const auto& kv : model.named_parameters()) {
      const auto& t = kv.value();
      out.push_back({kv.key(), t, t.sizes().vec(), 0, t.dim() ? t.size(0) : 1});
    }
  }
  if (tp)
    for (auto& p : out) to_whole_parameter(p, *tp);
  return out;
}

namespace {

// Every rank's string: the lengths first, then the bytes padded to the longest.
std::vector<std::string> all_gather_strings(Comm& world, const std::string& mine, const std::string& tag) {
  const int64_t N = world.size();
  auto len = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64);
  auto lens = torch::empty({N}, torch::kInt64);
  world.all_gather_flat(len, lens, tag + ":len").wait();
  int64_t mx = 1;
  for (int64_t r = 0; r < N; ++r) mx = std::max(mx, lens[r].item<int64_t>());
  auto buf = torch::zeros({mx}, torch::kUInt8);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  auto all = torch::empty({N * mx}, torch::kUInt8);
  world.all_gather_flat(buf, all, tag).wait();
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int64_t r = 0; r < N; ++r) out.emplace_back(base + r * mx, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

}  // namespace

CheckpointComm checkpoint_comm(const std::shared_ptr<Comm>& world, c10::intrusive_ptr<c10d::Store> store) {
  if (!world) return CheckpointComm::single_process();
  CheckpointComm c;
  c.rank = world->rank();
  c.world_size = world->size();
  c.all_gather = [world](const std::string& mine, const std::string& tag) {
    return all_gather_strings(*world, mine, tag);
  };
  auto counts = std::make_shared<std::map<std::string, int64_t>>();
  auto key = [counts](const std::string& tag, int64_t r) {
    return "ctitan_ckpt/" + tag + "#" + std::to_string((*counts)[tag]) + "/" + std::to_string(r);
  };
  const int64_t rank = c.rank, N = c.world_size;
  c.arrive = [store, counts, key, rank](const std::string& tag) {
    ++(*counts)[tag];
    try {
      store->set(key(tag, rank), std::vector<uint8_t>{'1'});
    } catch (const std::exception&) {
      // The store host is gone; the collective that follows reports it.
    }
  };
  c.missing = [store, key, N](const std::string& tag) {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < N; ++r)
      if (!store->check({key(tag, r)})) out.push_back(r);
    return out;
  };
  return c;
}

namespace {

// Plain Python values for StateDict::python_object.
using K = pickle::Value::Kind;

pickle::Ptr py_value(K k) {
  auto v = std::make_shared<pickle::Value>();
  v->kind = k;
  return v;
}
pickle::Ptr py_float(double x) {
  auto v = py_value(K::Float);
  v->f = x;
  return v;
}
pickle::Ptr py_bool(bool b) {
  auto v = py_value(K::Bool);
  v->b = b;
  return v;
}
pickle::Ptr py_int(int64_t i) {
  auto v = py_value(K::Int);
  v->i = i;
  return v;
}
pickle::Ptr py_seq(K k, std::vector<pickle::Ptr> xs) {
  auto v = py_value(k);
  v->items = std::move(xs);
  return v;
}

// The hyper-parameters of Adam / AdamW's one param group, as PyTorch's group dict has them.
struct AdamGroup {
  double eps = 0, weight_decay = 0;
  std::tuple<double, double> betas;
  bool amsgrad = false, decoupled = false;
};

bool adam_group(const torch::optim::Optimizer& opt, AdamGroup& g) {
  const auto& o = opt.param_groups().at(0).options();
  if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    g.eps = w->eps(), g.weight_decay = w->weight_decay(), g.betas = w->betas(), g.amsgrad = w->amsgrad();
    g.decoupled = true;
    return true;
  }
  if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    g.eps = a->eps(), g.weight_decay = a->weight_decay(), g.betas = a->betas(), g.amsgrad = a->amsgrad();
    return true;
  }
  return false;  // OptimizerState accepts Adam and AdamW only
}

void add_param_group(StateDict& sd, const std::string& fqn, const AdamGroup& g, double lr, double initial_lr) {
  const std::string k = "optimizer.param_groups." + fqn + ".";
  sd.python_object(k + "lr", py_float(lr));
  sd.python_object(k + "betas", py_seq(K::Tuple, {py_float(std::get<0>(g.betas)), py_float(std::get<1>(g.betas))}));
  sd.python_object(k + "eps", py_float(g.eps));
  sd.python_object(k + "weight_decay", py_float(g.weight_decay));
  sd.python_object(k + "amsgrad", py_bool(g.amsgrad));
  sd.python_object(k + "maximize", py_bool(false));
  sd.python_object(k + "foreach", py_value(K::None));
  sd.python_object(k + "capturable", py_bool(false));
  sd.python_object(k + "differentiable", py_bool(false));
  sd.python_object(k + "fused", py_value(K::None));
  sd.python_object(k + "decoupled_weight_decay", py_bool(g.decoupled));
  sd.python_object(k + "initial_lr", py_float(initial_lr));
}

void add_lambda_lr(StateDict& sd, const LRScheduler& lr, double now) {
  sd.python_object("lr_scheduler.base_lrs", py_seq(K::List, {py_float(lr.base_lr())}));
  sd.python_object("lr_scheduler.last_epoch", py_int(lr.last_step));
  sd.python_object("lr_scheduler._step_count", py_int(lr.last_step + 1));
  sd.python_object("lr_scheduler._is_initial", py_bool(false));
  sd.python_object("lr_scheduler._get_lr_called_within_step", py_bool(false));
  sd.python_object("lr_scheduler._last_lr", py_seq(K::List, {py_float(now)}));
}

}  // namespace

std::function<void(StateDict&)> torchtitan_dcp_extras(torch::optim::Optimizer& opt, std::vector<std::string> fqns,
                                                      const LRScheduler& lr) {
  return [&opt, fqns, &lr](StateDict& sd) {
    AdamGroup g;
    if (!adam_group(opt, g)) return;
    const double now = lr.current_lr();
    for (const auto& fqn : fqns) add_param_group(sd, fqn, g, now, lr.base_lr());
    add_lambda_lr(sd, lr, now);
  };
}

}  // namespace ctitan
