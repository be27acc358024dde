#include "training/world.h"

#include <torch/torch.h>

#include "components/preemption.h"

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
