// The process groups a training job runs in, and the small agreements between its ranks
// that the loop makes: means, sums and maxima for the metrics, and the stop request.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "components/optimizer.h"
#include "parallelisms/comm.h"
#include "parallelisms/launch_env.h"
#include "parallelisms/parallel_dims.h"

namespace ctitan {

// The process groups of a job: world, FSDP shard group, HSDP replicate group.
struct Parallelism {
  LaunchEnv env;
  ParallelDims dims;
  std::unique_ptr<Distributed> dist;       // null for one process
  std::shared_ptr<Comm> shard, replicate;  // Gloo: CPU tensors (control, gradient norm)
  // FSDP's groups: shard / replicate themselves on the CPU; on GPUs the same ranks over NCCL
  // (build_parallelism makes both, Gloo keeping the CPU-side control).
  std::shared_ptr<Comm> fsdp_shard, fsdp_replicate;
  std::shared_ptr<Comm> fsdp_reduce_scatter;  // GPUs: a second NCCL group of the shard ranks
  // Tensor parallelism (tp > 1): the tp group (its collectives: NCCL on GPUs, Gloo else), and the
  // ranks of one replicate index, dp_shard × tp, over which the gradient norm's squares add up.
  std::shared_ptr<Comm> tp, shard_tp;
  // GPUs: NCCL groups of every rank (the shard group's when that group is every rank) and of
  // shard_tp's ranks, for the step's device-side sums (the loss's world mean, a family's sums,
  // the norm's squares with tp); null on the CPU.
  std::shared_ptr<Comm> world_nccl, shard_tp_nccl;
  int64_t dp_rank = 0;
};

// A step's sum over ranks of a contiguous tensor (float64 for the loss and the norm's squares),
// in place where the tensor is, so that the step reads nothing back: a CPU tensor over `gloo`;
// a GPU tensor over `nccl` when that is a NCCL group of the same ranks (stream-ordered: the
// host goes on queueing), else through the host (one read_to_host, counted). Null (nothing to
// add) for a group of one or none.
SumOverRanks sum_over(std::shared_ptr<Comm> gloo, std::shared_ptr<Comm> nccl, std::string tag);
// sum_over every rank: the world group, and world_nccl on GPUs (null on one process).
SumOverRanks sum_over_world(const Parallelism& par, std::string tag);

// Mean over ranks (sum / world) of a scalar, or the value itself on one process.
double world_mean(const Parallelism& par, double v, const char* tag);
// Max over ranks of each value (per-rank peak memory, communication wait).
std::vector<double> world_max(const Parallelism& par, std::vector<double> v);
// In place: each value summed over every rank (identity on one process).
void world_sum(const Parallelism& par, std::vector<double>& v, const char* tag);

// A stop request (preemption signal) seen by any rank, agreed at a step boundary so that
// every rank stops after the same step: one tiny all-gather of each rank's signal number.
struct StopRequest {
  int signal = 0;
  int64_t rank = -1;
};

StopRequest agree_on_stop(const Parallelism& par);

}  // namespace ctitan
