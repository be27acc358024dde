#include "training/world.h"

#include <torch/torch.h>

#include "components/preemption.h"
#include "kernels/device_route.h"

namespace ctitan {

double world_mean(const Parallelism& par, double v, const char* tag) {
  if (!par.dist) return v;
  auto t = torch::tensor({v}, torch::kFloat64);
  par.dist->world->all_reduce_sum(t, tag).wait();
  return t.item<double>() / static_cast<double>(par.env.world_size);
}

std::vector<double> world_max(const Parallelism& par, std::vector<double> v) {
  if (!par.dist) return v;
  const int64_t n = static_cast<int64_t>(v.size()), W = par.env.world_size;
  auto local = torch::tensor(v, torch::kFloat64);
  auto all = torch::empty({W * n}, torch::kFloat64);
  par.dist->world->all_gather_flat(local, all, "metrics").wait();
  auto mx = std::get<0>(all.view({W, n}).max(0));
  for (int64_t i = 0; i < n; ++i) v[i] = mx[i].item<double>();
  return v;
}

void world_sum(const Parallelism& par, std::vector<double>& v, const char* tag) {
  if (!par.dist) return;
  auto t = torch::tensor(v, torch::kFloat64);
  par.dist->world->all_reduce_sum(t, tag).wait();
  for (size_t i = 0; i < v.size(); ++i) v[i] = t[static_cast<int64_t>(i)].item<double>();
}

SumOverRanks sum_over(std::shared_ptr<Comm> gloo, std::shared_ptr<Comm> nccl, std::string tag) {
  if (!gloo || gloo->size() <= 1) return nullptr;
  if (nccl && nccl->kind() != CommKind::Nccl) nccl = nullptr;
  return [gloo = std::move(gloo), nccl = std::move(nccl), tag = std::move(tag)](torch::Tensor& t) {
    TORCH_CHECK(t.is_contiguous(), "sum_over(", tag, "): a contiguous tensor, got strides ", t.strides());
    auto flat = t.view({-1});  // the collectives take tensors of one dimension or more
    if (!on_gpu(t)) {
      gloo->all_reduce_sum(flat, tag).wait();
    } else if (nccl) {
      nccl->all_reduce_sum(flat, tag).wait();
    } else {
      auto host = read_to_host(flat);
      gloo->all_reduce_sum(host, tag).wait();
      flat.copy_(host);
    }
  };
}

SumOverRanks sum_over_world(const Parallelism& par, std::string tag) {
  return sum_over(par.dist ? par.dist->world : nullptr, par.world_nccl, std::move(tag));
}

StopRequest agree_on_stop(const Parallelism& par) {
  const int mine = stop_signal_received();
  if (!par.dist) return mine ? StopRequest{mine, 0} : StopRequest{};
  auto local = torch::tensor({static_cast<int64_t>(mine)}, torch::kInt64);
  auto all = torch::empty({par.env.world_size}, torch::kInt64);
  par.dist->world->all_gather_flat(local, all, "stop_request").wait();
  for (int64_t r = 0; r < par.env.world_size; ++r)
    if (all[r].item<int64_t>() != 0) return {static_cast<int>(all[r].item<int64_t>()), r};
  return {};
}

}  // namespace ctitan
