// How a model is parallelised (torchtitan's parallelize_fn): a family's
// ModelSpec::parallelize (models/model_spec.h), or, when the family leaves it empty,
// default_parallelize, which every family shares today: activation checkpointing, then FSDP
// (torchtitan's order), after tensor parallelism when parallelism.tensor_parallel_degree > 1
// (torchtitan's apply_tp comes first too).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "config/job_config.h"
#include "models/model_spec.h"
#include "models/train_model.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/device.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/tensor_parallel.h"
#include "training/world.h"

namespace ctitan {

// What a parallelize hook is given, and what it leaves applied.
struct ParallelizeArgs {
  const JobConfig& cfg;
  Parallelism& par;  // ParallelDims and the process groups (FSDP's group of one is set on one rank)
  const DeviceChoice& device;
  bool sharded = false;  // FSDP applies (train.cpp's fsdp_applies)
  // For a model built with ModelInit::Deferred: fills unit i before FSDP keeps this rank's rows
  // (empty: the shards start as zeros for a checkpoint to fill).
  std::function<void(size_t)> init_unit;

  // Applied (null: not applied).
  std::shared_ptr<TensorParallel> tp;
  std::shared_ptr<ActivationCheckpoint> ac;
  std::shared_ptr<FSDP> fsdp;
};

// spec.parallelize, or default_parallelize when the family has none.
void parallelize(const ModelSpec& spec, TrainModel& model, ParallelizeArgs& p);
// Tensor parallelism when the mesh has a tp dimension (the family's TrainModel::tp_plan),
// activation checkpointing of the blocks (activation_checkpoint.mode), then FSDP when p.sharded.
void default_parallelize(TrainModel& model, ParallelizeArgs& p);

// FSDP's reshard_after_forward as it applies with dp data-parallel ranks.
std::string fsdp_reshard_policy(const JobConfig& cfg, int64_t dp);

// FSDPOptions::keep_compute_grads (what it changes applies on one data-parallel rank only):
// where the optimizer reads the compute dtype's gradients as they are — ctitan's AdamW on the
// CPU, and its CUDA kernel on a GPU with CTITAN_GPU_KERNELS=ctitan (own_gpu_kernels); torch's
// fused AdamW (the GPU's default route) and torch::optim's Adam want float32 ones. Not with
// tensor parallelism: its sum of the replicated norms' gradients over the tp ranks would then
// add in bf16, not float32.
bool fsdp_keeps_compute_grads(const JobConfig& cfg, bool cuda, bool own_gpu_kernels, bool tensor_parallel);
// Whether one data-parallel rank's gradients are bf16 after a step: FSDP over a group of one
// keeps autograd's (fsdp_keeps_compute_grads, with this build's GPU AdamW route) under bf16
// compute, the reduce dtype does not round them (float32 or bfloat16), and the step has one
// micro-batch (a second widens the kept gradients to float32).
bool one_rank_keeps_bf16_grads(const JobConfig& cfg, bool cuda, bool tensor_parallel, int64_t micro_batches);

}  // namespace ctitan
