// Glue between the checkpoint manager and the trainer's objects (FSDP, process groups).
// Header-only and included by train.cpp alone: it uses the parallelisms library, which the
// checkpoint library itself does not link. (The dataloader's state and its redistribution
// belong to datasets/sharding.h.)
#pragma once
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/lr_scheduler.h"
#include "config/errors.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"

namespace ctitan {

// The parameters as this rank holds them: FSDP's fp32 shards (the optimizer's tensors), or
// the model's own full parameters on one process.
inline std::vector<ShardedParam> sharded_params(const torch::nn::Module& model, FSDP* fsdp) {
  std::vector<ShardedParam> out;
  if (fsdp) {
    for (const auto& fqn : fsdp->fqns()) {
      const auto rows = fsdp->local_rows(fqn);
      out.push_back({fqn, fsdp->local_shard(fqn), fsdp->global_shape(fqn), rows.first, rows.second});
    }
    return out;
  }
  for (const auto& kv : model.named_parameters()) {
    const auto& t = kv.value();
    out.push_back({kv.key(), t, t.sizes().vec(), 0, t.dim() ? t.size(0) : 1});
  }
  return out;
}

// The checkpoint manager's collectives over the world group: strings are all-gathered as
// their lengths, then as bytes padded to the longest. arrive/missing use the rendezvous
// store to name the ranks that never reached a point (a killed rank cannot say so itself).
inline CheckpointComm checkpoint_comm(const std::shared_ptr<Comm>& world, c10::intrusive_ptr<c10d::Store> store) {
  if (!world) return CheckpointComm::single_process();
  CheckpointComm c;
  c.rank = world->rank();
  c.world_size = world->size();
  c.all_gather = [world](const std::string& mine, const std::string& tag) {
    const int64_t N = world->size();
    auto len = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64);
    auto lens = torch::empty({N}, torch::kInt64);
    world->all_gather_flat(len, lens, tag + ":len").wait();
    int64_t mx = 1;
    for (int64_t r = 0; r < N; ++r) mx = std::max(mx, lens[r].item<int64_t>());
    auto buf = torch::zeros({mx}, torch::kUInt8);
    std::memcpy(buf.data_ptr(), mine.data(), mine.size());
    auto all = torch::empty({N * mx}, torch::kUInt8);
    world->all_gather_flat(buf, all, tag).wait();
    std::vector<std::string> out;
    const char* base = static_cast<const char*>(all.data_ptr());
    for (int64_t r = 0; r < N; ++r) out.emplace_back(base + r * mx, static_cast<size_t>(lens[r].item<int64_t>()));
    return out;
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

// ---- torchtitan's extra DCP keys -----------------------------------------------------------
//
// checkpoint.format = "dcp": beside ctitan's entries, what torchtitan's flattened state dict
// holds and its dcp.load asks for: the optimizer's param group per parameter
// (get_optimizer_state_dict(..., flatten_optimizer_state_dict=True): lr, betas, eps,
// weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused,
// decoupled_weight_decay, initial_lr, as PyTorch 2.13's AdamW has them) and LambdaLR's state
// (base_lrs, last_epoch, _step_count, _is_initial, _get_lr_called_within_step, _last_lr).
// The LR is the one the next step uses, as PyTorch's group holds it after scheduler.step().
inline std::function<void(StateDict&)> torchtitan_dcp_extras(torch::optim::Optimizer& opt,
                                                             std::vector<std::string> fqns,
                                                             const LRScheduler& lr) {
  return [&opt, fqns, &lr](StateDict& sd) {
    using K = pickle::Value::Kind;
    auto val = [](K k) {
      auto v = std::make_shared<pickle::Value>();
      v->kind = k;
      return v;
    };
    auto num = [&](double x) {
      auto v = val(K::Float);
      v->f = x;
      return v;
    };
    auto flag = [&](bool b) {
      auto v = val(K::Bool);
      v->b = b;
      return v;
    };
    auto integer = [&](int64_t i) {
      auto v = val(K::Int);
      v->i = i;
      return v;
    };
    auto seq = [&](K k, std::vector<pickle::Ptr> xs) {
      auto v = val(k);
      v->items = std::move(xs);
      return v;
    };
    const auto& o = opt.param_groups().at(0).options();
    double eps = 0, wd = 0;
    std::tuple<double, double> betas;
    bool amsgrad = false, decoupled = false;
    if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
      eps = w->eps(), wd = w->weight_decay(), betas = w->betas(), amsgrad = w->amsgrad(), decoupled = true;
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
      eps = a->eps(), wd = a->weight_decay(), betas = a->betas(), amsgrad = a->amsgrad();
    } else {
      return;  // OptimizerState accepts Adam and AdamW only
    }
    const double now = lr.current_lr();
    for (const auto& fqn : fqns) {
      const std::string k = "optimizer.param_groups." + fqn + ".";
      sd.python_object(k + "lr", num(now));
      sd.python_object(k + "betas", seq(K::Tuple, {num(std::get<0>(betas)), num(std::get<1>(betas))}));
      sd.python_object(k + "eps", num(eps));
      sd.python_object(k + "weight_decay", num(wd));
      sd.python_object(k + "amsgrad", flag(amsgrad));
      sd.python_object(k + "maximize", flag(false));
      sd.python_object(k + "foreach", val(K::None));
      sd.python_object(k + "capturable", flag(false));
      sd.python_object(k + "differentiable", flag(false));
      sd.python_object(k + "fused", val(K::None));
      sd.python_object(k + "decoupled_weight_decay", flag(decoupled));
      sd.python_object(k + "initial_lr", num(lr.base_lr()));
    }
    sd.python_object("lr_scheduler.base_lrs", seq(K::List, {num(lr.base_lr())}));
    sd.python_object("lr_scheduler.last_epoch", integer(lr.last_step));
    sd.python_object("lr_scheduler._step_count", integer(lr.last_step + 1));
    sd.python_object("lr_scheduler._is_initial", flag(false));
    sd.python_object("lr_scheduler._get_lr_called_within_step", flag(false));
    sd.python_object("lr_scheduler._last_lr", seq(K::List, {num(now)}));
  };
}

}  // namespace ctitan
