// Fully sharded data parallelism with FSDP2 semantics, applied from outside the model.
//
// Every parameter is sharded on dim 0 over the shard group: rank r holds rows
// [r·c, (r+1)·c) with c = ceil(rows / N), zero-padded when rows is not a multiple of N.
// The optimizer sees only these fp32 local shards ("master weights"). The model's own
// parameter tensors become the *unsharded* parameters in the compute dtype; their
// storage is allocated only while a unit runs (forward, and backward when freed after
// forward) and released with at::native::resize_bytes_cpu, so autograd, which keeps
// referring to the same tensors, sees the data again when backward re-gathers it.
//
// Per unit (tok_embeddings, each block, [norm, output]):
//   forward  : wait for/issue its all-gather; prefetch the next unit's; run; free the
//              unsharded parameters (parallelism.fsdp_reshard_after_forward).
//   backward : an identity node on the unit's output fires before the unit's backward
//              and re-gathers (prefetching the unit before it); gradient-accumulator
//              hooks see when every parameter of the unit has its gradient, which is then
//              reduce-scattered (reduce dtype, mean over the dp group; HSDP: all-reduce
//              over the replicate group after) and the unsharded storage freed.
//   finish_backward(): waits for the outstanding reduce-scatters and accumulates them
//              into the shards' .grad (gradient accumulation adds micro-batches).
#pragma once
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "models/unit_runner.h"
#include "parallelisms/comm.h"

namespace ctitan {

struct FSDPOptions {
  // default: free after forward except the last unit (it is needed again at once in
  // backward), as torchtitan; always; never.
  std::string reshard_after_forward = "default";
  at::ScalarType param_dtype = at::kFloat;   // compute dtype of the unsharded parameters
  at::ScalarType reduce_dtype = at::kFloat;  // dtype of the gradient reduction
  bool prefetch = true;                      // issue the next unit's all-gather early
  // Where the shards, the unsharded parameters and the reduction buffers live. The model's
  // parameters may be initialised on the CPU (deferred init: one unit at a time, the values a
  // CPU run has); each rank's rows then move here. A GPU needs NCCL groups (CommKind::Nccl).
  at::Device device = at::kCPU;
  // One data-parallel rank (a shard group of one, no replicas): the gradient autograd made in the
  // compute dtype becomes the shard's gradient as it is, instead of a float32 copy of it, when
  // the reduce dtype would not round it (float32, or the compute dtype itself). The float32 cast
  // of a bf16 gradient is exact, so an optimizer that reads bf16 gradients and widens them
  // (ctitan's AdamW) computes what it computed from the cast, without the cast's pass and with
  // half the gradient memory. Accumulation over micro-batches still adds in float32 (the
  // second micro-batch widens the first's gradient). Only for such an optimizer: train sets it
  // for AdamW on the CPU, and on a GPU with CTITAN_GPU_KERNELS=ctitan (ctitan's AdamW kernel),
  // without tensor parallelism (whose sum of replicated gradients would add in bf16).
  bool keep_compute_grads = false;
};

struct FSDPStats {
  double comm_wait_s = 0;  // time blocked waiting on collectives (exposed communication)
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
};

class FSDP {
 public:
  // units: the model's units in forward order. shard: the shard group (size N).
  // replicate: the HSDP replicate group (nullptr or size 1: plain FSDP).
  // Parameters with values: every rank must hold the same full values (same seed); each
  // keeps its own rows and the full tensors are freed.
  // Parameters without storage (built under models/init.h's DeferredParameters): one unit
  // at a time, in order, FSDP gives the unit's parameters fp32 storage, calls
  // init_unit(unit index) to fill them, keeps this rank's rows and frees the rest, so the
  // full model never exists on a rank (peak: the shards plus one unit). With the same
  // generator state the rows are bitwise those of a full init when init_unit(0, 1, …)
  // draws what the full init draws, in that order. Without init_unit the shards start as
  // zeros: the values come later (a checkpoint load) and nothing random is drawn.
  FSDP(std::vector<ModelUnit> units, std::shared_ptr<Comm> shard, std::shared_ptr<Comm> replicate, FSDPOptions options,
       const std::function<void(size_t unit)>& init_unit = {});
  ~FSDP();
  FSDP(const FSDP&) = delete;
  FSDP& operator=(const FSDP&) = delete;

  // The model's UnitWrapper, its unit runner: install with TrainModel::set_unit_runner (with AC:
  // in either order, models/unit_runner.h), or model->set_unit_wrapper(fsdp->wrapper()) alone.
  at::Tensor run(const std::string& unit, const UnitFn& fn, const at::Tensor& input);
  UnitWrapper wrapper() {
    return [this](const std::string& u, const UnitFn& fn, const at::Tensor& x) { return run(u, fn, x); };
  }

  // Local fp32 shards, [c, ...] each (padded rows included), for the optimizer.
  std::vector<at::Tensor> sharded_parameters() const;
  // FQN → local shard, and the global shape of each parameter.
  const std::vector<std::string>& fqns() const { return fqns_; }
  at::Tensor local_shard(const std::string& fqn) const;
  std::vector<int64_t> global_shape(const std::string& fqn) const;
  // Rows of the global parameter this rank holds: [begin, end) (end - begin may be < c).
  std::pair<int64_t, int64_t> local_rows(const std::string& fqn) const;

  // Waits for the outstanding gradient reductions; call after each backward.
  void finish_backward();
  // Frees every unit's unsharded parameters. A forward without backward (evaluation under
  // no-grad) leaves the units that do not reshard after forward (the last one, by default)
  // gathered; this returns them to the state a training step ends in.
  void reshard_all();

  // Full fp32 parameters (a collective: every rank calls it), for tests and export.
  std::map<std::string, at::Tensor> gather_full_parameters();
  // Bytes of this rank's sharded parameters and gradients.
  int64_t sharded_param_bytes() const;
  int64_t sharded_grad_bytes() const;

  // Reduce-scatters over `group` instead of the shard group: the same ranks in the same order,
  // a second process group. On GPUs train gives a second NCCL group, so that all-gathers and
  // reduce-scatters run on two streams (each NCCL group has its own), as FSDP2's do, and a
  // prefetched all-gather does not queue behind the previous unit's reduce-scatter.
  void use_reduce_scatter_group(std::shared_ptr<Comm> group);

  FSDPStats& stats() { return stats_; }
  int64_t shard_size() const { return shard_->size(); }

  // Internal, used by the autograd nodes.
  void pre_backward(size_t unit);
  void on_param_grad(size_t unit);

 private:
  struct Param;
  struct Unit;
  enum class State { Sharded, Gathering, Unsharded };

  void start_gather(Unit& u);
  void finish_gather(Unit& u);
  void ensure_unsharded(Unit& u);
  void reshard(Unit& u);
  void reduce_grads(Unit& u);
  bool keeps_as_is(const at::Tensor& g, const at::Tensor& shard) const;
  void complete_reduction(Unit& u);
  void wait(PendingCollective& p);
  size_t index_of(const std::string& unit) const;
  const Param& param(const std::string& fqn) const;

  std::vector<std::unique_ptr<Unit>> units_;
  std::map<std::string, size_t> unit_index_;
  std::vector<std::string> fqns_;
  std::shared_ptr<Comm> shard_, replicate_;
  std::shared_ptr<Comm> reduce_scatter_;  // the shard group's ranks: shard_, or a second group
  FSDPOptions opt_;
  FSDPStats stats_;
  // Keeps the hooks alive. The element type is whatever grad_accumulator returns: a
  // std::shared_ptr<Node> up to PyTorch 2.12, a c10::intrusive_ptr<Node> from 2.13.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))> accumulators_;
  bool in_backward_ = false;
  std::deque<size_t> pending_reductions_;  // units whose reduce-scatter is in flight
};

// Builds the units' FSDP runner with the options of the training config.
FSDPOptions fsdp_options(const std::string& reshard_after_forward, const std::string& param_dtype,
                         const std::string& reduce_dtype);

}  // namespace ctitan
